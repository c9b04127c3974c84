"""Arithmetic sites: every floating op that rounds its result, measured against the same op on the same inputs
in FP64 (its local rounding error), and promotable (the op computed in FP64 and rounded once).

An op of `OPS` (``blame(..., ops="all")`` or a subset; ``simdist blame --ops``) whose outputs are floating and
narrower than FP64 (BF16, FP16, FP32) is run twice: as the program runs it, and on FP64 copies of its inputs
(``exact``). How exact that reference is:

* ``add``/``sub`` of two tensors (or a tensor and a number; ``alpha`` 1 or a power of two), plain or in place:
  exact. The FP64 sum of two FP32 values spanning more than 53 bits rounds (``2**30 + 2**-30``), so Knuth's
  TwoSum adds the FP64 sum's own rounding error (`two_sum_low`) and the figures are taken against the pair;
  a promoted one is the pair rounded once (`round_pair`: FP64 rounded to odd, then to the output dtype).
* products of two BF16/FP16/FP32 values (``mul``, one term of ``mm``...) are exact in FP64.
* every other op -- a longer sum (``sum``, ``mean``, ``mm``, ``_foreach_add`` of lists, ...), ``div``,
  ``addcmul``/``addcdiv``/``lerp``, the fused optimizer steps -- has an FP64 reference that is itself
  rounded: for a sum of ``n`` exact terms ``|fp64 - exact| <= (n - 1) 2**-53 sum|terms|`` (to first
  order), so ``err/sum|t|`` is within ``(n - 1) 2**-53`` of the true figure (``n``: the terms per output
  element; for FP32 output that is ``(n - 1) 2**-29`` of its unit roundoff). ``max ulp`` and ``max rel``
  of a cancelling sum can be off by more (they divide by ``|exact|``).
  ``tests/integration/test_blame_arithmetic_wide.py`` checks the exact ``add`` and the bound of ``sum``
  against `fractions.Fraction`.

Its
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

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from simdist.errors import SimdistError, UsageError

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


class _NotMeasurable(SimdistError):
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


TWO_SUM = frozenset({"add", "sub"})
"""Ops whose FP64 reference gets its TwoSum low part (`two_sum_low`): exact for any two floating inputs."""


def two_sum_low(name: str, args: tuple, kwargs: dict, high: torch.Tensor) -> torch.Tensor | None:
    """The rounding error of the FP64 ``high = a + alpha * b`` (``add``/``sub``, ``alpha`` a power of two or 1):
    ``a + alpha * b == high + low`` exactly (Knuth's TwoSum; no FP64 overflow). None where it does not apply
    (a list op, a ``alpha`` whose product could round, a non-float operand)."""
    if len(args) < 2:
        return None
    alpha = kwargs.get("alpha", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha == 0:
        return None
    if abs(math.frexp(alpha)[0]) != 0.5:  # not a power of two: alpha * b may round in FP64
        return None
    operands = []
    for value in args[:2]:
        if isinstance(value, torch.Tensor):
            if not (_plain(value) and value.is_floating_point()):
                return None
            operands.append(value.detach().to(torch.float64))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            operands.append(torch.tensor(float(value), dtype=torch.float64))
        else:
            return None
    a, b = operands[0], operands[1] * (-alpha if _base(name) in SUBTRACTING else alpha)
    a, b = torch.broadcast_tensors(a, b)
    if a.shape != high.shape:
        return None
    virtual = high - a
    low = (a - (high - virtual)) + (b - virtual)
    return torch.where(torch.isfinite(low), low, 0.0)


def round_pair(high: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``high + low`` rounded once to ``dtype`` (BF16, FP16, FP32): ``high`` rounded to odd by ``low`` (the
    neighbour with an odd last bit where ``low`` is not 0), then to nearest in ``dtype``; rounding to odd in
    a format with at least 2 more bits than ``dtype`` and then to nearest is one correct rounding."""
    odd = (high.view(torch.int64) & 1) == 1
    toward = torch.where(low > 0, math.inf, -math.inf).to(torch.float64)
    nudged = torch.where((low != 0) & ~odd & torch.isfinite(high), torch.nextafter(high, toward), high)
    return nudged.to(dtype)


def _reference(name: str, call, written: tuple, args: tuple, kwargs: dict):
    """The op run in FP64 on the same inputs: ``(exact, absolute, lows)`` per output, ``absolute`` the op on the
    inputs' magnitudes (the sum of the terms' magnitudes, for a summing op; else ``|exact|``), ``lows`` the
    rounding error of the FP64 sum where two-sum recovers it (else None)."""
    exact = _run(None, call, written, args, kwargs, _wide)
    if _base(name) in SUMMING:
        abs_args = [_map(a, _absolute, abs) for a in args]
        if _base(name) in SUBTRACTING and len(abs_args) > 1:  # a - b: |a| - (-|b|)
            abs_args[1] = _map(abs_args[1], lambda t: -t, lambda x: -x)
        abs_kwargs = {k: _map(v, _absolute, abs) for k, v in kwargs.items()}
        absolute = [t.abs() for t in _run(None, call, written, tuple(abs_args), abs_kwargs, lambda t: t)]
    else:
        absolute = [t.abs() for t in exact]
    lows: list[torch.Tensor | None] = [None] * len(exact)
    if _base(name) in TWO_SUM and len(exact) == 1:
        lows[0] = two_sum_low(name, args, kwargs, exact[0])
    return exact, absolute, lows


def _dtypes_label(args: tuple, out_dtype: torch.dtype) -> str:
    """``"bf16"`` where every floating input is ``out_dtype``, else ``"bf16,fp32->fp32"`` (inputs -> output)."""
    from simdist.audit import dtype_name

    ins = sorted({t.dtype for t in _tensors(list(args)) if t.is_floating_point()}, key=lambda d: (d.itemsize, str(d)))
    return dtype_name(out_dtype) if ins == [out_dtype] else f"{','.join(map(dtype_name, ins))}->{dtype_name(out_dtype)}"


def measure_op(recorder, site, rank, name: str, call, written: tuple, args: tuple, kwargs: dict):
    """Run one op of the program (``recorder``'s op hook): measured against FP64 and, if promoted, replaced."""
    from simdist.attribution import collectives
    from simdist.attribution.measure import Errors, errors

    if collectives.busy() or site[0].startswith(_SIMDIST_DIR):
        return call(*args, **kwargs)
    try:
        with torch.no_grad():
            exact, absolute, lows = _reference(name, call, written, args, kwargs)
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
    dtypes = _dtypes_label(args, pairs[0][1].dtype)
    op = name.removeprefix("aten.")
    promoted = recorder.key(site, "arith", op, dtypes) in recorder.promote
    found = Errors()
    replaced = list(outputs)
    with torch.no_grad():
        for i, out in pairs:
            low = lows[i]
            if promoted:
                whole = (
                    exact[i].reshape(-1)
                    if low is None
                    else round_pair(exact[i].reshape(-1), low.reshape(-1), out.dtype)
                )
                rounded = whole.to(out.dtype).view(out.shape)
                if written:
                    out.copy_(rounded)
                else:
                    replaced[i] = rounded
            found.add(errors(replaced[i], exact[i], absolute[i], low))
    recorder.record(site, "arith", op, dtypes, rank, found, promoted=promoted)
    if promoted and not written:
        if isinstance(result, torch.Tensor):
            return replaced[0]
        return type(result)(replaced)
    return result
