"""Arithmetic sites: every floating op that rounds its result, measured against the same op on the same inputs
in FP64 (its local rounding error), and promotable (the op computed in FP64 and rounded once).

An op of `OPS` (``blame(..., ops="all")`` or a subset; ``simdist blame --ops``) whose outputs are floating and
narrower than FP64 (BF16, FP16, FP32) is run twice: as the program runs it, and on FP64 copies of its inputs
(``exact``; exact for additions of two BF16/FP16/FP32 values, and for products; a longer sum or a matmul of
FP64 values is itself rounded, about ``n * 2**-53`` relative, far below the narrow dtype's rounding). Its
``sum |terms|`` is the same op on the absolute values of the inputs (sub as add) for the summing ops
(`SUMMING`), ``|exact|`` for the others (mul, div, addcmul, the fused optimizer steps...). The figures are
then those of `simdist.attribution.measure.errors`, grouped like every site by the first frame outside torch,
simdist and blame (an ``optimizer.step()`` line for a fused or foreach optimizer).

The op set is the aten ops the program dispatches: ``x @ w`` and ``F.linear`` reach it as ``mm``/``addmm``/
``bmm``, ``torch.optim.AdamW(foreach=True)`` as ``_foreach_*`` ops, ``fused=True`` as ``_fused_adamw_``.
Not measured: tensor subclasses (DTensor: its local ops are; the wrapper's are not run twice), ops on the
meta device, ops inside a measured collective (the simulator's own) and in simdist's own code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from simdist.errors import UsageError

SUMMING = frozenset(
    {
        "add",
        "sub",
        "sum",
        "mean",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "matmul",
        "_foreach_add",
        "_foreach_sub",
    }
)
"""Ops whose result is a sum of terms: their ``sum |terms|`` is the op on absolute values (sub as add)."""

OPS = frozenset(
    SUMMING
    | {
        "mul",
        "div",
        "addcmul",
        "addcdiv",
        "lerp",
        "_foreach_mul",
        "_foreach_div",
        "_foreach_addcmul",
        "_foreach_addcdiv",
        "_foreach_lerp",
        "_fused_adam",
        "_fused_adamw",
        "_fused_sgd",
    }
)
"""The base names (no ``aten.``, no trailing ``_``) ``ops="all"`` measures."""

SUBTRACTING = frozenset({"sub", "_foreach_sub"})
_SIMDIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def op_names(ops: str | Iterable[str] | None) -> frozenset[str]:
    """The aten op names (``aten.add``, ``aten.add_``, ...) that ``ops`` selects; ``ValueError`` for an unknown one.

    ``None`` selects none (no arithmetic sites: the default), ``"all"`` every op of `OPS`, a comma-separated
    string or an iterable the named ones.
    """
    if ops is None:
        return frozenset()
    if isinstance(ops, str):
        chosen = sorted(OPS) if ops.strip() == "all" else [o.strip() for o in ops.split(",") if o.strip()]
    else:
        chosen = [str(o).strip() for o in ops]
    if not chosen:
        raise UsageError("ops: name at least one op, or 'all'")
    unknown = sorted({o.removeprefix("aten.").rstrip("_") if not o.startswith("_") else o for o in chosen} - OPS)
    unknown = [o for o in unknown if o.rstrip("_") not in OPS]
    if unknown:
        raise UsageError(f"ops: unknown op(s) {', '.join(unknown)}; known: all, {', '.join(sorted(OPS))}")
    names = set()
    for o in chosen:
        base = o.removeprefix("aten.").rstrip("_")
        names.update({f"aten.{base}", f"aten.{base}_"})
    return frozenset(names)


def _base(name: str) -> str:
    return name.removeprefix("aten.").rstrip("_")


def _plain(value) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.device.type != "meta"


class _NotMeasurable(Exception):
    pass


def _map(value, tensor: Callable[[torch.Tensor], torch.Tensor], number: Callable[[Any], Any]):
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, tensor, number) for v in value)
    if isinstance(value, torch.Tensor):
        if not _plain(value):
            raise _NotMeasurable
        return tensor(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return number(value)
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    return value


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64, copy=True) if t.is_floating_point() else t.detach().clone()


def _absolute(t: torch.Tensor) -> torch.Tensor:
    return _wide(t).abs() if t.is_floating_point() else t.detach().clone()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _outputs(result, written: tuple, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if written:
        found: list[torch.Tensor] = []
        for key in written:
            found += _tensors(args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key))
        return found
    return _tensors(result)


def _run(_unused, call, written: tuple, args: tuple, kwargs: dict, convert) -> list[torch.Tensor]:
    """The op on converted copies of its arguments; its outputs (the written arguments, or the result)."""
    wide_args = tuple(_map(a, convert, lambda x: x) for a in args)
    wide_kwargs = {k: _map(v, convert, lambda x: x) for k, v in kwargs.items()}
    result = call(*wide_args, **wide_kwargs)
    return _outputs(result, written, wide_args, wide_kwargs)


def measure_op(recorder, site, rank, name: str, call, written: tuple, args: tuple, kwargs: dict):
    """Run one op of the program (``recorder``'s op hook): measured against FP64 and, if promoted, replaced."""
    from simdist.attribution import collectives
    from simdist.attribution.measure import Errors, errors
    from simdist.audit import dtype_name

    if collectives.busy() or site[0].startswith(_SIMDIST_DIR):
        return call(*args, **kwargs)
    try:
        with torch.no_grad():
            exact = _run(None, call, written, args, kwargs, _wide)
            if _base(name) in SUMMING:
                abs_args = [_map(a, _absolute, abs) for a in args]
                if _base(name) in SUBTRACTING and len(abs_args) > 1:  # a - b: |a| - (-|b|)
                    abs_args[1] = _map(abs_args[1], lambda t: -t, lambda x: -x)
                abs_kwargs = {k: _map(v, _absolute, abs) for k, v in kwargs.items()}
                absolute = [t.abs() for t in _run(None, call, written, tuple(abs_args), abs_kwargs, lambda t: t)]
            else:
                absolute = [t.abs() for t in exact]
    except (_NotMeasurable, RuntimeError, TypeError, ValueError, AttributeError):
        return call(*args, **kwargs)
    result = call(*args, **kwargs)
    outputs = _outputs(result, written, args, kwargs)
    pairs = [
        (i, out)
        for i, out in enumerate(outputs)
        if i < len(exact) and out.is_floating_point() and out.dtype != torch.float64 and out.numel() == exact[i].numel()
    ]
    if not pairs:
        return result
    ins = sorted({t.dtype for t in _tensors(list(args)) if t.is_floating_point()}, key=lambda d: (d.itemsize, str(d)))
    out_dtype = pairs[0][1].dtype
    dtypes = (
        dtype_name(out_dtype) if ins == [out_dtype] else f"{','.join(map(dtype_name, ins))}->{dtype_name(out_dtype)}"
    )
    op = name.removeprefix("aten.")
    promoted = recorder.key(site, "arith", op, dtypes) in recorder.promote
    found = Errors()
    replaced = list(outputs)
    with torch.no_grad():
        for i, out in pairs:
            if promoted:
                rounded = exact[i].to(out.dtype).view(out.shape)
                if written:
                    out.copy_(rounded)
                else:
                    replaced[i] = rounded
            found.add(errors(replaced[i], exact[i], absolute[i]))
    recorder.record(site, "arith", op, dtypes, rank, found, promoted=promoted)
    if promoted and not written:
        if isinstance(result, torch.Tensor):
            return replaced[0]
        return type(result)(replaced)
    return result
