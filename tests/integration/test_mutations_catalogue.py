"""bench/mutations.py stays usable: every catalogue entry still applies to the source, names tests that exist,
and a mutation is reported killed or surviving as pytest says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("simdist_bench_mutations", ROOT / "bench" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


mutations = _load()


def test_every_mutation_applies_to_the_current_source_and_names_existing_tests():
    """An entry whose ``old`` text no longer occurs ``count`` times would be reported as an error, not run: the
    catalogue is fixed in the same commit as the code it mutates."""
    names = [m.name for m in mutations.CATALOGUE]
    assert len(names) == len(set(names))
    for m in mutations.CATALOGUE:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == m.count, m.name
        assert m.old != m.new, m.name
        for test in m.tests:
            assert (ROOT / test.split("::")[0]).exists(), (m.name, test)
        assert not (m.equivalent and m.awaiting), m.name


def test_apply_refuses_an_edit_that_does_not_match(tmp_path):
    (tmp_path / "x.py").write_text("a = 1\na = 1\n")
    twice = mutations.Mutation("t", "twice", "x.py", "a = 1", "a = 2", ("tests",))
    with pytest.raises(ValueError, match="occurs 2 times"):
        twice.apply(tmp_path)
    mutations.Mutation("t", "twice", "x.py", "a = 1", "a = 2", ("tests",), count=2).apply(tmp_path)
    assert (tmp_path / "x.py").read_text() == "a = 2\na = 2\n"


@pytest.mark.slow
def test_a_mutation_is_killed_and_the_tree_restored(tmp_path):
    """End to end on a private tree: the Sequential model folded backwards dies in the test that pins the
    one-chunk fold order, an edit of a docstring survives, and the mutated file is restored after each run."""
    tree = mutations.make_tree(tmp_path / "tree")
    original = (tree / "simdist/reduce/textbook.py").read_text()
    killer = next(m for m in mutations.CATALOGUE if m.name == "sequential-reversed")
    pinned = "tests/integration/test_gloo_reduction.py::test_small_lengths_fold_in_descending_rank_order"
    killed = mutations.run_one(killer, tree, (pinned,), 600)
    assert killed.status == "killed" and killed.killed_by == [pinned], killed
    assert (tree / "simdist/reduce/textbook.py").read_text() == original
    comment = mutations.Mutation(
        "comment", "a docstring word", "simdist/reduce/textbook.py", "textbook", "schoolbook", ("tests",)
    )
    survived = mutations.run_one(comment, tree, ("tests/unit/reduce/test_textbook.py",), 600)
    assert survived.status == "survived", survived
    assert (tree / "simdist/reduce/textbook.py").read_text() == original


@pytest.mark.slow
def test_the_native_kernel_tests_pass_in_a_private_tree_without_an_installed_extension(tmp_path):
    """A private tree carries no built extension (``*.so`` is not copied: its kernel is built from its own
    ``_fold.c`` on first use), so the native kernel's tests must hold there too, or the baseline of every run that
    selects them fails (it did: a test read the kernel's status after faking an installed extension)."""
    tree = mutations.make_tree(tmp_path / "tree")
    assert not list((tree / "simdist").rglob("*.so"))
    code, output = mutations.run_pytest(tree, (mutations.NATIVE,), 600)
    assert code == 0, output[-3000:]
