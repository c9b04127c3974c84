"""Seeded synthetic parameters and BF16 local gradients with every folding family present.

The gradients mimic what the folded forward leaves on each rank:

* dense parameters (weights, LayerNorm) are replicated and see the same
  tokens on every TP peer, so TP peers hold identical gradients (different
  across data-parallel replicas);
* router gradients differ between TP peers: each peer holds ``tp x`` its own
  routed-token slice. This matters: with identical peers the FP32 average is
  exactly the BF16 value and the #8913 writeback rounds nothing;
* model-parallel shards and routed experts are local to their rank.

Magnitudes are realistic for a small model's gradients (about ``1e-3``, with a
spread of a few binades).
"""

from __future__ import annotations

import zlib

import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.world.spec import ParallelSpec

DEFAULT_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("router.weight", Family.ROUTER_GATE_REPLICATED, (4, 16)),
    ParamSpec("router_partial.weight", Family.ROUTER_GATE_PARTIAL, (4, 16)),
    ParamSpec("dense.weight", Family.DENSE, (16, 16)),
    ParamSpec("norm.weight", Family.DENSE, (16,)),
    ParamSpec("attn_tp.weight", Family.MODEL_PARALLEL, (8, 16)),
    ParamSpec("expert.w1", Family.EXPERT, (16, 32)),
)
"""One parameter of each folding family (two for dense: a weight and a LayerNorm)."""


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def _normal(shape, seed: int, scale: float, spread: int = 3) -> torch.Tensor:
    """``normal * scale * 2**k`` in BF16, ``k`` uniform in ``[-spread, spread]`` per element."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-spread, spread + 1, shape, generator=g).to(torch.float32)
    return (torch.randn(shape, generator=g) * scale * torch.pow(2.0, exponent)).to(torch.bfloat16)


class SyntheticGradients:
    """``(step, micro, rank, param) -> BF16 local gradient`` for a spec, reproducible from ``seed``."""

    def __init__(self, spec: ParallelSpec, seed: int = 0, scale: float = 1e-3, spread: int = 3) -> None:
        self.spec = spec
        self.seed = seed
        self.scale = scale
        self.spread = spread
        """Elements are scaled by ``2**k``, ``k`` uniform in ``[-spread, spread]`` (3: a few binades; a wider
        spread makes FP32 sums of a few BF16 values round, so their order shows in the bits)."""

    def owner(self, rank: int, param: ParamSpec) -> tuple:
        """Which ranks share one value: TP peers for dense params, else the rank itself."""
        if param.family.identical_on_tp_peers:
            return ("tp-group", self.spec.group_of("tp", rank))
        return ("rank", rank)

    def __call__(self, step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
        key = _seed(self.seed, step, micro, param.name, self.owner(rank, param))
        return _normal(param.shape, key, self.scale, self.spread)


class InitialWeights:
    """``(rank, param) -> BF16 initial weight``: replicated where the layout replicates the parameter.

    A class (not a closure) so that rank programs using it pickle into real
    torch.distributed processes.
    """

    def __init__(self, spec: ParallelSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed

    def __call__(self, rank: int, param: ParamSpec) -> torch.Tensor:
        owner: tuple[str | int, ...]
        if param.family is Family.MODEL_PARALLEL:
            owner = ("tp-rank", self.spec.group_of("tp", rank).index(rank))
        elif param.family is Family.EXPERT:
            owner = ("ep-rank", self.spec.group_of("ep", rank).index(rank))
        else:
            owner = ("replicated",)
        return _normal(param.shape, _seed("init", self.seed, param.name, owner), 0.02 * 8)
