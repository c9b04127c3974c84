"""The import graph of simdist: no cycles (lazy imports included) and no upward imports between the layers.

Every module under ``simdist/`` (``simdist.policies`` included) is parsed with `ast`; each ``import`` and
``from ... import`` of a simdist module is an edge, at module level or inside a function (a lazy import still
ties the two modules together). Imports under ``if TYPE_CHECKING:`` never run and are not edges. The layer
order is read from the ``layers`` block of docs/ARCHITECTURE.md (lowest first): a module may import its own
layer and the layers below it; the deliberate lazy upward imports ARCHITECTURE names are the only exceptions
(`ALLOWED_UPWARD`, each checked to still exist and to stay inside a function).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

ALLOWED_UPWARD = {
    ("simdist.studies.repro", "simdist.cases.deepspeed.issue_8913"): "only `simdist repro 8913 --code deepspeed` "
    "drives the real DeepSpeed case",
    ("simdist.cases.deepspeed.engine", "simdist.audit"): "the rank processes of the real engine run the audit "
    "(the narrowing sites of DeepSpeed)",
}
"""(importer, imported) -> why: the lazy upward imports docs/ARCHITECTURE.md names, and nothing else."""

PACKAGE_ROOT = "simdist"
"""``simdist/__init__.py`` (`DISTRIBUTION`, the backend registration, lazy ``spawn``/``blame``) is outside the
layers: Python runs it before any submodule, so importing it cannot reorder anything, and it may reach every layer
(it is the package's front door)."""


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``simdist.policies`` included; a folder without
    ``__init__.py``, such as ``simdist/cases/reproducers/``, holds package data, not modules)."""
    modules = {}
    for folder, subfolders, files in os.walk(root / "simdist"):
        if "__init__.py" not in files:
            subfolders[:] = []
            continue
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, modules: dict[str, Path], type_only: bool = False) -> dict[str, bool]:
    """The simdist modules ``module`` imports -> whether every such import is inside a function (lazy); with
    ``type_only``, the imports under ``if TYPE_CHECKING:`` too (they never run, but a circle of them is still two
    modules that need each other)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: dict[str, bool] = {}

    def add(target: str, lazy: bool) -> None:
        if target != module:
            found[target] = found.get(target, True) and lazy

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "simdist" or alias.name.startswith("simdist."):
                    add(alias.name, lazy)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "simdist" or source.startswith("simdist."):
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    add(sub if sub in modules else source, lazy)
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def import_graph(root: Path = ROOT, type_only: bool = False) -> dict[str, dict[str, bool]]:
    """importer -> {imported: lazy}, for every module of the package (``type_only``: `imports_of`'s)."""
    modules = module_files(root)
    return {name: imports_of(name, path, modules, type_only) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layers(text: str | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The ``layers`` block of docs/ARCHITECTURE.md: ``(name, module prefixes)``, lowest layer first."""
    text = ARCHITECTURE.read_text(encoding="utf-8") if text is None else text
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        if line.strip():
            name, prefixes = line.split(":", 1)
            out.append((name.strip(), tuple(prefixes.split())))
    return out


def layer_of(module: str, table: list[tuple[str, tuple[str, ...]]]) -> int | None:
    """The index of the layer whose longest prefix matches ``module`` (None for the package root)."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = i, len(prefix)
    return best


def upward_imports(graph: dict[str, dict[str, bool]], table) -> dict[tuple[str, str], bool]:
    """(importer, imported) -> lazy, for every import into a higher layer (the package root aside)."""
    out = {}
    for importer, imported in graph.items():
        for target, lazy in imported.items():
            if PACKAGE_ROOT in (importer, target):
                continue
            low, high = layer_of(importer, table), layer_of(target, table)
            if low is not None and high is not None and high > low:
                out[(importer, target)] = lazy
    return out


def private_imports(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer, source) -> the private names (``_x``, not dunders) ``from source import`` brings across."""
    out = {}
    for module, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("simdist"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if names:
                    out[(module, node.module)] = names
    return out


def test_every_module_is_in_a_layer():
    table = layers()
    assert [name for name, _ in table][:4] == ["errors", "optional frameworks", "numerics", "reductions"], table
    unplaced = sorted(m for m in module_files() if m != PACKAGE_ROOT and layer_of(m, table) is None)
    assert not unplaced, f"modules in no layer of docs/ARCHITECTURE.md: {unplaced}"


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100 and "simdist.policies.bf16_only" in graph  # the walk sees the whole package
    assert not cycles(graph), f"import cycles (lazy imports included): {cycles(graph)}"
    typed = import_graph(type_only=True)
    assert not cycles(typed), f"import cycles through imports under TYPE_CHECKING: {cycles(typed)}"


def test_no_upward_imports_but_the_named_lazy_ones():
    up = upward_imports(import_graph(), layers())
    unexpected = sorted(edge for edge in up if edge not in ALLOWED_UPWARD)
    assert not unexpected, f"imports into a higher layer of docs/ARCHITECTURE.md: {unexpected}"
    eager = sorted(edge for edge, lazy in up.items() if not lazy)
    assert not eager, f"the allowed upward imports must stay inside a function: {eager}"
    stale = sorted(set(ALLOWED_UPWARD) - set(up))
    assert not stale, f"allowed upward imports that no longer exist (drop them here and in ARCHITECTURE): {stale}"


def test_private_names_are_imported_only_within_a_package():
    crossing = {
        (importer, source): names
        for (importer, source), names in private_imports().items()
        if source.rsplit(".", 1)[0] not in (importer, importer.rsplit(".", 1)[0])
    }
    assert not crossing, f"private names imported from another package: {crossing}"


ORACLE = "simdist.gradpath.oracle"
"""The independent oracle: this package and every module under it."""

JUDGED = ("simdist.gradpath.kernel", "simdist.gradpath.policy", "simdist.gradpath.path", "simdist.gradpath.batched")
"""The gradient path the oracle judges: its kernel, the policies as data and the two adapters. The oracle may share
the parameter list (`simdist.gradpath.families`) and the capture names (`simdist.gradpath.probes`), nothing else of
``simdist.gradpath`` (`simdist.gradpath.matched_policy` is a policy the gradient path runs: judged too)."""


def oracle_modules(graph: dict[str, dict[str, bool]]) -> list[str]:
    """The oracle's modules: ``simdist.gradpath.oracle`` and everything under it."""
    return sorted(m for m in graph if m == ORACLE or m.startswith(ORACLE + "."))


def judged_imports(graph: dict[str, dict[str, bool]]) -> dict[str, list[str]]:
    """oracle module -> the modules of ``simdist.gradpath`` outside the oracle it reaches, directly or through other
    modules, lazy imports included, other than the two it may share (a module below the gradient path cannot reach
    it back: the layers)."""
    oracle = set(oracle_modules(graph))
    shared = {"simdist.gradpath.families", "simdist.gradpath.probes"}
    out = {}
    for start in oracle:
        seen, todo = {start}, [start]
        while todo:
            for target in graph.get(todo.pop(), {}):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        judged = sorted(
            m
            for m in seen
            if (m == "simdist.gradpath" or m.startswith("simdist.gradpath.")) and m not in oracle and m not in shared
        )
        if judged:
            out[start] = judged
    return out


def test_the_oracle_imports_nothing_it_judges():
    """Nothing under ``gradpath/oracle/`` imports the gradient path's kernel, or anything of the gradient path but
    the parameter list and the capture names (docs/glossary.md, *oracle*)."""
    graph = import_graph()
    assert oracle_modules(graph) == [
        "simdist.gradpath.oracle",
        "simdist.gradpath.oracle.rules",
        "simdist.gradpath.oracle.runs",
        "simdist.gradpath.oracle.step",
    ]
    assert all(m in graph for m in JUDGED), "a judged module moved: update JUDGED"
    found = judged_imports(graph)
    assert not found, f"the oracle imports the gradient path it judges: {found}"
    assert not any(m in JUDGED for reached in found.values() for m in reached)


def test_the_oracle_rule_sees_a_kernel_import():
    """Mutation of the rule's input: the oracle's step importing the kernel (even lazily, even through a shared
    module) is found."""
    graph = {m: dict(edges) for m, edges in import_graph().items()}
    graph["simdist.gradpath.oracle.step"]["simdist.gradpath.kernel"] = True
    assert judged_imports(graph) == {
        m: ["simdist.gradpath.kernel", "simdist.gradpath.policy"]
        for m in ("simdist.gradpath.oracle", "simdist.gradpath.oracle.runs", "simdist.gradpath.oracle.step")
    }
    graph = {m: dict(edges) for m, edges in import_graph().items()}
    graph["simdist.gradpath.families"]["simdist.gradpath.kernel"] = True
    assert "simdist.gradpath.oracle.rules" in judged_imports(graph)


def test_the_checks_see_what_they_must(tmp_path):
    """The checks themselves, on a small fake package: a lazy cycle, an upward import, a type-only import."""
    pkg = tmp_path / "simdist"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from simdist.low import b\n")
    (pkg / "low" / "b.py").write_text("from .a import f\n")
    (pkg / "low" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from simdist.high import d\n"
    )
    (pkg / "high" / "d.py").write_text("from simdist.low.c import _x\n")
    (pkg / "low" / "e.py").write_text("def g():\n    import simdist.high.d\n")
    (pkg / "low" / "scripts").mkdir()
    (pkg / "low" / "scripts" / "s.py").write_text("import simdist.high.d\n")  # package data: not a module
    graph = import_graph(tmp_path)
    assert "simdist.low.scripts.s" not in graph
    assert cycles(graph) == [["simdist.low.a", "simdist.low.b"]]
    assert graph["simdist.low.c"] == {}
    assert import_graph(tmp_path, type_only=True)["simdist.low.c"] == {"simdist.high.d": False}
    table = layers("```layers\nlow: simdist.low\nhigh: simdist.high\n```\n")
    assert upward_imports(graph, table) == {("simdist.low.e", "simdist.high.d"): True}
    assert private_imports(tmp_path) == {("simdist.high.d", "simdist.low.c"): ["_x"]}
