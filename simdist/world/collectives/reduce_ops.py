"""A collective's reduce op, resolved once per call, and the sums it names through the group's reduction.

`resolve_op` (c10d's ``ReduceOp``) and `named_op` (simdist's `ReduceOp`, as a
`Comm` passes it) give an `Op`; `check_op` refuses at the call what the group
refuses. The sums are the group's `Reduction` (the members' tensors are
handed to it as they are): `reduce_all` is ``reduction.reduce``, `reduce_blocks`
``reduction.reduce_scatter``, `reduce_root` ``reduction.reduce_to`` (if the reduction has
it), `reduce_list` ``reduction.reduce_scatter_list`` (if it has it). SUM, AVG,
PRODUCT, MIN, MAX are the reduction's (it refuses what it does not model);
BAND/BOR/BXOR are element-wise on integer and bool tensors (exact, order
free); PREMUL_SUM (reductions without gloo's rules) multiplies every input by the
factor in the tensor dtype, then takes the reduction's SUM.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from simdist.reduce import ReduceOp, Reduction

_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


class Op:
    """A reduce op resolved once per call: its name, how errors show it, simdist's `ReduceOp`."""

    __slots__ = ("factor", "name", "reduce_op", "shown")

    def __init__(self, name: str, factor: Any = None) -> None:
        self.name = name
        self.factor = factor
        self.shown = f"op=PREMUL_SUM({factor})" if name == "PREMUL_SUM" else f"op={name}"
        self.reduce_op = ReduceOp[name] if name in ReduceOp.__members__ else None


_OPS: dict[int, Op] = {}
_NAMED: dict[str, Op] = {}


def resolve_op(op: Any) -> Op:
    """The `Op` of a ``dist.ReduceOp`` (or its ``RedOpType``).

    The hot path is one ``hash``: c10d's ``ReduceOp`` and ``RedOpType`` hash to the op type's number (torch's
    bindings; reading ``op.op`` and converting it costs three times more, on every collective). An op is filed
    under its hash only where that equals its type's number, and ``PREMUL_SUM`` (a factor per call) never is.
    """
    found = _OPS.get(hash(op))
    if found is not None:
        return found
    kind = getattr(op, "op", op)
    key = int(kind)
    name = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    if name == "PREMUL_SUM":
        return Op(name, getattr(op, "factor", None))
    found = Op(name)
    if hash(op) == key:
        _OPS[key] = found
    return found


_MEMBER_OPS: dict[int, Op] = {}  # id of a `ReduceOp` member -> its Op (members live as long as the enum)


def named_op(op: ReduceOp | str) -> Op:
    """The `Op` of simdist's `ReduceOp` (or its name), as a `Comm` passes it."""
    found = _MEMBER_OPS.get(id(op))  # an enum's .name and hash are Python code: this runs on every collective
    if found is not None:
        return found
    if isinstance(op, ReduceOp):
        found = _MEMBER_OPS[id(op)] = named_op(op.name)
        return found
    name = ReduceOp.coerce(op).name
    found = _NAMED.get(name)
    if found is None:
        found = _NAMED[name] = Op(name)
    return found


def check_op(reduction: Reduction, op: Op, tensors: Sequence[torch.Tensor]) -> None:
    """Refuse, at the call and with gloo's error type, what real gloo refuses before communicating."""
    if op.reduce_op is not None:
        return
    if op.name in _BITWISE:
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                raise RuntimeError(f"Cannot use ReduceOp.{op.name} with non-integral dtype")
    elif op.name == "PREMUL_SUM" and reduction.gloo_rules:
        raise RuntimeError("Cannot use ReduceOp.PREMUL_SUM with Gloo")


def _reduction_op(op: Op) -> ReduceOp:
    """simdist's `ReduceOp` for ``op``; the reduction refuses the ops it does not model (``ValueError``)."""
    return op.reduce_op if op.reduce_op is not None else ReduceOp.coerce(op.name)


def _premul(tensors: Sequence[torch.Tensor], op: Op) -> list[torch.Tensor]:
    return [t * torch.as_tensor(op.factor, dtype=t.dtype, device=t.device) for t in tensors]


def reduce_all(reduction: Reduction, tensors: Sequence[torch.Tensor], op: Op) -> torch.Tensor:
    """The all-reduce of the members' ``tensors`` under ``op``."""
    if op.reduce_op is not None:
        return reduction.reduce(tensors, op.reduce_op)
    if op.name in _BITWISE:
        return functools.reduce(_BITWISE[op.name], tensors).clone()
    if op.name == "PREMUL_SUM":
        return reduction.reduce(_premul(tensors, op), ReduceOp.SUM)
    return reduction.reduce(tensors, _reduction_op(op))


def reduce_root(reduction: Reduction, tensors: Sequence[torch.Tensor], op: Op, root: int) -> torch.Tensor:
    """What ``reduce`` leaves on group rank ``root``."""
    reduce_to = getattr(reduction, "reduce_to", None)
    if op.name in _BITWISE or op.name == "PREMUL_SUM" or reduce_to is None:
        return reduce_all(reduction, tensors, op)
    return reduce_to(tensors, _reduction_op(op), root)


def reduce_blocks(reduction: Reduction, tensors: Sequence[torch.Tensor], op: Op) -> torch.Tensor:
    """reduce_scatter_tensor: ``[n, numel / n]`` blocks, block ``i`` for group rank ``i``."""
    n = len(tensors)
    if op.name in _BITWISE:
        return reduce_all(reduction, [t.reshape(-1) for t in tensors], op).reshape(n, -1)
    if op.name == "PREMUL_SUM":
        return reduction.reduce_scatter(_premul(tensors, op), ReduceOp.SUM)
    return reduction.reduce_scatter(tensors, _reduction_op(op))


def reduce_list(reduction: Reduction, lists: Sequence[Sequence[torch.Tensor]], op: Op) -> list[torch.Tensor]:
    """List reduce_scatter: entry ``i`` of every member's list reduced, for group rank ``i``."""
    method = getattr(reduction, "reduce_scatter_list", None)
    if method is not None and op.name not in _BITWISE and op.name != "PREMUL_SUM":
        return list(method(lists, _reduction_op(op)))
    n = len(lists)
    return [reduce_all(reduction, [lst[i] for lst in lists], op) for i in range(n)]
