"""What a case is: a question, the real code that answers it, the simdist policy it checks, a verdict.

A case runs a real framework (DeepSpeed, FSDP2, ...) on a process group and
compares what it computes, bit for bit, with simdist's transcription of the
same path. Its ``run`` returns a verdict dataclass whose ``ok`` says whether
every claim the case checks holds; tests assert on the dataclass, the CLI
prints its ``summary`` (or the whole dataclass as JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from simdist.cases.ranks import PER_RANK_GLOBALS
from simdist.extras import missing_extras


class Verdict(Protocol):
    """What every case's verdict has: ``ok`` (every checked claim holds) and a one-paragraph ``summary``; it is a
    dataclass (the CLI's ``--json`` is `dataclasses.asdict` of it)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    ok: bool
    summary: str


@dataclass(frozen=True)
class Case:
    """One case: its name, the question it answers, the real code it drives, the policies it checks."""

    name: str
    question: str
    real_code: str
    policies: tuple[str, ...]
    requires: tuple[str, ...]
    """The extras of ``pyproject.toml`` (`simdist.extras.EXTRAS`) whose framework the case drives; () for torch's."""
    run: Callable[..., Any]
    """``run(where="gloo", **options) -> verdict dataclass``."""
    processes_because: str | None = PER_RANK_GLOBALS
    """Why the case refuses ``where="threads"``; None where it runs on rank threads too."""

    def missing(self) -> list[str]:
        """The required extras whose framework is not importable here."""
        return missing_extras(self.requires)
