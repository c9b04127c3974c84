"""`blame` (a rank function on `simdist.run` threads) and `blame_target` (any callable, a script): run, rank, promote"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from simdist.attribution.arithmetic import op_names
from simdist.attribution.report import CATEGORIES, BlameReport, Movement, Promotion
from simdist.attribution.run import Recorder, execute, local
from simdist.errors import UsageError
from simdist.world.options import DEFAULT_REDUCTION, DEFAULT_TIMEOUT_S
from simdist.world.spec import ParallelSpec

SiteSpec = int | str
"""A site of the base run's table: its id (``3`` or ``"3"``) or ``"path:line"`` (every site on that line;
``path`` may be any trailing part of the file's path)."""


def _result_tensors(value, name: str = "result", out: dict | None = None) -> dict:
    """The floating tensors in what the target returned (lists, tuples, dicts), named by their path."""
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out[name] = local(value)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _result_tensors(v, f"{name}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _result_tensors(v, f"{name}[{k!r}]", out)
    return out


def _state(recorder, results) -> dict:
    return {**recorder.final_state(), "results": _result_tensors(results)}


def _ranked(recorder) -> list:
    return sorted(
        recorder.sites.values(),
        key=lambda s: (
            -s.errors.overflow,
            -s.errors.mass,
            -s.errors.max_term_relative,
            s.file,
            s.line,
            s.kind,
            s.op,
            s.dtypes,
        ),
    )


class SiteNotFound(UsageError):
    """A ``--promote`` entry that names no site of the base run (bad input)."""


def check_spec(spec: object) -> SiteSpec:
    """``spec`` if it has the form of a site (an id >= 1 or ``path:line``), else ``SiteNotFound`` saying so.

    Checked before the base run: a malformed entry is bad input, not something a run can answer.
    """
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        kind = type(spec).__name__
        raise SiteNotFound(f"--promote {spec!r}: a site is an id (1, 2, ...) or 'file:line', not a {kind}")
    text = str(spec).strip()
    if text.lstrip("+-").isdigit():
        if int(text) < 1:
            raise SiteNotFound(f"--promote {text}: site ids start at 1")
        return int(text)
    path, _, line = text.rpartition(":")
    if not (path and line.isdigit()):
        raise SiteNotFound(f"--promote {text!r}: a site is an id (1, 2, ...) or 'file:line' (e.g. train.py:42)")
    return spec


def check_count(value: object, name: str = "promote_top") -> int:
    """``value`` if it is a non-negative int, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def resolve(report: BlameReport, spec: SiteSpec) -> list[int]:
    """The ids of the base report's sites that ``spec`` names; ``ValueError`` listing the sites if none."""
    text = str(spec).strip()
    if not report.sites:
        raise SiteNotFound(f"--promote {text}: this run has no sites (no measured collective, cast or op)")
    if text.isdigit():
        if not 1 <= int(text) <= len(report.sites):
            raise SiteNotFound(f"--promote {text}: site ids of this run are 1-{len(report.sites)}")
        return [int(text)]
    path, _, line = text.rpartition(":")
    if path and line.isdigit():
        tail = os.path.normpath(path)
        found = [
            i
            for i, s in enumerate(report.sites, 1)
            if s.line == int(line) and (s.file == os.path.abspath(tail) or s.file.endswith(os.sep + tail))
        ]
        if found:
            return found
    listed = ", ".join(f"{i}={os.path.basename(s.file)}:{s.line}" for i, s in enumerate(report.sites[:12], 1))
    raise SiteNotFound(f"--promote {text!r} names no site of this run; use an id or file:line ({listed})")


Run = Callable[[set, frozenset], tuple[Any, Any]]
"""One blamed run: ``run(promoted site keys, op names) -> (recorder, results)``; the recorder holds ``sites``,
``promoted``, ``unpromotable``, ``sharded`` and ``final_state()`` (a `Recorder`, or process mode's merged one)."""


def blame_target(
    target: Callable[[], Any],
    *,
    promote: Iterable[SiteSpec] = (),
    promote_top: int = 0,
    ops: str | Iterable[str] | None = None,
) -> BlameReport:
    """Run ``target()`` blamed; then, for each entry of ``promote`` (and each of the ``promote_top`` first
    sites), rerun it with those sites exact and measure how far the final state moved.

    ``ops``: also measure arithmetic sites (`simdist.attribution.arithmetic`): ``"all"`` the ops of
    `simdist.attribution.arithmetic.OPS`, or some of them by name (``"mm,add"``, ``["mm"]``); None: none.

    The base run is the comparison point of every promotion: simdist runs are deterministic, so a rerun
    without promotion gives the same bits (the tests check it).
    """

    def run(keys: set, names: frozenset) -> tuple[Any, Any]:
        recorder = Recorder(promote=keys, ops=names)
        return recorder, execute(target, recorder)

    return blame_runs(run, promote=promote, promote_top=promote_top, ops=ops)


def blame_runs(
    run: Run,
    *,
    promote: Iterable[SiteSpec] = (),
    promote_top: int = 0,
    ops: str | Iterable[str] | None = None,
) -> BlameReport:
    """`blame_target` for any way of running the program (``run``, see `Run`): threads or processes."""
    promote = [check_spec(spec) for spec in promote]
    check_count(promote_top)
    names = op_names(ops)
    recorder, results = run(set(), names)
    report = BlameReport(_ranked(recorder), _state(recorder, results), results)
    if recorder.sharded:
        report.notes.append("DTensor parameters and optimizer states are compared by each rank's local shard")
    specs: list[SiteSpec] = list(promote) + [i for i in range(1, min(promote_top, len(report.sites)) + 1)]
    for spec in specs:
        ids = resolve(report, spec)
        keys = {report.site(i).key for i in ids}
        label = " + ".join(f"#{i} {os.path.basename(report.site(i).file)}:{report.site(i).line}" for i in ids)
        try:
            rerun, rerun_results = run(keys, names)
        except Exception as exc:  # the program cannot go on in the wide dtype there (e.g. an autograd cast)
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            report.promotions.append(Promotion(ids, label, 0, [], failed=f"{type(exc).__name__}: {message}"))
            continue
        state = _state(rerun, rerun_results)
        movement = {c: Movement.between(report.state[c], state[c]) for c in CATEGORIES}
        unpromotable = sorted(i for i in ids if report.site(i).key in rerun.unpromotable)
        events = sum(rerun.promoted.values())
        if not events and not unpromotable:
            raise RuntimeError(f"promoting {label} changed nothing: the rerun never reached the site")
        why = "; ".join(sorted({rerun.unpromotable[report.site(i).key] for i in unpromotable}))
        report.promotions.append(
            Promotion(ids, label, events, unpromotable, movement, unpromotable_why=why, state=state)
        )
    return report


def blame(
    fn: Callable[..., Any],
    world: int | ParallelSpec,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    promote: Iterable[SiteSpec] = (),
    promote_top: int = 0,
    ops: str | Iterable[str] | None = None,
    reduction: Any = DEFAULT_REDUCTION,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    one_cpu: bool = True,
    intra_op_threads: int | None = 1,
) -> BlameReport:
    """Run ``fn(rank, *args, **kwargs)`` on every rank of ``world`` as threads (`simdist.run`) and blame its
    rounding, site by site.

    ``fn`` is unmodified ``torch.distributed`` code. For every reducing collective call site and every
    narrowing cast (file:line and function, over calls, ranks and steps) the report gives elements,
    calls, max ulp, max error / sum|terms| and max relative error against the exact result of the same
    inputs (an FP64 reduction of the members' tensors computed in the same run; the wide input of a cast),
    and each site's share of the run's error mass. ``promote`` / ``promote_top``: see `blame_target`.
    ``world``, ``args``, ``kwargs``, ``reduction``, ``timeout_s``, ``one_cpu`` and ``intra_op_threads`` are
    `simdist.run`'s (its keywords apart from ``fn``'s, as there; the ranks are always threads of this process).
    ``report.results`` holds ``fn``'s per-rank results; ``ops`` adds arithmetic sites (see `blame_target`);
    ``report.figure()`` draws the sites and their error per step.
    """
    from simdist.world.runner import run

    def launch() -> list[Any]:
        return run(
            fn,
            world,
            args=args,
            kwargs=kwargs,
            reduction=reduction,
            timeout_s=timeout_s,
            one_cpu=one_cpu,
            intra_op_threads=intra_op_threads,
        )

    return blame_target(launch, promote=promote, promote_top=promote_top, ops=ops)
