"""simdist.audit: exact reports on code with known rounding boundaries, the #8913 writeback named by the audit
of one real gradient-path step, and the audit inside autograd, SimWorld rank threads, gloo processes and the CLI."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import simdist
import simdist.gradpath.kernel
import simdist.sources.synthetic
from simdist.audit import AuditReport, audit, audited, narrows
from simdist.cli import build_parser
from simdist.cli.audit import run_audit
from simdist.cli.configs import AuditCommand
from simdist.cli.options import from_args
from simdist.gradpath.path import PathConfig, train_rank
from simdist.numerics.floats import bitwise_equal
from simdist.policies.catalogue import get_policy
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.studies.repro import run
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

HERE = str(Path(__file__).resolve())
GRADPATH = str(Path(simdist.gradpath.kernel.__file__).resolve())  # the stage logic (casts, optimizer)
SYNTHETIC = str(Path(simdist.sources.synthetic.__file__).resolve())
SPEC = ParallelSpec(4, tp=2, ep=2)


@pytest.fixture(autouse=True)
def _leaves_no_mode_behind():
    yield
    assert torch._C._len_torch_dispatch_stack() == 0 and threading.getprofile() is None


def _line(path: str, text: str) -> int:
    """The one line of ``path`` containing ``text`` (lines that look it up excepted), so edits elsewhere in
    the file do not break the tests."""
    lines = Path(path).read_text().splitlines()
    found = [i for i, line in enumerate(lines, 1) if text in line and "_at(" not in line and "_line(" not in line]
    assert len(found) == 1, f"{text!r} occurs {len(found)} times in {path}"
    return found[0]


def _at(path: str, text: str) -> str:
    return f"{path}:{_line(path, text)}"


# -- synthetic code with known boundaries -------------------------------------------


def known_boundaries(x64: torch.Tensor) -> torch.Tensor:
    """Three narrowing conversions and one narrow accumulation, among operations that narrow nothing."""
    x32 = x64.to(torch.float32)  # boundary: fp64 -> fp32
    low = x32.to(torch.bfloat16)  # boundary: fp32 -> bf16
    half = torch.empty(x32.shape, dtype=torch.float16)
    half.copy_(x32)  # boundary: fp32 -> fp16 by copy_
    acc = torch.zeros(x32.shape, dtype=torch.bfloat16)
    acc.add_(x32)  # boundary: fp32 added into bf16
    wide = low.float() + x32 + half.float()  # widening and same-dtype arithmetic
    total = x32.sum() + x64.sum()  # fp32 sum, then fp32 + fp64 -> fp64
    scaled = low * 0.5 + acc  # bf16 with a Python scalar, bf16 + bf16
    return wide.sum() + total + scaled.float().sum()


def test_known_boundaries_give_exactly_the_expected_report():
    x64 = torch.tensor([1 / 3, -2 / 3, 0.0, 1e-3, 12345.678], dtype=torch.float64)
    with audit() as a:
        known_boundaries(x64)
    report = a.report()
    expected = {
        (_at(HERE, "# boundary: fp64 -> fp32"), "cast", "fp64->fp32"),
        (_at(HERE, "# boundary: fp32 -> bf16"), "cast", "fp32->bf16"),
        (_at(HERE, "# boundary: fp32 -> fp16 by copy_"), "cast", "fp32->fp16"),
        (_at(HERE, "# boundary: fp32 added into bf16"), "accumulate", "bf16+fp32->bf16"),
    }
    assert report.keys() == expected
    assert report.keys(kinds=("collective",)) == set()
    assert report.total == 4 and len(report.records) == 4
    by_dtypes = {s.dtypes: s for s in report.sites}
    assert {s.function for s in report.sites} == {"known_boundaries"}
    assert by_dtypes["fp32->bf16"].op == "aten._to_copy" and by_dtypes["fp32->fp16"].op == "aten.copy_"
    assert by_dtypes["bf16+fp32->bf16"].op == "aten.add_" and by_dtypes["fp32->bf16"].shapes == [(5,)]
    for dtypes, unit in (
        ("fp64->fp32", 2.0**-24),
        ("fp32->bf16", 2.0**-8),
        ("fp32->fp16", 2.0**-11),
        ("bf16+fp32->bf16", 2.0**-8),
    ):
        assert 0 < by_dtypes[dtypes].max_rel_error <= unit, dtypes


def test_more_narrowing_ops_and_no_false_alarms():
    a32 = torch.tensor([0.1, 0.2, 0.3])
    b16 = torch.ones(3, dtype=torch.bfloat16)
    with audit(max_records=3) as a:
        a32.sum(dtype=torch.bfloat16)  # reduction requested in bf16
        torch.add(b16, a32, out=torch.empty(3, dtype=torch.bfloat16))  # out= narrower than an input
        stored = b16.clone().mul_(a32)  # in-place store (re-run in fp32 on copies for the error)
        a32.half().to(torch.bfloat16)  # fp32 -> fp16, then fp16 -> bf16 (fewer mantissa bits)
        b16.to(torch.float16)  # bf16 -> fp16 loses range
        b16.float().double()  # widening only
        torch.randn(3).to(torch.float32)  # no dtype change
        a32.to(torch.int32)  # not a floating conversion
        torch.ones(3, device="meta").to(torch.bfloat16)  # recorded, no error computable
    report = a.report()
    assert torch.equal(stored, b16 * a32.to(torch.bfloat16)) and stored.dtype == torch.bfloat16
    assert report.total == 7 and len(report.records) == 3 and report.dropped == 4
    kinds = {(s.op, s.kind, s.dtypes) for s in report.sites}
    assert kinds == {
        ("aten.sum", "accumulate", "fp32->bf16"),
        ("aten.add", "accumulate", "bf16+fp32->bf16"),
        ("aten.mul_", "store", "bf16+fp32->bf16"),
        ("aten._to_copy", "cast", "fp32->fp16"),
        ("aten._to_copy", "cast", "fp16->bf16"),
        ("aten._to_copy", "cast", "bf16->fp16"),
        ("aten._to_copy", "cast", "fp32->bf16"),
    }
    assert [s.max_rel_error for s in report.sites if (s.kind, s.dtypes) == ("cast", "fp32->bf16")] == [None]
    assert narrows(torch.float16, torch.bfloat16) and narrows(torch.bfloat16, torch.float16)
    assert not narrows(torch.bfloat16, torch.float32) and not narrows(torch.float32, torch.float32)


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=16))
def test_reported_error_is_the_largest_relative_rounding_error(values):
    x = torch.tensor(values, dtype=torch.float32)
    with audit() as a:
        y = x.to(torch.bfloat16)
    (site,) = a.report().sites
    errors = [
        abs(float(n) - float(w)) / abs(float(w)) if math.isfinite(float(n)) else math.inf
        for n, w in zip(y.tolist(), values, strict=True)
        if w != 0 and math.isfinite(w)
    ]
    assert site.max_rel_error == max(errors, default=0.0)


def test_skip_attributes_a_record_to_the_next_frame_outward():
    grads = SyntheticGradients(SPEC)
    with audit() as inside, audit(skip=("simdist.sources.synthetic",)) as outside:
        grads(0, 0, 0, DEFAULT_PARAMS[0])  # here
    assert {s.function for s in inside.report().sites} == {"_normal"}
    assert {s.file for s in inside.report().sites} == {SYNTHETIC}
    assert {s.where for s in outside.report().sites} == {_at(HERE, "grads(0, 0, 0, DEFAULT_PARAMS[0])  # here")}


# -- the gradient path: #8913's writeback named --------------------------------------


def _one_step(policy: str) -> AuditReport:
    world = SimWorld(SPEC, reduction=Gloo())
    args = (
        list(DEFAULT_PARAMS),
        InitialWeights(SPEC),
        SyntheticGradients(SPEC),
        get_policy(policy),
        PathConfig(steps=1),
    )
    ranks = world.run(audited(train_rank), *args)
    assert [report.rank for _, report in ranks] == [0, 1, 2, 3]
    for plain, (traced, _) in zip(world.run(train_rank, *args), ranks, strict=True):  # the audit changes no bit
        assert plain.values.keys() == traced.values.keys()
        assert all(bitwise_equal(plain.values[k], traced.values[k]) for k in plain.values)
    return AuditReport.merge(report for _, report in ranks)


def test_bf16_writeback_names_the_writeback_and_fp32_staging_has_none():
    writeback, copy_back = _at(GRADPATH, "return value.to(stage.dtype)"), _at(GRADPATH, "self.lp.copy_(self.master)")
    reports = {name: _one_step(name) for name in ("bf16_writeback", "fp32_staging")}
    in_gradpath = {
        name: {(s.where, s.kind, s.op) for s in r.narrowings("fp32", "bf16") if s.file == GRADPATH}
        for name, r in reports.items()
    }
    assert in_gradpath["bf16_writeback"] == {(writeback, "cast", "aten._to_copy"), (copy_back, "cast", "aten.copy_")}
    assert in_gradpath["fp32_staging"] == {(copy_back, "cast", "aten.copy_")}
    site = next(s for s in reports["bf16_writeback"].sites if s.where == writeback and s.dtypes == "fp32->bf16")
    assert site.function == "apply_stage" and site.ranks == [0, 1, 2, 3] and 0 < site.max_rel_error <= 2.0**-8
    for report in reports.values():  # every other fp32 -> bf16 narrowing generates the synthetic data
        assert {s.file for s in report.narrowings()} == {GRADPATH, SYNTHETIC}
        tp = [
            s for s in report.sites if s.kind == "collective" and s.context == "group=tp" and s.function == "all_reduce"
        ]
        assert [(s.op, s.dtypes) for s in tp] == [("comm.all_reduce", "fp32")]


def test_following_threads_audits_an_unmodified_run():
    with audit(threads=True) as a:
        run(SPEC, get_policy("bf16_writeback"), PathConfig(steps=1), Gloo())
    sites = {(s.where, s.dtypes): s for s in a.report().sites}
    site = sites[(_at(GRADPATH, "return value.to(stage.dtype)"), "fp32->bf16")]
    assert site.ranks == [0, 1, 2, 3]


# -- autograd and threads -------------------------------------------------------------


def test_backward_formulas_and_gradient_hooks_are_audited():
    x = torch.linspace(-1, 1, 8, requires_grad=True)

    def hook(grad):
        return grad.to(torch.bfloat16).to(grad.dtype)  # hook rounds the gradient

    with audit() as forward_only:
        h = x.double()  # widening forward; its backward narrows the fp64 gradient to fp32
        h.register_hook(hook)
        loss = (h / 3).sum()
    with audit() as a:
        loss.backward()  # backward call
    assert forward_only.report().sites == []
    sites = {(s.where, s.dtypes): s.context for s in a.report().sites}
    assert sites == {
        (_at(HERE, "# hook rounds the gradient"), "fp64->bf16"): "backward:ToCopyBackward0",
        (_at(HERE, "loss.backward()  # backward call"), "fp64->fp32"): "backward:ToCopyBackward0",
    }
    x.grad = None
    loss = (x.double() / 3).sum()
    with audit() as before:
        pass
    loss.backward()  # outside any audit: nothing is recorded
    assert before.report().sites == []


def _narrow_in_thread():
    torch.full((3,), 1 / 3, dtype=torch.float64).float()  # thread narrows


def test_threads_are_audited_only_when_followed():
    with audit() as a:
        t = threading.Thread(target=_narrow_in_thread)
        t.start()
        t.join()
    assert a.report().sites == []
    with audit(threads=True) as b:
        t = threading.Thread(target=_narrow_in_thread, name="simdist-rank-3")
        t.start()
        t.join()
    (site,) = b.report().sites
    assert site.where == _at(HERE, "# thread narrows") and site.ranks == [3]


def ranks_program(comm):
    rank = comm.get_rank()
    x = torch.full((4,), 1 / 3 + rank)
    low = x.to(torch.bfloat16)  # every rank
    if rank == 1:
        x.double().float()  # rank 1 only
    comm.all_reduce(low, group=comm.group("tp"))  # bf16 collective
    return float(low[0])


def test_simworld_ranks_record_into_their_own_reports():
    results = SimWorld(ParallelSpec(4, tp=2, ep=1)).run(audited(ranks_program))
    every, only, collective = (_at(HERE, "# every rank"), _at(HERE, "# rank 1 only"), _at(HERE, "# bf16 collective"))
    for rank, (_, report) in enumerate(results):
        assert report.rank == rank and {r.rank for r in report.records} == {rank}
        keys = {(s.where, s.kind, s.dtypes) for s in report.sites}
        expected = {(every, "cast", "fp32->bf16"), (collective, "collective", "bf16")}
        assert keys == (expected | {(only, "cast", "fp64->fp32")} if rank == 1 else expected)
    merged = AuditReport.merge(report for _, report in results)
    counts = {(s.where, s.op, s.context): (s.count, s.ranks) for s in merged.sites}
    assert counts == {
        (every, "aten._to_copy", ""): (4, [0, 1, 2, 3]),
        (only, "aten._to_copy", ""): (1, [1]),
        (collective, "comm.all_reduce", "group=tp"): (4, [0, 1, 2, 3]),
    }  # the simulated reduction runs paused: nothing is charged to the rank that completes it
    assert AuditReport.from_dict(merged.to_dict()) == merged


# -- real gloo processes ---------------------------------------------------------------


def _reduce_bf16(comm):
    x = torch.tensor([1.0, 3.0], dtype=torch.bfloat16) * (comm.get_rank() + 1)
    comm.all_reduce(x)  # wrapped all_reduce
    return x


def gloo_rank(comm):
    """Rank program: a bf16 all_reduce under a plain audit (c10d op) and under `audited` (comm op)."""
    x = torch.tensor([1.0, 3.0], dtype=torch.bfloat16) * (comm.get_rank() + 1)
    with audit(rank=comm.get_rank(), skip=("simdist",)) as a:
        comm.all_reduce(x)  # raw all_reduce
    _, wrapped = audited(_reduce_bf16)(comm)
    return {"raw": a.report().to_dict(), "wrapped": wrapped.to_dict()}


@pytest.mark.gloo
@pytest.mark.slow  # by default: the audit on real gloo (next test) and raw dist.all_reduce sites (CLI test below)
def test_gloo_collectives_are_recorded_with_their_dtype():
    results = simdist.run(gloo_rank, ParallelSpec(2, tp=1, ep=1), api="comm", where="gloo", timeout_s=120)
    for rank, result in enumerate(results):
        raw = AuditReport.from_dict(result["raw"])
        assert [(s.op, s.kind, s.dtypes, s.where, s.ranks) for s in raw.sites] == [
            ("c10d.allreduce_", "collective", "bf16", _at(HERE, "# raw all_reduce"), [rank])
        ]
        wrapped = AuditReport.from_dict(result["wrapped"])
        assert [(s.op, s.dtypes, s.where, s.context) for s in wrapped.sites] == [
            ("comm.all_reduce", "bf16", _at(HERE, "# wrapped all_reduce"), "group=world")
        ]


def gradpath_step(comm):
    """Rank program: one audited bf16_writeback step; the report as plain data."""
    _, report = audited(train_rank)(
        comm,
        list(DEFAULT_PARAMS),
        InitialWeights(SPEC),
        SyntheticGradients(SPEC),
        get_policy("bf16_writeback"),
        PathConfig(steps=1),
    )
    return report.to_dict()


@pytest.mark.gloo
@pytest.mark.slow  # seconds of the default suite; CI runs it with the slow tests
def test_one_rank_program_gives_the_same_report_on_gloo_and_in_simworld():
    real = [AuditReport.from_dict(d) for d in simdist.run(gradpath_step, SPEC, api="comm", where="gloo", timeout_s=120)]
    simulated = [AuditReport.from_dict(d) for d in SimWorld(SPEC, reduction=Gloo()).run(gradpath_step)]
    for a, b in zip(real, simulated, strict=True):
        assert a.rank == b.rank and a.sites == b.sites  # same sites, counts, dtypes and rounding errors


# -- command line -------------------------------------------------------------------------

SCRIPT = """\
import sys, torch
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec
x = torch.full((3,), 1 / 3)
y = x.to(torch.bfloat16)
print("script args", sys.argv[1:])
SimWorld(ParallelSpec(2, tp=1, ep=1)).run(lambda comm: x.double().half())
sys.exit(3 if "--fail" in sys.argv else 0)
"""


def _cli(argv: list[str]) -> AuditCommand:
    return from_args(AuditCommand, build_parser().parse_args(argv))


def test_cli_runs_a_script_and_prints_its_sites(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert run_audit(_cli(["audit", str(script), "one", "--fail"])) == 3
    out = capsys.readouterr().out
    assert "script args ['one', '--fail']" in out
    lines = {line.split()[3]: line for line in out.splitlines() if str(script) in line and "aten." in line}
    assert set(lines) == {"fp32->bf16", "fp64->fp16"}  # the second one in SimWorld's rank threads
    assert f"{script}:5 in <module>" in lines["fp32->bf16"] and lines["fp32->bf16"].split()[0] == "1"
    assert f"{script}:7 in <lambda>" in lines["fp64->fp16"] and "[ranks 0-1]" in lines["fp64->fp16"]
    assert run_audit(_cli(["audit", "--json", "--no-errors", str(script)])) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert "script args []" in captured.err
    assert {(s["where"], s["dtypes"], tuple(s["ranks"])) for s in data["sites"]} == {
        (f"{script}:5", "fp32->bf16", ()),
        (f"{script}:7", "fp64->fp16", (0, 1)),
    }
    assert all(s["max_rel_error"] is None for s in data["sites"])
    with pytest.raises(ValueError, match="no such script"):
        run_audit(_cli(["audit", str(tmp_path / "missing.py")]))


WORLDS_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import simdist
from simdist.reduce import make_reduction
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec


def sim_rank(comm):
    x = torch.full((4,), float(comm.get_rank()), dtype=torch.bfloat16)
    comm.all_reduce(x, group=comm.group("tp"))  # SimWorld's Comm
    return x


def backend_rank(rank):
    x = torch.full((4,), float(rank), dtype=torch.float16)
    dist.all_reduce(x)  # the simdist torch.distributed backend
    return x


SimWorld(ParallelSpec(2, tp=2, ep=1), reduction=make_reduction("upcast")).run(sim_rank)  # sums in FP32
simdist.run(backend_rank, 2)
code = sys.argv[1] if sys.argv[1:] else None
sys.exit(int(code) if code and code.isdigit() else code)
"""


def test_cli_reports_collectives_of_simworld_and_the_simdist_backend_and_passes_exit_through(tmp_path, capsys):
    from simdist.cli import main

    script = tmp_path / "worlds.py"
    script.write_text(WORLDS_SCRIPT)
    assert main(["audit", "--no-errors", str(script), "the script's own message"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == "the script's own message"  # sys.exit("msg"): printed, status 1
    sites = {line.split()[2]: line for line in captured.out.splitlines() if line.split()[1:2] == ["collective"]}
    assert set(sites) == {"comm.all_reduce", "dist.all_reduce"}
    # the upcast reduction's FP32 -> BF16 rounding runs on the rank that completes the collective, paused: not charged
    assert "2 sites, 4 events, ranks 0-1" in captured.out
    comm, backend = sites["comm.all_reduce"], sites["dist.all_reduce"]
    assert f"{_at(str(script), '# SimWorld')} in sim_rank" in comm and "bf16" in comm
    assert "[group=tp; ranks 0-1]" in comm and comm.split()[0] == "2"
    assert f"{_at(str(script), '# the simdist torch')} in backend_rank" in backend and "fp16" in backend
    assert "backend simdist; ranks 0-1]" in backend
    assert main(["audit", "--no-errors", "--top", "1", str(script), "7"]) == 7  # sys.exit(7): the script's code
    out = capsys.readouterr().out
    assert "exit status 7" in out and out.rstrip().endswith("... 1 more sites")
    assert main(["audit", "--no-errors", "--top", "2", str(script)]) == 0
    assert "more sites" not in capsys.readouterr().out


def test_example_script_reports_the_writeback_as_the_readme_shows(capsys):
    """README's example block, line numbers left out, is what ``experiments/audit_example.py`` prints now."""
    import re
    import runpy

    root = Path(__file__).resolve().parents[2]
    namespace = runpy.run_path(str(root / "experiments" / "audit_example.py"))
    assert namespace["main"]([]) == 0
    out = capsys.readouterr().out
    assert f"simdist/gradpath/kernel.py:{_line(GRADPATH, 'return value.to(stage.dtype)')} in apply_stage" in out
    printed = out.replace(str(Path(simdist.__file__).resolve().parent.parent) + "/", "")
    printed = re.sub(r"(\.py):\d+", r"\1", printed)
    readme = (root / "docs" / "howto" / "audit-and-blame.md").read_text()
    block = readme[readme.index("(`python experiments/audit_example.py`)") :]
    block = block[block.index("```\n") + 4 : block.index("\n```", block.index("```\n") + 4)]
    rows = [line for line in block.splitlines() if line.strip() != "..."]
    assert len(rows) >= 7
    for row in rows:
        assert row in printed.splitlines(), row


@pytest.mark.slow
def test_the_audit_command_exits_with_the_scripts_status_not_an_abort(tmp_path):
    """Followed rank threads used to hold the audit in C++ thread-local state past interpreter finalization:
    ``simdist audit`` of a SimWorld script aborted at exit (status 134) in about half of the runs."""
    import subprocess
    import sys

    script = tmp_path / "worlds.py"
    script.write_text(WORLDS_SCRIPT)
    for _ in range(6):
        done = subprocess.run(
            [sys.executable, "-m", "simdist.cli", "audit", "--no-errors", str(script), "5"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 5, done.stderr[-500:]
