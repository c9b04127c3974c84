"""``simdist blame --nproc N --processes``: a torchrun-style script with a module-global group on simdist rank
processes, its per-rank records merged into the table thread mode gives; promotion through a narrow buffer."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.distributed as dist

from simdist.attribution import blame
from simdist.attribution.measure import Errors, SiteErrors
from simdist.attribution.processes import merge
from simdist.cli import main

SCRIPT = '''
"""Ranks draw different values; the group is a module global (as DeepSpeed's and Megatron's are)."""
import torch
import torch.distributed as dist

GROUP = None


def main():
    global GROUP
    dist.init_process_group("gloo")
    GROUP = dist.new_group(list(range(dist.get_world_size())))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    master = torch.randn(48, generator=torch.Generator().manual_seed(0)).requires_grad_()
    opt = torch.optim.SGD([master], lr=0.1)
    for _ in range(2):
        x = torch.randn(48, generator=g) * torch.exp2(torch.randint(-12, 12, (48,), generator=g).float())
        loss = (master * x).to(torch.bfloat16).float().sum()
        loss.backward()
        grad = master.grad.to(torch.bfloat16)
        dist.all_reduce(grad, group=GROUP)
        master.grad = grad.float() / 3
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

EXACT = ("file", "line", "function", "kind", "op", "dtypes", "ranks", "groups", "calls", "elements", "nonfinite")
MAXIMA = ("max_ulp", "max_err_over_sum_abs_terms", "max_rel_err")


def _json(capsys, argv: list[str]) -> dict:
    assert main(["blame", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_process_mode_gives_thread_modes_sites_with_every_rank_merged(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    processes = _json(capsys, ["--nproc", "2", "--processes", str(script)])
    threads = _json(capsys, ["--nproc", "2", str(script)])
    assert len(processes["sites"]) == len(threads["sites"]) >= 3
    kinds = {s["kind"] for s in processes["sites"]}
    assert kinds == {"cast", "collective"}
    for p, t in zip(processes["sites"], threads["sites"], strict=True):
        for key in EXACT + MAXIMA + ("by_rank",):
            assert p[key] == t[key], (key, p, t)
        assert p["ranks"] == [0, 1]
        assert p["error_mass"] == pytest.approx(t["error_mass"], rel=1e-13)
        per_rank = p["by_rank"]
        assert set(per_rank) == {"0", "1"}
        assert p["elements"] == sum(r["elements"] for r in per_rank.values())
        for key in ("max_ulp", "max_err_over_sum_abs_terms"):
            assert p[key] == max(r[key] for r in per_rank.values())
    rounding = [s for s in processes["sites"] if s["error_mass"] > 0 and s["kind"] == "cast"]
    assert rounding and all(s["by_rank"]["0"] != s["by_rank"]["1"] for s in rounding)  # the ranks' data differ


def test_merge_adds_counts_and_masses_and_keeps_the_largest_maxima():
    def site(rank: int, found: Errors) -> SiteErrors:
        s = SiteErrors("t.py", 3, "f", "cast", "to", "fp32->bf16")
        s.add(rank, 0, found, "world")
        return s

    a = Errors(elements=4, nonfinite=1, overflow=1, max_ulp=0.5, max_term_relative=1e-3, max_relative=2e-3, mass=0.25)
    b = Errors(elements=6, max_ulp=0.25, max_term_relative=3e-3, max_relative=1e-3, mass=0.5)
    record = {"promoted": {}, "unpromotable": {}, "sharded": False}
    merged = merge(
        [
            {**record, "sites": [site(0, a)], "state": {"parameters": {"rank 0 p": torch.zeros(1)}}},
            {**record, "sites": [site(1, b)], "state": {"parameters": {"rank 1 p": torch.ones(1)}}},
        ]
    )
    (only,) = merged.sites.values()
    assert only.calls == 2 and only.ranks == {0, 1}
    e = only.errors
    assert (e.elements, e.nonfinite, e.overflow, e.mass) == (10, 1, 1, 0.75)
    assert (e.max_ulp, e.max_term_relative, e.max_relative) == (0.5, 3e-3, 2e-3)
    assert only.by_rank[0] == a and only.by_rank[1] == b
    assert set(merged.state["parameters"]) == {"rank 0 p", "rank 1 p"}
    with pytest.raises(ValueError, match="same final-state tensor"):
        merge([{**record, "sites": [], "state": {"parameters": {"p": torch.zeros(1)}}}] * 2)


def _writeback(rank: int, variant: str) -> None:
    """A gradient averaged in FP32, written back into a BF16 buffer and widened again (the #8913 shape);
    ``fix``: the FP32 value used directly; ``stale``: the buffer is changed before it is widened."""
    g = torch.Generator().manual_seed(20 + rank)
    master = torch.zeros(64)
    opt = torch.optim.SGD([master], lr=1.0)
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(2):
        scale = torch.exp2(torch.randint(-8, 8, (64,), generator=g).float())
        reduced = (torch.randn(64, generator=g) * scale).to(torch.bfloat16).float()
        dist.all_reduce(reduced)
        reduced /= 3  # an FP32 average that BF16 cannot hold
        if variant == "fix":
            hp = reduced
        else:
            buffer.copy_(reduced.to(torch.bfloat16))  # WRITEBACK
            if variant == "stale":
                buffer.mul_(2)
            hp = buffer.float() / (2 if variant == "stale" else 1)
        master.grad = hp
        opt.step()


WRITEBACK = next(i for i, text in enumerate(inspect.getsource(_writeback).splitlines()) if "# WRITEBACK" in text)


def _bits(state: dict) -> dict:
    return {k: v.view(torch.int32) for k, v in state["parameters"].items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_promoted_writeback_reaches_the_wide_buffer_as_the_fix_does():
    line = inspect.getsourcelines(_writeback)[1] + WRITEBACK
    spec = f"test_blame_processes.py:{line}"
    shipped = blame(_writeback, 2, args=("writeback",), promote=[spec])
    fixed = blame(_writeback, 2, args=("fix",))
    (promotion,) = shipped.promotions
    assert promotion.events > 0
    assert not _equal(_bits(shipped.state), _bits(fixed.state))  # power: the writeback rounds
    assert _equal(_bits(promotion.state), _bits(fixed.state))
    stale = blame(_writeback, 2, args=("stale",), promote=[spec])  # the buffer changed: its widening is not replaced
    assert _equal(_bits(stale.promotions[0].state), _bits(stale.state))
    assert not math.isnan(stale.total_mass)


def test_processes_without_nproc_is_refused_before_the_run(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    assert main(["blame", "--processes", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--nproc" in err and "the script ran" not in err


def test_the_forkserver_preloads_the_frameworks_a_script_imports(tmp_path):
    from simdist.attribution.processes import frameworks_of
    from simdist.cases.ranks import DEEPSPEED_MODULES
    from simdist.extras import installed

    plain, framework = tmp_path / "plain.py", tmp_path / "ds.py"
    plain.write_text(SCRIPT + "# deepspeed is mentioned, not imported\n")
    framework.write_text("import torch\nfrom deepspeed.utils import groups\n")
    assert frameworks_of(str(plain)) == ()
    assert frameworks_of(str(framework)) == (DEEPSPEED_MODULES if installed("deepspeed") else ())


def test_a_script_importing_a_module_global_framework_runs_in_processes_by_itself(tmp_path, capsys, monkeypatch):
    """``blame --nproc N ds_script.py`` (no ``--processes``): DeepSpeed's groups are module globals, which rank
    threads would share, so the ranks are processes, said in one line on stderr; a plain script stays on threads."""
    import simdist.attribution.processes as processes
    from simdist.cases.ranks import DEEPSPEED_MODULES

    launched: list[str] = []

    def recording(script, argv, nproc, **kwargs):
        launched.append(script)
        raise processes.ScriptExit(7, "stopped before the launch")

    monkeypatch.setattr(processes, "blame_processes", recording)
    monkeypatch.setattr(processes, "frameworks_of", lambda script: DEEPSPEED_MODULES if "ds" in script else ())
    framework = tmp_path / "ds.py"
    framework.write_text("import deepspeed\n")
    assert main(["blame", "--nproc", "2", str(framework)]) == 7
    assert launched == [str(framework)]
    assert "its ranks run as processes" in capsys.readouterr().err
    plain = tmp_path / "plain.py"
    plain.write_text(SCRIPT)
    main(["blame", "--nproc", "2", str(plain)])
    assert launched == [str(framework)]  # threads: the process launcher was not called
