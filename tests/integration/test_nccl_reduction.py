"""The `Nccl` reduction's own invariants, on CPU, bit for bit.

No GPU is involved: these tests pin what the model claims NCCL v2.30.7 does
(see `simdist.reduce.nccl.reduction`), not that NCCL does it; `experiments/nccl_fingerprint.py`
is the check against hardware. The central property test runs a literal
message-passing simulation of NCCL's ring kernel (every rank, every loop,
every step, as ``runRing`` in ``src/device/all_reduce.h`` walks them) and
requires the vectorised model to give the same bits on every rank.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.numerics.floats import bits, float_format, round_exact, unit_roundoff
from simdist.reduce import ReduceOp, Sequential, make_reduction
from simdist.reduce.nccl import Nccl
from simdist.reduce.nccl.arith import fma_round, premul_scale
from simdist.reduce.nccl.schedule import (
    DEFAULT_BUFFSIZE,
    PROTOCOLS,
    VERSIONS,
    btree,
    chain_tree,
    channel_parts,
    double_binary_trees,
    ring_chunk_elements,
    ring_segments,
    task_channels,
)
from simdist.testing._internal.nccl_sim import (
    simulate_ring_allreduce,
    simulate_ring_reduce,
    simulate_ring_reduce_scatter,
    simulate_tree_allreduce,
)
from simdist.testing.strategies import float_values, rank_tensors

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL_BUFFERS = {"simple": ("buffsize", (1024, 2048, 8192)), "ll": ("ll_buffsize", (256, 512, 4096)),
                 "ll128": ("ll128_buffsize", (16384, 32768))}  # fmt: skip
SPREAD_FOR = {torch.float32: 12, torch.bfloat16: 4, torch.float16: 4}
ROOT = Path(__file__).resolve().parents[2]


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    differ = (bits(actual) != bits(expected)).nonzero().flatten()
    assert differ.numel() == 0, f"{what}: {differ.numel()} elements differ, first at {differ[:5].tolist()}"


def fold_rows(rows: torch.Tensor, order) -> torch.Tensor:
    acc = rows[order[0]].clone()
    for r in order[1:]:
        acc = acc + rows[r]
    return acc


# -- strategies --------------------------------------------------------------------------------


@st.composite
def reductions(draw, n: int) -> Nccl:
    protocol = draw(st.sampled_from(PROTOCOLS))
    params: dict = {"protocol": protocol, "channels": draw(st.integers(1, 4))}
    key, sizes = SMALL_BUFFERS[protocol]
    if draw(st.booleans()):
        params[key] = draw(st.sampled_from(sizes))
    if draw(st.booleans()):
        params["task_channels"] = draw(st.integers(1, params["channels"]))
    if draw(st.booleans()):
        params["nccl_version"] = draw(st.sampled_from(VERSIONS))
    if draw(st.booleans()):
        perms = st.permutations(list(range(n))).map(tuple)
        params["rings"] = tuple(draw(st.lists(perms, min_size=1, max_size=3)))
    return Nccl(**params)


def inputs(n: int, count: int, dtype: torch.dtype, seed: int, spread: int = 12) -> torch.Tensor:
    """Normal values times exact powers of two (built without exp2/pow)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, count, generator=g, dtype=torch.float64)
    k = torch.randint(-spread, spread + 1, (n, count), generator=g)
    return torch.ldexp(x, k).to(dtype)


@st.composite
def cases(draw):
    n = draw(st.integers(2, 6))
    reduction = draw(reductions(n))
    dtype = draw(st.sampled_from(DTYPES))
    count = draw(st.one_of(st.integers(0, 70), st.integers(0, 12000)))
    spread = 12 if dtype == torch.float32 else 4
    return n, reduction, inputs(n, count, dtype, draw(st.integers(0, 2**31)), spread)


# -- the ring against the literal simulation ------------------------------------------------


@given(cases(), st.sampled_from([ReduceOp.SUM, ReduceOp.AVG]))
def test_ring_allreduce_equals_literal_simulation_on_every_rank(case, op):
    n, reduction, x = case
    pre = x * premul_scale(n, x.dtype) if op is ReduceOp.AVG else x
    simulated = simulate_ring_allreduce(pre, reduction)
    got = reduction.reduce(x, op)
    for rank, result in enumerate(simulated):
        assert_bitwise(got, result, f"{reduction} {op.name} n={n} N={x.shape[1]} {x.dtype} rank {rank}")


@given(cases())
def test_every_element_is_a_fold_of_all_n_inputs_in_the_predicted_order(case):
    n, reduction, x = case
    count = x.shape[1]
    orders = reduction.element_orders(count, x.element_size(), n)
    assert torch.equal(orders.sort(dim=0).values, torch.arange(n).unsqueeze(1).expand(n, count))
    got = reduction.sum(x)
    for order in {tuple(col) for col in orders.T.tolist()}:
        cols = (torch.tensor(order) == orders.T).all(dim=1)
        assert_bitwise(got[cols], fold_rows(x[:, cols], order), f"{reduction} order {order}")


@given(cases())
def test_reduce_scatter_equals_literal_simulation(case):
    n, reduction, x = case
    count = x.shape[1] - x.shape[1] % n
    x = x[:, :count]
    assert_bitwise(reduction.reduce_scatter(x), simulate_ring_reduce_scatter(x, reduction), f"{reduction} n={n}")


@given(cases(), st.integers(0, 5))
def test_reduce_to_root_equals_literal_simulation(case, root):
    n, reduction, x = case
    root %= n
    got = reduction.reduce_to(x, ReduceOp.SUM, root)
    assert_bitwise(got, simulate_ring_reduce(x, reduction, root), f"{reduction} root {root}")
    if x.shape[1] and (reduction.rings is None or len(set(reduction.rings)) == 1):
        ring = reduction.ring_of(0, n)
        start = ring.index(root) + 1
        assert_bitwise(got, fold_rows(x, [ring[(start + j) % n] for j in range(n)]), f"{reduction} root {root}")


@given(cases(), st.booleans())
def test_tree_allreduce_equals_literal_simulation_on_every_rank(case, chains):
    n, reduction, x = case
    trees = None
    if chains:
        trees = (chain_tree(range(n)), chain_tree(range(n - 1, -1, -1)))
    elif n >= 4:
        trees = double_binary_trees([[0, 1], list(range(2, n))])
    reduction = Nccl(algorithm="tree", protocol=reduction.protocol, channels=reduction.channels, trees=trees,
                 task_channels=reduction.task_channels)  # fmt: skip
    for rank, result in enumerate(simulate_tree_allreduce(x, reduction)):
        assert_bitwise(reduction.sum(x), result, f"{reduction} n={n} rank {rank}")


# -- small worlds, stacked vs list, dtypes ---------------------------------------------------


@given(cases())
def test_two_ranks_are_one_add_and_one_rank_a_copy(case):
    _, reduction, x = case
    assert_bitwise(reduction.sum(x[:2]), x[0] + x[1])
    assert_bitwise(
        reduction.reduce(x[:2], ReduceOp.AVG), x[0] * premul_scale(2, x.dtype) + x[1] * premul_scale(2, x.dtype)
    )
    assert_bitwise(reduction.sum(x[:1]), x[0])
    assert_bitwise(reduction.reduce(x[:1], ReduceOp.AVG), x[0])


@given(cases())
def test_stacked_and_list_inputs_give_the_same_bits_and_shape_is_kept(case):
    n, reduction, x = case
    if x.shape[1] % 2 == 0 and x.shape[1]:
        shaped = x.reshape(n, 2, -1)
        assert_bitwise(reduction.sum(list(shaped)), reduction.sum(x).reshape(2, -1))


def test_tree_on_one_node_is_the_fold_from_the_tail_of_the_chain():
    x = inputs(5, 3000, torch.bfloat16, 1, spread=4)
    assert_bitwise(Nccl(algorithm="tree").sum(x), fold_rows(x, [4, 3, 2, 1, 0]))
    chain = (2, 0, 4, 1, 3)
    reduction = Nccl(algorithm="tree", trees=(chain_tree(chain),))
    assert_bitwise(reduction.sum(x), fold_rows(x, list(reversed(chain))))
    assert not torch.equal(bits(reduction.sum(x)), bits(Sequential().sum(x)))


def test_tree_channels_each_use_their_own_tree():
    x = inputs(4, 40000, torch.float32, 2)
    trees = (chain_tree((0, 1, 2, 3)), chain_tree((3, 2, 1, 0)))
    reduction = Nccl(algorithm="tree", channels=2, task_channels=2, trees=trees)
    parts = reduction.parts(40000, 4, 4)
    assert [c for c, _, _ in parts] == [0, 1]
    got = reduction.sum(x)
    for channel, offset, part in parts:
        order = [3, 2, 1, 0] if channel == 0 else [0, 1, 2, 3]
        assert_bitwise(got[offset : offset + part], fold_rows(x[:, offset : offset + part], order))


def test_multi_node_tree_adds_children_in_down_order():
    # 3 nodes of 2 ranks, pattern "tree": heads 0, 2, 4. Over the nodes tree 0 is 0 <- 2 <- 1, so
    # rank 0 adds its chain child 1 then node 2's head 4; rank 4 adds 5 then node 1's head 2.
    t0, _ = double_binary_trees([[0, 1], [2, 3], [4, 5]])
    assert btree(3, 0) == (-1, -1, 2, 0) and btree(3, 2) == (0, 1, -1, 1) and btree(3, 1) == (2, -1, -1, 0)
    assert t0 == ((1, 4), (), (3,), (), (5, 2), ())
    x = inputs(6, 100, torch.float32, 3)
    reduction = Nccl(algorithm="tree", trees=(t0,))
    node1 = x[2] + x[3]
    node2 = (x[4] + x[5]) + node1
    expected = (x[0] + x[1]) + node2
    assert_bitwise(reduction.sum(x), expected)


def test_btree_matches_the_picture_of_fourteen_ranks_in_trees_cc():
    # 0 - 8; 8: 4, 12; 4: 2, 6; 12: 10, 13; 2: 1, 3; 6: 5, 7; 10: 9, 11.
    down = {r: btree(14, r)[1:3] for r in range(14)}
    assert btree(14, 0)[2] == 8
    assert down[8] == (4, 12) and down[4] == (2, 6) and down[12] == (10, 13)
    assert down[2] == (1, 3) and down[6] == (5, 7) and down[10] == (9, 11) and down[13] == (-1, -1)
    assert btree(14, 13)[0] == 12 and btree(14, 12)[0] == 8


def test_second_tree_mirrors_for_even_and_shifts_for_odd_node_counts():
    t0, t1 = double_binary_trees([[r] for r in range(4)])
    assert t0 == ((2,), (), (1, 3), ()) and t1 == ((), (2, 0), (), (1,))
    t0, t1 = double_binary_trees([[r] for r in range(3)])
    assert t0 == ((2,), (), (1,)) and t1 == ((2,), (0,), ())


# -- schedule pins derived by hand from the source --------------------------------------------


def test_chunk_sizes_per_protocol():
    assert ring_chunk_elements("simple", 4) == (DEFAULT_BUFFSIZE // 2) // 4 == 524288
    assert ring_chunk_elements("ll", 2) == 32768 // 2
    assert ring_chunk_elements("ll128", 4) == 576000 // 4
    assert ring_chunk_elements("simple", 2, buffsize=65536) == 16384
    with pytest.raises(ValueError, match="too small"):
        ring_chunk_elements("simple", 4, buffsize=512)


def test_channel_split_examples():
    # 4 MiB fp32 on 8 channels: 256 cells of 16 KiB, 32 per channel.
    assert channel_parts(1 << 20, 4, "simple", 8, 8) == [(c, c * 131072, 131072) for c in range(8)]
    # five more elements: 257 cells, 33 per channel, the last one short.
    parts = channel_parts((1 << 20) + 5, 4, "simple", 8, 8)
    assert [p for _, _, p in parts] == [135168] * 7 + [102405]
    # LL: 4-KiB cells, 8x traffic.
    assert channel_parts(1 << 20, 4, "ll", 8, 8) == [(c, c * 131072, 131072) for c in range(8)]
    # one channel in the communicator: everything in it.
    assert channel_parts(10**6, 2, "simple", 1, 1) == [(0, 0, 10**6)]
    # small calls use one channel.
    assert channel_parts(100, 4, "simple", 8, 8) == [(0, 0, 100)]


def test_channel_split_before_2_29_uses_16_kib():
    # 8-KiB cells (16 KiB / 2 traffic per byte), 65 per channel, the last one short.
    parts = channel_parts((1 << 20) + 5, 4, "simple", 8, 8, nccl_version=(2, 28))
    assert [p for _, _, p in parts] == [133120] * 7 + [116741]
    assert Nccl(nccl_version=(2, 27)).parts((1 << 20) + 5, 4, 2)[0][2] != Nccl().parts((1 << 20) + 5, 4, 2)[0][2]
    with pytest.raises(ValueError, match="nccl_version"):
        Nccl(nccl_version=(2, 18))


def test_channel_split_covers_the_buffer():
    for count, e, proto, chans, used, version in itertools.product(
        (1, 4095, 4096, 4097, 100000, 3 << 20), (2, 4), PROTOCOLS, (1, 2, 3, 8), (1, 2, 8), ((2, 28), (2, 30))
    ):
        parts = channel_parts(count, e, proto, chans, min(used, chans), nccl_version=version)
        assert sum(p for _, _, p in parts) == count
        assert [o for _, o, _ in parts] == list(itertools.accumulate([0] + [p for _, _, p in parts[:-1]]))
        assert [c for c, _, _ in parts] == list(range(len(parts))) and len(parts) <= chans
        assert all(p > 0 for _, _, p in parts)


def test_task_channels_drop_for_small_calls():
    assert task_channels(1 << 20, 16, 4) == 16
    assert task_channels(65536, 16, 4) == 2  # 65536 < nc * 512 * 64 for nc > 2
    assert task_channels(100, 16, 4) == 1
    assert task_channels(65536, 16, 4, protocol="ll") == 4  # 65536 < nc * 512 * 8 * 4 for nc > 4


def test_ring_segments_short_loop_aligns_to_16_bytes():
    assert ring_segments(10, 4, 524288, 4) == [(0, 4, 1), (4, 4, 2), (8, 2, 3)]
    assert ring_segments(10, 4, 524288, 2) == [(0, 8, 1), (8, 2, 2)]
    # two full loops of 4 x 8 then a short loop of 5 elements (chunks of 4).
    segs = ring_segments(69, 4, 8, 4)
    assert segs[:4] == [(0, 8, 1), (8, 8, 2), (16, 8, 3), (24, 8, 0)]
    assert segs[8:] == [(64, 4, 1), (68, 1, 2)]


def test_small_tensor_order_example():
    # n=4 fp32, 10 elements: chunks of 4 start at ring positions 1, 2, 3.
    x = inputs(4, 10, torch.float32, 5)
    got = Nccl().sum(x)
    assert_bitwise(got[:4], fold_rows(x[:, :4], [1, 2, 3, 0]))
    assert_bitwise(got[4:8], fold_rows(x[:, 4:8], [2, 3, 0, 1]))
    assert_bitwise(got[8:], fold_rows(x[:, 8:], [3, 0, 1, 2]))


def test_rings_are_read_from_rank_zero():
    x = inputs(4, 1, torch.float32, 6)
    # ring 0 -> 2 -> 1 -> 3 (as NCCL logs it); element 0 is chunk 0, which starts at position 1.
    for ring in ((0, 2, 1, 3), (1, 3, 0, 2)):
        assert_bitwise(Nccl(rings=(ring,)).sum(x), fold_rows(x, [2, 1, 3, 0]))


# -- operations ------------------------------------------------------------------------------


def test_premul_scale_bits():
    assert bits(premul_scale(3, torch.bfloat16)).item() == 0x3EAB
    assert bits(premul_scale(3, torch.float16)).item() == 0x3555
    assert bits(premul_scale(3, torch.float32)).item() == 0x3EAAAAAB
    assert bits(premul_scale(5, torch.bfloat16)).item() == 0x3E4D
    assert premul_scale(8, torch.bfloat16).item() == 0.125


@given(cases())
def test_avg_is_the_sum_of_premultiplied_inputs(case):
    n, reduction, x = case
    assert_bitwise(reduction.reduce(x, ReduceOp.AVG), reduction.sum(x * premul_scale(n, x.dtype)))


def test_avg_on_a_power_of_two_is_the_scaled_sum():
    x = inputs(4, 5000, torch.bfloat16, 7, spread=4)
    reduction = Nccl()
    assert_bitwise(reduction.reduce(x, ReduceOp.AVG), reduction.sum(x) * 0.25)


def test_avg_on_integers_truncates_the_sum():
    x = torch.tensor([[7, -7, 100], [0, 0, 27], [1, -1, 0]], dtype=torch.int32)
    assert Nccl().reduce(x, ReduceOp.AVG).tolist() == [2, -2, 42]


def test_max_and_min_ignore_nan_unless_all_are_nan():
    nan = float("nan")
    x = torch.tensor([[nan, 1.0, nan], [2.0, nan, nan], [0.5, 3.0, nan]])
    got = Nccl().reduce(x, ReduceOp.MAX)
    assert got[:2].tolist() == [2.0, 3.0] and got[2].isnan()
    assert Nccl().reduce(x, ReduceOp.MIN)[:2].tolist() == [0.5, 1.0]


def test_fingerprint_distinguishes_nccl_from_rank_order():
    # one rank holds 1.0, two others half an ulp: 1 + ulp iff the halves meet first.
    n, count = 4, 64
    x = torch.zeros(n, count)
    triples = [(b, s, t) for b in range(n) for s, t in itertools.combinations(range(n), 2) if b not in (s, t)]
    for e in range(count):
        b, s, t = triples[e % len(triples)]
        x[b, e], x[s, e], x[t, e] = 1.0, 2.0**-24, 2.0**-24
    assert not torch.equal(Nccl().sum(x), Sequential().sum(x))


@given(st.sampled_from(DTYPES), st.integers(1, 8), st.integers(1, 40), st.data())
def test_recursive_summation_bound_and_exact_small_integers(dtype, n, numel, data):
    values = float_values(dtype, max_exponent=float_format(dtype).emax - 4)
    per_rank = torch.stack(data.draw(rank_tensors(n, numel, dtype, values)))
    exact = [sum((Fraction(v) for v in col), Fraction(0)) for col in per_rank.double().T.tolist()]
    magnitude = [sum((abs(Fraction(v)) for v in col), Fraction(0)) for col in per_rank.double().T.tolist()]
    u = Fraction(unit_roundoff(dtype))
    ints = torch.tensor(data.draw(st.lists(st.integers(-16, 16), min_size=n * numel, max_size=n * numel)))
    ints = ints.reshape(n, numel).to(dtype)
    for reduction in (Nccl(), Nccl(protocol="ll", channels=3, task_channels=3), Nccl(algorithm="tree")):
        got = reduction.sum(per_rank).double().tolist()
        for g, s, m in zip(got, exact, magnitude, strict=True):
            assert abs(Fraction(g) - s) <= (n - 1) * u * m, (reduction, g, s)
        assert_bitwise(reduction.sum(ints) + 0.0, ints.double().sum(0).to(dtype) + 0.0, str(reduction))


# -- registry and validation -----------------------------------------------------------------


def test_registry_and_name():
    reduction = make_reduction("nccl", algorithm="tree", protocol="ll128", channels=4)
    assert isinstance(reduction, Nccl) and reduction.name == "nccl(tree, ll128, channels=4)"
    assert make_reduction("nccl").name == "nccl(ring, simple, channels=2)"


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"algorithm": "nvls"}, "algorithm"),
        ({"protocol": "LL"}, "protocol"),
        ({"channels": 0}, "channels"),
        ({"channels": 2, "task_channels": 3}, "task_channels"),
        ({"buffsize": 0}, "buffsize"),
        ({"rings": ()}, "rings"),
    ],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        Nccl(**params)


def test_bad_ring_or_tree_for_the_group_is_refused():
    with pytest.raises(ValueError, match="permutation"):
        Nccl(rings=((0, 1, 2),)).sum(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="tree"):
        Nccl(algorithm="tree", trees=(((1,), (0,), ()),)).sum(torch.zeros(3, 3))


@pytest.mark.slow  # a subprocess (~7 s CPU); by default the Nccl model meets the same nccl_sim in-process above
def test_fingerprint_script_dry_run(tmp_path):
    script = ROOT / "experiments" / "nccl_fingerprint.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--dry-run",
            "--world-sizes",
            "4",
            "--quick",
            "--out",
            str(tmp_path),
            "--knobs",
            "ring-simple-c4-buf64k,ring-ll-c2,tree-simple-c2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model == real" in done.stdout and "MISMATCH" not in done.stdout


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_several_channels_loops_and_rings_against_the_simulation(protocol):
    key, sizes = SMALL_BUFFERS[protocol]
    reduction = Nccl(protocol=protocol, channels=3, task_channels=3, rings=((0, 1, 2, 3, 4), (0, 3, 1, 4, 2)),
                 **{key: sizes[0]})  # fmt: skip
    x = inputs(5, 60011, torch.bfloat16, 8, spread=4)
    parts = reduction.parts(60011, 2, 5)
    chunk = ring_chunk_elements(protocol, 2, reduction.buffsize, reduction.ll_buffsize, reduction.ll128_buffsize)
    assert len(parts) == 3 and all(p > 5 * chunk for _, _, p in parts)  # three channels, several loops each
    for rank, result in enumerate(simulate_ring_allreduce(x, reduction)):
        assert_bitwise(reduction.sum(x), result, f"{protocol} rank {rank}")


def test_channels_last_tensors_are_reduced_in_memory_order():
    g = torch.Generator().manual_seed(9)
    per_rank = [torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last) for _ in range(3)]
    reduction = Nccl()
    got = reduction.sum(per_rank)
    assert got.shape == (2, 3, 4, 5) and got.is_contiguous(memory_format=torch.channels_last)
    in_memory = torch.stack([t.permute(0, 2, 3, 1).reshape(-1) for t in per_rank])
    assert_bitwise(got.permute(0, 2, 3, 1).reshape(-1), reduction.sum(in_memory))
    logical = reduction.sum(torch.stack([t.contiguous() for t in per_rank]))
    assert not torch.equal(bits(got.contiguous()), bits(logical))  # chunk boundaries fall elsewhere


def test_tensors_torch_nccl_refuses_are_refused():
    with pytest.raises(ValueError, match="Tensors must be contiguous"):
        Nccl().sum([torch.zeros(4, 4).T] * 3)
    with pytest.raises(ValueError, match="Tensors must be contiguous"):
        Nccl().reduce_scatter([torch.zeros(6, 2)[::2]] * 3)
    with pytest.raises(ValueError, match="different memory formats"):
        t = torch.zeros(1, 2, 3, 3)
        Nccl().sum([t, t.to(memory_format=torch.channels_last).add(0).contiguous(memory_format=torch.channels_last)])


@given(st.sampled_from(DTYPES), st.integers(0, 2**31), st.integers(3, 7))
def test_fma_round_is_one_correct_rounding(dtype, seed, n):
    x, acc = inputs(2, 200, dtype, seed, spread=SPREAD_FOR[dtype])
    scale = premul_scale(n, dtype)
    got = fma_round(x, scale, acc).double().tolist()
    s = Fraction(scale.item())
    for g, a, b in zip(got, x.double().tolist(), acc.double().tolist(), strict=True):
        assert g == round_exact(Fraction(a) * s + Fraction(b), dtype), (a, b, g)


def test_fma_round_ties_and_specials():
    one, half_ulp = torch.tensor([1.0]), torch.tensor([2.0**-24])
    # 1 * 1 + 2**-24 is a tie: to even (1.0); a tiny extra product pushes it up.
    assert fma_round(one, torch.tensor(1.0), half_ulp).item() == 1.0
    # x * s = 2**-24 - 2**-60 lands the fp64 sum exactly on the midpoint 1 + 3 * 2**-24: the exact value is
    # below it, so the answer is 1 + 2**-23, where rounding the fp64 sum would give the even 1 + 2**-22.
    x, s, acc = torch.tensor([1 + 2.0**-18]), torch.tensor((1 - 2.0**-18) * 2.0**-24), torch.tensor([1 + 2.0**-23])
    assert fma_round(x, s, acc).item() == 1 + 2.0**-23
    assert (x.double() * s.double() + acc.double()).float().item() == 1 + 2.0**-22
    assert fma_round(torch.tensor([2.0**-30]), torch.tensor(1.0), torch.tensor([1.0])).item() == 1.0
    special = fma_round(torch.tensor([float("inf"), 1.0]), torch.tensor(1.0), torch.tensor([1.0, float("nan")]))
    assert special[0].item() == float("inf") and special[1].isnan()
    with pytest.raises(ValueError, match="fused"):
        fma_round(torch.zeros(1, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64), torch.zeros(1))


@given(cases())
def test_fused_premultiply_folds_exactly_in_the_element_order(case):
    n, reduction, x = case
    count = min(x.shape[1], 64)
    x = x[:, :count]
    fused = Nccl(**{**_params(reduction), "premul_fma": True})
    got = fused.reduce(x, ReduceOp.AVG).double().tolist()
    orders = reduction.element_orders(count, x.element_size(), n).T.tolist()
    s = Fraction(premul_scale(n, x.dtype).item())
    values = x.double().T.tolist()
    for e in range(count):
        order, col = orders[e], values[e]
        acc = round_exact(Fraction(col[order[0]]) * s, x.dtype)
        for r in order[1:]:
            acc = round_exact(Fraction(col[r]) * s + Fraction(acc), x.dtype)
        assert got[e] == acc, (e, order)


def test_fused_premultiply_matters_only_when_the_product_rounds():
    x = inputs(4, 4000, torch.float32, 11)
    assert_bitwise(Nccl(premul_fma=True).reduce(x, ReduceOp.AVG), Nccl().reduce(x, ReduceOp.AVG))
    x = inputs(3, 4000, torch.float32, 11)
    fused, plain = Nccl(premul_fma=True).reduce(x, ReduceOp.AVG), Nccl().reduce(x, ReduceOp.AVG)
    assert not torch.equal(bits(fused), bits(plain))
    tree = Nccl(algorithm="tree", premul_fma=True)
    expected = fma_round(x[0], premul_scale(3, x.dtype), fma_round(x[1], premul_scale(3, x.dtype),
                                                                    x[2] * premul_scale(3, x.dtype)))  # fmt: skip
    assert_bitwise(tree.reduce(x, ReduceOp.AVG), expected)
    assert_bitwise(Nccl(premul_fma=True).sum(x), Nccl().sum(x))  # SUM has no premultiply


def _params(reduction: Nccl) -> dict:
    return {f: getattr(reduction, f) for f in reduction.__dataclass_fields__}


def test_list_reduce_scatter_is_one_reduce_scatter_of_the_flattened_lists():
    x = inputs(3, 3 * 20, torch.bfloat16, 12, spread=4)
    lists = [list(row.reshape(3, 4, 5).unbind(0)) for row in x]
    reduction = Nccl(rings=((0, 2, 1),))
    got = reduction.reduce_scatter_list(lists)
    blocks = reduction.reduce_scatter(x)
    for i in range(3):
        assert got[i].shape == (4, 5)
        assert_bitwise(got[i].reshape(-1), blocks[i])
    uneven = [[row[:5], row[5:12], row[12:]] for row in x]
    got = reduction.reduce_scatter_list(uneven)
    for i in range(3):
        assert_bitwise(got[i], reduction.reduce_to([lst[i] for lst in uneven], ReduceOp.SUM, i))


def _collectives(rank: int) -> dict:
    import torch.distributed as dist

    x = inputs(4, 3000, torch.bfloat16, 13, spread=4)[rank].clone()
    out = {"sum": x.clone(), "avg": x.clone(), "root": x.clone()}
    dist.all_reduce(out["sum"])
    dist.all_reduce(out["avg"], op=dist.ReduceOp.AVG)
    dist.reduce(out["root"], dst=2)
    out["rs"] = torch.empty(750, dtype=x.dtype)
    dist.reduce_scatter_tensor(out["rs"], x)
    out["rs_list"] = torch.empty(750, dtype=x.dtype)
    dist.reduce_scatter(out["rs_list"], list(x.chunk(4)))
    return out


def test_the_simdist_backend_runs_the_nccl_model_end_to_end():
    import simdist

    reduction = Nccl(channels=2, rings=((0, 2, 3, 1),))
    results = simdist.run(_collectives, 4, reduction=reduction)
    x = inputs(4, 3000, torch.bfloat16, 13, spread=4)
    blocks = reduction.reduce_scatter(x)
    for rank, out in enumerate(results):
        assert_bitwise(out["sum"], reduction.sum(x))
        assert_bitwise(out["avg"], reduction.reduce(x, ReduceOp.AVG))
        assert_bitwise(out["rs"], blocks[rank])
        assert_bitwise(out["rs_list"], blocks[rank])
    assert_bitwise(results[2]["root"], reduction.reduce_to(x, ReduceOp.SUM, 2))
    assert not torch.equal(bits(reduction.sum(x)), bits(reduction.reduce_to(x, ReduceOp.SUM, 2)))
