"""``simdist blame --processes`` on an unmodified DeepSpeed AutoEP+AutoTP BF16_Optimizer training script
(``experiments/blame_deepspeed_autoep.py``, real DeepSpeed 0.19.8 on 4 simdist rank processes): the #8913
writeback in ``auto_ep_folding.py`` is a top site, and promoting it gives the FP32 masters of the fixed run,
bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from simdist.extras import installed, not_installed_reason

if not installed("deepspeed"):  # found, not imported: only the ranks import it
    pytest.skip(not_installed_reason("deepspeed"), allow_module_level=True)

from simdist.attribution.processes import blame_processes

SCRIPT = str(Path(__file__).resolve().parents[2] / "experiments" / "blame_deepspeed_autoep.py")
CORRECTED = 64 + 64 + 256 + 16
"""Elements the folding helper averages over TP per rank and step: both routers, the dense weight and norm."""
ROUTERS = 64 + 64
"""The routers' elements: the first of the dense parameter group's flat buffer."""


def _writeback_line() -> str:
    """``module_inject/auto_ep_folding.py:LINE`` of the writeback in the installed DeepSpeed (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "module_inject" / "auto_ep_folding.py"
    lines = source.read_text().splitlines()
    (line,) = [i for i, text in enumerate(lines, 1) if "copy_(reduced.to(grad_data.dtype))" in text]
    return f"module_inject/auto_ep_folding.py:{line}"


def _masters(state: dict) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.int32) for name, t in state["parameters"].items()}


@pytest.mark.slow
def test_the_writeback_is_a_top_site_and_its_promotion_gives_the_fixed_runs_masters():
    shipped = blame_processes(SCRIPT, [], 4, promote=[_writeback_line()])
    fixed = blame_processes(SCRIPT, ["--fix"], 4)

    writeback = [i for i, s in enumerate(shipped.sites, 1) if s.file.endswith("module_inject/auto_ep_folding.py")]
    assert len(writeback) == 1
    site = shipped.site(writeback[0])
    assert writeback[0] <= 3, shipped.format()
    assert (site.kind, site.op, site.dtypes) == ("cast", "to", "fp32->bf16")
    assert site.function == "reduce_autoep_folding_gradient"
    assert site.ranks == {0, 1, 2, 3}
    assert site.errors.elements == CORRECTED * 4 * 2  # 4 ranks, 2 steps
    assert 0 < site.errors.max_ulp <= 0.5 and site.errors.mass > 0
    assert not any(s.file.endswith("auto_ep_folding.py") for s in fixed.sites)  # the fix never writes back

    base, fix = _masters(shipped.state), _masters(fixed.state)
    (promotion,) = shipped.promotions
    promoted = _masters(promotion.state)
    assert base.keys() == fix.keys() == promoted.keys() and len(base) == 8  # 4 ranks x (dense, expert) partitions
    moved = {k: (base[k] != fix[k]).nonzero().flatten() for k in base}
    # power: as shipped, the masters differ -- only in the routers' elements (the first 2 x 64 of the dense
    # partition that ranks 0 and 1 hold)
    assert sum(len(v) for v in moved.values()) > 200
    assert all(int(v.max()) < ROUTERS for v in moved.values() if len(v))
    assert {k.split(" optimizer")[0] for k, v in moved.items() if len(v)} == {"rank 0", "rank 1"}
    for name in base:
        assert torch.equal(promoted[name], fix[name]), name
