"""Every backticked reference in simdist's docstrings and in docs/ARCHITECTURE.md resolves, so a move cannot leave
stale names behind.

Where: the module, class and function docstrings of every module of the package (a ``.py`` file in a folder with an
``__init__.py``, ``simdist/policies`` included; the reproducer scripts under ``simdist/cases/reproducers/`` are
package data, not modules), parsed with `ast`, and docs/ARCHITECTURE.md outside its fenced blocks.

What is a reference (the reStructuredText convention the docstrings follow): a span in single backticks. A span in
double backticks (````x````) is a literal and never checked. A single-backticked span is a reference when it is

- a path ending in ``.py``: it must exist relative to the docstring's own package folder, to ``simdist/`` or to the
  repository root (``world/simworld.py``, ``simdist/world/simworld.py``, ``tests/...``, ``bench/...``); a path
  ending in ``/`` that starts with ``simdist/``, ``tests/``, ``bench/`` or ``docs/`` must be a folder;
- a dotted name (identifiers joined by dots, a trailing ``()`` ignored). One that starts with ``simdist.`` must be
  a module, or an attribute or class member reached from the longest module it starts with (modules are imported
  with importlib). Any other is looked up by its first name, in this order: a module or subpackage of the
  docstring's own package or of a package above it (``spawn.spawn_threads`` inside ``simdist/world/threads/``,
  ``oracle.rules`` inside ``simdist/gradpath/``); a parameter of the documented function (nothing after it is
  checked); a member of the enclosing classes; a name of the docstring's module (for ARCHITECTURE.md: of the
  modules its table row names, else of ``simdist``); any module of the package or any name a module of the
  package defines at its top level. The rest of the name must then resolve as attributes as long as the object reached
  belongs to the package (once it leaves the package, ``torch.distributed``, the rest is not checked). A bare
  name found nowhere is stale, unless it is a builtin or a standard-library module; a dotted name whose first name
  is found nowhere names another library's code (``auto_ep_folding.apply_folding_correction_to_grad_buffer``) and
  is not checked.

Anything else in single backticks (an expression, ``SIMDIST_NATIVE=0``, ``Policy(...)``) is not a reference.
A dataclass field, an annotated class attribute and an attribute the class's methods assign to ``self`` count as
class members even without a class-level value.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = "simdist"

NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
PY_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*\.py")
FOLDER = re.compile(r"(?:simdist|tests|bench|docs)(?:/[\w.-]+)*/")


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (folders without ``__init__.py`` hold data)."""
    modules = {}
    for folder, subfolders, files in os.walk(root / package):
        if "__init__.py" not in files:
            subfolders[:] = []
            continue
        for name in files:
            if name.endswith(".py"):
                parts = list((Path(folder) / name).relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = Path(folder) / name
    return modules


@dataclass(frozen=True)
class Docstring:
    """One docstring and the scope its references are read in."""

    where: str
    """``path:line`` of the docstring (or of the ARCHITECTURE.md line)."""
    text: str
    packages: tuple[str, ...]
    """The docstring's own package and the packages above it, innermost first."""
    scopes: tuple[object, ...]
    """Enclosing classes (innermost first), then the module namespaces whose names are in scope."""
    params: frozenset[str] = frozenset()


def spans(text: str) -> list[str]:
    """The single-backticked spans of ``text``: fenced blocks and double-backticked literals removed first."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"``.*?``", "", text, flags=re.S)
    return [s.strip() for s in re.findall(r"`([^`]+)`", text)]


def _packages_of(package: str) -> tuple[str, ...]:
    parts = package.split(".")
    return tuple(".".join(parts[:i]) for i in range(len(parts), 0, -1))


def _import(module: str) -> ModuleType:
    return importlib.import_module(module)


@functools.cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """The ``self.x`` a class's own methods assign (instance attributes have no class-level value)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return frozenset()
    return frozenset(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        if isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def _defined(path: Path) -> set[str]:
    """The names a module's top level defines (functions, classes, assignments; imports are not definitions)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = node.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}


def module_docstrings(module: str, path: Path, root: Path) -> list[Docstring]:
    """The module, class and function docstrings of one module, each with its scope."""
    namespace = _import(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    where = path.relative_to(root).as_posix()
    out = []

    def visit(node: ast.AST, classes: tuple[object, ...], params: frozenset[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = params | _params(node)
        if isinstance(node, ast.ClassDef):
            owner = classes[0] if classes else namespace
            found = getattr(owner, node.name, None) if not params else None
            classes = (found, *classes) if isinstance(found, type) else classes
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                line = getattr(node, "lineno", 1)
                out.append(Docstring(f"{where}:{line}", text, _packages_of(package), (*classes, namespace), params))
        for child in ast.iter_child_nodes(node):
            visit(child, classes, params)

    visit(ast.parse(path.read_text(encoding="utf-8")), (), frozenset())
    return out


def architecture_docstrings(path: Path = ARCHITECTURE, root: Path = ROOT, package: str = PACKAGE) -> list[Docstring]:
    """docs/ARCHITECTURE.md line by line: a table row is read in the package its second cell names."""
    out = []
    top = _import(package)
    text = re.sub(
        r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"), flags=re.S | re.M
    )
    for number, line in enumerate(text.splitlines(), 1):
        packages, scopes = (package,), (top,)
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 3:
            named = [s for s in spans(cells[2]) if s.startswith(f"{package}/")]
            modules = [s.rstrip("/").removesuffix(".py").replace("/", ".") for s in named]
            if modules:
                first = named[0]
                packages = _packages_of(modules[0] if first.endswith("/") else modules[0].rpartition(".")[0])
                scopes = (*(_import(m) for m in modules), top)
        out.append(Docstring(f"{path.relative_to(root).as_posix()}:{number}", line, packages, scopes))
    return out


class Resolver:
    """Resolves the references of the docstrings of one package (see the module docstring for the rule)."""

    def __init__(self, root: Path = ROOT, package: str = PACKAGE):
        self.root, self.package = root, package
        self.modules = package_modules(root, package)
        self.index: dict[str, list[str]] = {}
        """name -> the dotted names it may stand for: every top-level name a module of the package defines."""
        for module, path in self.modules.items():
            for name in _defined(path):
                self.index.setdefault(name, []).append(f"{module}.{name}")

    def _owned(self, obj: object) -> bool:
        name = obj.__name__ if isinstance(obj, ModuleType) else getattr(obj, "__module__", None)
        return isinstance(name, str) and (name == self.package or name.startswith(self.package + "."))

    @staticmethod
    def _member(obj: object, name: str) -> tuple[bool, object]:
        """Whether ``obj`` has ``name`` (a dataclass field or an annotation counts) and the value, if any."""
        if hasattr(obj, name):
            return True, getattr(obj, name)
        if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
            return True, None
        if any(name in vars(k).get("__annotations__", {}) for k in getattr(obj, "__mro__", ())):
            return True, None
        if isinstance(obj, type) and any(name in _instance_attributes(k) for k in obj.__mro__):
            return True, None
        return False, None

    def _follow(self, obj: object, rest: list[str]) -> bool:
        for part in rest:
            if obj is None or not self._owned(obj):
                return True
            if isinstance(obj, ModuleType) and f"{obj.__name__}.{part}" in self.modules:
                obj = _import(f"{obj.__name__}.{part}")
                continue
            found, obj = self._member(obj, part)
            if not found:
                return False
        return True

    def absolute(self, name: str) -> bool:
        """A dotted name starting with the package: a module, or a member reached from the longest one."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in self.modules:
                return self._follow(_import(".".join(parts[:i])), parts[i:])
        return False

    def name(self, name: str, doc: Docstring) -> bool:
        first, *rest = name.split(".")
        if first == self.package:
            return self.absolute(name)
        for package in doc.packages:
            if f"{package}.{first}" in self.modules:
                return self.absolute(f"{package}.{name}")
        if first in doc.params:
            return True
        for scope in doc.scopes:
            found, obj = self._member(scope, first)
            if found:
                return self._follow(obj, rest)
        if first in self.index:
            return any(self.absolute(".".join([target, *rest])) for target in self.index[first])
        return bool(rest) or hasattr(builtins, first) or first in sys.stdlib_module_names

    def path(self, span: str, doc: Docstring) -> bool:
        bases = [self.root, self.root / self.package]
        bases += [self.root.joinpath(*p.split(".")) for p in doc.packages[:1]]
        if span.endswith("/"):
            return (self.root / span).is_dir()
        return any((base / span).is_file() for base in bases)

    def stale(self, docs: list[Docstring]) -> list[str]:
        """``where: `span``` for every reference of ``docs`` that does not resolve."""
        out = []
        for doc in docs:
            for span in spans(doc.text):
                name = span.removesuffix("()")
                if FOLDER.fullmatch(span) or PY_PATH.fullmatch(span):
                    ok = self.path(span, doc)
                elif NAME.fullmatch(name):
                    ok = self.name(name, doc)
                else:
                    continue
                if not ok:
                    out.append(f"{doc.where}: `{span}`")
        return out


def package_docstrings(root: Path = ROOT, package: str = PACKAGE) -> list[Docstring]:
    """Every module, class and function docstring of the package."""
    modules = package_modules(root, package)
    docs = []
    for module, path in sorted(modules.items()):
        if not module.endswith("__main__"):  # ``python -m`` entry points run on import
            docs += module_docstrings(module, path, root)
    return docs


def test_every_docstring_reference_resolves():
    docs = package_docstrings()
    assert len(docs) > 1000 and any(d.where.startswith("simdist/policies/") for d in docs)
    stale = Resolver().stale(docs)
    assert not stale, "stale references in docstrings:\n" + "\n".join(stale)


def test_every_architecture_reference_resolves():
    docs = architecture_docstrings()
    assert sum(len(spans(d.text)) for d in docs) > 200
    stale = Resolver().stale(docs)
    assert not stale, "stale references in docs/ARCHITECTURE.md:\n" + "\n".join(stale)


def test_the_checker_sees_a_stale_reference(tmp_path, monkeypatch):
    """The checker itself, on a small fake package: of each pair of references, exactly the stale one is reported."""
    pkg = tmp_path / "fakepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "__init__.py").write_text(
        '"""`sub.mod.Thing.size` and `sub.gone`; `fakepkg.sub.mod.f` and `fakepkg.old`."""\n'
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(
        "import dataclasses\n\n\n@dataclasses.dataclass\nclass Thing:\n"
        '    """`size`, `Thing.count` and `Thing.weight`; `mod.py` and `old.py`; ``literal``, `x + y`."""\n\n'
        "    size: int\n\n    def grow(self):\n        self.count = 1\n\n\n"
        'def f(steps):\n    """`steps` and `Thing.grow` and `inproc`."""\n'
    )
    (pkg / "data" / "script.py").write_text('"""`nowhere` is not checked: a data file, not a module."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    docs = package_docstrings(tmp_path, "fakepkg")
    assert sorted(Resolver(tmp_path, "fakepkg").stale(docs)) == [
        "fakepkg/__init__.py:1: `fakepkg.old`",
        "fakepkg/__init__.py:1: `sub.gone`",
        "fakepkg/sub/mod.py:14: `inproc`",
        "fakepkg/sub/mod.py:5: `Thing.weight`",
        "fakepkg/sub/mod.py:5: `old.py`",
    ]
