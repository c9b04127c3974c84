"""The independent FP32/FP64 oracle: explicit TP-then-DP per-parameter reduction and a real ``torch.optim.AdamW``.

This is the accepted numerical reference of the #8913 report ("an explicit FP32
TP-then-DP/per-parameter reducer" next to a real optimizer), written so that it
shares no code with the gradient-path engine it judges (`simdist.gradpath.kernel`,
`simdist.gradpath.policy`): only the reduction models (`simdist.reduce`), the
group tables (`ParallelSpec.groups`), the parameter list (`ParamSpec`) and the
capture names (`simdist.gradpath.probes`) are shared.

Per optimizer step, for every parameter, in plain loops over ranks and groups:

1. every micro-step, each rank's BF16 local gradient is staged into ``dtype``;
   the TP correction of the parameter's family (`CORRECTIONS`, restated here
   from DeepSpeed's ``auto_ep_folding.py``, not read from
   `simdist.gradpath.families`) runs on the staged values of each TP group --
   the group's ``tp_model`` sum and/or ``/ tp`` -- on every micro-step, and
   the result is added to the rank's ``dtype`` accumulation buffer;
2. at the boundary, each DP group (the EDP group for routed experts) sums its
   members' buffers in ``dp_model``'s order and scales by ``1 / dp`` (the
   dense DP size, for experts too);
3. the reduced gradient is the ``.grad`` of the ``dtype`` master weights
   (every rank's and parameter's, in one flat tensor: AdamW is element-wise),
   and ``torch.optim.AdamW`` -- the real optimizer class, with its own state
   -- takes one step over them; the masters are rounded to BF16 (nearest
   even) as the next step's parameters.

Why the correction rule is restated rather than taken from the family table:
an oracle that read `Family.correction` would share any error in that table
with the engine, and the comparison could not see it; restated, a mutated table
makes the engine and the oracle disagree (tested). A test also checks that the
restated table equals DeepSpeed's own strategy names for the synthetic
parameters (the ``deepspeed-8913`` case records them from the real code).

Where every TP or DP group has two members, a group sum is one addition whatever the model's order, and
`Oracle.step` (when nothing is captured) runs that stage for every parameter at once on one flat buffer
(`_FusedPairs`, a third of the per-parameter step's time in the growth study); a NaN in such a sum, whose
payload does depend on the order, sends the stage back to the per-parameter loops. Tested equal, bit for bit.

Power checks (`Control`, used by `simdist.studies.power`): the oracle can run with one deliberate error --
DP before TP, experts over the dense DP group, a BF16 TP sum, the corrected value rounded to BF16 -- so that a
verdict can show that its inputs would see that error; the default `Control()` changes nothing.

Not modelled: global-norm clipping (``max_norm`` must be 0, which every study
uses) and the correction-once marker (the oracle corrects every micro-step,
the intended semantics). Values may carry leading batch dimensions
(``[seed]`` in the growth study): every operation above is element-wise along
them, and each reduction runs per batch item, so each item gets the bits it gets alone (tested).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from simdist.errors import UsageError
from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.probes import BOUNDARY, Capture, Trace
from simdist.reduce import ReductionModel
from simdist.world.spec import ParallelSpec

CORRECTIONS: dict[Family, tuple[bool, bool]] = {
    Family.ROUTER_GATE_REPLICATED: (True, True),  # DeepSpeed "average": TP sum, then / tp
    Family.ROUTER_GATE_PARTIAL: (True, False),  # "sum": TP sum only
    Family.DENSE: (True, True),  # "average"
    Family.MODEL_PARALLEL: (False, False),  # "skip"
    Family.EXPERT: (False, True),  # "expert_tp_cancel": / tp, no TP sum
}
"""``family -> (TP sum, divide by tp)``, restated from DeepSpeed's ``auto_ep_folding`` strategies (with
``tp == 1`` nothing runs)."""

DEEPSPEED_STRATEGY: dict[tuple[bool, bool], str] = {
    (True, True): "average",
    (True, False): "sum",
    (False, False): "skip",
    (False, True): "expert_tp_cancel",
}
"""The name DeepSpeed's folding code gives each rule (what the real optimizer reports per parameter)."""


def correction(family: Family, tp: int) -> tuple[bool, bool]:
    """``(TP sum, divide by tp)`` for ``family`` on a TP group of ``tp`` ranks."""
    return (False, False) if tp <= 1 else CORRECTIONS[family]


def dp_kind(family: Family) -> str:
    """The group kind of the data-parallel reduction: ``edp`` for routed experts, ``dp`` for the rest."""
    return "edp" if family is Family.EXPERT else "dp"


@dataclass(frozen=True)
class Control:
    """A deliberate error in the oracle, for the power checks (`simdist.studies.power`): a verdict whose inputs
    can see what it asserts must see the controlled oracle differ from the oracle. The default is no change.

    * ``dp_then_tp`` -- the TP correction runs after the DP reduction (on the DP-reduced buffer) instead of
      on every micro-step before it;
    * ``expert_dp`` -- routed experts are reduced over this group kind (``"dp"``) instead of `dp_kind`'s;
    * ``tp_sum_dtype`` -- the TP sum runs on values rounded to this dtype, in this dtype (a BF16 TP sum);
    * ``corrected_dtype`` -- the corrected value is rounded to this dtype before it is accumulated (the fix's
      staging rounded to BF16, i.e. the #8913 writeback).
    """

    dp_then_tp: bool = False
    expert_dp: str | None = None
    tp_sum_dtype: torch.dtype | None = None
    corrected_dtype: torch.dtype | None = None

    @property
    def changes(self) -> bool:
        return self != Control()


@dataclass(frozen=True)
class AdamWSettings:
    """The hyper-parameters handed to ``torch.optim.AdamW`` (anything with these attributes will do)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


Key = tuple[int, str]
"""``(rank, parameter name)``."""
Captured = Callable[[int, int, str, str, torch.Tensor], None]
"""``(step, micro, param, stage, value)``: ``value`` is every rank's, ``[*batch, rank, *shape]`` (the oracle's own
tensor: copy what you keep); ``micro`` is `BOUNDARY` for the step's boundary."""


class Oracle:
    """The oracle's state for every rank: BF16 parameters, ``dtype`` masters and a ``torch.optim.AdamW``.

    ``initial[(rank, name)]`` is a BF16 tensor ``[*batch, *shape]``. `step` runs one optimizer step from the
    local gradients of its micro-steps. ``fused=False`` keeps every stage in the per-parameter loops (see
    `_FusedPairs`; tests compare the two).

    Each parameter's tensors of every rank sit in one ``[*batch, rank, *shape]`` tensor (`stacked`): casts,
    ``/ tp``, ``+=`` and every AdamW operation are element-wise, so they give each rank's elements the bits
    they get in the rank's own tensor, and a group's reduction takes its members out of the rank dimension in
    group-rank order. One tensor per parameter instead of one per rank and parameter keeps the number of torch
    calls (the cost of small tensors) independent of the world size. The masters of every trained parameter
    are one flat ``[*batch, rank, N]`` parameter of the real ``torch.optim.AdamW`` (`part` gives a parameter's
    view): on CPU it runs its single-tensor step, whose every operation is element-wise, so each element gets
    the bits it gets in its own parameter's tensor (``tests/test_oracle_group_sums.py`` checks this layout against one
    optimizer parameter per rank and parameter), and one tensor costs a fifth of five.
    """

    def __init__(
        self,
        spec: ParallelSpec,
        params: Sequence[ParamSpec],
        initial: dict[Key, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        tp_model: ReductionModel,
        dp_model: ReductionModel,
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
        self.spec, self.dtype, self.tp_model, self.dp_model = spec, dtype, tp_model, dp_model
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
        self._fused = _FusedPairs(spec, self.trained, self.spans, start) if fused else None

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
        tp = self.spec.tp
        # one flat ``dtype`` buffer in the masters' layout; each parameter's buffer is a view of it (`_Parts`)
        hp_flat = torch.zeros(self.master[0].shape, dtype=self.dtype) if self.master else None
        hp = _Parts(self, hp_flat)
        fused = self._fused if capture is None and hp_flat is not None else None
        for micro in range(gas):
            grads = local_grads(micro, _PerRank(self.lp, self.params))
            if fused is not None and hp_flat is not None and fused.micro_step(self, grads, hp_flat):
                continue
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
        grad = fused.boundary(self, hp_flat) if fused is not None and hp_flat is not None else None
        if grad is None:
            flat_grads: list[torch.Tensor] = []
            for p in self.trained:
                kind = dp_kind(p.family)
                if p.family is Family.EXPERT and self.control.expert_dp is not None:
                    kind = self.control.expert_dp
                reduced = self._group_sums(self.dp_model, kind, hp[p.name], p, scale=1.0 / self.spec.dp)
                if self.control.dp_then_tp:
                    reduced = self._tp_correct(reduced, p, *correction(p.family, tp), step, BOUNDARY, seen)
                seen(step, BOUNDARY, p.name, Capture.DP_REDUCED, reduced)
                seen(step, BOUNDARY, p.name, Capture.CLIPPED, reduced)
                flat_grads.append(reduced.flatten(reduced.dim() - len(p.shape)))
            grad = torch.cat(flat_grads, dim=-1) if flat_grads else None
        if not self.master:
            return
        master = self.master[0]
        master.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state = self.optimizer.state[master]
        lp = master.detach().to(torch.bfloat16)
        for p in self.trained:
            self.lp[p.name] = self.part(lp, p)
            if capture is None:  # nothing sees the views below: skip making them
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
                value = self._group_sums(self.tp_model, "tp", value, p)
            else:
                value = self._group_sums(self.tp_model, "tp", value.to(summed_dtype), p).to(self.dtype)
            if divides:
                seen(step, micro, p.name, Capture.TP_REDUCED, value)
        if divides:
            value = value / self.spec.tp
        return value

    def _group_sums(
        self, model: ReductionModel, kind: str, value: torch.Tensor, p: ParamSpec, scale: float | None = None
    ) -> torch.Tensor:
        """Every rank's group sum (``model``'s order, group-rank order) of ``value`` ``[*batch, rank, *shape]``
        over the groups of ``kind``, times ``scale`` if given, in a new tensor."""
        dim = value.dim() - len(p.shape) - 1
        groups = self.spec.groups(kind)
        if all(len(group) == 2 for group in groups):
            # two members are one addition: every group's pair is summed at once (the groups ride along as
            # batch items, as the seeds do in `_reduce`), then each rank takes its group's sum
            first, second, group_of = _pair_indexes(groups, len(self.ranks))
            pairs = [value.index_select(dim, first), value.index_select(dim, second)]
            out = _reduce(model, pairs, p.shape).index_select(dim, group_of)
            return out if scale is None else out * scale
        sums: dict[int, torch.Tensor] = {}
        rows = value.unbind(dim)
        for group in groups:
            total = _reduce(model, [rows[r].contiguous() for r in group], p.shape)
            for r in group:
                sums[r] = total
        out = torch.stack([sums[r] for r in self.ranks], dim=dim)
        return out if scale is None else out * scale

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


class _FusedPairs:
    """The oracle's step for every trained parameter at once, where a group sum is one addition.

    When every group of a kind has two members, a group's sum is one addition per element, which every order
    performs on the same two values: it does not depend on where the element sits in its parameter, so one
    reduction of the flat ``[*batch, rank, N]`` buffer (every parameter, in the masters' layout) gives each
    element the bits of its own parameter's reduction (the assumption `_reduce` already makes for the seeds
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

        One IEEE addition, written here rather than asked of the reduction model: every model performs this same
        addition on a pair (only a NaN's payload depends on which member receives, and a NaN sends the stage to
        the per-parameter loops, which ask the model), so the fused stage shares no code with the engine."""
        dim = value.dim() - 2
        first, second, group_of = _pair_indexes(self.spec.groups(kind), self.spec.world_size)
        out = value.index_select(dim, first) + value.index_select(dim, second)
        if math.isnan(out.sum().item()):  # as in `_reduce`: a NaN anywhere makes the sum NaN
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


def stacked(per_rank: Sequence[torch.Tensor], p: ParamSpec) -> torch.Tensor:
    """Every rank's ``[*batch, *shape]`` tensor of ``p`` as one ``[*batch, rank, *shape]`` tensor."""
    return torch.stack(list(per_rank), dim=per_rank[0].dim() - len(p.shape))


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


@functools.lru_cache(maxsize=64)
def _pair_indexes(groups: tuple[tuple[int, ...], ...], world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-member ``groups``: the ranks of their first members, of their second members, and each rank's group."""
    group_of = [0] * world
    for g, group in enumerate(groups):
        for r in group:
            group_of[r] = g
    first, second = (torch.tensor([group[j] for group in groups]) for j in (0, 1))
    return first, second, torch.tensor(group_of)


def _reduce(model: ReductionModel, members: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``model``'s sum of one group's members, each batch item on its own: a reduction model's order depends on
    the size of the tensor a rank hands in (a parameter's), not on how many seeds ride along.

    Two members are one addition, which every order performs on the same two values, and IEEE addition is
    commutative: the whole batch is reduced at once, unless the result holds a NaN (whose payload is the first
    operand's, so it depends on the order): then, as for more members, each item is reduced on its own."""
    batch = members[0].shape[: members[0].dim() - len(shape)]
    if not batch:
        return model.reduce(members)
    if len(members) <= 2:
        out = model.reduce(members)
        if not math.isnan(out.sum().item()):  # a NaN anywhere makes the sum NaN (inf - inf only adds false alarms)
            return out
    flat = [m.reshape(-1, *shape) for m in members]
    items = [model.reduce([m[i] for m in flat]) for i in range(flat[0].shape[0])]
    return torch.stack(items).reshape(*batch, *shape)


Values = dict[tuple[int, int, str, str], torch.Tensor]
"""``values[(step, micro, param, stage)]``: every rank's capture, ``[rank, *shape]``."""


def oracle_values(
    spec: ParallelSpec,
    params: Sequence[ParamSpec],
    initial: Callable[[int, ParamSpec], torch.Tensor],
    local_grads,
    *,
    steps: int,
    gas: int,
    tp_model: ReductionModel,
    dp_model: ReductionModel,
    dtype: torch.dtype = torch.float32,
    adam=None,
    keep: frozenset[str] | None = None,
    world_model: ReductionModel | None = None,
    control: Control | None = None,
) -> Values:
    """The oracle's captures over ``steps`` optimizer steps (unbatched), every rank's in one ``[rank, *shape]``
    copy per ``(step, micro, param, stage)``; ``keep`` selects stages (default all).

    ``local_grads`` is a ``(step, micro, rank, param) -> BF16 gradient`` function; or an object whose
    ``stacked(step, micro)`` gives ``{name: [rank, *shape]}`` (every rank's gradients at once); or a gradient
    source with ``backward(comm, step, micro, lp, deliver, hooks)`` (a model: its gradients depend on the
    oracle's own parameters), which then runs on a `SimWorld` whose groups use ``world_model`` (default
    ``dp_model``).
    """
    values: Values = {}
    oracle = Oracle(
        spec,
        params,
        {(r, p.name): initial(r, p).to(torch.bfloat16) for r in range(spec.world_size) for p in params},
        dtype=dtype,
        tp_model=tp_model,
        dp_model=dp_model,
        adam=adam,
        control=control,
    )
    trained = [p for p in params if not p.frozen]

    def capture(step: int, micro: int, param: str, stage: str, value: torch.Tensor) -> None:
        if keep is None or stage in keep:
            values[(step, micro, param, stage)] = value.detach().clone()

    source: Callable[[int, Mapping[Key, torch.Tensor]], Mapping]
    for step in range(steps):
        if hasattr(local_grads, "backward"):
            source = _SourceGrads(spec, params, local_grads, step, world_model or dp_model)
        elif hasattr(local_grads, "stacked"):

            def source(micro, lp, step=step):
                return local_grads.stacked(step, micro)

        else:

            def source(micro, lp, step=step):
                return {(r, p.name): local_grads(step, micro, r, p) for r in range(spec.world_size) for p in trained}

        oracle.step(step, gas, source, capture)
    return values


def oracle_traces(
    spec: ParallelSpec,
    params: Sequence[ParamSpec],
    initial: Callable[[int, ParamSpec], torch.Tensor],
    local_grads,
    *,
    keep: frozenset[str] | None = None,
    **options: Any,
) -> list[Trace]:
    """Every rank's `Trace` of the oracle over ``steps`` optimizer steps (unbatched): `oracle_values` (which
    takes the same arguments: ``steps``, ``gas``, ``tp_model``, ``dp_model``, ...), split by rank."""
    values = oracle_values(spec, params, initial, local_grads, keep=keep, **options)
    traces = [Trace(r, keep) for r in range(spec.world_size)]
    for key, value in values.items():
        for r, trace in enumerate(traces):
            trace.values[key] = value[r]
    return traces


class _SourceGrads:
    """Local gradients of a model for one step: its forward/backward on every rank of a `SimWorld`, with the
    oracle's BF16 parameters."""

    def __init__(self, spec, params, source, step: int, model: ReductionModel) -> None:
        self.spec, self.params, self.source, self.step, self.model = spec, params, source, step, model

    def __call__(self, micro: int, lp: Mapping[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        from simdist.world.simworld import SimWorld

        def rank(comm) -> dict[str, torch.Tensor]:
            r = comm.get_rank()
            got: dict[str, torch.Tensor] = {}
            weights = {p.name: lp[(r, p.name)] for p in self.params}
            self.source.backward(comm, self.step, micro, weights, lambda n, g: got.__setitem__(n, g.detach()), False)
            return got

        results = SimWorld(self.spec, reduction=self.model, timeout_s=None).run(rank)
        return {(r, name): g for r, got in enumerate(results) for name, g in got.items()}
