"""The one call-site rule (`simdist.callsite`): the first frame outside torch, simdist's machinery and wrappers."""

from __future__ import annotations

import functools
import os
import sys
import warnings

import pytest
import torch

from simdist import callsite


def _here() -> tuple[str, int, str]:
    frame = sys._getframe(1)
    return os.path.abspath(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name


def test_the_users_frame_is_the_first_outside_the_machinery(tmp_path):
    torch_file = os.path.join(os.path.dirname(torch.__file__), "functional.py")
    world_file = os.path.join(os.path.dirname(callsite.__file__), "world", "backend", "process_group.py")
    audit_file = os.path.join(os.path.dirname(callsite.__file__), "audit", "mode.py")
    blame_file = os.path.join(os.path.dirname(callsite.__file__), "attribution", "run.py")
    for internal in (
        torch_file,
        world_file,
        audit_file,
        blame_file,
        warnings.__file__,
        "<frozen importlib._bootstrap>",
    ):
        assert callsite.is_internal(internal), internal
    for own in (__file__, str(tmp_path / "train.py"), os.path.join(os.path.dirname(callsite.__file__), "cli", "x.py")):
        assert not callsite.is_internal(own), own
    assert callsite.is_internal(str(tmp_path / "lib" / "a.py"), callsite.internal_prefixes([str(tmp_path / "lib")]))


def test_site_of_walks_past_internal_frames():
    def inner():
        return callsite.site_of(sys._getframe(0))

    path, _, name = callsite.site_of(sys._getframe(0))
    assert (path, name) == (os.path.abspath(__file__), "test_site_of_walks_past_internal_frames")
    assert inner()[2] == "inner"
    assert callsite.site_of(sys._getframe(0), skip=[os.path.abspath(__file__)]) != inner()
    assert callsite.site_of(None) == callsite.NO_SITE


def test_the_rule_imports_neither_torch_nor_simdist():
    import ast

    with open(callsite.__file__) as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "simdist")}


def _machinery_chain(namespace: dict):
    """A callable whose stack runs user -> torch -> a decorator wrapper -> frozen import machinery ->
    simdist.world -> simdist.audit -> simdist.attribution (innermost), each frame compiled under such a file's name,
    so each rule meets one frame of every kind it must skip, innermost first. The innermost frame returns
    ``(world_site(frame), audit._site(), blame_site(frame))`` with those three from ``namespace``."""
    simdist_dir = os.path.dirname(callsite.__file__)
    files = [  # outermost first
        os.path.join(os.path.dirname(torch.__file__), "functional.py"),
        os.path.abspath(warnings.__file__),
        "<frozen importlib._bootstrap>",
        os.path.join(simdist_dir, "world", "backend.py"),
        os.path.join(simdist_dir, "audit", "ranks.py"),
        os.path.join(simdist_dir, "attribution", "collectives.py"),
    ]
    innermost = "return world_site(sys._getframe()), audit._site(), blame_site(sys._getframe())"
    call = None
    for filename in reversed(files):
        scope = {"sys": sys, **namespace}
        exec(
            compile(f"def level(call):\n    {innermost if call is None else 'return call()'}\n", filename, "exec"),
            scope,
        )
        call = functools.partial(scope["level"], call)
    return call


def test_the_world_the_audit_and_blame_name_the_same_frame_for_the_same_call():
    from simdist.attribution.run import Recorder
    from simdist.audit.mode import Audit
    from simdist.world.rendezvous.calls import site

    chain = _machinery_chain({"world_site": site, "audit": Audit(), "blame_site": Recorder().site_of})
    expected = _here()
    world_site, audit_site, blame_site = chain()  # the user's call
    expected = (expected[0], expected[1] + 1, expected[2])
    assert audit_site == blame_site == expected
    assert world_site == f"{expected[0]}:{expected[1]} in {expected[2]}"


def test_a_collective_through_the_audits_comm_is_named_at_the_users_line():
    """Was ``simdist/audit/ranks.py ... in _collective`` while the world's rule did not skip the audit."""
    from simdist.audit import Audit
    from simdist.audit.ranks import AuditedComm
    from simdist.world.errors import CollectiveMismatchError
    from simdist.world.simworld import SimWorld
    from simdist.world.spec import ParallelSpec

    lines: list[int] = []

    def prog(comm):
        x = torch.ones(4 + comm.get_rank())
        lines.append(sys._getframe().f_lineno + 1)
        AuditedComm(comm, Audit()).all_reduce(x)

    with pytest.raises(CollectiveMismatchError) as raised:
        SimWorld(ParallelSpec(2, tp=1, ep=1)).run(prog)
    assert f"at {os.path.abspath(__file__)}:{lines[0]} in prog" in str(raised.value)
    assert "audit" not in str(raised.value)


def test_the_audits_cache_tells_equal_code_of_two_files_apart(tmp_path):
    """Code objects compare equal across files (the filename is not part of equality): the audit's per-code cache
    of the rule's answer must not hand a torch frame's "skip" to the same code in the user's file."""
    from simdist.audit.mode import Audit

    audit, sites = Audit(), []
    user_file = str(tmp_path / "train.py")
    for filename in (os.path.join(os.path.dirname(torch.__file__), "functional.py"), user_file):
        scope: dict = {}
        exec(compile("def probe(audit):\n    return audit._site()\n", filename, "exec"), scope)
        sites.append(scope["probe"](audit))
    assert sites[0][2] == "test_the_audits_cache_tells_equal_code_of_two_files_apart"
    assert sites[1] == (user_file, 2, "probe")
