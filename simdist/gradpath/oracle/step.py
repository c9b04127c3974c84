"""The oracle's state and its optimizer step for every rank (`Oracle`), and how it sums a group.

`Oracle` holds BF16 parameters, ``dtype`` masters, the TP correction on every micro-step, the DP reduction at the
boundary and a real ``torch.optim.AdamW``. Its group sums come first in this module: per parameter in the
reduction's order (`group_sums`), and every parameter at once where a group has two members (`FusedPairs`). Values
are ``[*batch, rank, *shape]`` tensors (`stacked`): a group takes its members out of the rank dimension in
group-rank order, and each batch item (a seed of the growth study) gets the bits it gets alone (`group_sum`).

Part of the independent oracle (`simdist.gradpath.oracle`, which states what it computes and why); it shares no
code with the gradient path it judges. Its rules come from `simdist.gradpath.oracle.rules`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from simdist.errors import UsageError
from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.oracle.rules import AdamWSettings, Control, correction, dp_kind
from simdist.gradpath.probes import BOUNDARY, Capture
from simdist.reduce import Reduction
from simdist.world.spec import ParallelSpec


def stacked(per_rank: Sequence[torch.Tensor], p: ParamSpec) -> torch.Tensor:
    """Every rank's ``[*batch, *shape]`` tensor of ``p`` as one ``[*batch, rank, *shape]`` tensor."""
    return torch.stack(list(per_rank), dim=per_rank[0].dim() - len(p.shape))


@functools.lru_cache(maxsize=64)
def pair_indexes(groups: tuple[tuple[int, ...], ...], world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-member ``groups``: the ranks of their first members, of their second members, and each rank's group."""
    group_of = [0] * world
    for g, group in enumerate(groups):
        for r in group:
            group_of[r] = g
    first, second = (torch.tensor([group[j] for group in groups]) for j in (0, 1))
    return first, second, torch.tensor(group_of)


def group_sum(reduction: Reduction, members: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``reduction``'s sum of one group's members, each batch item on its own: a reduction's order depends on
    the size of the tensor a rank hands in (a parameter's), not on how many seeds ride along.

    Two members are one addition, which every order performs on the same two values, and IEEE addition is
    commutative: the whole batch is reduced at once, unless the result holds a NaN (whose payload is the first
    operand's, so it depends on the order): then, as for more members, each item is reduced on its own."""
    batch = members[0].shape[: members[0].dim() - len(shape)]
    if not batch:
        return reduction.reduce(members)
    if len(members) <= 2:
        out = reduction.reduce(members)
        if not math.isnan(out.sum().item()):  # a NaN anywhere makes the sum NaN (inf - inf only adds false alarms)
            return out
    flat = [m.reshape(-1, *shape) for m in members]
    items = [reduction.reduce([m[i] for m in flat]) for i in range(flat[0].shape[0])]
    return torch.stack(items).reshape(*batch, *shape)


def group_sums(
    spec: ParallelSpec,
    reduction: Reduction,
    kind: str,
    value: torch.Tensor,
    shape: tuple[int, ...],
    scale: float | None = None,
) -> torch.Tensor:
    """Every rank's group sum (``reduction``'s order, group-rank order) of ``value`` ``[*batch, rank, *shape]`` over
    the groups of ``kind``, times ``scale`` if given, in a new tensor."""
    dim = value.dim() - len(shape) - 1
    groups = spec.groups(kind)
    if all(len(group) == 2 for group in groups):
        # two members are one addition: every group's pair is summed at once (the groups ride along as
        # batch items, as the seeds do in `group_sum`), then each rank takes its group's sum
        first, second, group_of = pair_indexes(groups, spec.world_size)
        pairs = [value.index_select(dim, first), value.index_select(dim, second)]
        out = group_sum(reduction, pairs, shape).index_select(dim, group_of)
        return out if scale is None else out * scale
    sums: dict[int, torch.Tensor] = {}
    rows = value.unbind(dim)
    for group in groups:
        total = group_sum(reduction, [rows[r].contiguous() for r in group], shape)
        for r in group:
            sums[r] = total
    out = torch.stack([sums[r] for r in range(spec.world_size)], dim=dim)
    return out if scale is None else out * scale


class FusedPairs:
    """The oracle's step for every trained parameter at once, where a group sum is one addition.

    When every group of a kind has two members, a group's sum is one addition per element, which every order
    performs on the same two values: it does not depend on where the element sits in its parameter, so one
    reduction of the flat ``[*batch, rank, N]`` buffer (every parameter, in the masters' layout) gives each
    element the bits of its own parameter's reduction (the assumption `group_sum` already makes for the seeds
    that ride along). The per-family TP correction becomes masks over the flat buffer; the DP reduction is
    fused only when every parameter's DP kind has the same groups. A NaN's payload does
    depend on the order: if a fused sum holds a NaN, that stage returns "not done" and `Oracle.step` runs it
    parameter by parameter instead. Used only when nothing is captured; tested equal, bit for bit, to the
    per-parameter step (``tests/unit/test_oracle_fused.py``).
    """

    def __init__(self, spec: ParallelSpec, trained: Sequence[ParamSpec], spans: dict[str, tuple[int, int]], n: int):
        self.spec = spec
        reduces, divides = (torch.zeros(n, dtype=torch.bool) for _ in range(2))
        for p in trained:
            start, stop = spans[p.name]
            reduces[start:stop], divides[start:stop] = correction(p.family, spec.tp)
        self.reduces = reduces if bool(reduces.any()) else None
        self.divides = divides if bool(divides.any()) else None
        pairs = {kind: all(len(g) == 2 for g in spec.groups(kind)) for kind in ("tp", "dp", "edp")}
        self.tp_ready = self.reduces is None or pairs["tp"]
        # the DP reduction at once: every trained parameter's DP kind (``dp``, ``edp`` for experts) has the same
        # two-member groups (``edp`` is ``dp`` unless experts are sharded over more than the TP group)
        kinds = {dp_kind(p.family) for p in trained}
        self.dp_kind = next(iter(sorted(kinds)), "dp")
        self.dp_ready = all(pairs[k] and spec.groups(k) == spec.groups(self.dp_kind) for k in kinds)

    def _pair_sums(self, kind: str, value: torch.Tensor) -> torch.Tensor | None:
        """Every rank's two-member group sum of the flat ``value`` ``[*batch, rank, N]``; None if it holds a NaN.

        One IEEE addition, written here rather than asked of the reduction: every reduction performs this same
        addition on a pair (only a NaN's payload depends on which member receives, and a NaN sends the stage to
        the per-parameter loops, which ask the reduction), so the fused stage shares no code with the gradient path."""
        dim = value.dim() - 2
        first, second, group_of = pair_indexes(self.spec.groups(kind), self.spec.world_size)
        out = value.index_select(dim, first) + value.index_select(dim, second)
        if math.isnan(out.sum().item()):  # as in `group_sum`: a NaN anywhere makes the sum NaN
            return None
        return out.index_select(dim, group_of)

    def micro_step(self, oracle: Oracle, grads: Mapping, hp: torch.Tensor) -> bool:
        """Add one micro-step's corrected local gradients of every trained parameter to ``hp``; False (``hp``
        untouched) when it cannot (a TP group of more than two, or a NaN in the TP sum)."""
        if not self.tp_ready:
            return False
        parts = []
        for p in oracle.trained:
            local = grads[p.name] if p.name in grads else stacked([grads[(r, p.name)] for r in oracle.ranks], p)
            parts.append(local.flatten(local.dim() - len(p.shape)))
        value = torch.cat(parts, dim=-1).to(oracle.dtype)
        if self.reduces is not None:
            summed = self._pair_sums("tp", value)
            if summed is None:
                return False
            value = torch.where(self.reduces, summed, value)
        if self.divides is not None:
            value = torch.where(self.divides, value / self.spec.tp, value)
        hp += value
        return True

    def boundary(self, oracle: Oracle, hp: torch.Tensor) -> torch.Tensor | None:
        """The DP-reduced gradient of every trained parameter, flat; None when it cannot (see `micro_step`)."""
        if not self.dp_ready:
            return None
        reduced = self._pair_sums(self.dp_kind, hp)
        return None if reduced is None else reduced * (1.0 / self.spec.dp)


Key = tuple[int, str]
"""``(rank, parameter name)``."""
Captured = Callable[[int, int, str, str, torch.Tensor], None]
"""``(step, micro, param, stage, value)``: ``value`` is every rank's, ``[*batch, rank, *shape]`` (the oracle's own
tensor: copy what you keep); ``micro`` is `BOUNDARY` for the step's boundary."""


class Oracle:
    """The oracle's state for every rank: BF16 parameters, ``dtype`` masters and a ``torch.optim.AdamW``.

    ``initial[(rank, name)]`` is a BF16 tensor ``[*batch, *shape]``. `step` runs one optimizer step from the
    local gradients of its micro-steps. ``fused=False`` keeps every stage in the per-parameter loops (see
    `FusedPairs`; tests compare the two).

    Each parameter's tensors of every rank sit in one ``[*batch, rank, *shape]`` tensor (`stacked`): casts,
    ``/ tp``, ``+=`` and every AdamW operation are element-wise, so they give each rank's elements the bits
    they get in the rank's own tensor, and a group's reduction takes its members out of the rank dimension in
    group-rank order. One tensor per parameter instead of one per rank and parameter keeps the number of torch
    calls (the cost of small tensors) independent of the world size. The masters of every trained parameter
    are one flat ``[*batch, rank, N]`` parameter of the real ``torch.optim.AdamW`` (`part` gives a parameter's
    view): on CPU it runs its single-tensor step, whose every operation is element-wise, so each element gets
    the bits it gets in its own parameter's tensor (``tests/unit/gradpath/oracle/test_step_group_sums.py`` checks this
    layout
    against one optimizer parameter per rank and parameter), and one tensor costs a fifth of five.
    """

    def __init__(
        self,
        spec: ParallelSpec,
        params: Sequence[ParamSpec],
        initial: dict[Key, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        tp_reduction: Reduction,
        dp_reduction: Reduction,
        adam=None,
        max_norm: float = 0.0,
        fused: bool = True,
        control: Control | None = None,
    ) -> None:
        self.control = control or Control()
        if self.control.changes:
            fused = False  # the fused stage knows only the oracle's own rules
        if max_norm:
            raise UsageError("the independent oracle does not clip: run it with max_norm = 0")
        self.spec, self.dtype, self.tp_reduction, self.dp_reduction = spec, dtype, tp_reduction, dp_reduction
        self.params = list(params)
        self.trained = [p for p in self.params if not p.frozen]
        self.ranks = range(spec.world_size)
        self.lp = {p.name: stacked([initial[(r, p.name)].detach() for r in self.ranks], p) for p in self.params}
        self.spans: dict[str, tuple[int, int]] = {}
        start = 0
        for p in self.trained:
            self.spans[p.name] = (start, start + math.prod(p.shape))
            start += math.prod(p.shape)
        # the masters of every trained parameter, flat: ``[*batch, rank, N]`` in parameter order (`part`)
        masters = [self.lp[p.name].to(dtype).flatten(self.lp[p.name].dim() - len(p.shape)) for p in self.trained]
        self.master = [torch.nn.Parameter(torch.cat(masters, dim=-1))] if masters else []
        h = adam or AdamWSettings()
        self.optimizer = torch.optim.AdamW(
            self.master,
            lr=h.lr,
            betas=(h.beta1, h.beta2),
            eps=h.eps,
            weight_decay=h.weight_decay,
        )
        self._fused = FusedPairs(spec, self.trained, self.spans, start) if fused else None

    def part(self, flat: torch.Tensor, p: ParamSpec) -> torch.Tensor:
        """``p``'s ``[*batch, rank, *shape]`` view of a flat ``[*batch, rank, N]`` tensor of the masters' layout."""
        start, stop = self.spans[p.name]
        return flat[..., start:stop].view(*flat.shape[:-1], *p.shape)

    def step(
        self,
        step: int,
        gas: int,
        local_grads: Callable[[int, Mapping[Key, torch.Tensor]], Mapping],
        capture: Captured | None = None,
    ) -> None:
        """One optimizer step; ``local_grads(micro, lp)`` gives every rank's BF16 local gradient of every trained
        parameter for that micro-step, computed from the current BF16 parameters ``lp`` (``lp[(rank, name)]``):
        as ``{(rank, name): [*batch, *shape]}``, or as ``{name: [*batch, rank, *shape]}`` (every rank's at once).
        ``capture`` sees every stage's ``[*batch, rank, *shape]`` value (`Captured`)."""
        seen = capture or (lambda *args: None)
        # one flat ``dtype`` buffer in the masters' layout; each parameter's buffer is a view of it (`_Parts`)
        hp_flat = torch.zeros(self.master[0].shape, dtype=self.dtype) if self.master else None
        hp = _Parts(self, hp_flat)
        fused = self._fused if capture is None and hp_flat is not None else None
        for micro in range(gas):
            grads = local_grads(micro, _PerRank(self.lp, self.params))
            if fused is not None and hp_flat is not None and fused.micro_step(self, grads, hp_flat):
                continue
            self._accumulate(step, micro, grads, hp, seen)
        grad = fused.boundary(self, hp_flat) if fused is not None and hp_flat is not None else None
        if grad is None:
            grad = self._dp_reduce(step, hp, seen)
        if self.master:
            self._optimizer_step(step, grad, capture is not None, seen)

    def _accumulate(self, step: int, micro: int, grads: Mapping, hp: _Parts, seen) -> None:
        """One micro-step, parameter by parameter: the local gradient in ``dtype``, TP-corrected per its family,
        added to its accumulation buffer in ``hp``."""
        tp = self.spec.tp
        for p in self.trained:
            reduces, divides = correction(p.family, tp)
            if self.control.dp_then_tp:
                reduces = divides = False  # corrected at the boundary, after the DP reduction
            local = grads[p.name] if p.name in grads else stacked([grads[(r, p.name)] for r in self.ranks], p)
            seen(step, micro, p.name, Capture.LOCAL, local)
            value = local.to(self.dtype)
            if reduces or divides:
                seen(step, micro, p.name, Capture.STAGED, value)
            value = self._tp_correct(value, p, reduces, divides, step, micro, seen)
            if (reduces or divides) and self.control.corrected_dtype is not None:
                value = value.to(self.control.corrected_dtype).to(self.dtype)
            if reduces or divides:
                seen(step, micro, p.name, Capture.CORRECTED, value)
            hp[p.name] += value
            seen(step, micro, p.name, Capture.HP, hp[p.name])

    def _dp_reduce(self, step: int, hp: _Parts, seen) -> torch.Tensor | None:
        """Each parameter's accumulated gradient averaged over its data-parallel group (then TP-corrected, for
        the DP-then-TP control), as one flat gradient in the masters' layout; None where nothing is trained."""
        flat_grads: list[torch.Tensor] = []
        for p in self.trained:
            kind = dp_kind(p.family)
            if p.family is Family.EXPERT and self.control.expert_dp is not None:
                kind = self.control.expert_dp
            reduced = group_sums(self.spec, self.dp_reduction, kind, hp[p.name], p.shape, scale=1.0 / self.spec.dp)
            if self.control.dp_then_tp:
                reduced = self._tp_correct(reduced, p, *correction(p.family, self.spec.tp), step, BOUNDARY, seen)
            seen(step, BOUNDARY, p.name, Capture.DP_REDUCED, reduced)
            seen(step, BOUNDARY, p.name, Capture.CLIPPED, reduced)
            flat_grads.append(reduced.flatten(reduced.dim() - len(p.shape)))
        return torch.cat(flat_grads, dim=-1) if flat_grads else None

    def _optimizer_step(self, step: int, grad: torch.Tensor | None, captured: bool, seen) -> None:
        """AdamW on the flat FP32 master; the new BF16 parameters (and, when ``captured``, every view seen)."""
        master = self.master[0]
        master.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state = self.optimizer.state[master]
        lp = master.detach().to(torch.bfloat16)
        for p in self.trained:
            self.lp[p.name] = self.part(lp, p)
            if not captured:  # nothing sees the views below: skip making them
                continue
            seen(step, BOUNDARY, p.name, Capture.MASTER, self.part(master.detach(), p))
            seen(step, BOUNDARY, p.name, Capture.ADAM_M, self.part(state["exp_avg"], p))
            seen(step, BOUNDARY, p.name, Capture.ADAM_V, self.part(state["exp_avg_sq"], p))
            seen(step, BOUNDARY, p.name, Capture.PARAM, self.lp[p.name])

    def _tp_correct(
        self, value: torch.Tensor, p: ParamSpec, reduces: bool, divides: bool, step: int, micro: int, seen
    ) -> torch.Tensor:
        """The TP correction of ``p``'s family on ``value`` (the group's sum and/or ``/ tp``)."""
        if reduces:
            summed_dtype = self.control.tp_sum_dtype
            if summed_dtype is None:
                value = group_sums(self.spec, self.tp_reduction, "tp", value, p.shape)
            else:
                value = group_sums(self.spec, self.tp_reduction, "tp", value.to(summed_dtype), p.shape).to(self.dtype)
            if divides:
                seen(step, micro, p.name, Capture.TP_REDUCED, value)
        if divides:
            value = value / self.spec.tp
        return value

    # -- flat state, for the rank-batched growth study ------------------------------------------------------------

    def flat(self, which: str) -> torch.Tensor:
        """``master``, ``m``, ``v`` or ``lp`` of every trained parameter as ``[*batch, rank, N]`` (parameter order)."""
        if which == "lp":
            parts = [self.lp[p.name] for p in self.trained]
            return torch.cat([t.flatten(t.dim() - len(p.shape)) for t, p in zip(parts, self.trained, strict=True)], -1)
        master = self.master[0]
        if which == "master":
            return master.detach()
        state = self.optimizer.state.get(master)
        if not state:
            return torch.zeros_like(master.detach())
        return state["exp_avg" if which == "m" else "exp_avg_sq"]

    def state(self) -> dict[str, torch.Tensor]:
        """Masters, moments and BF16 parameters as flat ``[*batch, rank, N]`` tensors (for checkpoints)."""
        names = {"master": "master", "adam_m": "m", "adam_v": "v", "lp": "lp"}
        return {key: self.flat(which) for key, which in names.items()}

    def load(self, state: dict[str, torch.Tensor], steps_done: int) -> None:
        """Restore `state` after ``steps_done`` optimizer steps (the optimizer's step counters included)."""
        master = self.master[0]
        with torch.no_grad():
            master.copy_(state["master"])
        lp = state["lp"].clone()
        for p in self.trained:
            self.lp[p.name] = self.part(lp, p)
        if steps_done:
            self.optimizer.state[master] = {
                "step": torch.tensor(float(steps_done)),
                "exp_avg": state["adam_m"].clone(),
                "exp_avg_sq": state["adam_v"].clone(),
            }


class _Parts(dict):
    """``{name: view}`` of each trained parameter's part of a flat buffer, each view made when first asked for
    (the fused step never asks)."""

    def __init__(self, oracle: Oracle, flat: torch.Tensor | None) -> None:
        super().__init__()
        self.oracle, self.flat = oracle, flat

    def __missing__(self, name: str) -> torch.Tensor:
        assert self.flat is not None, "a parameter's buffer was asked for, but nothing is trained"
        view = self[name] = self.oracle.part(self.flat, next(p for p in self.oracle.trained if p.name == name))
        return view


class _PerRank(Mapping):
    """``lp[(rank, name)]``: one rank's ``[*batch, *shape]`` view of the stacked BF16 parameters."""

    def __init__(self, lp: dict[str, torch.Tensor], params: Sequence[ParamSpec]) -> None:
        self.lp, self.shapes = lp, {p.name: p.shape for p in params}

    def __getitem__(self, key: Key) -> torch.Tensor:
        rank, name = key
        value = self.lp[name]
        return value.select(value.dim() - len(self.shapes[name]) - 1, rank)

    def __iter__(self):
        return ((r, name) for name, value in self.lp.items() for r in range(value.shape[-len(self.shapes[name]) - 1]))

    def __len__(self) -> int:
        return sum(1 for _ in self)
