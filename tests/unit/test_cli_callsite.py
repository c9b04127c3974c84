"""The one call-site rule (`simdist.callsite`): the first frame outside torch, simdist's machinery and wrappers."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from simdist import callsite


def _here() -> tuple[str, int, str]:
    frame = sys._getframe(1)
    return os.path.abspath(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name


def test_the_users_frame_is_the_first_outside_the_machinery(tmp_path):
    torch_file = os.path.join(os.path.dirname(torch.__file__), "functional.py")
    world_file = os.path.join(os.path.dirname(callsite.__file__), "world", "backend.py")
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
