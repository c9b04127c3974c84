"""Per-rank tensor dumps (safetensors) of a training run, and the comparer behind ``simdist compare``.

A dump is a directory with one ``rank{r}.safetensors`` per rank. Each file
holds every captured stage of every parameter of that rank (local grad,
corrected grad, hp grad, DP-reduced grad, FP32 master, Adam m and v) per step
and micro-step, under keys ``param|stage|s{step}|m{micro}`` (``mb`` for the
step boundary), and its metadata as JSON under the ``simdist`` key: spec,
policy, steps, gas, seed, marker, update path, model config, shapes, plus
where it ran (world, backend, device, reduction), which may differ
between two dumps of the same run.

`compare_dumps` checks first that two dumps describe the same run (else
`NotSameRun`, one line), then compares every tensor bit for bit and, where
bits differ, in ulps of the tensor's dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from simdist.errors import UsageError
from simdist.gradpath.probes import BOUNDARY, Capture, Trace
from simdist.numerics.compare import Comparison, Pair, compare

FORMAT = "simdist-dump/1"
DUMP_STAGES: frozenset[str] = frozenset(
    {Capture.LOCAL, Capture.CORRECTED, Capture.HP, Capture.DP_REDUCED, Capture.MASTER, Capture.ADAM_M, Capture.ADAM_V}
)
"""Stages a dump keeps: local grad, corrected grad, hp grad, DP-reduced grad, master, Adam m and v."""
RUN_FIELDS: tuple[str, ...] = ("spec", "policy", "steps", "gas", "seed", "marker", "update_path", "model", "shapes")
"""Metadata that must agree for two dumps to describe the same run (where and how it ran may differ)."""


class NotSameRun(UsageError):
    """Two dumps do not describe the same run; the message is one line naming what differs."""


def key(param: str, stage: str, step: int, micro: int) -> str:
    return f"{param}|{stage}|s{step}|m{'b' if micro == BOUNDARY else micro}"


def parse_key(name: str) -> tuple[str, str, int, int]:
    param, stage, step, micro = name.split("|")
    return param, stage, int(step[1:]), BOUNDARY if micro == "mb" else int(micro[1:])


def rank_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.safetensors"


def write_rank_dump(directory: str | Path, trace: Trace, metadata: dict) -> Path:
    """Write one rank's captures and ``metadata`` (JSON-able) to ``directory/rank{r}.safetensors``."""
    path = rank_file(directory, trace.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        key(param, stage, step, micro): value.detach().cpu().contiguous()
        for (step, micro, param, stage), value in trace.values.items()
    }
    meta = {"format": FORMAT, "rank": trace.rank, **metadata}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"simdist": json.dumps(meta)})
    tmp.replace(path)
    return path


def read_metadata(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("simdist")
    if raw is None:
        raise NotSameRun(f"{path} is not a simdist dump (no 'simdist' metadata)")
    return json.loads(raw)


def load_dump(directory: str | Path) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """Every rank's metadata and tensors, in rank order; ``ValueError`` if the directory holds no dump."""
    directory = Path(directory)
    files = sorted(directory.glob("rank*.safetensors"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise UsageError(f"{directory} holds no rank*.safetensors dump")
    metas = [read_metadata(p) for p in files]
    world = metas[0]["spec"]["world_size"]
    if [m["rank"] for m in metas] != list(range(world)):
        raise UsageError(f"{directory} has ranks {[m['rank'] for m in metas]}, expected 0..{world - 1}")
    return metas, [load_file(str(p)) for p in files]


@dataclass
class TensorRow:
    """One (parameter, stage) compared over every rank, step and micro-step."""

    param: str
    stage: str
    tensors: int
    bitwise: int
    max_ulp: int
    fraction_differing: float
    first: str = ""
    nonfinite: int = 0
    """Differing elements with a NaN or an infinity on either side (beyond every ulp tolerance)."""

    @classmethod
    def of(cls, param: str, stage: str, comparison: Comparison) -> TensorRow:
        """The row of one (parameter, stage): a view of its `Comparison`, whose order is (step, micro, rank)."""
        first = ""
        if comparison.first is not None:
            (step, _, rank, micro), _, _ = comparison.first
            first = f"rank {rank}, step {step}, " + ("boundary" if micro == BOUNDARY else f"micro-step {micro}")
        d = comparison.difference
        return cls(
            param,
            stage,
            comparison.tensors,
            comparison.equal,
            d.max_ulp,
            d.fraction_differing,
            first,
            d.nonfinite_differing,
        )


@dataclass
class DumpComparison:
    rows: list[TensorRow] = field(default_factory=list)
    tolerance_ulp: int = 0
    where: tuple[str, str] = ("", "")

    @property
    def tensors(self) -> int:
        return sum(r.tensors for r in self.rows)

    @property
    def beyond_tolerance(self) -> list[TensorRow]:
        return [r for r in self.rows if r.bitwise < r.tensors and (r.max_ulp > self.tolerance_ulp or r.nonfinite > 0)]

    @property
    def ok(self) -> bool:
        return not self.beyond_tolerance


def same_run(meta_a: dict, meta_b: dict) -> None:
    """`NotSameRun` (one line) when two dumps' run metadata differ."""
    for name in RUN_FIELDS:
        if meta_a.get(name) != meta_b.get(name):
            raise NotSameRun(
                f"the dumps do not describe the same run: {name} differs ({_short(meta_a.get(name))} vs "
                f"{_short(meta_b.get(name))})"
            )


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def compare_dumps(dir_a: str | Path, dir_b: str | Path, tolerance_ulp: int = 0) -> DumpComparison:
    """Compare two dumps tensor by tensor; `NotSameRun` if they describe different runs."""
    metas_a, ranks_a = load_dump(dir_a)
    metas_b, ranks_b = load_dump(dir_b)
    same_run(metas_a[0], metas_b[0])
    if len(ranks_a) != len(ranks_b):
        raise NotSameRun(f"the dumps do not describe the same run: {len(ranks_a)} vs {len(ranks_b)} rank files")
    for rank, (a, b) in enumerate(zip(ranks_a, ranks_b, strict=True)):
        if a.keys() != b.keys():
            only = sorted(a.keys() ^ b.keys())
            raise NotSameRun(f"the dumps do not describe the same run: rank {rank} tensors differ, e.g. {only[0]}")
    groups: dict[tuple[str, str], list[Pair]] = {}
    for rank, (a, b) in enumerate(zip(ranks_a, ranks_b, strict=True)):
        for name in sorted(a, key=lambda n: _order(parse_key(n))):
            param, stage, step, micro = parse_key(name)
            if a[name].dtype != b[name].dtype or a[name].shape != b[name].shape:
                raise NotSameRun(
                    f"the dumps do not describe the same run: {name} on rank {rank} is "
                    f"{a[name].dtype}{tuple(a[name].shape)} vs {b[name].dtype}{tuple(b[name].shape)}"
                )
            where = (step, _micro(micro), rank, micro)
            groups.setdefault((param, stage), []).append((name, where, a[name], b[name], None))
    result = DumpComparison(
        tolerance_ulp=tolerance_ulp, where=(str(metas_a[0].get("world")), str(metas_b[0].get("world")))
    )
    order = {n: i for i, n in enumerate(metas_a[0].get("shapes", {}))}
    for (param, stage), pairs in sorted(
        groups.items(), key=lambda kv: (order.get(kv[0][0], 1 << 20), kv[0][0], Capture(kv[0][1]).order)
    ):
        result.rows.append(TensorRow.of(param, stage, compare(pairs)))
    return result


def _micro(micro: int) -> int:
    return 1 << 30 if micro == BOUNDARY else micro


def _order(parsed: tuple[str, str, int, int]) -> tuple:
    param, stage, step, micro = parsed
    return step, _micro(micro), param, Capture(stage).order


def format_comparison(cmp: DumpComparison) -> str:
    """One line per (parameter, stage): bitwise equal, or max ulp and the fraction of elements differing."""
    out = [f"{'parameter':<16} {'tensor':<16} result"]
    for r in cmp.rows:
        label = Capture(r.stage).label
        if r.bitwise == r.tensors:
            text = f"bitwise equal ({r.tensors} tensors)"
        else:
            mark = "" if r.max_ulp <= cmp.tolerance_ulp and not r.nonfinite else "  BEYOND TOLERANCE"
            nonfinite = f" ({r.nonfinite} elements at a NaN or infinity)" if r.nonfinite else ""
            text = (
                f"{r.tensors - r.bitwise}/{r.tensors} tensors differ: max {r.max_ulp} ulp{nonfinite}, "
                f"{100 * r.fraction_differing:.1f}% of elements; first at {r.first}{mark}"
            )
        out.append(f"{r.param:<16} {label:<16} {text}")
    bad = cmp.beyond_tolerance
    equal = sum(r.bitwise for r in cmp.rows)
    verdict = (
        f"{equal}/{cmp.tensors} tensors bitwise equal ({cmp.where[0]} vs {cmp.where[1]}); "
        + ("all within " if not bad else f"{len(bad)} (parameter, stage) rows beyond ")
        + (f"{cmp.tolerance_ulp} ulp" if cmp.tolerance_ulp else "bitwise tolerance")
    )
    out.append(verdict)
    return "\n".join(out)
