"""The batched synthetic gradient stream and the batched gradient-path emulation. See `simdist.studies.growth`."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from simdist.gradpath.families import Correction, Family, ParamSpec
from simdist.gradpath.path import AdamW, _predivide_factor, adamw_step
from simdist.gradpath.policy import Policy, Stage
from simdist.models.synthetic import InitialWeights
from simdist.numerics.rounding import stochastic_round
from simdist.world.spec import ParallelSpec


class BatchedGradients:
    """BF16 local gradients for every ``[seed, rank]`` at once; counter-based (no RNG state to checkpoint).

    For each ``(seed, step, micro)`` one generator draws, for every parameter,
    one value per *owner* (TP group for dense parameters, rank otherwise) with
    the distribution of `simdist.models.synthetic._normal`: ``randn * scale *
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
        """A `simdist.gradpath.path.LocalGrads` for one seed (what `train_rank` on `SimWorld` consumes)."""

        def grads(step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
            return self.draw(step, micro)[param.name][seed_index, rank].clone()

        return grads


def peer_index(spec: ParallelSpec, kind: str) -> torch.Tensor | None:
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
        self.peers = {kind: peer_index(self.spec, kind) for kind in ("tp", "dp", "edp")}
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
        """`simdist.gradpath.path._dp_reduce`, batched: same casts and scalings, a two-rank (order-free) sum."""
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
