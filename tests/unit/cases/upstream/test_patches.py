"""`simdist.cases.upstream.patches`: line edits guarded by the hash of the lines they replace, rendered as diffs."""

import hashlib

import pytest

from simdist.cases.upstream.patches import LineEdit, Patch, apply, patched_lines, unified_diff

ORIGINAL = ["def f(x):", "    y = x + 1", "    return y", "", "def g():", "    return 0"]


def _edit(first: int, last: int, new: tuple[str, ...], lines=ORIGINAL) -> LineEdit:
    digest = hashlib.sha256("\n".join(lines[first - 1 : last]).encode()).hexdigest()
    return LineEdit("pkg/mod.py", first, last, digest, new)


def test_edits_replace_their_ranges_bottom_up():
    patch = Patch("p", (_edit(2, 2, ("    y = x + 2", "    y *= 3")), _edit(6, 6, ("    return 1",))))
    assert patched_lines(patch, "pkg/mod.py", ORIGINAL) == [
        "def f(x):",
        "    y = x + 2",
        "    y *= 3",
        "    return y",
        "",
        "def g():",
        "    return 1",
    ]


def test_other_text_is_refused():
    patch = Patch("p", (_edit(2, 2, ("    y = x + 2",)),))
    changed = [*ORIGINAL]
    changed[1] = "    y = x + 1  # edited"
    with pytest.raises(ValueError, match=r"is not DeepSpeed 0\.19\.8's text"):
        patched_lines(patch, "pkg/mod.py", changed)
    shifted = ["# header", *ORIGINAL]  # the same line one further down: the range no longer holds it
    with pytest.raises(ValueError, match="is not DeepSpeed"):
        patched_lines(patch, "pkg/mod.py", shifted)
    with pytest.raises(ValueError, match="has 1 lines, the edit needs 2-2"):
        patched_lines(patch, "pkg/mod.py", ORIGINAL[:1])


def test_diff_and_apply_make_the_same_edit(tmp_path):
    """(``patch -p1`` applying the rendered diffs is checked in tests/integration/test_upstream_packages.py.)"""
    patch = Patch("p", (_edit(2, 3, ("    return x + 1",)), _edit(6, 6, ("    return 1",))))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/mod.py").write_text("\n".join(ORIGINAL) + "\n")
    diff = unified_diff(patch, tmp_path)
    assert diff.splitlines() == [
        "--- a/pkg/mod.py",
        "+++ b/pkg/mod.py",
        "@@ -1,6 +1,5 @@",
        " def f(x):",
        "-    y = x + 1",
        "-    return y",
        "+    return x + 1",
        " ",
        " def g():",
        "-    return 0",
        "+    return 1",
    ]
    apply(patch, tmp_path)
    assert (tmp_path / "pkg/mod.py").read_text() == "def f(x):\n    return x + 1\n\ndef g():\n    return 1\n"
    with pytest.raises(ValueError, match="has 5 lines, the edit needs 6-6"):  # applying twice is refused
        apply(patch, tmp_path)
