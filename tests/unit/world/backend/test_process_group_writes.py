"""How ``dist.all_reduce`` of one tensor writes its result on rank threads: as gloo writes from C++.

The hot path passes a tensor that does not require grad to the completion itself (no ``.data`` alias per rank
call); the completion writes it through the native kernel (a C write) or, where the kernel does not apply
(AVG, a reduction without one), through a ``.data`` alias it makes. Either way the caller's version counter is
not bumped and nothing is recorded by autograd, as on gloo (tests/isolation_programs.py's ``broadcast_params``
checks gloo's side). Sums of small integers are exact, so the expected bits are plain integer sums.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.reduce import Gloo, ReduceOp

N = 4


def _rank_values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(64) % 7 + rank).to(dtype)


def _expected(dtype: torch.dtype, avg: bool = False) -> torch.Tensor:
    total = sum(_rank_values(r, torch.int64) for r in range(N))
    return (total.to(dtype) / N) if avg else total.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _writes(rank: int) -> dict:
    out = {}
    for name, dtype, op in (
        ("sum_f32", torch.float32, dist.ReduceOp.SUM),
        ("sum_i64", torch.int64, dist.ReduceOp.SUM),
        ("avg_f32", torch.float32, dist.ReduceOp.AVG),
    ):
        x = _rank_values(rank, dtype)
        before = x._version
        dist.all_reduce(x, op=op)
        out[name] = (x, x._version - before)
    p = torch.nn.Parameter(_rank_values(rank, torch.float32))
    before = p._version
    dist.all_reduce(p)
    out["param"] = (p.detach().clone(), p._version - before, p.is_leaf and p.grad_fn is None and p.requires_grad)
    y = _rank_values(rank, torch.float32).requires_grad_()
    z = y * 2  # a non-leaf that requires grad: untracked at the call, as before
    before = z._version
    dist.all_reduce(z.view(-1))
    out["non_leaf"] = (z.detach().clone(), z._version - before)
    return out


@pytest.mark.parametrize("reduction", ["gloo", "sequential"])
def test_all_reduce_writes_do_not_bump_versions_or_record_autograd(reduction):
    results = simdist.run(_writes, N, reduction=reduction)
    for out in results:
        for name, dtype in (("sum_f32", torch.float32), ("sum_i64", torch.int64)):
            value, bumped = out[name]
            assert _same(value, _expected(dtype)), name
            assert bumped == 0, name
        value, bumped = out["avg_f32"]
        assert _same(value, _expected(torch.float32, avg=True))
        assert bumped == 0  # AVG: the kernel does not apply, the alias made by the completion is written
        value, bumped, still_leaf = out["param"]
        assert _same(value, _expected(torch.float32)) and bumped == 0 and still_leaf
        value, bumped = out["non_leaf"]
        assert _same(value, _expected(torch.float32) * 2) and bumped == 0


class _Spy(Gloo):
    """Gloo, recording what the completion hands the native kernel and whether the kernel applied."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[list[torch.Tensor], bool]] = []

    def reduce_into(self, tensors, op: ReduceOp, outs) -> bool:
        done = super().reduce_into(tensors, op, outs)
        self.seen.append((list(tensors), done))
        return done


def _identity(rank: int) -> tuple[torch.Tensor, torch.nn.Parameter]:
    x = _rank_values(rank, torch.float32)
    dist.all_reduce(x)
    p = torch.nn.Parameter(_rank_values(rank, torch.float32))
    dist.all_reduce(p)
    return x, p


def test_the_hot_path_hands_the_tensor_itself_and_a_parameter_reaches_the_kernel():
    spy = _Spy()
    results = simdist.run(_identity, N, reduction=spy)
    (plain, plain_done), (params, params_done) = spy.seen
    assert plain_done and params_done  # a parameter's alias does not require grad: the kernel applies to it
    assert all(t is x for t, (x, _) in zip(plain, results, strict=True))  # no alias made per rank call
    assert all(t is not p and t.data_ptr() == p.data_ptr() for t, (_, p) in zip(params, results, strict=True))
    assert not any(t.requires_grad for t in params)
