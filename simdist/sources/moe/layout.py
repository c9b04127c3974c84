"""The MoE block's sizes, its one parameter table, initial weights, shards and token batches.

Every fact about a parameter (name, folding family, full shape, which group shards it along which
dimension) is in `parameter_table`; local shapes, initial weights, `shard` and `unshard` derive from it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from simdist.errors import UsageError
from simdist.gradpath.families import Family, ParamSpec
from simdist.world.spec import ParallelSpec


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of the block. ``tokens`` is per rank and micro-step (TP peers share them)."""

    hidden: int = 16
    experts: int = 4
    top_k: int = 2
    expert_hidden: int = 32
    dense_hidden: int = 32
    tp_hidden: int = 16
    tokens: int = 8

    def validate(self, spec: ParallelSpec) -> None:
        """``ValueError`` naming the broken constraint when this block cannot be laid out on ``spec``."""
        if spec.pp != 1 or spec.etp != 1:
            raise UsageError(f"the MoE block needs pp=1 and etp=1, got {spec.describe()}")
        if self.experts % spec.ep:
            valid = [d for d in range(1, self.experts + 1) if self.experts % d == 0]
            raise UsageError(f"ep={spec.ep} must divide experts={self.experts}; valid ep values: {valid}")
        if self.tp_hidden % spec.tp:
            raise UsageError(f"tp={spec.tp} must divide tp_hidden={self.tp_hidden}")
        if not 1 <= self.top_k <= self.experts:
            raise UsageError(f"top_k={self.top_k} must be in 1..experts={self.experts}")


DEFAULT_CONFIG = MoEConfig()
"""The block's default sizes (an immutable value, safe as a default argument)."""


@dataclass(frozen=True)
class MoEParam:
    """One parameter of the block: its family, its unsharded shape, and how it is sharded.

    ``sharded_by`` is ``(group kind, dim)``: the full weight is cut into equal chunks along ``dim``, one
    per member of this rank's group of that kind; ``None`` for a replicated parameter.
    """

    name: str
    family: Family
    full_shape: tuple[int, ...]
    sharded_by: tuple[str, int] | None = None

    def local_shape(self, spec: ParallelSpec) -> tuple[int, ...]:
        if self.sharded_by is None:
            return self.full_shape
        kind, dim = self.sharded_by
        shape = list(self.full_shape)
        shape[dim] //= spec.size(kind)
        return tuple(shape)


def parameter_table(cfg: MoEConfig) -> tuple[MoEParam, ...]:
    """Every parameter of the block, in forward order."""
    h, e, dense, mp = cfg.hidden, cfg.experts, Family.DENSE, Family.MODEL_PARALLEL
    return (
        MoEParam("ln1.weight", dense, (h,)),
        MoEParam("ln1.bias", dense, (h,)),
        MoEParam("mlp.w1", dense, (cfg.dense_hidden, h)),
        MoEParam("mlp.w2", dense, (h, cfg.dense_hidden)),
        MoEParam("ln2.weight", dense, (h,)),
        MoEParam("ln2.bias", dense, (h,)),
        MoEParam("router.weight", Family.ROUTER_GATE_REPLICATED, (e, h)),
        MoEParam("experts.w1", Family.EXPERT, (e, cfg.expert_hidden, h), ("ep", 0)),
        MoEParam("experts.w2", Family.EXPERT, (e, h, cfg.expert_hidden), ("ep", 0)),
        MoEParam("ln3.weight", dense, (h,)),
        MoEParam("ln3.bias", dense, (h,)),
        MoEParam("tp_mlp.w1", mp, (cfg.tp_hidden, h), ("tp", 0)),
        MoEParam("tp_mlp.w2", mp, (h, cfg.tp_hidden), ("tp", 1)),
    )


def _table(cfg: MoEConfig) -> dict[str, MoEParam]:
    return {p.name: p for p in parameter_table(cfg)}


def moe_params(spec: ParallelSpec, cfg: MoEConfig = DEFAULT_CONFIG) -> list[ParamSpec]:
    """Every parameter as a rank holds it (local shapes), in forward order."""
    cfg.validate(spec)
    return [ParamSpec(p.name, p.family, p.local_shape(spec)) for p in parameter_table(cfg)]


def seed_of(*parts: object) -> int:
    """A 32-bit seed derived from ``parts`` (the same on every platform and process)."""
    return zlib.crc32(repr(parts).encode())


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), device="cpu")


class MoEInitialWeights:
    """``(rank, param) -> BF16 initial weight``: the full weight is seeded once and sharded by the layout.

    Replicated parameters are identical on every rank; a TP-sharded weight is
    the ``tp_rank``-th slice of its full weight, an expert weight the
    ``ep_rank``-th block of experts. A class so that it pickles into real
    torch.distributed processes; ``device`` is where the tensors are put.
    """

    def __init__(self, spec: ParallelSpec, cfg: MoEConfig = DEFAULT_CONFIG, seed: int = 0, device: str = "cpu"):
        cfg.validate(spec)
        self.spec, self.cfg, self.seed, self.device = spec, cfg, seed, device

    def full(self, name: str) -> torch.Tensor:
        """The unsharded BF16 initial weight (on CPU): LayerNorms near (1, 0), matrices ``randn / sqrt(fan_in)``."""
        shape = _table(self.cfg)[name].full_shape
        seed = seed_of("moe-init", self.seed, name)
        if name.startswith("ln"):
            noise = _randn(shape, seed) * 0.1
            return (1.0 + noise if name.endswith("weight") else noise).to(torch.bfloat16)
        return (_randn(shape, seed) / shape[-1] ** 0.5).to(torch.bfloat16)

    def __call__(self, rank: int, param: ParamSpec) -> torch.Tensor:
        return shard(self.spec, rank, param.name, self.full(param.name), self.cfg).to(self.device)


def shard(
    spec: ParallelSpec, rank: int, name: str, full: torch.Tensor, cfg: MoEConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """The slice of the unsharded ``full`` weight that ``rank`` holds (itself for replicated parameters)."""
    sharded_by = _table(cfg)[name].sharded_by
    if sharded_by is None:
        return full
    kind, dim = sharded_by
    group = spec.group_of(kind, rank)
    return full.chunk(len(group), dim=dim)[group.index(rank)].clone()


def unshard(
    spec: ParallelSpec, name: str, local: Callable[[int], torch.Tensor], cfg: MoEConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """The full weight assembled from the shards ``local(rank)`` of rank 0's TP or EP group."""
    sharded_by = _table(cfg)[name].sharded_by
    if sharded_by is None:
        return local(0)
    kind, dim = sharded_by
    return torch.cat([local(r) for r in spec.group_of(kind, 0)], dim=dim)


def batch(cfg: MoEConfig, seed: int, step: int, micro: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic BF16 tokens and targets of one DP replica (all its TP peers) for ``(step, micro)``."""
    g = torch.Generator().manual_seed(seed_of("moe-batch", seed, step, micro, replica))
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g, device="cpu")
    target = torch.randn(cfg.tokens, cfg.hidden, generator=g, device="cpu") * 0.5
    return x.to(torch.bfloat16), target.to(torch.bfloat16)


def replica_of(spec: ParallelSpec, rank: int) -> int:
    """The dense data-parallel replica (index of the TP group) that ``rank`` belongs to."""
    return spec.groups("tp").index(spec.group_of("tp", rank))
