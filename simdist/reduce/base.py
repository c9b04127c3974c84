"""Reductions: how a collective sums, and where it rounds.

A reduction is a pure, vectorised function from the per-rank tensors of
one group (stacked along dim 0 in group-rank order) to the reduced tensor. It
never looks at threads, devices or arrival order, so the same reduction gives the
same bits on CPU and CUDA and can be property-tested on its own.

Every reduction rounds each partial sum to the dtype of the tensors unless it says
otherwise. Additions run as torch element-wise adds in that dtype: for fp32
that is one IEEE-754 round-to-nearest-even addition; for bf16 and fp16 torch
adds in fp32 and rounds once to the narrow type, which equals the correctly
rounded narrow sum because fp32 carries more than ``2p + 2`` bits of the narrow
format (double rounding is innocuous for a single addition).

Operations (`ReduceOp`):

* ``SUM`` -- the reduction's summation order.
* ``AVG`` -- the reduction's SUM, then one division by the group size in the
  tensor dtype (``postdiv``, one extra rounding); or, with ``avg="premul"``,
  each input multiplied by ``1/n`` rounded to the dtype, before the SUM
  (NCCL's ``ncclAvg`` pre-multiplies floating types in this way).
* ``PRODUCT`` -- the reduction's order with multiplication in place of addition
  (`Reduction.product`; a reduction that does not define it refuses ``PRODUCT``).
* ``MAX`` / ``MIN`` -- element-wise; order-free; NaN propagates (a reduction may
  override this: `simdist.reduce.gloo.reduction.Gloo` folds with gloo's comparison).

A reduction says what its order is, so that every front end and the rank-batched gradient path
(`Reduction.sum_many`) run it vectorised without knowing its class: a rank fold returns its
`simdist.reduce.plan.FoldPlan` from `Reduction.fold_plan` and gets `Reduction.sum`, `Reduction.product` and
`Reduction.sum_many` from it; an order that is not a fold but the same at every element (a tree over the ranks) sets
``position_free = True``; anything else overrides `Reduction.sum_many`. A subclass that overrides
``sum`` or ``reduce`` without one of these is not batched with its parent's plan (it would no longer
describe the order): the rank-batched gradient path then reduces it one item at a time and warns once
(`PerItemWarning`).
"""

from __future__ import annotations

import enum
import functools
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch

from simdist.errors import UsageError
from simdist.reduce import native
from simdist.reduce.plan import PLAN_CACHE_SIZE, FoldPlan, Hops, fold

AvgMode = Literal["postdiv", "premul"]


Tensors = torch.Tensor | Sequence[torch.Tensor]
"""Per-rank tensors of one group: stacked on dim 0, or a sequence, in group-rank order."""


class ReduceOp(enum.Enum):
    """ReductionName operations of a collective (mirrors ``torch.distributed.ReduceOp``)."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MAX = "max"
    MIN = "min"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp:
        """Accept a `ReduceOp`, its name, or a ``torch.distributed.ReduceOp``."""
        if isinstance(op, cls):
            return op
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        try:
            return cls[name.upper()]
        except KeyError:
            raise UsageError(f"unsupported reduce op {op!r}; valid: {', '.join(o.name for o in cls)}") from None


class PerItemWarning(UserWarning):
    """A reduction declares no order (`Reduction.fold_plan`, ``position_free``, ``sum_many``): the
    rank-batched gradient path reduces its items one at a time."""


_ORDER_DECLARATIONS = ("fold_plan", "position_free", "sum_many")


class Reduction(ABC):
    """How a group reduces: a summation order plus the dtype each partial is rounded to.

    Capabilities are class attributes the front ends read (never the reduction's class): ``avg``,
    ``gloo_rules``, ``position_free``; the order itself is `fold_plan` (see the module docstring).
    """

    avg: AvgMode = "postdiv"
    gloo_rules: bool = False
    """Whether front ends apply torch's gloo backend rules (shape checks, PREMUL_SUM) to its collectives."""

    position_free: bool = False
    """Whether `sum` adds the members in the same order at every element and so reduces a stacked
    ``[n, *batch, *shape]`` tensor item by item in one call (the rank-batched gradient path relies on it)."""

    _declared: ClassVar[bool] = True
    _warned: ClassVar[set[type]] = set()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        namespace = vars(cls)
        if any(name in namespace for name in _ORDER_DECLARATIONS):
            cls._declared = True
        elif "sum" in namespace or "reduce" in namespace:
            # a new order written as code: the parent's plan (or batched schedule) no longer describes it
            cls._declared = False
            cls.sum_many = Reduction.sum_many  # type: ignore[method-assign]
            cls.sum_many_into = Reduction.sum_many_into  # type: ignore[method-assign]

    @property
    @abstractmethod
    def name(self) -> str:
        """A short name that identifies the reduction and its parameters."""

    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan | None:
        """This reduction's SUM of ``n`` members of ``numel`` elements of ``dtype`` as a fold plan; None when the
        SUM is not a left fold over the members (e.g. a tree). Called through `plan`, which caches it."""
        return None

    def plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan | None:
        """`fold_plan`, cached per ``(reduction, n, numel, dtype)`` (at most `PLAN_CACHE_SIZE` plans per process)."""
        return _plan_of(self, n, numel, dtype)

    def fold_order(self, n: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``index[j, e]``: the member whose value element ``e`` of an ``n``-member SUM adds at hop ``j``."""
        plan = self.plan(n, numel, dtype)
        if plan is None:
            raise UsageError(f"the {self.name} reduction's SUM is not a fold over the members")
        return plan.index()

    def sum(self, tensors: Tensors) -> torch.Tensor:
        """Sum the per-rank ``tensors`` (group-rank order) with this reduction's order and rounding.

        ``tensors`` is either one stacked tensor of shape ``[n, *shape]`` or a
        sequence of ``n`` tensors of one shape; both give the same bits.
        """
        return self._planned(tensors, multiply=False, what="SUM")

    def fold_hops(self, hops: Hops, multiply: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Combine the hops of a plan (hop 0 first) into ``out`` (`FoldPlan.output`): the left fold in the
        tensor dtype, unless a reduction says otherwise (`Upcast` accumulates in a wider dtype)."""
        return fold(hops, multiply, out)

    def sum_many(self, stacked: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
        """The SUM of many independent reductions at once: ``[n, *batch, *shape] -> [*batch, *shape]``.

        ``shape`` is one member's logical shape (default: everything after dim 1, one batch dimension).
        Equal, bit for bit, to `sum` of each reduction ``stacked[:, i]`` in turn; vectorised over the batch
        through `plan` or ``position_free``; a reduction that declares neither is reduced item by item
        (`PerItemWarning`, once per class).
        """
        n = stacked.shape[0]
        shape = tuple(stacked.shape[2:]) if shape is None else tuple(shape)
        batch = tuple(stacked.shape[1 : stacked.dim() - len(shape)])
        numel = math.prod(shape)
        if n == 1 or numel == 0 or (self.position_free and self._declared):
            return self.sum(stacked)
        plan = self.plan(n, numel, stacked.dtype) if self._declared else None
        if plan is not None:
            if plan.is_uniform:
                return self.fold_hops_trimmed(plan, stacked)
            flat = stacked.reshape(n, math.prod(batch), numel)
            return self.fold_hops_trimmed(plan, flat).reshape(*batch, *shape)
        kind = type(self)
        if kind not in Reduction._warned:
            Reduction._warned.add(kind)
            warnings.warn(
                f"{kind.__name__} declares no order (fold_plan, position_free or sum_many): the rank-batched "
                "engine reduces its items one at a time",
                PerItemWarning,
                stacklevel=2,
            )
        flat = stacked.reshape(n, -1, *shape)
        return torch.stack([self.sum(flat[:, i]) for i in range(flat.shape[1])]).reshape(*batch, *shape)

    def sum_many_into(
        self, stacked: torch.Tensor, out: torch.Tensor, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """`sum_many` written into every member row of ``out`` (``stacked``'s shape and dtype, any strides): what
        many independent all-reduces leave on their members, ``out[r] = sum_many(stacked, shape)`` for every
        ``r``. Returns ``out``. A reduction may write the copies in the same pass
        (`simdist.reduce.gloo.reduction.Gloo`)."""
        return out.copy_(self.sum_many(stacked, shape))

    def fold_hops_trimmed(self, plan: FoldPlan, members: Tensors, multiply: bool = False) -> torch.Tensor:
        """`fold_hops` of ``plan``'s hops of ``members`` (``[numel]`` or ``[count, numel]`` each; any shape for
        a uniform plan), trimmed to the members' shape. `simdist.reduce.gloo.reduction.Gloo` adds its NaN bits here.
        The plain left fold (`fold_hops` not overridden) goes to the native kernel where it applies and no result
        is NaN (`simdist.reduce.native`; the same values, and the eager path's NaN bits)."""
        if type(self).fold_hops is Reduction.fold_hops:
            out = native.fold(plan, members, multiply, gloo_nan=False)
            if out is not None:
                return out
        hops = plan.hops(members)
        return plan.trim(self.fold_hops(hops, multiply, plan.output(hops)), members)

    def _planned(self, tensors: Tensors, multiply: bool, what: str) -> torch.Tensor:
        """`sum` / `product` through the reduction's plan."""
        n = len(tensors)
        first = tensors[0]
        plan = self.plan(n, first.numel(), first.dtype)
        if plan is None:
            if multiply:
                raise UsageError(f"the {self.name} reduction does not reduction ReduceOp.PRODUCT")
            raise NotImplementedError(f"{type(self).__name__} defines neither fold_plan nor {what.lower()}")
        if plan.is_uniform:
            return self.fold_hops_trimmed(plan, tensors, multiply)
        if isinstance(tensors, torch.Tensor):
            members: Hops = tensors.reshape(n, -1).unbind(0)
        elif all(t.dim() == 1 for t in tensors):
            members = tensors  # already flat: no views to make
        else:
            members = [t.reshape(-1) for t in tensors]
        out = self.fold_hops_trimmed(plan, members, multiply)
        return out if members is tensors else out.reshape(first.shape)

    def product(self, tensors: Tensors) -> torch.Tensor:
        """Multiply the per-rank ``tensors`` in this reduction's order (its plan), rounding each partial product."""
        return self._planned(tensors, multiply=True, what="PRODUCT")

    def reduce(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """The reduced tensor for ``op`` over the per-rank ``tensors`` (stacked or a sequence)."""
        n = len(tensors)
        if n == 0:
            raise UsageError("a reduction needs the tensors of at least one rank")
        if op is ReduceOp.SUM:
            return self.sum(tensors)
        if op is ReduceOp.PRODUCT:
            return self.product(tensors)
        if op is ReduceOp.MAX:
            return torch.amax(as_stacked(tensors), dim=0)  # propagates NaN
        if op is ReduceOp.MIN:
            return torch.amin(as_stacked(tensors), dim=0)  # propagates NaN
        if op is ReduceOp.AVG:
            if self.avg == "premul":
                stacked = as_stacked(tensors)
                return self.sum(stacked * torch.tensor(1.0 / n, dtype=stacked.dtype, device=stacked.device))
            return self.sum(tensors) / n
        raise UsageError(f"unsupported reduce op {op!r}")

    def reduce_scatter(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Per-rank output blocks, shape ``[n, numel / n]``: block ``i`` goes to group rank ``i``.

        By default this is the matching slice of `reduce` on the flat tensor, so
        ``all_gather(reduce_scatter(x)) == all_reduce(x)`` bit for bit.
        """
        n = len(tensors)
        flat = as_stacked(tensors).reshape(n, -1)
        if flat.shape[1] % n:
            raise UsageError(f"reduce_scatter needs numel divisible by the group size {n}, got {flat.shape[1]}")
        return self.reduce(flat, op).reshape(n, -1)

    def __repr__(self) -> str:
        return self.name


def as_stacked(tensors: Tensors) -> torch.Tensor:
    """Per-rank tensors as one ``[n, *shape]`` tensor (no copy when already stacked)."""
    return tensors if isinstance(tensors, torch.Tensor) else torch.stack(list(tensors))


def may_hold_nan(t: torch.Tensor) -> bool:
    """False only if ``t`` holds no NaN: one float sum (cheaper than ``isnan().any()``; inf - inf may give a
    false alarm, never a miss). Models use it to take their exact NaN-bits path only where a NaN may be."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    return math.isnan(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item())


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _cached_plan(reduction: Reduction, n: int, numel: int, dtype: torch.dtype) -> FoldPlan | None:
    return reduction.fold_plan(n, numel, dtype)


def _plan_of(reduction: Reduction, n: int, numel: int, dtype: torch.dtype) -> FoldPlan | None:
    """`Reduction.plan`: cached when the reduction is hashable (frozen dataclasses are), else built afresh."""
    try:
        return _cached_plan(reduction, n, numel, dtype)
    except TypeError:  # an unhashable reduction
        return reduction.fold_plan(n, numel, dtype)
