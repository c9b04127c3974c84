"""Scale: 512-rank NCCL all-reduces against plain-loop restatements, the batched gradient path at TP8 x DP64, and the
memory ceilings that refuse a run too large for the machine before anything is allocated.

The restatements below are written from the schedule NCCL's source describes (`simdist.reduce.nccl.reduction`'s module
docstring, steps 1-4), not from the model's code: numpy float32 arrays, one loop per chunk and hop (ring) or
per tree node, nothing imported from `simdist.reduce`. They cover the regime where one all-reduce uses one
channel and one short ring loop (below 64 KiB on the Simple protocol with 512 threads: NCCL drops to one
channel while ``bytes < channels * 512 * 64``), which is where a ring on many ranks has the most chunk
starts (up to one per rank).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from simdist.cli import main
from simdist.cli.limits import SizeError
from simdist.gradpath.batched import batched_sum
from simdist.numerics.floats import bitwise_equal
from simdist.reduce.nccl import Nccl
from simdist.reduce.nccl.schedule import double_binary_trees

N = 512
ROOT = Path(__file__).resolve().parents[4]


def _inputs(n: int, numel: int, seed: int) -> torch.Tensor:
    """fp32 values spread over 40 binades, so that the fold order shows in the bits."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, numel, generator=gen) * 2.0 ** torch.randint(-20, 20, (n, numel), generator=gen)


def ring_restated(x: np.ndarray, ring: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """NCCL's ring all-reduce of ``x[n, numel]`` (float32, one channel, one short loop): the result and the rank
    each element adds at each hop.

    Ring positions start at rank 0. The loop's chunk is ``ceil(numel / n)`` rounded up to 16 bytes (4 fp32
    elements); chunk ``j`` (``[j*k, (j+1)*k)``, clipped) starts with the value of ring position ``j + 1``, then
    each next position adds its own value to the partial it received, ending at position ``j``.
    """
    n, numel = x.shape
    ring = ring[ring.index(0) :] + ring[: ring.index(0)]
    k = -(-numel // n)
    k = -(-k // 4) * 4
    out = np.empty(numel, dtype=np.float32)
    adds = np.empty((n, numel), dtype=np.int64)
    for j in range(n):
        lo, hi = j * k, min((j + 1) * k, numel)
        if lo >= numel:
            break
        first = ring[(j + 1) % n]
        acc = x[first, lo:hi].copy()
        adds[0, lo:hi] = first
        for hop in range(1, n):
            rank = ring[(j + 1 + hop) % n]
            acc = x[rank, lo:hi] + acc  # float32 + float32: one IEEE rounding
            adds[hop, lo:hi] = rank
        out[lo:hi] = acc
    return out, adds


def tree_restated(x: np.ndarray, down: list[list[int]]) -> np.ndarray:
    """NCCL's tree all-reduce of ``x[n, numel]`` on one channel: each rank adds its own value to its first
    child's partial sum, then each further child's partial in ``down`` order; the root's sum is the result."""
    n = len(down)
    children = {c for d in down for c in d}
    (root,) = [r for r in range(n) if r not in children]
    partial: dict[int, np.ndarray] = {}
    stack, visited = [root], []
    while stack:  # parents before children; reversed, children before parents
        r = stack.pop()
        visited.append(r)
        stack.extend(down[r])
    for r in reversed(visited):
        acc = x[r].copy()
        for i, child in enumerate(down[r]):
            acc = x[r] + partial[child] if i == 0 else acc + partial[child]
        partial[r] = acc
    return partial[root]


def heap_of_chains(nodes: int, per_node: int) -> list[list[int]]:
    """A 2-level tree written for this test: each node a chain head-first, node ``k``'s head the parent of
    the heads of nodes ``2k+1`` and ``2k+2`` (after its own chain child)."""
    down: list[list[int]] = [[] for _ in range(nodes * per_node)]
    for node in range(nodes):
        head = node * per_node
        for i in range(per_node - 1):
            down[head + i].append(head + i + 1)
        for child in (2 * node + 1, 2 * node + 2):
            if child < nodes:
                down[head].append(child * per_node)
    return down


def nccl_double_binary_restated(nodes: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """NCCL's two trees over ``nodes`` nodes (a power of two) of ``per_node`` ranks each, pattern ``tree``, as
    ``down`` tables, restated from NCCL's description (src/graph/trees.cc's comments and figures, and how
    src/graph/connect.cc fills ``tree.down``), not from `simdist.reduce.nccl.reduction`'s port of its bit arithmetic.

    Tree 0 over node indices: node 0 is the root, with the single child ``nodes / 2``; under it, the in-order
    binary tree over ``1 .. nodes - 1``: the middle of a range is the parent of the middles of its lower and
    upper halves, lower first (child 0, child 1). Tree 1 (``nodes`` even) is tree 0 mirrored: node ``v`` has
    the mirrored children of node ``nodes - 1 - v``, each in its slot. Ranks: node ``k`` holds ranks
    ``k * per_node ..`` as a chain, head first (``tree.down[0]`` is the next rank of the chain); a node's head
    then adds its tree children's heads in the free slots, child 0 before child 1."""
    assert nodes >= 2 and nodes & (nodes - 1) == 0
    tree0: list[list[int]] = [[] for _ in range(nodes)]
    tree0[0] = [nodes // 2]

    def middle(lo: int, hi: int) -> int | None:
        """The root of the in-order tree over ``lo .. hi`` (inclusive), its subtrees filled in ``tree0``."""
        if lo > hi:
            return None
        mid = (lo + hi) // 2
        tree0[mid] = [c for c in (middle(lo, mid - 1), middle(mid + 1, hi)) if c is not None]
        return mid

    assert middle(1, nodes - 1) == nodes // 2
    tree1 = [[nodes - 1 - c for c in tree0[nodes - 1 - v]] for v in range(nodes)]
    tables = []
    for tree in (tree0, tree1):
        down = [[r + 1] if (r + 1) % per_node else [] for r in range(nodes * per_node)]
        for node, children in enumerate(tree):
            down[node * per_node] += [c * per_node for c in children]
        tables.append(down)
    return tables[0], tables[1]


@pytest.mark.parametrize("numel", [2048, 2300])
def test_a_512_rank_nccl_ring_all_reduce_is_the_plain_loop_restatement_bit_for_bit(numel):
    """fp32 on 512 ranks and a shuffled ring: 2048 elements are 512 chunks of 4 (every ring position starts
    one); 2300 are 288 chunks of 8 (``ceil(2300 / 512) = 5`` rounded up to 16 bytes), the last one short."""
    x = _inputs(N, numel, seed=1)
    ring = torch.randperm(N, generator=torch.Generator().manual_seed(2)).tolist()
    reduction = Nccl("ring", rings=(tuple(ring),))
    expected, adds = ring_restated(x.numpy(), ring)
    assert bitwise_equal(reduction.reduce(x), torch.from_numpy(expected))
    assert torch.equal(reduction.element_orders(numel, 4, N), torch.from_numpy(adds))
    # the order matters here: a plain rank-order fold differs in most elements
    plain = x[0].clone()
    for r in range(1, N):
        plain = plain + x[r]
    assert (plain != torch.from_numpy(expected)).float().mean() > 0.5


@pytest.mark.parametrize("tree", ["heap_of_chains", "nccl_double_binary", "chain"])
def test_a_512_rank_nccl_tree_all_reduce_is_the_plain_loop_restatement_bit_for_bit(tree):
    """Trees over 64 nodes of 8: one written here, NCCL's double binary tree 0 (the model's table builder, judged
    against `nccl_double_binary_restated` for both trees; the arithmetic on tree 0 restated), and the model's
    default single chain over 512 ranks."""
    numel = 1000
    x = _inputs(N, numel, seed=3)
    if tree == "heap_of_chains":
        down = heap_of_chains(64, 8)
        reduction = Nccl("tree", trees=(tuple(tuple(d) for d in down),))
    elif tree == "nccl_double_binary":
        trees = double_binary_trees([list(range(k * 8, k * 8 + 8)) for k in range(64)])
        restated = nccl_double_binary_restated(64, 8)
        assert [[list(d) for d in t] for t in trees] == list(restated)
        down = restated[0]
        reduction = Nccl("tree", trees=trees)
    else:
        down = [[r + 1] if r + 1 < N else [] for r in range(N)]
        reduction = Nccl("tree")
    assert bitwise_equal(reduction.reduce(x), torch.from_numpy(tree_restated(x.numpy(), down)))


@pytest.mark.parametrize(
    ("n", "reduction", "shape"),
    [
        (N, Nccl("ring"), (40, 9)),
        (24, Nccl("ring", channels=4, protocol="ll"), (40, 9)),
        (6, Nccl("ring"), (40, 9)),
        # 16 KiB per member: one channel (tree 0); the 6 reductions' flat length would use two (tree 1 too)
        (N, Nccl("tree", trees=double_binary_trees([list(range(k * 8, k * 8 + 8)) for k in range(64)])), (64, 64)),
    ],
    ids=["ring-512", "ring-24-ll", "ring-6", "tree-512"],
)
def test_the_batched_engine_reduces_nccl_groups_as_each_alone(n, reduction, shape):
    """`batched_sum` (the rank-batched gradient path's collective) gives every group and seed the bits `Nccl.reduce`
    gives it alone: the plan is one member's, never that of the batch's flat length."""
    stacked = _inputs(n, 3 * 2 * math.prod(shape), seed=4).view(n, 3, 2, *shape)
    together = batched_sum(reduction, stacked, shape)
    for b in range(3):
        for g in range(2):
            assert bitwise_equal(together[b, g], reduction.reduce(stacked[:, b, g])), (b, g)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_scale_bench_refuses_a_request_above_the_memory_it_can_have_before_allocating(capsys):
    bench = _bench()
    plan = bench.parse(["--worlds", "8,512", "--numel", str(1 << 20), "--skip-growth"])
    plan.check(available=64 << 30)  # 512 x 1 Mi fp32 x 3 copies = 6 GiB: fits in 64 GiB
    with pytest.raises(SizeError, match=r"all_reduce at world 512: this run needs an estimated 6\.\d GiB"):
        plan.check(available=4 << 30)
    assert bench.main(["--worlds", "512", "--numel", str(1 << 40), "--skip-growth"]) == 2
    err = capsys.readouterr().err
    assert "this run needs an estimated" in err and "512 ranks x 1099511627776 elements" in err
    assert len(err.strip().splitlines()) == 1


def test_growth_at_world_512_is_refused_with_its_estimate_when_it_cannot_fit(capsys, tmp_path):
    argv = ["growth", "--world-size", "512", "--tp", "8", "--ep", "8", "--steps", "10", "--no-progress"]
    assert main([*argv, "--seeds", "100000", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "this run needs an estimated" in err and "states 12.2 TiB" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["gloo", "nccl"])
def test_tp8_dp64_growth_matches_the_independent_oracle(tmp_path, reduction):
    """TP8 x DP64 (EP8) on 512 ranks, 3 steps, 2 seeds: ``fp32_staging`` run by the rank-batched gradient path holds
    the independent oracle's bits (`simdist.gradpath.oracle`: per-rank loops, a real ``torch.optim.AdamW``,
    each reduction one ``model.reduce`` per group and seed) at every step, rank and seed; ``bf16_only`` does
    not (so the comparison can fail)."""
    from simdist.studies.growth import GrowthConfig, run_growth
    from simdist.world.spec import ParallelSpec

    config = GrowthConfig(
        ("fp32_staging", "bf16_only"),
        steps=3,
        seeds=2,
        spec=ParallelSpec(512, tp=8, ep=8),
        reduction=reduction,
    )
    summary = run_growth(config, tmp_path, progress=False, plot=False)
    assert summary["policies"]["fp32_staging"]["bitwise_equal_to_oracle"]
    assert not summary["policies"]["bf16_only"]["bitwise_equal_to_oracle"]


def test_the_ring_models_cached_plans_hold_no_per_element_index():
    """A per-element index is ``8 * n * numel`` bytes (64 MiB at 512 ranks x 16384): the Ring's cached plan
    must not hold one, so a sweep over sizes at 512 ranks keeps kilobytes, whatever the tensor size."""
    from simdist.reduce import Ring, native
    from simdist.reduce.plan import ROW_GATHER_LIMIT

    reduction = Ring()
    for numel in (8, 900, 4096, 16_384):  # whole chunks (gathered chunk by chunk) and many-chunk members
        stacked = _inputs(512, 2 * numel, seed=numel).view(512, 2, numel)
        with native.disabled():  # the eager path's index tensors (the native kernel reads the plan's rows only)
            assert torch.equal(reduction.sum_many(stacked, (numel,))[1], reduction.reduce(stacked[:, 1]))
        plan = reduction.plan(512, numel, torch.float32)
        held = sum(t.numel() * t.element_size() for t in plan._index.values())
        assert 0 < held <= 4 * ROW_GATHER_LIMIT * 8
    assert 4 * ROW_GATHER_LIMIT * 8 < 8 * 512 * 16_384 // 100  # the bound is far below a per-element index
    # one plan, many batch sizes: each size gathers with its own chunk-row index (1024 * count rows here), and
    # the plan keeps the last few, not one per size ever seen (16 sizes: 1.1 MB held without the bound)
    plan = reduction.plan(512, 2, torch.float32)
    for count in range(1, 17):
        stacked = _inputs(512, 2 * count, seed=count).view(512, count, 2)
        with native.disabled():  # the eager path's per-batch-size indexes are what is bounded here
            assert torch.equal(reduction.sum_many(stacked, (2,))[count - 1], reduction.reduce(stacked[:, count - 1]))
    chunk_rows = [t for key, t in plan._index.items() if isinstance(key, tuple)]  # (count, device) keys
    assert 1 <= len(chunk_rows) <= 4
    assert sum(t.numel() * t.element_size() for t in chunk_rows) <= 4 * ROW_GATHER_LIMIT * 8
