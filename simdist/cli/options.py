"""The one generator of the command line: a command's configuration dataclass makes its argparse options.

Each command has one configuration tree (a dataclass, possibly holding another as a *section*, e.g. `repro`'s
`simdist.studies.repro.ReproConfig`); its fields are the command's options, its defaults their defaults, and
each field's ``metadata`` (a plain dict, so that the studies, a lower layer, need not import this module) their
help. `add_options` builds the options from the tree and `from_args` builds the tree back from the parsed
namespace, so no default is written twice.

What a field's type makes of it:

* ``bool`` -- a flag (``store_true``; its default must be ``False``);
* ``int`` / ``float`` / ``str`` -- an option taking one value (``metadata["minimum"]``: an ``int`` at least
  that, with a one-line error otherwise; ``metadata["path"]``: a non-empty path);
* an `enum.Enum` or a ``Literal[...]`` -- a choice among the values (`choices`; ``metadata["skip"]`` leaves
  some out); the tree receives the enum member;
* ``tuple[str, ...]`` -- a comma-separated list (``metadata["repeat"]``: a repeatable option instead);
* `simdist.world.spec.ParallelSpec` -- the layout options ``--world-size --tp --ep`` (and ``--etp`` unless
  ``metadata["etp"]`` is false), defaulting to the field's default layout;
* a dataclass with ``metadata["section"]`` -- its fields, added to the same parser.

Other metadata keys: ``help`` (the help text; `add_options` appends the default), ``flag`` (the option name,
default ``--field-name``), ``positional`` (an argument, not an option), ``remainder`` (every argument after
it, as ``argparse.REMAINDER``), ``metavar``, ``required``, ``off`` (the name of a second flag that clears a
``bool`` field, in a mutually exclusive pair; ``off_help`` its help) and ``cli: False`` (not on the command
line: the tree keeps the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from collections.abc import Callable
from typing import Any

from simdist.cli.inputs import path_argument
from simdist.errors import coerce
from simdist.world.spec import ParallelSpec

__all__ = ["add_options", "choices", "from_args", "int_at_least", "option_defaults"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, with a one-line error naming what it must be."""
    what = {0: "non-negative", 1: "positive"}.get(minimum, f">= {minimum}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value

    return parse


def choices(kind: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The values a choice field accepts: an enum's member values or a ``Literal``'s, minus ``skip``.

    The one enum-choice rule of the command line: every option whose values are an enum's lists them from here.
    """
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        values = [str(member.value) for member in kind]
    else:
        values = [str(v) for v in typing.get_args(kind)]
    return [v for v in values if v not in skip]


def _comma_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return names


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _is_choice(kind: Any) -> bool:
    return (isinstance(kind, type) and issubclass(kind, enum.Enum)) or typing.get_origin(kind) is typing.Literal


def _optional(kind: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    args = typing.get_args(kind)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return kind


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_options(parser: argparse.ArgumentParser, cls: type, _seen: set[str] | None = None) -> None:
    """Add the options of configuration dataclass ``cls`` (and of its sections) to ``parser``."""
    seen = set() if _seen is None else _seen
    for f, kind in _fields(cls):
        meta = f.metadata
        if meta.get("section"):
            add_options(parser, kind, seen)
            continue
        if f.name in seen:  # two sections naming one field: the namespace could not hold both
            raise TypeError(f"{cls.__name__}.{f.name}: the field name is already an option of this command")
        seen.add(f.name)
        default = _default(f)
        if kind is ParallelSpec:
            _add_layout(parser, default, etp=meta.get("etp", True))
            continue
        _add_field(parser, f, _optional(kind), default)


def _help(meta: Any, default: Any, kind: Any) -> str | None:
    text = meta.get("help")
    if text is None or kind is bool or default is None or meta.get("required") or meta.get("positional"):
        return text
    if default == () or "(default" in text:
        return text
    return f"{text} (default: {_shown(default)})"


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, kind: Any, default: Any) -> None:
    meta = f.metadata
    text = _help(meta, default, kind)
    if meta.get("remainder"):
        parser.add_argument(f.name, nargs=argparse.REMAINDER, metavar=meta.get("metavar"), help=text)
        return
    if meta.get("positional"):
        kwargs: dict[str, Any] = {"help": text, "metavar": meta.get("metavar")}
        if _is_choice(kind):
            kwargs["choices"] = choices(kind, meta.get("skip", ()))
        else:
            kwargs["type"] = _value_type(kind, meta)
        parser.add_argument(f.name, **kwargs)
        return
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    if kind is bool:
        if default is not False:
            raise TypeError(f"{f.name}: a flag's default must be False")
        if meta.get("off"):
            pair = parser.add_mutually_exclusive_group()
            pair.add_argument(meta["off"], dest=f.name, action="store_false", default=False, help=meta.get("off_help"))
            pair.add_argument(flag, dest=f.name, action="store_true", help=text)
        else:
            parser.add_argument(flag, dest=f.name, action="store_true", help=text)
        return
    kwargs = {"dest": f.name, "default": default, "help": text, "metavar": meta.get("metavar")}
    if meta.get("required"):
        kwargs["required"] = True
    if _is_choice(kind):
        kwargs["choices"] = choices(kind, meta.get("skip", ()))
        kwargs.pop("metavar")
    elif meta.get("repeat"):
        kwargs.update(action="append", type=_value_type(str, meta), default=[])
    else:
        kwargs["type"] = _value_type(kind, meta)
    parser.add_argument(flag, **kwargs)


def _value_type(kind: Any, meta: Any) -> Callable[[str], Any]:
    if "parse" in meta:
        return meta["parse"]
    if kind is int:
        return int_at_least(meta["minimum"]) if "minimum" in meta else int
    if kind is float:
        return float
    if typing.get_origin(kind) is tuple:
        return _comma_list
    return path_argument if meta.get("path") else str


def _add_layout(parser: argparse.ArgumentParser, spec: ParallelSpec, etp: bool) -> None:
    positive = int_at_least(1)
    parser.add_argument("--world-size", type=positive, default=spec.world_size, help="ranks (default: %(default)s)")
    parser.add_argument("--tp", type=positive, default=spec.tp, help="tensor-parallel size (default: %(default)s)")
    parser.add_argument("--ep", type=positive, default=spec.ep, help="expert-parallel size (default: %(default)s)")
    if etp:
        parser.add_argument(
            "--etp", type=positive, default=spec.etp, help="expert tensor-parallel size (default: %(default)s)"
        )


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The configuration tree ``cls`` with the values ``args`` (from `add_options`' parser) holds.

    Choice fields receive the enum member (or the ``Literal``'s string); fields kept off the command line keep
    their defaults. A broken layout raises the `UsageError` of `ParallelSpec`.
    """
    values: dict[str, Any] = {}
    for f, kind in _fields(cls):
        if f.metadata.get("section"):
            values[f.name] = from_args(kind, args)
            continue
        kind = _optional(kind)
        if kind is ParallelSpec:
            etp = getattr(args, "etp", None)
            values[f.name] = ParallelSpec(
                args.world_size, tp=args.tp, ep=args.ep, **({} if etp is None else {"etp": etp})
            )
            continue
        value = getattr(args, f.name)
        if isinstance(kind, type) and issubclass(kind, enum.Enum) and value is not None:
            value = coerce(kind, value, f.name.replace("_", " "))
        elif typing.get_origin(kind) is tuple and isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def option_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default of every command-line field of ``cls`` and its sections (what `add_options` uses)."""
    out: dict[str, Any] = {}
    for f, kind in _fields(cls):
        if f.metadata.get("section"):
            out.update(option_defaults(kind))
        else:
            out[f.name] = _default(f)
    return out
