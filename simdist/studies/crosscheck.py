"""The cross-check rank program: train the folded MoE block and dump every tensor, wherever its ranks run.

`train_and_dump` is the rank program of ``experiments/crosscheck.py``: the
same function runs on `SimWorld` and on real process groups (gloo, NCCL) and
writes one safetensors dump per rank and policy (`simdist.studies.dumps`), which
``simdist compare`` then compares across the places the runs ran.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from simdist.errors import coerce
from simdist.gradpath.kernel import Marker, UpdatePath
from simdist.gradpath.path import PathConfig, train_rank
from simdist.policies.catalogue import get_policy
from simdist.sources.moe import MoEConfig, MoEGradients
from simdist.studies.dumps import DUMP_STAGES, write_rank_dump
from simdist.world.spec import DEFAULT_SPEC, ParallelSpec


@dataclass(frozen=True)
class CrossCheck:
    """One cross-check run: layout, model (the MoE block's `MoEConfig`), data, policies, and the gradient path's
    marker and update path."""

    spec: ParallelSpec = DEFAULT_SPEC
    steps: int = 3
    gas: int = 1
    seed: int = 0
    policies: tuple[str, ...] = ("bf16_writeback", "fp32_staging")
    marker: Marker = Marker.DEEPSPEED
    update_path: UpdatePath = UpdatePath.EPILOGUE
    device: str = "cpu"
    model: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "marker", coerce(Marker, self.marker, "marker"))
        object.__setattr__(self, "update_path", coerce(UpdatePath, self.update_path, "update path"))
        object.__setattr__(self, "policies", tuple(self.policies))


def train_and_dump(comm, check: CrossCheck, out: str, where: dict) -> list[str]:
    """Rank program: train every policy of ``check`` and write ``out/<policy>/rank{r}.safetensors``.

    ``where`` (world, backend, reduction, ...) is stored in the metadata; it
    may differ between two dumps of the same run. Returns the written paths.
    """
    spec = comm.spec
    source = MoEGradients(spec, check.model, check.seed, check.gas, check.device)
    shapes = {p.name: list(p.shape) for p in source.params}
    config = PathConfig(
        steps=check.steps, gas=check.gas, seed=check.seed, marker=check.marker, update_path=check.update_path
    )
    written = []
    device = contextlib.nullcontext() if check.device == "cpu" else torch.device(check.device)
    for name in check.policies:
        with device:
            trace = train_rank(comm, source.params, source.initial, source, get_policy(name), config, DUMP_STAGES)
        metadata = {
            "spec": asdict(spec),
            "policy": name,
            "steps": check.steps,
            "gas": check.gas,
            "seed": check.seed,
            "marker": check.marker,
            "update_path": check.update_path,
            "model": asdict(check.model),
            "shapes": shapes,
            "device": check.device,
            **where,
        }
        written.append(str(write_rank_dump(Path(out) / name, trace, metadata)))
    return written
