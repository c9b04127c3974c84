"""Seeded synthetic parameters and BF16 local gradients with every folding family present.

The gradients mimic what the folded forward leaves on each rank:

* dense parameters (weights, LayerNorm) are replicated and see the same
  tokens on every TP peer, so TP peers hold identical gradients (different
  across data-parallel replicas);
* router gradients differ between TP peers: each peer holds ``tp x`` its own
  routed-token slice. This matters: with identical peers the FP32 average is
  exactly the BF16 value and the #8913 writeback rounds nothing;
* model-parallel shards and routed experts are local to their rank.

Magnitudes are realistic for a small model's gradients (about ``1e-3``). Two named input distributions
(`Inputs`, `synthetic_gradients`): ``rounding`` (the studies' and cases' default) spreads elements over 31
binades and shifts each owner's (rank's, or TP group's for dense parameters) magnitudes by 0..3 binades, so
that FP32 and BF16 sums of a few of them round and their order, group and dtype show in the bits;
``narrow`` (3 binades either side, the distribution every study used before) makes most FP32 sums of a
few BF16 values exact, so order never shows: it is kept only as a named variant.
"""

from __future__ import annotations

import enum
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


def _normal(shape, seed: int, scale: float, spread: int = 3, shift: int = 0) -> torch.Tensor:
    """``normal * scale * 2**(k + shift)`` in BF16, ``k`` uniform in ``[-spread, spread]`` per element."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-spread, spread + 1, shape, generator=g).to(torch.float32) + shift
    return (torch.randn(shape, generator=g) * scale * torch.pow(2.0, exponent)).to(torch.bfloat16)


class Inputs(enum.StrEnum):
    """A named distribution of the synthetic local gradients (`synthetic_gradients`)."""

    ROUNDING = "rounding"
    """31 binades (``k`` in ``[-15, 15]``) and a per-owner shift of 0..3 binades: sums round (the default)."""
    NARROW = "narrow"
    """7 binades (``k`` in ``[-3, 3]``), no shift: the old distribution, whose few-term FP32 sums are mostly exact."""


INPUT_SETTINGS: dict[Inputs, tuple[int, int]] = {Inputs.ROUNDING: (15, 3), Inputs.NARROW: (3, 0)}
"""``inputs -> (spread, owner_shift)`` of `SyntheticGradients`."""


def describe_inputs(inputs: Inputs | str) -> str:
    """One line naming the distribution, as verdicts print it."""
    spread, shift = INPUT_SETTINGS[Inputs(inputs)]
    return f"{Inputs(inputs).value}: BF16 normal * 1e-3 * 2**k, k uniform in [-{spread}, {spread}] per element" + (
        f", each owner's magnitudes shifted by 0..{shift} binades" if shift else ""
    )


def synthetic_gradients(spec: ParallelSpec, seed: int = 0, inputs: Inputs | str = Inputs.ROUNDING):
    """`SyntheticGradients` drawn from the named distribution ``inputs``."""
    spread, shift = INPUT_SETTINGS[Inputs(inputs)]
    return SyntheticGradients(spec, seed=seed, spread=spread, owner_shift=shift)


class SyntheticGradients:
    """``(step, micro, rank, param) -> BF16 local gradient`` for a spec, reproducible from ``seed``."""

    def __init__(
        self, spec: ParallelSpec, seed: int = 0, scale: float = 1e-3, spread: int = 3, owner_shift: int = 0
    ) -> None:
        self.spec = spec
        self.owner_shift = owner_shift
        """Each owner's elements are scaled by a further ``2**j``, ``j`` in ``[0, owner_shift]`` from the owner's
        key (0: none, the old draws bit for bit): ranks hold different magnitudes."""
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
        owner = self.owner(rank, param)
        key = _seed(self.seed, step, micro, param.name, owner)
        shift = _seed("shift", self.seed, owner) % (self.owner_shift + 1) if self.owner_shift else 0
        return _normal(param.shape, key, self.scale, self.spread, shift)


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
