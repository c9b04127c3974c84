"""One hop of gloo's ring: its element-wise functions, NaN bits included.

``SUM``/``PRODUCT`` (`arith_walk`): IEEE adds/multiplies rounded to the dtype, with the NaN each dtype leaves
(`nan_bits`); ``MAX``/``MIN`` (`compare_walk`): ``std::max``'s comparison, bits copied. Found against real gloo
(torch 2.13); the evidence is in `simdist.reduce.gloo.reduction`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from simdist.reduce.base import ReduceOp, may_hold_nan
from simdist.reduce.plan import fold

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
_QUIET_BIT = {torch.float64: 1 << 51, torch.float32: 1 << 22}
_DEFAULT_NAN = {torch.float64: -(1 << 51), torch.float32: -(1 << 22)}  # x86's "real indefinite": -qNaN
_BF16_NAN = 0x7FC0
_FP16_QNAN = (0x7E00, 0xFE00 - (1 << 16))  # + and - quiet NaN, as int16


def nan_bits(local: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The NaN gloo's ``sum``/``product`` leave where ``local (op) acc`` is NaN (bits, as the int view).

    fp32/fp64: x86 returns the first operand's NaN, quieted (``local``, the
    receiving rank's value), else the second's, else the default NaN.
    bf16: c10's float -> bf16 rounding writes ``0x7FC0`` for every NaN.
    fp16: c10's float -> fp16 conversion keeps the sign of that fp32 NaN and writes ``0x7E00``.
    """
    dtype = local.dtype
    int_t = _INT_VIEW[dtype]
    if dtype == torch.bfloat16:
        return torch.full(local.shape, _BF16_NAN, dtype=int_t, device=local.device)
    lb, ab = local.view(int_t), acc.view(int_t)
    if dtype == torch.float16:
        sign = torch.where(local.isnan(), lb < 0, torch.where(acc.isnan(), ab < 0, True))
        return torch.where(sign, _FP16_QNAN[1], _FP16_QNAN[0]).to(int_t)
    quiet, default = _QUIET_BIT[dtype], torch.tensor(_DEFAULT_NAN[dtype], dtype=int_t, device=local.device)
    return torch.where(local.isnan(), lb | quiet, torch.where(acc.isnan(), ab | quiet, default))


def arith_walk(hops: Sequence[torch.Tensor], multiply: bool) -> torch.Tensor:
    """``local + acc`` (or ``*``) at every hop, with gloo's NaN bits (see `nan_bits`).

    The values are IEEE sums/products whatever the operand order; only NaN
    bits depend on it. NaN is absorbing, so the plain fold is exact except
    where its result is NaN; those columns are walked again hop by hop.
    """
    acc = fold(hops, multiply)
    if not may_hold_nan(acc):
        return acc
    cols = acc.isnan().nonzero().squeeze(1)
    int_t = _INT_VIEW[acc.dtype]
    walk = hops[0][cols]
    for hop in hops[1:]:
        local = hop[cols]
        value = local * walk if multiply else local + walk
        walk = torch.where(value.isnan(), nan_bits(local, walk).view(acc.dtype), value)
    acc.view(int_t)[cols] = walk.view(int_t)
    return acc


def compare_walk(hops: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """gloo's ``max``/``min`` (``std::max(local, acc)``): keep ``acc`` only if it compares greater (smaller).

    A comparison with NaN is false, so the receiving rank's value wins: NaN
    survives only if the last rank on the walk holds it or the walk's value
    was NaN and nothing later beat it, and of ``+0``/``-0`` the later one stays.
    Bits are copied, never rounded.
    """
    acc = hops[0]
    for local in hops[1:]:
        keep = acc > local if op is ReduceOp.MAX else acc < local
        acc = torch.where(keep, acc, local)
    return acc if len(hops) > 1 else acc.clone()
