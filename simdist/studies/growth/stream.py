"""The batched synthetic gradient stream: BF16 local gradients for every ``[seed, rank]`` at once."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

from simdist.gradpath.families import ParamSpec
from simdist.world.spec import ParallelSpec

_POWERS = torch.tensor([2.0**k for k in range(-3, 4)])


class BatchedGradients:
    """BF16 local gradients for every ``[seed, rank]`` at once; counter-based (no RNG state to checkpoint).

    For each ``(seed, step, micro)`` one generator draws, for every parameter,
    one value per *owner* (TP group for dense parameters, rank otherwise) with
    the distribution of `simdist.models.synthetic._normal`: ``randn * scale *
    2**randint(-3, 3)``, rounded to BF16 (one draw for all parameters, then
    split). `local` gives one rank's tensor for `train_rank`.
    """

    def __init__(self, spec: ParallelSpec, params: tuple[ParamSpec, ...], seeds: list[int], scale: float = 1e-3):
        self.spec, self.params, self.seeds, self.scale = spec, params, list(seeds), scale
        tp_groups = [tuple(g) for g in spec.groups("tp")]
        self.owner_index: dict[str, torch.Tensor] = {}
        for p in params:
            if p.family.identical_on_tp_peers:
                idx = [tp_groups.index(tuple(spec.group_of("tp", r))) for r in range(spec.world_size)]
            else:
                idx = list(range(spec.world_size))
            self.owner_index[p.name] = torch.tensor(idx)
        self._owners = [int(self.owner_index[p.name].max()) + 1 for p in params]
        self._spans, start = [], 0
        for p, owners in zip(params, self._owners, strict=True):
            self._spans.append((start, start + owners * math.prod(p.shape)))
            start += owners * math.prod(p.shape)
        self._total = start
        self._cache: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None

    def draw(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """``{param: bf16 tensor [seed, rank, *shape]}`` for this step and micro-step."""
        if self._cache is not None and self._cache[0] == (step, micro):
            return self._cache[1]
        normal, spread = [], []
        for seed in self.seeds:
            g = torch.Generator().manual_seed(zlib.crc32(repr(("growth", seed, step, micro)).encode()))
            spread.append(torch.randint(-3, 4, (self._total,), generator=g))
            normal.append(torch.randn(self._total, generator=g))
        # 2**spread from a table of exact powers of two (the same values torch.pow gives, without its kernels)
        flat = (torch.stack(normal) * self.scale * _POWERS[torch.stack(spread) + 3]).to(torch.bfloat16)
        out = {}
        for p, (start, stop), owners in zip(self.params, self._spans, self._owners, strict=True):
            value = flat[:, start:stop].reshape(len(self.seeds), owners, *p.shape)
            out[p.name] = value.index_select(1, self.owner_index[p.name])
        self._cache = ((step, micro), out)
        return out

    def local(self, seed_index: int) -> Callable[[int, int, int, ParamSpec], torch.Tensor]:
        """A `simdist.gradpath.path.LocalGrads` for one seed (what `train_rank` on `SimWorld` consumes)."""

        def grads(step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
            return self.draw(step, micro)[param.name][seed_index, rank].clone()

        return grads
