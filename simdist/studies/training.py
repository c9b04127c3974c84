"""Training the folded MoE block: a policy next to a matched policy, step by step.

`train` runs ``steps x gas`` micro-steps of `simdist.sources.moe.MoEGradients` under
any policy and reduction, and next to it the same run under a matched policy
(`simdist.gradpath.matched_policy`: the oracle's FP32 TP-then-DP staging run
through the gradient path, `MATCHED_FP32` by default). The two runs are two `SimWorld` runs in
lockstep: each rank's gradient source publishes what it sees at every
micro-step -- its BF16 local gradients, its loss, and at the start of a step
the BF16 weights the previous update produced -- and the matching rank of the
other run compares and drops them. A run may get at most ``lag`` steps ahead
of the other, so memory holds a few steps' tensors, never the history. One
extra, gradient-free step at the end exposes the weights after the last
update. The gradient norms come from the runs' traces (scalars only).

Recorded per step (`StepRecord`): the loss (mean over DP replicas and
micro-steps of the per-replica loss) and gradient norm of both runs, and for
every parameter the divergence from the matched run (max ulp, max relative error,
fraction of elements differing) of its local gradient and of its BF16 weight
after the step's update. FP32 masters and Adam moments stay private to the
gradient path (`train_rank` does not expose them while it runs); the per-rank
dumps of `simdist.studies.crosscheck.train_and_dump` hold them for short runs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from simdist.errors import coerce
from simdist.gradpath.kernel import Marker, UpdatePath
from simdist.gradpath.matched_policy import MATCHED_FP32
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy
from simdist.numerics.compare import Difference, difference
from simdist.policies.catalogue import get_policy
from simdist.reduce import Reduction, make_reduction
from simdist.sources.moe import MoEConfig, MoEGradients
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec


@dataclass
class StepRecord:
    """One optimizer step of the policy run next to the matched run.

    ``tensors`` maps ``(param, kind)`` with kind ``local grad`` (the BF16
    gradient the model produced this step) or ``param`` (the BF16 weight
    after this step's update) to its divergence from the matched run's.
    """

    step: int
    loss: float = math.nan
    matched_loss: float = math.nan
    grad_norm: float = math.nan
    matched_grad_norm: float = math.nan
    tensors: dict[tuple[str, str], Difference] = field(default_factory=dict)

    @property
    def worst(self) -> tuple[tuple[str, str], Difference] | None:
        """The tensor with the largest relative error this step (None when every tensor is bitwise equal)."""
        found = [(k, d) for k, d in self.tensors.items() if not d.bitwise_equal]
        return max(found, key=lambda kd: (kd[1].norm_relative, kd[1].max_ulp), default=None)


class _Lockstep:
    """Where the two runs meet: pairs each rank's payloads, turns them into divergences, bounds the lag."""

    def __init__(self, steps: int, world_size: int, lag: int, progress: bool) -> None:
        self.cond = threading.Condition()
        self.lag = lag
        self.at = {(side, r): -1 for side in ("policy", "matched") for r in range(world_size)}
        self.pending: dict[tuple, dict[str, torch.Tensor]] = {}
        self.records = [StepRecord(s) for s in range(steps)]
        self.sums: dict[tuple, list] = {}  # (step, param, kind) -> [((rank, micro), Difference)]
        self.losses: dict[tuple[str, int], list[float]] = {}
        self.failed = False
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc="training", unit="step")

    def arrive(self, side: str, rank: int, step: int) -> None:
        """Note that ``side``'s ``rank`` reached ``step``; wait while it is more than ``lag`` steps ahead."""
        other = "matched" if side == "policy" else "policy"
        with self.cond:
            if step > self.at[(side, rank)]:
                self.at[(side, rank)] = step
                self.cond.notify_all()
                if self.bar is not None and side == "policy" and rank == 0 and 0 < step <= len(self.records):
                    self.bar.update(1)
            while not self.failed and self.at[(other, rank)] < step - self.lag:
                self.cond.wait(timeout=1.0)

    def put(self, side: str, rank: int, step: int, kind: str, micro: int, tensors: dict[str, torch.Tensor]) -> None:
        slot = (rank, step, kind, micro)
        with self.cond:
            if self.failed:
                return
            mine = self.pending.pop(slot, None)
            if mine is None:
                self.pending[slot] = tensors
                return
        policy, matched = (tensors, mine) if side == "policy" else (mine, tensors)
        diffs = {name: difference(policy[name], matched[name]) for name in tensors}
        with self.cond:
            for name, d in diffs.items():
                self.sums.setdefault((step, name, kind), []).append(((rank, micro), d))

    def loss(self, side: str, step: int, value: float) -> None:
        with self.cond:
            acc = self.losses.setdefault((side, step), [0.0, 0])
            acc[0] += value
            acc[1] += 1

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.pending.clear()
            self.cond.notify_all()

    def finish(self) -> list[StepRecord]:
        if self.bar is not None:
            self.bar.close()
        for (step, name, kind), parts in self.sums.items():
            # pooled in (rank, micro) order, not arrival order, so the float sums are the same every run
            self.records[step].tensors[(name, kind)] = Difference.pool(d for _, d in sorted(parts, key=lambda p: p[0]))
        for (side, step), (total, n) in self.losses.items():
            setattr(self.records[step], "loss" if side == "policy" else "matched_loss", total / n)
        return self.records


class _Probe:
    """Wraps the gradient source of one run: publishes weights, local gradients and losses to the lockstep."""

    def __init__(self, source: MoEGradients, lockstep: _Lockstep, side: str, steps: int) -> None:
        self.source, self.lockstep, self.side, self.steps = source, lockstep, side, steps

    def backward(self, comm, step, micro, lp, deliver, hooks) -> None:
        rank = comm.get_rank()
        self.lockstep.arrive(self.side, rank, step)
        if micro == 0 and step > 0:
            weights = {name: t.detach().clone() for name, t in lp.items()}
            self.lockstep.put(self.side, rank, step - 1, "param", 0, weights)
        if step >= self.steps:  # the extra step only shows the weights after the last update; its gradients
            for name, weight in lp.items():  # are zeros (train_rank needs every gradient) and its update is unread
                deliver(name, torch.zeros_like(weight))
            return
        grads: dict[str, torch.Tensor] = {}

        def spy(name: str, grad: torch.Tensor) -> None:
            grads[name] = grad.detach().clone()
            deliver(name, grad)

        loss = self.source.backward(comm, step, micro, lp, spy, hooks)
        self.lockstep.put(self.side, rank, step, "local grad", micro, grads)
        self.lockstep.loss(self.side, step, loss)


def train(
    spec: ParallelSpec,
    policy: Policy | str,
    *,
    steps: int = 10,
    gas: int = 1,
    seed: int = 0,
    reduction: Reduction | str = DEFAULT_REDUCTION,
    marker: str = "deepspeed",
    update_path: str = "epilogue",
    matched: Policy = MATCHED_FP32,
    model: MoEConfig | None = None,
    lag: int = 2,
    progress: bool = False,
) -> list[StepRecord]:
    """Train the folded MoE block ``steps x gas`` under ``policy``; one `StepRecord` per step against the run of
    ``matched`` (a matched policy: the oracle's FP32 staging run through the gradient path, by default).

    The matched run uses the same spec, model, data, seed and reduction,
    with the TP correction on every micro-step (``marker="per_micro_step"``),
    as the #8913 oracle does.
    """
    policy = get_policy(policy) if isinstance(policy, str) else policy
    reduction = make_reduction(reduction) if isinstance(reduction, str) else reduction
    source = MoEGradients(spec, model or MoEConfig(), seed, gas)
    lockstep = _Lockstep(steps, spec.world_size, lag, progress)
    runs = {
        "policy": (
            policy,
            PathConfig(
                steps=steps + 1,
                gas=gas,
                seed=seed,
                marker=coerce(Marker, marker, "marker"),
                update_path=coerce(UpdatePath, update_path, "update_path"),
            ),
        ),
        "matched": (matched, PathConfig(steps=steps + 1, gas=gas, seed=seed, marker=Marker.PER_MICRO_STEP)),
    }
    traces = _run_side_by_side(spec, reduction, source, lockstep, runs, steps)
    records = lockstep.finish()
    for record in records:
        record.grad_norm = traces["policy"][0].scalars[(record.step, "grad_norm")]
        record.matched_grad_norm = traces["matched"][0].scalars[(record.step, "grad_norm")]
    return records


def _run_side_by_side(
    spec: ParallelSpec,
    reduction: Reduction,
    source: MoEGradients,
    lockstep: _Lockstep,
    runs: dict[str, tuple[Policy, PathConfig]],
    steps: int,
) -> dict[str, list]:
    """The two `SimWorld` runs of ``runs`` in lockstep: ``matched`` on a helper thread, ``policy`` on this one;
    each side's traces. The first exception of either side stops both and is raised."""
    traces: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(side: str) -> None:
        chosen, config = runs[side]
        try:
            world = SimWorld(spec, reduction=reduction, intra_op_threads=None, timeout_s=None)  # as long as it trains
            probe = _Probe(source, lockstep, side, steps)
            traces[side] = world.run(train_rank, source.params, source.initial, probe, chosen, config, frozenset())
        except BaseException as exc:
            errors.append(exc)
            lockstep.fail()

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # both runs share the process: one intra-op setting for both, set once
    try:
        helper = threading.Thread(target=run, args=("matched",), name="simdist-matched-run", daemon=True)
        helper.start()
        run("policy")
        helper.join()
    finally:
        torch.set_num_threads(threads_before)
    if errors:
        raise errors[0]
    return traces


def format_records(records: list[StepRecord]) -> str:
    """A table: loss and grad norm of the policy's and the matched run, and the worst tensor of each step."""
    out = [f"{'step':>4} {'loss':>10} {'matched':>10} {'grad norm':>10} {'matched':>10}  worst tensor vs matched"]
    for r in records:
        worst = r.worst
        text = (
            "every tensor bitwise equal"
            if worst is None
            else (
                f"{worst[0][0]} {worst[0][1]}: normwise rel {worst[1].norm_relative:.2e}, max {worst[1].max_ulp} ulp, "
                f"{100 * worst[1].fraction_differing:.1f}% differ"
            )
        )
        out.append(
            f"{r.step:>4} {r.loss:>10.6f} {r.matched_loss:>10.6f} {r.grad_norm:>10.6f} "
            f"{r.matched_grad_norm:>10.6f}  {text}"
        )
    return "\n".join(out)
