"""What each aten op is (cast, accumulation, store, collective, or nothing to watch), and the rounding error
of a narrowing: the narrow result against the wide value, in fp64."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from simdist.audit.report import ACCUMULATE, CAST, COLLECTIVE, IGNORE, STORE
from simdist.errors import SimdistError

_Tensor = torch.Tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

# -- what each op is -----------------------------------------------------------

_CAST_SOURCE = {  # op name -> position of the value being converted
    "aten._to_copy": 0,
    "aten.copy_": 1,
    "aten.copy": 1,
    "aten._copy_from": 0,
    "aten._copy_from_and_resize": 0,
    "aten._autocast_to_reduced_precision": 0,
    "aten._foreach_copy_": 1,  # a list into a list (FSDP2's parameter casts to param_dtype)
    "aten._foreach_copy": 1,
    "prims.convert_element_type": 0,
}
_ACCUMULATE = frozenset(
    {
        "add",
        "sub",
        "rsub",
        "sum",
        "nansum",
        "mean",
        "cumsum",
        "cumprod",
        "prod",
        "addmm",
        "addmv",
        "addbmm",
        "baddbmm",
        "addr",
        "mm",
        "bmm",
        "matmul",
        "dot",
        "vdot",
        "mv",
        "index_add",
        "scatter_add",
        "scatter_reduce",
        "index_reduce",
        "addcmul",
        "addcdiv",
        "linalg_vector_norm",
        "norm",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "logsumexp",
        "embedding_bag",
        "_embedding_bag",
        "segment_reduce",
        "trace",
        "_fused_adam",
        "_fused_adamw",
    }
)  # base names (no trailing _ or _foreach_ prefix) of ops that sum or reduce
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


@dataclass(frozen=True)
class _Op:
    name: str
    kind: str
    call: Callable
    source: int = 0
    written: tuple = ()  # positions (int) or kwarg names (str) of the arguments the op writes
    outs: frozenset = frozenset()  # kwarg names of out= arguments (outputs, not inputs)
    dtype_args: tuple = ()  # positions or names of ScalarType arguments
    lists: bool = False  # takes a list of tensors
    kw_inputs: tuple = ()  # kwarg-only tensor inputs (not out=)
    seeded: bool = False  # a random op: never re-run it
    func: Any = None


_OPS: dict[int, _Op] = {}


def _describe_op(func) -> _Op:
    namespace = getattr(func, "namespace", "")
    opname = getattr(func, "_opname", None) or str(func).split(".")[-2]
    name = f"{namespace}.{opname}"
    written, outs, dtype_args, kw_inputs = [], set(), [], []
    tensor_args, lists = 0, False
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        key = arg.name if arg.kwarg_only else i
        typ = str(arg.type)
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(key)
        if arg.is_out:
            outs.add(arg.name)
        elif "Tensor" in typ:
            tensor_args += 1
            lists = lists or "List" in typ or "[]" in typ
            if arg.kwarg_only:
                kw_inputs.append(arg.name)
        if arg.name.endswith("dtype") or "ScalarType" in typ:  # ScalarType prints as int
            dtype_args.append(key)
    tags = getattr(func, "tags", ())
    seeded = torch.Tag.nondeterministic_seeded in tags
    base = opname[:-1] if opname.endswith("_") and not opname.endswith("__") else opname
    base = base.removeprefix("_foreach_")
    if name in _CAST_SOURCE:
        kind = CAST
    elif namespace in _COLLECTIVE_NAMESPACES:
        kind = IGNORE if ("wait" in opname or "barrier" in opname) else COLLECTIVE
    elif (
        opname.endswith("_like")
        or opname.startswith(("new_", "empty", "_local_scalar"))
        or (opname == "view" and dtype_args)
        or seeded
    ):
        kind = IGNORE  # values not derived from an input by rounding (factories, bit views, random ops)
    elif schema is not None and (tensor_args == 0 or (tensor_args == 1 and not dtype_args and not outs)):
        kind = IGNORE  # no tensor input, or one and no dtype argument: computes and stores in its dtype
    else:
        kind = ACCUMULATE if base in _ACCUMULATE else STORE
    return _Op(
        name,
        kind,
        getattr(func, "_op", func),
        _CAST_SOURCE.get(name, 0),
        tuple(written),
        frozenset(outs),
        tuple(dtype_args),
        lists,
        tuple(kw_inputs),
        seeded,
        func,
    )


def _get(args: tuple, kwargs: dict, key):
    if isinstance(key, int):
        return args[key] if key < len(args) else None
    return kwargs.get(key)


def _tensors(value) -> list:
    if isinstance(value, _Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, _Tensor)]
    return []


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16})


def _as_float64(t: torch.Tensor, copy: bool) -> np.ndarray:
    """``t`` as a float64 numpy array: numpy converts fp32/fp16 faster than a torch op, and without releasing
    the GIL (in SimWorld every release may hand the interpreter to another rank thread)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        a = t.numpy()
        return a.astype(np.float64) if copy else np.asarray(a, dtype=np.float64)
    return t.to(torch.float64).numpy()


def _rel_error(narrow: torch.Tensor, wide: torch.Tensor) -> float | torch.Tensor | None:
    """``max |narrow - wide| / |wide|`` in fp64 over nonzero finite ``wide``, or None if not computable.

    A float on the CPU, a 0-dim tensor elsewhere (read once, when the report is
    made). Call with grad mode off. Where ``wide`` is 0, inf or NaN the quotient
    is NaN (a narrowing keeps zeros and infinities) and is dropped; an overflow
    (finite wide, infinite narrow) gives ``inf``.
    """
    if type(narrow) not in _PLAIN_TENSORS or type(wide) not in _PLAIN_TENSORS or narrow.numel() == 0:
        return None
    if narrow.is_meta or wide.is_meta:
        return None
    if narrow.is_cpu and wide.is_cpu:  # numpy: a fraction of torch's per-op cost
        n, w = _as_float64(narrow, copy=True), _as_float64(wide, copy=False)
        with np.errstate(all="ignore"):
            np.subtract(n, w, out=n)
            np.abs(n, out=n)
            np.divide(n, np.abs(w), out=n)
        worst = float(np.fmax.reduce(n, axis=None))  # fmax skips NaN
        return 0.0 if worst != worst else worst
    w64 = wide.to(device=narrow.device, dtype=torch.float64)
    n64 = narrow.to(torch.float64, copy=True)
    return n64.sub_(w64).abs_().div_(w64.abs()).nan_to_num_(nan=0.0, posinf=math.inf).max()


class _Quiet:
    """Grad mode off and no Python dispatch (no mode, ours or another, sees the audit's own arithmetic)."""

    __slots__ = ("grad", "guard")

    def __enter__(self) -> None:
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        self.guard = torch._C._DisableTorchDispatch()
        self.guard.__enter__()

    def __exit__(self, *exc) -> None:
        self.guard.__exit__(*exc)
        torch._C._set_grad_enabled(self.grad)


def _safe_error(narrow, wide):
    """`_rel_error`, or None where it cannot be computed: the audit never breaks the audited program."""
    try:
        with _Quiet():
            return _rel_error(narrow, wide)
    except (RuntimeError, TypeError, ValueError):
        return None


def _widen(op: _Op, args: tuple, kwargs: dict, widest: torch.dtype, requested) -> tuple | None:
    """Copies of the op's arguments with every floating tensor in ``widest`` (written ones always copied)."""
    written = set(op.written)

    def up(value, is_written: bool, is_out: bool):
        if isinstance(value, (list, tuple)):
            return type(value)(up(v, is_written, is_out) for v in value)
        if isinstance(value, _Tensor):
            if type(value) not in _PLAIN_TENSORS or value.device.type == "meta":
                raise _NoError
            if is_out:
                return torch.empty(
                    0, dtype=widest if value.dtype.is_floating_point else value.dtype, device=value.device
                )
            if value.dtype.is_floating_point and value.dtype != widest:
                return value.to(widest)
            return value.clone() if is_written else value
        if requested is not None and value is requested:
            return widest
        return value

    try:
        with _Quiet():
            wide_args = tuple(up(a, i in written, False) for i, a in enumerate(args))
            wide_kwargs = {k: up(v, k in written, k in op.outs) for k, v in kwargs.items()}
    except (_NoError, RuntimeError, TypeError, ValueError):
        return None
    return wide_args, wide_kwargs


class _NoError(SimdistError):
    pass


def _wide_error(op: _Op, wide: tuple, outputs: list, narrowed: list[int]):
    wide_args, wide_kwargs = wide
    try:
        with _Quiet():
            result = op.call(*wide_args, **wide_kwargs)
            if op.written:
                references = [t for key in op.written for t in _tensors(_get(wide_args, wide_kwargs, key))]
            else:
                references = _tensors(result)
            errors = [_rel_error(outputs[i], references[i]) for i in narrowed if i < len(references)]
            floats = [e for e in errors if isinstance(e, float)]
            tensors = [e for e in errors if isinstance(e, torch.Tensor)]
            if tensors:
                return torch.stack([*tensors, *(torch.tensor(f, device=tensors[0].device) for f in floats)]).max()
            return max(floats, default=None)
    except (RuntimeError, TypeError, ValueError, IndexError):  # the op does not accept the wide dtype
        return None
