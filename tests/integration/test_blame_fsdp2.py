"""simdist.blame on FSDP2 with a MixedPrecisionPolicy (real torch FSDP2 on simdist.run threads): FSDP2's own
parameter casts (``torch._foreach_copy_`` into the BF16 all-gather input) are sites, and promotion runs on
DTensor parameters and states (compared by each rank's local shard)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from simdist.attribution import blame

SHAPES = [(32, 16), (32,), (4, 32), (4,)]
STEPS = 2


def _train(rank: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    shards = []
    for _ in range(STEPS):
        shards.append([p.to_local().detach().clone() for p in model.parameters()])
        x = torch.randn(8, 16, generator=g)
        model(x).float().pow(2).mean().backward()  # LINE_FORWARD
        opt.step()
        opt.zero_grad()
    return shards


def _line(marker: str) -> int:
    lines, start = inspect.getsourcelines(_train)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def test_fsdp2_parameter_casts_are_sites_with_exact_figures_and_promotion_runs_on_dtensors():
    report = blame(_train, 2)
    casts = [s for s in report.sites if s.kind == "cast" and s.op == "_foreach_copy_"]  # named as FSDP2 calls it
    (site,) = casts
    assert (site.dtypes, site.line) == ("fp32->bf16", _line("LINE_FORWARD"))
    assert site.calls == 2 * STEPS * len(SHAPES)  # one foreach copy per parameter, rank and step
    # the casts' figures from the shards each rank held before each step: FP32 -> BF16, exact value the FP32 one
    wide = torch.cat([t.reshape(-1).double() for step in report.results for shards in step for t in shards])
    narrow = torch.cat(
        [t.reshape(-1).to(torch.bfloat16).double() for step in report.results for shards in step for t in shards]
    )
    assert site.errors.elements == wide.numel() == STEPS * sum(torch.Size(s).numel() for s in SHAPES)
    assert bool((wide != 0).all())
    relative = (narrow - wide).abs() / wide.abs()
    assert site.errors.max_relative == float(relative.max()) > 0
    assert site.errors.mass == pytest.approx(float(relative.sum()), rel=1e-12)

    rs = next(i for i, s in enumerate(report.sites, 1) if s.op == "reduce_scatter_tensor")
    cast = report.sites.index(site) + 1
    promoted = blame(_train, 2, promote=[rs, cast])  # raised "different meshes" comparing DTensors before
    by_site = {p.sites[0]: p for p in promoted.promotions}
    assert by_site[rs].failed is None and by_site[rs].movement["parameters"].tensors == 2 * len(SHAPES)
    assert by_site[cast].unpromotable == [cast]  # FSDP2's all-gather input is a BF16 buffer: in place
    assert "local shard" in promoted.format()
    # the figures are the local shards' (dim 0 split over the 2 ranks), both ranks' together the full parameters
    for rank in (0, 1):
        local = [tuple(t.shape) for n, t in promoted.state["parameters"].items() if n.startswith(f"rank {rank} ")]
        assert local == [(s[0] // 2, *s[1:]) for s in SHAPES]
