"""The batched synthetic gradient stream: BF16 local gradients for every ``[seed, rank]`` at once."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

from simdist.gradpath.families import ParamSpec
from simdist.world.spec import ParallelSpec


class BatchedGradients:
    """BF16 local gradients for every ``[seed, rank]`` at once; counter-based (no RNG state to checkpoint).

    For each ``(seed, step, micro)`` one generator draws, for every parameter,
    one value per *owner* (TP group for dense parameters, rank otherwise) with
    the distribution of `simdist.sources.synthetic._normal`: ``randn * scale *
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
        # parameters owned by every rank in rank order are views of the draw; the rest gather their owners' rows
        self._identity = {
            p.name: bool(torch.equal(self.owner_index[p.name], torch.arange(spec.world_size))) for p in params
        }
        self._cache: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None

    def draw(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """``{param: bf16 tensor [seed, rank, *shape]}`` for this step and micro-step.

        Each seed's generator is seeded ``crc32(("growth", seed, step, micro))`` and draws ``randint(-3, 4)`` then
        ``randn``, as `draw_reference` spells out. Done here faster with the same bits (tested): one generator
        re-seeded per seed; the draws written in place into one ``[seed, total]`` buffer each (``random_`` with the
        range shifted by the FP32 exponent bias 127: the same random integers, as the range keeps its 7 values;
        ``normal_``); ``2**k`` built from those exponent bits instead of ``torch.pow``; a parameter owned rank by rank
        returned as a view of the draw (not contiguous) instead of a gathered copy. The generators' own work, 2 x 3616
        values per seed at world 4, is most of what is left.
        """
        if self._cache is not None and self._cache[0] == (step, micro):
            return self._cache[1]
        count = len(self.seeds)
        biased = torch.empty(count, self._total, dtype=torch.int32)  # fresh buffers: rank threads may draw at once
        normal = torch.empty(count, self._total)
        g = torch.Generator()
        for i, seed in enumerate(self.seeds):
            g.manual_seed(zlib.crc32(repr(("growth", seed, step, micro)).encode()))
            biased[i].random_(124, 131, generator=g)  # 127 + k, k in [-3, 3]: randint's integers, shifted
            normal[i].normal_(generator=g)  # randn's values
        powers = biased.bitwise_left_shift_(23).view(torch.float32)  # exactly 2**k: exponent field 127 + k, mantissa 0
        flat = normal.mul_(self.scale).mul_(powers).to(torch.bfloat16)  # (normal * scale) * 2**k, as the reference
        out = {}
        for p, (start, stop), owners in zip(self.params, self._spans, self._owners, strict=True):
            value = flat[:, start:stop].view(count, owners, *p.shape)
            out[p.name] = value if self._identity[p.name] else value.index_select(1, self.owner_index[p.name])
        self._cache = ((step, micro), out)
        return out

    def draw_reference(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """`draw` written plainly (a generator per seed, ``randint(-3, 4)``, ``torch.pow``, a gather per parameter):
        the definition `draw` is tested against, bit for bit; not used by runs."""
        normal, spread = [], []
        for seed in self.seeds:
            g = torch.Generator().manual_seed(zlib.crc32(repr(("growth", seed, step, micro)).encode()))
            spread.append(torch.randint(-3, 4, (self._total,), generator=g))
            normal.append(torch.randn(self._total, generator=g))
        flat = torch.stack(normal) * self.scale * torch.pow(2.0, torch.stack(spread).to(torch.float32))
        flat = flat.to(torch.bfloat16)
        out = {}
        for p, (start, stop), owners in zip(self.params, self._spans, self._owners, strict=True):
            value = flat[:, start:stop].reshape(len(self.seeds), owners, *p.shape)
            out[p.name] = value.index_select(1, self.owner_index[p.name])
        return out

    def local(self, seed_index: int) -> Callable[[int, int, int, ParamSpec], torch.Tensor]:
        """A `simdist.gradpath.path.LocalGrads` for one seed (what `train_rank` on `SimWorld` consumes)."""

        def grads(step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
            return self.draw(step, micro)[param.name][seed_index, rank].clone()

        return grads
