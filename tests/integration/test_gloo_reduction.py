"""The `Gloo` reduction against real gloo processes, bit for bit.

The model tests at the top run in-process. The ``gloo`` tests spawn one real
process group per world size (2, 4 and, marked slow, 3; module-scoped fixture) that runs every
case at once: the ranks rebuild all per-rank inputs from seeds, so the parent
can apply the models to exactly the same tensors. Inputs are built only from
``randn``/``randint`` and exact power-of-two scaling, which give the same bits
whatever the thread count (``exp2`` and friends do not).
"""

from __future__ import annotations

import pytest
import torch

import simdist
from simdist.numerics.floats import bits
from simdist.reduce import ReduceOp, Ring, Sequential, Tree, Upcast, make_reduction
from simdist.reduce.gloo import Gloo, chunk_length, chunk_start_ranks
from simdist.testing._internal.gloo_probe import order_fingerprint
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

DTYPES = (torch.float32, torch.bfloat16)
LENGTHS = (1, 2, 3, 7, 8, 63, 64, 65, 1000, 1023, 1024, 4097, 65536, 100000)
SEGMENT_ELEMENTS = {torch.float32: 262144, torch.bfloat16: 524288}  # 1 MiB gloo segments


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    differ = (bits(actual) != bits(expected)).nonzero().flatten()
    assert differ.numel() == 0, f"{what}: {differ.numel()} elements differ, first at {differ[:5].tolist()}"


def reference_gloo_sum(stacked: torch.Tensor) -> torch.Tensor:
    """Straight transcription of the documented order, one chunk at a time (slow, obvious)."""
    n = stacked.shape[0]
    flat = stacked.reshape(n, -1)
    numel = flat.shape[1]
    length = chunk_length(numel, n, flat.element_size())
    out = torch.empty_like(flat[0])
    for c in range(n):
        part = slice(c * length, min(numel, (c + 1) * length))
        order = [(c - 1 - j) % n for j in range(n)]
        acc = flat[order[0], part].clone()
        for r in order[1:]:
            acc = acc + flat[r, part]
        out[part] = acc
    return out.reshape(stacked.shape[1:])


def random_ranks(seed: int, n: int, numel: int, dtype: torch.dtype, wide: bool) -> torch.Tensor:
    """``[n, numel]`` per-rank inputs: normal values, or ``normal * 2**k`` with ``k`` uniform in [-60, 60]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, numel, generator=gen)
    if wide:
        k = torch.randint(-60, 61, (n, numel), generator=gen, dtype=torch.int32)
        x = x * ((k + 127) << 23).view(torch.float32)  # exact powers of two
    return x.to(dtype)


def random_cases(n: int) -> list[tuple[int, int, torch.dtype, bool]]:
    """(seed, numel, dtype, wide) cases for world size ``n``: fixed and random lengths, one past the segment cap."""
    gen = torch.Generator().manual_seed(7000 + n)
    lengths = list(LENGTHS) + torch.randint(1, 100_001, (4,), generator=gen).tolist()
    cases = [(dt, numel, wide) for dt in DTYPES for wide in (False, True) for numel in lengths]
    cases += [(dt, SEGMENT_ELEMENTS[dt] * (2 * n + 1) + 7, False) for dt in DTYPES]
    return [(1000 * n + i, numel, dt, wide) for i, (dt, numel, wide) in enumerate(cases)]


def fingerprint_cases(n: int) -> list[tuple[int, torch.dtype]]:
    return [(numel, dt) for dt in DTYPES for numel in (1, 2, 3, 7, 64, 1000, 1023, 4097)] if n >= 3 else []


def gloo_rank(comm) -> dict[str, list[torch.Tensor]]:
    """Rank program: every case through real all_reduce and reduce_scatter_tensor (SUM)."""
    n, rank = comm.get_world_size(), comm.get_rank()
    out: dict[str, list[torch.Tensor]] = {"all_reduce": [], "reduce_scatter": [], "fingerprint": []}
    for seed, numel, dtype, wide in random_cases(n):
        x = random_ranks(seed, n, numel, dtype, wide)[rank].clone()
        comm.all_reduce(x)
        out["all_reduce"].append(x)
        if numel <= 100_000:
            scatter_in = random_ranks(seed, n, n * max(1, numel // n), dtype, wide)[rank].clone()
            block = torch.empty(scatter_in.numel() // n, dtype=dtype)
            comm.reduce_scatter_tensor(block, scatter_in)
            out["reduce_scatter"].append(block)
    for numel, dtype in fingerprint_cases(n):
        x = order_fingerprint(n, numel, dtype)[rank].clone()
        comm.all_reduce(x)
        out["fingerprint"].append(x)
    return out


# -- the model on its own -------------------------------------------------------


def test_chunk_formula_examples():
    assert chunk_length(1024, 4, 4) == 256  # 8 segments of 128
    assert chunk_start_ranks(1024, 4, 4) == [3, 0, 1, 2]
    assert chunk_length(1023, 3, 4) == 2 * 171
    assert chunk_start_ranks(2, 5, 4) == [4]  # N <= 2: one chunk, descending fold
    assert chunk_length(262144 * 9, 4, 4) == 3 * 196608  # past the 1 MiB cap: S = roundup(9, 4) = 12 segments
    assert chunk_length(262144 * 9, 4, 2) == 2 * 294912  # bf16: 5 segments' worth, so S = 2n = 8


def test_small_lengths_fold_in_descending_rank_order():
    x = torch.tensor([[1.0], [2.0**-24], [2.0**-24]])
    assert Gloo().sum(x).item() == 1.0 + 2.0**-23  # (x2 + x1) + x0
    assert Sequential().sum(x).item() == 1.0


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_equals_reference_transcription(n, dtype):
    for numel in (1, 2, 3, 5, 17, 100, 1023, 1024, 3001):
        x = random_ranks(n * 100 + numel, n, numel, dtype, wide=True)
        assert_bitwise(Gloo().sum(x), reference_gloo_sum(x), f"n={n} numel={numel}")


def test_model_keeps_shape_and_handles_views_and_ops():
    x = random_ranks(3, 4, 3 * 5 * 7, torch.float32, wide=False).reshape(4, 3, 5, 7)
    assert Gloo().sum(x).shape == (3, 5, 7)
    assert_bitwise(Gloo().sum(x), reference_gloo_sum(x), "4-d")
    strided = x.transpose(2, 3)
    assert_bitwise(Gloo().sum(strided), reference_gloo_sum(strided.contiguous()), "non-contiguous")
    assert_bitwise(Gloo().reduce(x, ReduceOp.AVG), Gloo().sum(x) / 4, "avg is postdiv")
    assert_bitwise(Gloo().reduce(x, ReduceOp.MAX), x.amax(0), "max")
    assert Gloo().sum(torch.empty(3, 0)).shape == (0,)
    assert make_reduction("gloo") == Gloo() and repr(Gloo()) == "gloo"


# -- against real gloo ------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow), 4], ids=lambda n: f"gloo{n}")
def gloo_run(request):
    n = request.param
    return n, simdist.run(gloo_rank, ParallelSpec(n, tp=1, ep=1), api="comm", where="gloo", timeout_s=240)


@pytest.mark.gloo
def test_all_reduce_bitwise_equals_real_gloo(gloo_run):
    n, results = gloo_run
    for i, (seed, numel, dtype, wide) in enumerate(random_cases(n)):
        real = results[0]["all_reduce"][i]
        for r in range(1, n):
            assert_bitwise(results[r]["all_reduce"][i], real, f"rank {r} vs rank 0")
        stacked = random_ranks(seed, n, numel, dtype, wide)
        assert_bitwise(Gloo().sum(stacked), real, f"n={n} numel={numel} {dtype} wide={wide}")


@pytest.mark.gloo
def test_reduce_scatter_bitwise_equals_real_gloo(gloo_run):
    n, results = gloo_run
    cases = [c for c in random_cases(n) if c[1] <= 100_000]
    for i, (seed, numel, dtype, wide) in enumerate(cases):
        stacked = random_ranks(seed, n, n * max(1, numel // n), dtype, wide)
        blocks = Gloo().reduce_scatter(stacked)
        for r in range(n):
            assert_bitwise(blocks[r], results[r]["reduce_scatter"][i], f"n={n} numel={numel} {dtype} block {r}")


@pytest.mark.gloo
def test_fingerprints_reveal_the_modelled_order(gloo_run):
    n, results = gloo_run
    for i, (numel, dtype) in enumerate(fingerprint_cases(n)):
        stacked = order_fingerprint(n, numel, dtype)
        real = results[0]["fingerprint"][i]
        assert_bitwise(Gloo().sum(stacked), real, f"fingerprint n={n} numel={numel} {dtype}")
        if numel >= 64:  # the order matters: a plain rank-order fold gets some elements wrong
            assert not torch.equal(Sequential().sum(stacked), real)


@pytest.mark.gloo
def test_every_model_agrees_with_gloo_on_two_ranks(gloo_run):
    n, results = gloo_run
    if n != 2:
        pytest.skip("one addition per element only on groups of 2")
    reductions = [Gloo(), Sequential(), Tree(), Ring(), Ring(chunk_size=64, shift=0), Upcast(torch.float32)]
    for i, (seed, numel, dtype, wide) in enumerate(random_cases(n)):
        stacked = random_ranks(seed, n, numel, dtype, wide)
        for reduction in reductions:
            assert_bitwise(reduction.sum(stacked), results[0]["all_reduce"][i], f"{reduction} numel={numel} {dtype}")


@pytest.mark.gloo
def test_the_same_rank_program_in_simworld_gives_real_gloos_bits(gloo_run):
    n, real = gloo_run
    simulated = SimWorld(ParallelSpec(n, tp=1, ep=1), reduction=Gloo()).run(gloo_rank)
    for rank in range(n):
        for key, tensors in real[rank].items():
            for i, (sim, got) in enumerate(zip(simulated[rank][key], tensors, strict=True)):
                assert_bitwise(sim, got, f"rank {rank} {key} case {i}")


# -- gloo's element-wise functions on the ring walk (facts found against real gloo: test_gloo_corners.py) --


def _raw(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    int_t = {torch.float32: torch.int32, torch.float64: torch.int64}.get(dtype, torch.int16)
    width = 8 * torch.empty(0, dtype=dtype).element_size()
    return torch.tensor([v - (1 << width) if v >= 1 << (width - 1) else v for v in values], dtype=int_t).view(dtype)


def _hex(t: torch.Tensor) -> list[str]:
    width = 8 * t.element_size()
    return [hex(v % (1 << width)) for v in bits(t).tolist()]


NAN = float("nan")


def test_max_and_min_keep_the_receiving_ranks_value_unless_the_partial_compares_beyond_it():
    # 2 ranks, 4 elements: chunk 0 (elements 0, 1) ends on rank 0, chunk 1 (2, 3) on rank 1
    x0 = torch.tensor([NAN, 1.0, NAN, 1.0])
    x1 = torch.tensor([1.0, NAN, 1.0, NAN])
    for op in (ReduceOp.MAX, ReduceOp.MIN):
        got = Gloo().reduce([x0, x1], op)
        assert got.isnan().tolist() == [True, False, False, True], op  # the last rank's value wins over NaN
    assert Gloo().reduce([x0, x1], ReduceOp.MAX).isnan().tolist() != x0.maximum(x1).isnan().tolist()


def test_signed_zeros_under_max_and_min_are_the_last_ranks_zero():
    x0 = torch.tensor([0.0, -0.0, 0.0, -0.0])
    x1 = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    for op in (ReduceOp.MAX, ReduceOp.MIN):
        got = Gloo().reduce([x0, x1], op)
        assert torch.signbit(got).tolist() == [False, True, True, False], op


def test_three_ranks_max_with_nan_depends_on_where_the_nan_sits_on_the_walk():
    # one element: the walk is x2, x1, x0; a NaN survives only on rank 0 (last) or if nothing later beats it
    for nan_rank, survives in ((0, True), (1, False), (2, False)):
        x = torch.ones(3, 1)
        x[nan_rank] = NAN
        assert Gloo().reduce(x, ReduceOp.MAX).isnan().item() is survives, nan_rank


@pytest.mark.parametrize(
    ("dtype", "local", "partial", "expected"),
    [
        (torch.float32, 0x7FC00001, 0xFFC12345, 0x7FC00001),  # both NaN: the receiving rank's, quieted
        (torch.float32, 0x3F800000, 0x7F800001, 0x7FC00001),  # a signalling NaN is quieted
        (torch.float32, 0x7F800000, 0xFF800000, 0xFFC00000),  # inf - inf: x86's default NaN
        (torch.float64, 0x7FF0000000000001, 0x3FF0000000000000, 0x7FF8000000000001),
        (torch.bfloat16, 0xFFD5, 0x3F80, 0x7FC0),  # c10's float -> bf16: every NaN becomes 0x7FC0
        (torch.bfloat16, 0x7F80, 0xFF80, 0x7FC0),
        (torch.float16, 0xFE55, 0x7E01, 0xFE00),  # c10's float -> fp16: the sign, payload 0x200
        (torch.float16, 0x3C00, 0x7C01, 0x7E00),
        (torch.float16, 0x7C00, 0xFC00, 0xFE00),
    ],
)
def test_nan_bits_of_sum_and_product(dtype, local, partial, expected):
    # 2 ranks, 1 element: the walk starts at rank 1 and ends on rank 0, so rank 0's value is the receiving one
    x = torch.stack([_raw([local], dtype), _raw([partial], dtype)])
    assert _hex(Gloo().sum(x)) == [hex(expected)]
    if local not in (0x7F800000, 0x7C00, 0x7F80):  # inf * -inf is -inf, not NaN
        assert _hex(Gloo().product(x)) == [hex(expected)]


def test_one_rank_passes_the_bits_through_and_avg_divides_them():
    x = _raw([0x7F800001, 0xFFC12345], torch.float32).unsqueeze(0)
    assert _hex(Gloo().sum(x)) == ["0x7f800001", "0xffc12345"]  # a signalling NaN stays signalling
    assert _hex(Gloo().reduce(x, ReduceOp.AVG)) == ["0x7fc00001", "0xffc12345"]  # div_ quiets it


def reference_gloo_fold(stacked: torch.Tensor, combine) -> torch.Tensor:
    """The documented walk with any ``combine(local, partial)``, one chunk at a time (slow, obvious)."""
    n = stacked.shape[0]
    flat = stacked.reshape(n, -1)
    length = chunk_length(flat.shape[1], n, flat.element_size())
    out = torch.empty_like(flat[0])
    for c in range(n):
        part = slice(c * length, min(flat.shape[1], (c + 1) * length))
        acc = flat[(c - 1) % n, part].clone()
        for j in range(1, n):
            acc = combine(flat[(c - 1 - j) % n, part], acc)
        out[part] = acc
    return out.reshape(stacked.shape[1:])


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES)
def test_product_max_min_follow_the_same_walk_as_the_sum(n, dtype):
    for numel in (1, 2, 5, 100, 1023):
        x = random_ranks(n * 31 + numel, n, numel, dtype, wide=True)
        x = 1 + x / 64  # products of values near 1 round differently in different orders
        assert_bitwise(Gloo().product(x), reference_gloo_fold(x, torch.mul), f"product n={n} numel={numel}")
        for op, keep in ((ReduceOp.MAX, torch.gt), (ReduceOp.MIN, torch.lt)):
            expected = reference_gloo_fold(x, lambda local, acc, keep=keep: torch.where(keep(acc, local), acc, local))
            assert_bitwise(Gloo().reduce(x, op), expected, f"{op} n={n} numel={numel}")
    if n >= 3 and dtype == torch.bfloat16:
        x = 1 + random_ranks(n, n, 4096, dtype, wide=False) / 16
        assert not torch.equal(bits(Gloo().product(x)), bits(Sequential().product(x)))  # the order shows


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_integers_wrap_and_integer_avg_raises_torchs_error(dtype):
    x = torch.tensor([[100, 7, 127], [100, 9, 1], [100, 11, 1], [100, 13, 2]]).to(dtype)
    assert torch.equal(Gloo().sum(x), x[0] + x[1] + x[2] + x[3])  # two's complement wrap, any order
    assert torch.equal(Gloo().product(x), x[0] * x[1] * x[2] * x[3])
    assert torch.equal(Gloo().reduce(x, ReduceOp.MAX), x.max(0).values)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        Gloo().reduce(x, ReduceOp.AVG)


def test_avg_is_the_sum_divided_in_place_in_the_tensor_dtype():
    x = random_ranks(4, 3, 1000, torch.bfloat16, wide=True)
    assert_bitwise(Gloo().reduce(x, ReduceOp.AVG), Gloo().sum(x).div_(3), "avg")
    assert_bitwise(Gloo().reduce(list(x), ReduceOp.AVG), Gloo().sum(x) / 3, "avg of a list")


def test_dense_permuted_tensors_are_reduced_in_memory_order():
    x = random_ranks(9, 4, 64 * 48, torch.float32, wide=True).reshape(4, 64, 48)
    transposed = [t.t().contiguous().t() for t in x]  # logical values of x, storage of x.t()
    got = Gloo().sum(transposed)
    assert got.stride() == transposed[0].stride()
    assert_bitwise(got.contiguous(), Gloo().sum(torch.stack([t.t() for t in transposed])).t(), "memory order")
    assert not torch.equal(bits(got.contiguous()), bits(Gloo().sum(x)))  # chunks cut in logical order differ


def test_views_with_gaps_and_mixed_layouts_are_refused_naming_the_hazard():
    base = torch.randn(4, 6, 10)
    with pytest.raises(ValueError, match="memory outside the view"):
        Gloo().sum([b[:, ::2] for b in base])
    with pytest.raises(ValueError, match="different memory layouts"):
        Gloo().sum([base[0], base[1].t().contiguous().t(), base[2], base[3]])


def test_reduce_to_any_root_and_list_reduce_scatter_are_all_reduces():
    x = random_ranks(11, 3, 3 * 70, torch.bfloat16, wide=True)
    for root in range(3):
        assert_bitwise(Gloo().reduce_to(x, ReduceOp.SUM, root), Gloo().sum(x), f"root {root}")
    with pytest.raises(ValueError, match="root 3"):
        Gloo().reduce_to(x, ReduceOp.SUM, 3)
    lists = [list(r.reshape(3, 70)) for r in x]
    for i, block in enumerate(Gloo().reduce_scatter_list(lists, ReduceOp.MAX)):
        assert_bitwise(block, Gloo().reduce(x.reshape(3, 3, 70)[:, i], ReduceOp.MAX), f"block {i}")


def unsorted_group(comm):
    from simdist.world.groups import Group

    x = order_fingerprint(3, 64, torch.float32)[min(comm.get_rank(), 2)].clone()
    if comm.get_rank() < 3:
        comm.all_reduce(x, group=Group("custom", (2, 0, 1)))
    return x


def test_simworld_orders_a_groups_ranks_as_torch_does():
    results = SimWorld(ParallelSpec(4, tp=1, ep=1), reduction=Gloo()).run(unsorted_group)
    expected = Gloo().sum(order_fingerprint(3, 64, torch.float32))
    for rank in range(3):
        assert_bitwise(results[rank], expected, f"rank {rank}")


def test_reduce_leaves_each_other_rank_the_partial_of_its_own_hop():
    x = random_ranks(21, 4, 7, torch.float32, wide=True)  # 4 chunks of 2: chunk c walks c-1, c-2, c-3, c
    buffers = Gloo().reduce_buffers(list(x), ReduceOp.SUM, root=2)
    assert_bitwise(buffers[2], Gloo().sum(x), "root")
    assert_bitwise(buffers[3][:2], x[3, :2], "chunk 0 starts at rank 3: its input stays")
    assert_bitwise(buffers[1][:2], (x[3, :2] + x[2, :2]) + x[1, :2], "chunk 0, third hop")
    assert_bitwise(buffers[0][:2], Gloo().sum(x)[:2], "chunk 0 ends on rank 0: the full sum")
    assert_bitwise(buffers[3][2:4], x[0, 2:4] + x[3, 2:4], "chunk 1 starts at rank 0, then rank 3")
    averaged = Gloo().reduce_buffers(list(x), ReduceOp.AVG, root=2)
    for r in range(4):  # AVG divides every rank's tensor afterwards
        assert_bitwise(averaged[r], buffers[r] / 4, f"AVG rank {r}")


def test_integer_avg_raises_after_writing_the_sum():
    x = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 13]], dtype=torch.int32)
    with pytest.raises(RuntimeError) as raised:
        Gloo().reduce(list(x), ReduceOp.AVG)
    assert raised.value.written.tolist() == [22, 26, 31]  # what real gloo leaves in the tensor


def test_reduce_scatter_tensor_of_a_permuted_input_is_chunked_after_a_memory_order_all_reduce():
    x = random_ranks(17, 4, 8 * 33, torch.float32, wide=True).reshape(4, 8, 33)
    permuted = [t.t().contiguous().t() for t in x]
    blocks = Gloo().reduce_scatter(permuted)
    full = Gloo().sum(permuted)
    for i in range(4):
        assert_bitwise(blocks[i], full[2 * i : 2 * i + 2].reshape(-1), f"block {i}")
    assert not torch.equal(bits(blocks), bits(Gloo().reduce_scatter(x)))  # logical order differs
