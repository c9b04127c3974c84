"""Error growth over many steps: each policy next to the FP32 oracle, batched over seeds, resumable.

What is run
-----------
`run_growth` trains the synthetic gradient stream (`BatchedGradients`, the
same per-rank structure as `simdist.synthetic`: dense gradients identical on
TP peers, routers ``tp x`` their own slice, shards and experts local) under
each policy and under the FP32 TP-then-DP oracle, for ``steps`` optimizer
steps and ``seeds`` independent seeds, and records per step and seed how far
each policy's FP32 masters and Adam moments are from the oracle's.

How it is batched, and why that is exact
----------------------------------------
Threads of `SimWorld` cost tens of microseconds per collective; 10,000 steps
x 8 seeds x 4 runs would take hours. `Ensemble` instead holds every tensor
of every rank of every seed in one tensor with a leading ``[seed, rank]``
dimension and executes the *same stage list* that `train_rank` executes
(`Policy.micro_step_stages`, `Policy.boundary_stages`, the DP reduction of
`simdist.gradpath._dp_reduce`, and `simdist.gradpath.adamw_step` itself):

* casts, ``/tp``, ``* 1/dp``, ``+=hp`` and every AdamW operation are
  element-wise, so applying them to a batched tensor gives each element the
  bits it gets in a rank's own tensor (batch-invariance of element-wise ops);
* a collective over a group of two ranks is one addition ``a + b``, which is
  commutative in IEEE arithmetic, so every reduction model (gloo, ring, tree,
  sequential) gives ``x + x[peer]``; groups of more than two ranks are
  refused (their result depends on the modelled order);
* no reduction ever runs over the seed or rank dimension inside the
  arithmetic; only the *metrics* reduce, within one seed.

What batching changes: nothing in the bits of masters, moments or BF16
params (``tests/test_growth.py`` proves bitwise identity with `train_rank` on
`SimWorld` at every step, every rank and seed, for eight policies including
the oracle, GAS 2 and stochastic rounding; and that a seed gives the same
bits alone and inside an ensemble). Not emulated: the gradient-norm scalar
and clipping (growth runs use ``max_norm = 0``, the `PathConfig` default),
and layouts with groups of more than two ranks. The stream has the
distribution of `simdist.synthetic.SyntheticGradients` but its own draws (one
generator call per seed and step instead of one per rank and parameter).
Cost: 8 seeds take about 1.8-2.8x the time of one seed (``bench/growth.py``).
The MoE block's backward runs collectives inside autograd and has no batched
emulation: ``model="moe"`` runs unbatched (see below).

The gradient stream is counter-based: step ``t`` of seed ``s`` is drawn from a
generator seeded by ``(s, t, micro)``, so there is no RNG position to save and
a resumed run draws exactly what an uninterrupted run draws.

What the curves show (the random-walk model)
--------------------------------------------
If each step added an independent, zero-mean rounding error of similar size
to a quantity that keeps everything it is given, its error would grow like a
random walk: ``err(t) ~ err(t0) * sqrt(t / t0)``. The plot draws that line on
the master panels (the quantity that keeps everything it is given), anchored at
the median at step 10 (`random_walk`), dashed, in each policy's colour.

* masters sum every update, so their error follows the random walk while the
  per-step update errors are independent -- and departs from it upward when
  the errors are biased (same sign every step: linear growth), or when the
  masters' own divergence changes the update (weight decay, feedback);
* Adam ``m`` forgets with ``beta1 = 0.9`` (memory ~10 steps): its error only
  reflects the last few gradients' rounding and is flat from the first step;
  ``v`` averages squared gradients over ~1000 steps (``beta2 = 0.999``): its
  *relative* error falls while the average still gathers independent terms
  and levels off after about 1000 steps -- neither grows as ``sqrt(t)``;
* step 1 is special: Adam's first update is ``lr * g / |g|`` (a sign), which a
  small rounding of ``g`` rarely changes, so the master error jumps between
  steps 1 and 2 and the line is anchored at step 10;
* ``fp32_staging`` is bitwise equal to the FP32 oracle (no curve on log axes:
  the error is exactly zero); ``bf16_writeback`` adds one BF16 rounding of the
  router gradients per step (only the two router families differ: dense TP
  peers are identical, so their average is exact, and ``/2`` of a BF16 expert
  gradient is exact); ``bf16_only`` rounds the TP sum, the accumulation and
  the DP reduction in BF16 for every family, so its errors are the largest.
  Measured (``bench/growth.py``, 10,000 steps, 8 seeds): the median master
  error grows as ``t^0.52`` for both, i.e. as the random walk predicts.

The synthetic stream has no loss (gradients are drawn, not derived from the
weights), so the loss panel is omitted for ``model="synthetic"``.

``model="moe"``: the folded MoE block, unbatched
-------------------------------------------------
For every seed (sequentially) and policy, `simdist.training.train` runs the
folded MoE block (`simdist.moe.MoEGradients`, default `MoEConfig`) under the
policy next to the FP32 oracle, in lockstep on `SimWorld`, for ``steps``
steps. What it records is what the rows hold (`MOE_COLUMNS`): both losses and
their difference ``|loss_policy - loss_oracle|`` (the loss of step ``t`` is
computed before step ``t``'s update, so step 1's difference is always 0), both
gradient norms, and the divergence of the BF16 weights after the step's update
and of the BF16 local gradients, pooled over parameters and ranks (normwise
relative error, max BF16 ulps, fraction of elements differing). FP32 masters
and Adam moments are private to `train_rank` while it runs, so they are not
recorded. Each (policy, seed) run also reruns the oracle: about 50 ms per step
for a policy and its oracle together (default `MoEConfig`, 4 ranks, CPU).

Resume for MoE is per (policy, seed) run, not per step: the checkpoint holds
the rows of every finished run and is rewritten after each; a killed process
restarts the run it was in from step 0 (`train_rank` does not expose its
state mid-run) and skips the finished ones. A run is deterministic, so the
files equal those of an uninterrupted run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from simdist.families import Correction, Family
from simdist.gradpath import AdamW, ParamSpec, _predivide_factor, adamw_step
from simdist.oracle import FP32_ORACLE
from simdist.policy import Policy, Stage, dtype_name, get_policy
from simdist.rounding import stochastic_round
from simdist.spec import ParallelSpec
from simdist.synthetic import DEFAULT_PARAMS, InitialWeights

TENSORS = ("master", "adam_m", "adam_v")
METRICS = ("rel", "ulp_gmean", "ulp_max", "differ")
COLUMNS = tuple(f"{t}_{m}" for t in TENSORS for m in METRICS)
"""Per step, seed and policy, for each tensor: normwise relative error, geometric-mean FP32-ulp distance over
the elements that differ (0 when none), max FP32-ulp distance, fraction of elements that differ."""
MOE_COLUMNS = ("loss", "oracle_loss", "loss_diff", "grad_norm", "oracle_grad_norm",
               "param_rel", "param_ulp_max", "param_differ", "grad_rel", "grad_ulp_max", "grad_differ")
"""``model="moe"``, per step, seed and policy: the policy's and the oracle's loss, ``|loss - oracle_loss|``,
both gradient norms, and for the BF16 weights after the update (``param``) and the BF16 local gradients
(``grad``), pooled over parameters, ranks and micro-steps: normwise relative error, max BF16-ulp distance,
fraction of elements that differ."""
MODELS = ("synthetic", "moe")
_MOE_DIVERGENCE = ("loss_diff", "param_rel", "param_ulp_max", "param_differ", "grad_rel", "grad_ulp_max",
                   "grad_differ")


def columns(model: str) -> tuple[str, ...]:
    """The metric columns of ``model``'s rows."""
    return MOE_COLUMNS if model == "moe" else COLUMNS


# -- the batched gradient stream -----------------------------------------------------------------------------


class BatchedGradients:
    """BF16 local gradients for every ``[seed, rank]`` at once; counter-based (no RNG state to checkpoint).

    For each ``(seed, step, micro)`` one generator draws, for every parameter,
    one value per *owner* (TP group for dense parameters, rank otherwise) with
    the distribution of `simdist.synthetic._normal`: ``randn * scale *
    2**randint(-3, 3)``, rounded to BF16 (one draw for all parameters, then
    split). `local` gives one rank's tensor for `train_rank`.
    """

    def __init__(self, spec: ParallelSpec, params: tuple[ParamSpec, ...], seeds: list[int], scale: float = 1e-3):
        self.spec, self.params, self.seeds, self.scale = spec, params, list(seeds), scale
        tp_groups = [tuple(g) for g in spec.groups("tp")]
        self.owner_index: dict[str, torch.Tensor] = {}
        for p in params:
            if p.family.identical_on_tp_peers:
                idx = [tp_groups.index(tuple(spec.group_of("tp", r))) for r in range(spec.world_size)]
            else:
                idx = list(range(spec.world_size))
            self.owner_index[p.name] = torch.tensor(idx)
        self._owners = [int(self.owner_index[p.name].max()) + 1 for p in params]
        self._spans, start = [], 0
        for p, owners in zip(params, self._owners, strict=True):
            self._spans.append((start, start + owners * math.prod(p.shape)))
            start += owners * math.prod(p.shape)
        self._total = start
        self._cache: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None

    def draw(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """``{param: bf16 tensor [seed, rank, *shape]}`` for this step and micro-step."""
        if self._cache is not None and self._cache[0] == (step, micro):
            return self._cache[1]
        per_seed: dict[str, list[torch.Tensor]] = {p.name: [] for p in self.params}
        for seed in self.seeds:
            g = torch.Generator().manual_seed(zlib.crc32(repr(("growth", seed, step, micro)).encode()))
            spread = torch.randint(-3, 4, (self._total,), generator=g).to(torch.float32)
            flat = (torch.randn(self._total, generator=g) * self.scale * torch.pow(2.0, spread)).to(torch.bfloat16)
            for p, (start, stop), owners in zip(self.params, self._spans, self._owners, strict=True):
                value = flat[start:stop].reshape(owners, *p.shape)
                per_seed[p.name].append(value[self.owner_index[p.name]])
        out = {name: torch.stack(values) for name, values in per_seed.items()}
        self._cache = ((step, micro), out)
        return out

    def local(self, seed_index: int) -> Callable[[int, int, int, ParamSpec], torch.Tensor]:
        """A `simdist.gradpath.LocalGrads` for one seed (what `train_rank` on `SimWorld` consumes)."""

        def grads(step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
            return self.draw(step, micro)[param.name][seed_index, rank].clone()

        return grads


# -- the batched gradient path ------------------------------------------------------------------------------


def _peer_index(spec: ParallelSpec, kind: str) -> torch.Tensor | None:
    """``peer[r]``: the other rank of ``r``'s group of ``kind``; None for groups of one rank."""
    size = spec.size(kind)
    if size == 1:
        return None
    if size != 2:
        raise ValueError(f"the batched emulation needs {kind} groups of at most 2 ranks (an order-free sum); "
                         f"{kind}={size}")
    peer = [0] * spec.world_size
    for group in spec.groups(kind):
        a, b = group
        peer[a], peer[b] = b, a
    return torch.tensor(peer)


def _group_sum(x: torch.Tensor, peer: torch.Tensor | None) -> torch.Tensor:
    """The all_reduce SUM of a group of at most two ranks, for every rank (dim 1): ``a + b`` is order-free."""
    return x.clone() if peer is None else x + x[:, peer]


@dataclass
class Ensemble:
    """One policy's state for every seed and rank: masters, moments, low-precision params (``[S, R, N]``)."""

    policy: Policy
    spec: ParallelSpec
    params: tuple[ParamSpec, ...]
    seeds: list[int]
    gas: int = 1
    marker: str = "deepspeed"
    adam: AdamW = field(default_factory=AdamW)
    step: int = 0

    def __post_init__(self) -> None:
        self.slices: dict[str, slice] = {}
        start = 0
        for p in self.params:
            n = math.prod(p.shape)
            self.slices[p.name] = slice(start, start + n)
            start += n
        self.numel = start
        self.tp = self.spec.tp
        self.dense_dp = self.spec.dp
        self.peers = {kind: _peer_index(self.spec, kind) for kind in ("tp", "dp", "edp")}
        inits = [InitialWeights(self.spec, seed) for seed in self.seeds]
        lp = torch.stack([
            torch.stack([torch.cat([init(r, p).to(self.policy.grad_dtype).reshape(-1) for p in self.params])
                         for r in range(self.spec.world_size)])
            for init in inits])
        self.lp = lp
        self.master = lp.to(self.policy.master)
        self.m = torch.zeros(lp.shape, dtype=self.policy.moments)
        self.v = torch.zeros(lp.shape, dtype=self.policy.moments)
        self.hp = torch.zeros(lp.shape, dtype=self.policy.accumulate)

    # state for checkpoints
    def state(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "adam_m": self.m, "adam_v": self.v, "lp": self.lp}

    def load(self, state: dict[str, torch.Tensor], step: int) -> None:
        self.master, self.m, self.v, self.lp = (state[k].clone() for k in ("master", "adam_m", "adam_v", "lp"))
        self.hp.zero_()
        self.step = step

    def run_step(self, grads: Callable[[int], dict[str, torch.Tensor]]) -> None:
        """One optimizer step: ``gas`` micro-steps of ``_update_hp_grad``, then the boundary."""
        step = self.step
        markers = dict.fromkeys(self.slices, False)
        for micro in range(self.gas):
            local = grads(micro)
            for index, p in enumerate(self.params):
                self._micro(p, index, local[p.name].reshape(len(self.seeds), self.spec.world_size, -1),
                            markers, step, micro)
            if self.marker == "per_micro_step":
                markers = dict.fromkeys(self.slices, False)
        self._boundary(step)
        self.step += 1

    def _micro(self, p: ParamSpec, index: int, grad: torch.Tensor, markers, step: int, micro: int) -> None:
        policy = self.policy
        stages = policy.micro_step_stages(p.family, self.tp)
        correcting = not markers[p.name] and p.family.correction(self.tp) is not Correction.SKIP
        if not correcting:
            stages = [Stage("cast", "", policy.accumulate)] if grad.dtype != policy.accumulate else []
            stages.append(Stage("accumulate", "hp", policy.accumulate))
        hp = self.hp[..., self.slices[p.name]]
        value = grad.to(policy.grad_dtype)
        for stage in stages:
            if stage.kind == "accumulate":
                if policy.dp_at == "micro_step":
                    value = self._dp_reduce(value, p.family)
                hp.add_(value)
            else:
                value = self._apply(stage, value, p, index, step, micro)
        if correcting and policy.correct_at == "micro_step":
            markers[p.name] = True

    def _apply(self, stage: Stage, value: torch.Tensor, p: ParamSpec, index: int, step: int, micro) -> torch.Tensor:
        if stage.kind == "cast":
            if stage.rounding == "stochastic":
                out = torch.empty(value.shape, dtype=stage.dtype)
                for s, seed in enumerate(self.seeds):
                    for r in range(self.spec.world_size):
                        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, step, micro, r, index)).encode()))
                        out[s, r] = stochastic_round(value[s, r].reshape(p.shape), stage.dtype, g).reshape(-1)
                return out
            return value.to(stage.dtype)
        if stage.kind == "all_reduce":
            return _group_sum(value, self.peers["tp"])
        if stage.kind == "divide":
            return value / stage.divisor
        raise ValueError(f"unknown stage kind {stage.kind!r}")

    def _dp_reduce(self, value: torch.Tensor, family: Family) -> torch.Tensor:
        """`simdist.gradpath._dp_reduce`, batched: same casts and scalings, a two-rank (order-free) sum."""
        peer = self.peers[family.dp_group]
        x = value.to(self.policy.dp_reduce, copy=True)
        if self.policy.dp_scale == "prescale":
            x.mul_(1.0 / self.dense_dp)
            x = _group_sum(x, peer)
        elif self.policy.dp_scale == "pre_post_divide":
            pre = _predivide_factor(self.dense_dp)
            x.div_(pre)
            x = _group_sum(x, peer)
            x.div_(self.dense_dp / pre)
        else:
            x = _group_sum(x, peer)
            x.mul_(1.0 / self.dense_dp)
        return x.to(value.dtype)

    def _boundary(self, step: int) -> None:
        for index, p in enumerate(self.params):
            hp = self.hp[..., self.slices[p.name]]
            for stage in self.policy.boundary_stages(p.family, self.tp):
                hp.copy_(self._apply(stage, hp, p, index, step, -1))
            if self.policy.dp_at == "boundary":
                hp.copy_(self._dp_reduce(hp, p.family))
        # AdamW is element-wise: one call on the flat [S, R, N] state gives every element its per-rank bits
        adamw_step(self.master, self.hp.to(self.master.dtype), self.m, self.v, step + 1, self.adam)
        self.lp.copy_(self.master)
        self.hp.zero_()

    def per_param(self, which: str) -> dict[str, torch.Tensor]:
        """``{param: copy [seed, rank, *shape]}`` of ``master``, ``adam_m``, ``adam_v`` or ``lp``."""
        flat = self.state()[which]
        return {p.name: flat[..., self.slices[p.name]].reshape(*flat.shape[:2], *p.shape).clone()
                for p in self.params}


# -- metrics ------------------------------------------------------------------------------------------------


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """FP32 values as float64 integers monotone in the value (both zeros map to 0), as `simdist.floats` orders.

    ``raw ^ (sign & 0x7FFFFFFF) - sign`` with ``sign = raw >> 31`` (0 or -1) is
    ``raw`` for positives and ``-(raw & 0x7FFFFFFF)`` for negatives; float64
    holds every such integer and their differences exactly.
    """
    raw = t.to(torch.float32).contiguous().view(torch.int32)
    sign = raw >> 31
    return ((raw ^ (sign & 0x7FFFFFFF)) - sign).to(torch.float64)


class Reference:
    """The oracle's tensor ``[S, R, N]`` prepared once per step for `divergence`."""

    def __init__(self, expected: torch.Tensor) -> None:
        self.e64 = expected.to(torch.float32).double().flatten(1)
        self.ordered = _ordered(expected).flatten(1)
        self.norm = torch.linalg.vector_norm(self.e64, dim=1)
        self.nan = torch.isnan(self.e64)


def divergence(actual: torch.Tensor, reference: Reference) -> torch.Tensor:
    """Per seed ``[S, 4]``: normwise relative error, geometric-mean ulps of the differing elements, max ulps,
    fraction differing.

    Ulps are FP32 ulps; the geometric mean is over the elements that differ
    (0 when every element is equal), so a policy that perturbs one parameter
    family shows the typical error of that family's elements, and the few
    elements near zero (many ulps for a tiny absolute error) do not dominate it.

    ``actual`` is cast to FP32 (exact for FP32 and BF16 state). The metrics
    reduce over ranks and elements within a seed only, never across seeds. An
    element where exactly one side is NaN counts as ``inf`` ulps.
    """
    a64 = actual.to(torch.float32).double().flatten(1)
    err = torch.linalg.vector_norm(a64 - reference.e64, dim=1)
    rel = torch.where(reference.norm > 0, err / reference.norm, torch.where(err > 0, math.inf, 0.0))
    ulps = (_ordered(actual).flatten(1) - reference.ordered).abs_()
    if not bool(torch.isfinite(err).all()):
        ulps = torch.where(torch.isnan(a64) ^ reference.nan, math.inf, torch.where(torch.isnan(a64), 0.0, ulps))
    differs = ulps != 0
    count = differs.sum(dim=1)
    logs = torch.where(differs, ulps, 1.0).log2_().sum(dim=1)
    gmean = torch.where(count > 0, torch.exp2(logs / count.clamp(min=1)), 0.0)
    return torch.stack([rel, gmean, ulps.amax(dim=1), count.double() / ulps.shape[1]], dim=1)


# -- the resumable run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrowthConfig:
    """One growth run. ``seeds`` ensemble members use seeds ``seed, seed+1, ...``."""

    policies: tuple[str, ...] = ("bf16_writeback", "fp32_staging", "bf16_only")
    steps: int = 10_000
    seeds: int = 8
    seed: int = 0
    gas: int = 1
    marker: str = "deepspeed"
    model: str = "synthetic"
    world_size: int = 4
    tp: int = 2
    ep: int = 2
    checkpoint_every: int = 500

    def spec(self) -> ParallelSpec:
        return ParallelSpec(self.world_size, tp=self.tp, ep=self.ep)

    def identity(self) -> dict:
        """What must match for a checkpoint or a finished run to be reused (not ``checkpoint_every``)."""
        out = asdict(self)
        out.pop("checkpoint_every")
        out["policies"] = list(self.policies)
        return out

    def validate(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"growth supports --model {' or '.join(MODELS)}; got {self.model!r}")
        if self.steps < 1 or self.seeds < 1 or self.gas < 1 or self.checkpoint_every < 1:
            raise ValueError("steps, seeds, gas and checkpoint_every must be >= 1")
        for name in self.policies:
            get_policy(name)
        spec = self.spec()
        if self.model == "moe":
            from simdist.moe import MoEConfig

            MoEConfig().validate(spec)
            return
        for kind in ("tp", "dp", "edp"):
            _peer_index(spec, kind)


FILES = {"config": "config.json", "checkpoint": "checkpoint.safetensors", "metrics": "metrics.csv",
         "plot": "growth.png", "summary": "summary.json"}


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text))


def _hash(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class _Interrupted(Exception):
    """Raised by the ``stop_after`` test hook to simulate a kill."""


def run_growth(config: GrowthConfig, out: str | Path, *, force: bool = False, progress: bool = True,
               plot: bool = True, stop_after: int | None = None) -> dict:
    """Run (or resume, or reuse) a growth study in ``out``; returns the summary.

    ``out`` holds ``config.json``, ``checkpoint.safetensors`` (every
    ``checkpoint_every`` steps: states of every run, metrics so far, the step
    counter), and when finished ``metrics.csv``, ``growth.png`` and
    ``summary.json``; each written to a temporary file and renamed. A finished
    run with the same configuration is returned as is unless ``force``.
    ``stop_after`` (tests) raises after that many steps of this call, as a kill would
    (``model="moe"``: after that many finished (policy, seed) runs; its
    checkpoint is written after each such run and holds only their rows).
    """
    config.validate()
    out = Path(out)
    identity = config.identity()
    key = _hash(identity)
    if force and out.exists():
        for name in FILES.values():
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / FILES["summary"]
    config_path = out / FILES["config"]
    if config_path.exists():
        previous = json.loads(config_path.read_text())
        if previous != identity:
            raise ValueError(f"{out} holds a different run ({config_path}); use --force or another --out")
        if summary_path.exists():
            return json.loads(summary_path.read_text())
    _write_text(config_path, json.dumps(identity, indent=2, sort_keys=True))

    ckpt = out / FILES["checkpoint"]
    if config.model == "moe":
        metrics = _run_moe(config, ckpt, key, progress, stop_after)
    else:
        metrics = _run_synthetic(config, ckpt, key, progress, stop_after)
    _write_metrics(out / FILES["metrics"], config, metrics)
    summary = summarise(config, metrics)
    if plot:
        plot_growth(config, metrics, out / FILES["plot"])
    _write_text(summary_path, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _run_synthetic(config: GrowthConfig, ckpt: Path, key: str, progress: bool,
                   stop_after: int | None) -> np.ndarray:
    """The batched synthetic run, checkpointed every ``checkpoint_every`` steps; ``metrics[step, policy, seed]``."""
    from safetensors.torch import load_file, save_file

    spec = config.spec()
    seeds = [config.seed + i for i in range(config.seeds)]
    params = DEFAULT_PARAMS
    stream = BatchedGradients(spec, params, seeds)
    policies = [get_policy(n) for n in config.policies]
    runs = [Ensemble(FP32_ORACLE, spec, params, seeds, config.gas, "per_micro_step")]
    runs += [Ensemble(p, spec, params, seeds, config.gas, config.marker) for p in policies]
    metrics = np.zeros((config.steps, len(policies), config.seeds, len(COLUMNS)), dtype=np.float64)
    start = 0
    if ckpt.exists():
        loaded = load_file(str(ckpt))
        if loaded["key"].numpy().tobytes().decode() == key:
            start = int(loaded["step"].item())
            for i, run in enumerate(runs):
                run.load({k: loaded[f"run{i}.{k}"] for k in ("master", "adam_m", "adam_v", "lp")}, start)
            metrics[:start] = loaded["metrics"].numpy()[:start]

    def save_checkpoint(step: int) -> None:
        tensors = {"step": torch.tensor(step, dtype=torch.int64),
                   "key": torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8),
                   "metrics": torch.from_numpy(metrics[:step].copy())}
        for i, run in enumerate(runs):
            for k, t in run.state().items():
                tensors[f"run{i}.{k}"] = t.contiguous()
        _atomic_write(ckpt, lambda tmp: save_file(tensors, str(tmp)))

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start, desc="growth", unit="step")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threading costs more than it saves
    try:
        for step in range(start, config.steps):
            for run in runs:
                run.run_step(lambda micro, step=step: stream.draw(step, micro))
            refs = [Reference(t) for t in (runs[0].master, runs[0].m, runs[0].v)]
            for j, run in enumerate(runs[1:]):
                metrics[step, j] = torch.cat(
                    [divergence(t, ref) for t, ref in zip((run.master, run.m, run.v), refs, strict=True)], dim=1)
            if bar is not None:
                bar.update(1)
            done = step + 1
            if done % config.checkpoint_every == 0 or done == config.steps:
                save_checkpoint(done)
            if stop_after is not None and done - start >= stop_after and done < config.steps:
                raise _Interrupted(f"stopped after step {done}")
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()

    return metrics


def _moe_rows(records, steps: int) -> np.ndarray:
    """``[step, MOE_COLUMNS]`` from `simdist.training.StepRecord`s: losses, norms, pooled divergences."""
    rows = np.zeros((steps, len(MOE_COLUMNS)), dtype=np.float64)
    for record in records:
        row = {"loss": record.loss, "oracle_loss": record.oracle_loss,
               "loss_diff": abs(record.loss - record.oracle_loss),
               "grad_norm": record.grad_norm, "oracle_grad_norm": record.oracle_grad_norm}
        for kind, prefix in (("param", "param"), ("local grad", "grad")):
            found = [d for (_, k), d in record.tensors.items() if k == kind]
            err2 = sum(d.error_norm ** 2 for d in found)
            ref2 = sum(d.reference_norm ** 2 for d in found)
            numel = sum(d.numel for d in found)
            row[f"{prefix}_rel"] = math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf)
            row[f"{prefix}_ulp_max"] = max((d.max_ulp for d in found), default=0)
            row[f"{prefix}_differ"] = (sum(d.fraction_differing * d.numel for d in found) / numel) if numel else 0.0
        rows[record.step] = [row[c] for c in MOE_COLUMNS]
    return rows


def _run_moe(config: GrowthConfig, ckpt: Path, key: str, progress: bool, stop_after: int | None) -> np.ndarray:
    """Each (policy, seed) run of the MoE block next to the FP32 oracle (`simdist.training.train`), in turn.

    The checkpoint holds the rows of the finished runs (``done[policy, seed]``)
    and is rewritten after each; an unfinished run restarts from step 0.
    """
    from safetensors.torch import load_file, save_file

    from simdist.moe import MoEConfig
    from simdist.training import train

    spec = config.spec()
    metrics = np.zeros((config.steps, len(config.policies), config.seeds, len(MOE_COLUMNS)), dtype=np.float64)
    done = np.zeros((len(config.policies), config.seeds), dtype=np.uint8)
    if ckpt.exists():
        loaded = load_file(str(ckpt))
        if loaded["key"].numpy().tobytes().decode() == key and "done" in loaded:
            done[:] = loaded["done"].numpy()
            metrics[:] = loaded["metrics"].numpy()

    def save_checkpoint() -> None:
        tensors = {"key": torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8),
                   "done": torch.from_numpy(done.copy()), "metrics": torch.from_numpy(metrics.copy())}
        _atomic_write(ckpt, lambda tmp: save_file(tensors, str(tmp)))

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=done.size * config.steps, initial=int(done.sum()) * config.steps, desc="growth moe",
                   unit="step")
    finished = 0
    try:
        for s in range(config.seeds):
            for j, name in enumerate(config.policies):
                if done[j, s]:
                    continue
                records = train(spec, name, steps=config.steps, gas=config.gas, seed=config.seed + s,
                                marker=config.marker, model=MoEConfig())
                metrics[:, j, s] = _moe_rows(records, config.steps)
                done[j, s] = 1
                save_checkpoint()
                if bar is not None:
                    bar.update(config.steps)
                finished += 1
                if stop_after is not None and finished >= stop_after and not done.all():
                    raise _Interrupted(f"stopped after {finished} runs")
    finally:
        if bar is not None:
            bar.close()
    return metrics


def _write_metrics(path: Path, config: GrowthConfig, metrics: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "policy", "seed", *columns(config.model)])
            digits = ".17g" if config.model == "moe" else ".9g"  # MoE losses: exact, so loss_diff is recomputable
            for step in range(metrics.shape[0]):
                for j, name in enumerate(config.policies):
                    for s in range(metrics.shape[2]):
                        w.writerow([step + 1, name, config.seed + s, *(format(x, digits) for x in metrics[step, j, s])])

    _atomic_write(path, write)


def read_metrics(path: str | Path) -> tuple[list[str], np.ndarray]:
    """``(policies, metrics[step, policy, seed, column])`` from a ``metrics.csv``.

    Columns are in the file's order: `COLUMNS` for the synthetic model, `MOE_COLUMNS` for the MoE.
    """
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        names = [c for c in (reader.fieldnames or []) if c not in ("step", "policy", "seed")]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    steps = max(int(r["step"]) for r in rows)
    seeds = sorted({int(r["seed"]) for r in rows})
    out = np.zeros((steps, len(policies), len(seeds), len(names)))
    for r in rows:
        out[int(r["step"]) - 1, policies.index(r["policy"]), seeds.index(int(r["seed"]))] = [float(r[c])
                                                                                             for c in names]
    return policies, out


def summarise(config: GrowthConfig, metrics: np.ndarray) -> dict:
    """Final-step medians per policy, and the fitted growth exponent of the master error (log-log slope).

    ``model="moe"``: the exponent is that of the BF16 weights' error (``param_rel_growth_exponent``), and
    ``bitwise_equal_to_oracle`` means every divergence column and the loss difference are 0 at every step.
    """
    out: dict = {"config": config.identity(), "policies": {}}
    steps = np.arange(1, metrics.shape[0] + 1)
    names = columns(config.model)
    tracked = "param_rel" if config.model == "moe" else "master_rel"
    compared = [names.index(c) for c in (_MOE_DIVERGENCE if config.model == "moe" else COLUMNS)]
    for j, name in enumerate(config.policies):
        final = {c: float(np.median(metrics[-1, j, :, k])) for k, c in enumerate(names)}
        med = np.median(metrics[:, j, :, names.index(tracked)], axis=1)
        late = (steps >= max(10, steps[-1] // 10)) & (med > 0)
        slope = float(np.polyfit(np.log(steps[late]), np.log(med[late]), 1)[0]) if late.sum() >= 3 else None
        out["policies"][name] = {"final_median": final, f"{tracked}_growth_exponent": slope,
                                 "bitwise_equal_to_oracle": bool((metrics[:, j, :, compared] == 0).all())}
    if config.model == "moe":
        for j, name in enumerate(config.policies):
            out["policies"][name]["max_loss_diff"] = float(metrics[:, j, :, names.index("loss_diff")].max())
    return out


def random_walk(steps: np.ndarray, median: np.ndarray, anchor: int = 10) -> np.ndarray | None:
    """``median[t0] * sqrt(t / t0)`` with ``t0`` the first step >= ``anchor`` where the median is non-zero."""
    ok = np.nonzero((steps >= min(anchor, steps[-1])) & (median > 0))[0]
    if not len(ok):
        return None
    t0 = ok[0]
    return median[t0] * np.sqrt(steps / steps[t0])


def plot_growth(config: GrowthConfig, metrics: np.ndarray, path: str | Path) -> None:
    """Log-log panels (relative and ulp error of masters, m, v against step): median, 10-90% band, sqrt(t) line.

    ``model="moe"``: BF16 weights' relative and max-ulp error, the loss difference and the local gradients' error.
    """
    if config.model == "moe":
        _plot_moe(config, metrics, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, metrics.shape[0] + 1)
    fig, axes = plt.subplots(2, 3, figsize=(15, 9), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = {"master": "FP32 master", "adam_m": "Adam m", "adam_v": "Adam v"}
    for row, (metric, unit) in enumerate((("rel", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)"),
                                          ("ulp_gmean", "geo-mean error, differing elements (FP32 ulps)"))):
        for col, tensor in enumerate(TENSORS):
            ax = axes[row, col]
            k = COLUMNS.index(f"{tensor}_{metric}")
            for j, name in enumerate(config.policies):
                _draw_band(ax, steps, metrics[:, j, :, k], colours[j % len(colours)], name, walk=tensor == "master")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(labels[tensor])
            ax.set_ylabel(unit, fontsize=9)
            if row == 1:
                ax.set_xlabel("optimizer step (count)")
            ax.grid(True, which="major", alpha=0.3)
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    spec = config.spec()
    dtypes = _dtypes(config)
    fig.suptitle(y=0.99, t=f"Error growth vs the FP32 oracle — {spec.describe()}, "
                 f"model {config.model} (no loss: gradients are drawn, not derived), {config.seeds} seeds, "
                 f"GAS {config.gas}\n{dtypes}", fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.17, top=0.95 - 0.02 * (len(config.policies) + 1),
                        hspace=0.22, wspace=0.22)

    _save_figure(fig, path)


def _dtypes(config: GrowthConfig) -> str:
    return "\n".join(
        f"{n}: grad {dtype_name(p.grad_dtype)}, writeback {dtype_name(p.writeback) if p.writeback else 'none'}, "
        f"acc {dtype_name(p.accumulate)}, dp {dtype_name(p.dp_reduce)}, master/moments {dtype_name(p.master)}/"
        f"{dtype_name(p.moments)}" for n, p in ((n, get_policy(n)) for n in config.policies))


def _save_figure(fig, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    def save(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=90, metadata={"Software": None})

    _atomic_write(Path(path), save)
    plt.close(fig)


def _draw_band(ax, steps: np.ndarray, values: np.ndarray, colour, name: str, walk: bool) -> None:
    """Median and 10-90% band over seeds (``values[step, seed]``) on log axes; zeros are not drawn."""
    med = np.median(values, axis=1)
    if not (med > 0).any() and not (values > 0).any():
        ax.plot([], [], color=colour, label=f"{name} (bitwise equal to oracle: zero error)")
        return
    lo, hi = np.percentile(values, 10, axis=1), np.percentile(values, 90, axis=1)
    ax.fill_between(steps, np.where(lo > 0, lo, np.nan), np.where(hi > 0, hi, np.nan),
                    color=colour, alpha=0.2, linewidth=0)
    ax.plot(steps, np.where(med > 0, med, np.nan), color=colour, label=f"{name} median, 10–90% band")
    line = random_walk(steps, med) if walk else None
    if line is not None:
        ax.plot(steps, line, color=colour, linestyle="--", linewidth=1, label=f"{name} random walk ∝ √t")


def _plot_moe(config: GrowthConfig, metrics: np.ndarray, path: str | Path) -> None:
    """Log-log panels for the MoE block: BF16 weights' relative and ulp error, loss difference, local grads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simdist.moe import MoEConfig

    steps = np.arange(1, metrics.shape[0] + 1)
    fig, axes = plt.subplots(2, 2, figsize=(13, 10), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (
        ("param_rel", "BF16 weights after the update", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)", True),
        ("param_ulp_max", "BF16 weights after the update", "max error over elements (BF16 ulps)", False),
        ("loss_diff", "loss difference (loss of step t, before its update)",
         "|loss_policy − loss_oracle|  (loss units: MSE)", False),
        ("grad_rel", "BF16 local gradients (model backward)", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)",
         False),
    )
    for ax, (column, title, unit, walk) in zip(axes.flat, panels, strict=True):
        k = MOE_COLUMNS.index(column)
        for j, name in enumerate(config.policies):
            _draw_band(ax, steps, metrics[:, j, :, k], colours[j % len(colours)], name, walk)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step (count)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    cfg = MoEConfig()
    fig.suptitle(y=0.99, t=f"Error growth vs the FP32 oracle — {config.spec().describe()}, model moe (folded "
                 f"MoE block: hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.top_k}, {cfg.tokens} tokens/rank; "
                 f"BF16 weights and local grads), {config.seeds} seeds, GAS {config.gas}\n{_dtypes(config)}",
                 fontsize=9)
    fig.subplots_adjust(left=0.08, right=0.99, bottom=0.13, top=0.95 - 0.02 * (len(config.policies) + 1),
                        hspace=0.2, wspace=0.22)
    _save_figure(fig, path)


def clean(out: str | Path) -> None:
    """Remove a growth run directory."""
    shutil.rmtree(out, ignore_errors=True)
