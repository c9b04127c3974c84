"""The rank-batched gradient path: every rank of a job, and a batch of independent runs, in one thread.

`BatchedOps` is the `simdist.gradpath.kernel.Ops` of tensors with leading
``[batch, rank]`` dimensions. A group collective gathers each group's members
along the rank dimension, in group-rank order, and applies the group's
`Reduction` to the stacked members -- for any group size and any layout a
`ParallelSpec` derives -- then hands every member its group's result. Nothing
reduces across the batch dimension: batch item ``b`` holds the bits a separate
run would hold (``tests/unit/gradpath/test_batched.py`` proves this against
`simdist.gradpath.path.train_rank` on `SimWorld` threads, for every policy,
reduction and several layouts).

`BatchedPath` runs `simdist.gradpath.kernel.GradPath` (the one implementation
of the stage logic) on `BatchedOps`: the growth study and the Hypothesis
properties use it.

Reductions see each reduction's members in their logical shape: reductions
whose order depends on an element's position (ring chunks, gloo's segments)
are applied with the position plan of one member, vectorised over the batch
(`batched_sum`), never to a tensor whose flat length includes the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch

from simdist.errors import UsageError
from simdist.gradpath.families import ParamSpec
from simdist.gradpath.kernel import GradPath
from simdist.gradpath.path import PathConfig, stochastic_generator
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Trace
from simdist.numerics.rounding import stochastic_round
from simdist.reduce import Reduction
from simdist.world.options import ReductionChoice, read_reduction
from simdist.world.spec import ParallelSpec

__all__ = ["BatchedOps", "BatchedPath", "BatchedTrace", "batched_sum", "initial_buffer"]


def batched_sum(reduction: Reduction, stacked: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``reduction``'s SUM of many independent reductions at once: ``[k, *batch, *shape] -> [*batch, *shape]``.

    ``shape`` is one member's logical shape (default: everything after dim 1, i.e. one batch dimension).
    Equal, bit for bit, to ``reduction.reduce`` of each reduction ``stacked[:, i]`` in turn. The reduction says how
    (`Reduction.sum_many`: its fold plan, applied to the whole batch with the per-element positions of
    one member; ``position_free`` orders on the stacked tensor as it is; or its own batched schedule); this
    module never looks at the reduction's class.
    """
    return reduction.sum_many(stacked, shape)


GroupTable = tuple[str, torch.Tensor, torch.Tensor, int, int]


@functools.lru_cache(maxsize=64)
def _group_tables(spec: ParallelSpec) -> tuple[dict[str, GroupTable], torch.Tensor]:
    """Per group kind: how the groups sit in the rank dimension (``blocks``, ``strided`` or ``index``), the
    member and group-of-rank index tensors, the group count and size; and the TP-rank-0 mask."""
    tables = {}
    for kind in ("tp", "dp", "edp", "ep"):
        groups = spec.groups(kind)
        count, k = len(groups), len(groups[0])
        if all(group == tuple(range(g * k, (g + 1) * k)) for g, group in enumerate(groups)):
            layout = "blocks"  # rank = g * k + j: the groups are a view [G, k] of the rank dimension
        elif all(group == tuple(range(g, count * k, count)) for g, group in enumerate(groups)):
            layout = "strided"  # rank = j * G + g: a view [k, G]
        else:
            layout = "index"
        members = torch.tensor(groups).reshape(-1)
        where = torch.empty(spec.world_size, dtype=torch.long)
        for g, group in enumerate(groups):
            where[list(group)] = g
        tables[kind] = (layout, members, where, count, k)
    tp_root = torch.zeros(spec.world_size, dtype=torch.bool)
    for group in spec.groups("tp"):
        tp_root[group[0]] = True
    return tables, tp_root


class BatchedOps:
    """`simdist.gradpath.kernel.Ops` for ``[batch, rank, ...]`` tensors of a `ParallelSpec`.

    ``reduction`` chooses the reduction as every front end reads it (`simdist.world.options.read_reduction`: a
    name, a reduction, or a group kind -> reduction table; default `simdist.world.options.DEFAULT_REDUCTION`); a
    callable ``(ranks) -> Reduction`` is refused, since this path applies one reduction to every group of a kind.
    ``seeds`` are the per-batch-item seeds of stochastic rounding (``PathConfig.seed`` of each run).
    """

    def __init__(
        self,
        spec: ParallelSpec,
        seeds: Sequence[int],
        *,
        reduction: ReductionChoice | None = None,
    ) -> None:
        self.spec, self.seeds = spec, list(seeds)
        self.batch: tuple[int, ...] = (len(self.seeds), spec.world_size)
        self.table = read_reduction(reduction, callable_ok=False)
        self.reductions, self.default_reduction = self.table.named, self.table.default
        self._tables, self._tp_root = _group_tables(spec)

    def reduction_for(self, kind: str) -> Reduction:
        return self.table.for_kind(kind)

    def all_reduce(self, value: torch.Tensor, kind: str, reduction: Reduction | None = None) -> torch.Tensor:
        reduction = reduction or self.reduction_for(kind)
        layout, members, where, count, k = self._tables[kind]
        dims = value.shape
        batch, shape = dims[0], dims[2:]
        if k == 1:
            return batched_sum(reduction, value.unsqueeze(0), shape)
        if layout == "index":
            stacked = value.index_select(1, members).view(batch, count, k, *shape).movedim(2, 0)
            return batched_sum(reduction, stacked, shape).index_select(1, where)  # [batch, G, *shape] to the ranks
        # the groups are views [k, batch, G, *shape] of the rank dimension (rank g * k + j: blocks; j * G + g:
        # strided); every member's copy of its group's result is written into the same view of the result
        result = torch.empty_like(value, memory_format=torch.contiguous_format)
        size, vs, rs = (k, batch, count, *shape), value.stride(), result.stride()
        if layout == "blocks":
            stacked = value.as_strided(size, (vs[1], vs[0], k * vs[1], *vs[2:]))
            out = result.as_strided(size, (rs[1], rs[0], k * rs[1], *rs[2:]))
        else:
            stacked = value.as_strided(size, (count * vs[1], vs[0], vs[1], *vs[2:]))
            out = result.as_strided(size, (count * rs[1], rs[0], rs[1], *rs[2:]))
        reduction.sum_many_into(stacked, out, shape)
        return result

    def stochastic_cast(self, value: torch.Tensor, dtype: torch.dtype, key: tuple[int, int, int]) -> torch.Tensor:
        step, micro, index = key
        out = torch.empty(value.shape, dtype=dtype)
        for b, seed in enumerate(self.seeds):
            for rank in range(self.spec.world_size):
                generator = stochastic_generator(seed, step, micro, rank, index)
                out[b, rank] = stochastic_round(value[b, rank], dtype, generator)
        return out

    def on_tp_root(self, value: torch.Tensor) -> torch.Tensor:
        mask = self._tp_root.view(1, -1, *([1] * (value.dim() - 2)))
        return torch.where(mask, value, torch.zeros((), dtype=value.dtype))

    def grad_norm(self, total: torch.Tensor) -> torch.Tensor:
        # the per-rank adapter's ``float(total) ** 0.5``, element by element (Python's pow, not torch's sqrt)
        values = [[[float(x) ** 0.5 for x in rank] for rank in item] for item in total.tolist()]
        return torch.tensor(values, dtype=torch.float64)


class BatchedTrace:
    """Captures of a batched run: ``values[(step, micro, param, stage)] = [batch, rank, *shape]`` copies."""

    def __init__(self, keep: frozenset[str] | None = None) -> None:
        self.keep = keep
        self.values: dict[tuple[int, int, str, str], torch.Tensor] = {}
        self.scalars: dict[tuple[int, str], torch.Tensor] = {}

    def capture(self, step: int, micro: int, param: str, stage: str, value: torch.Tensor) -> None:
        if self.keep is None or stage in self.keep:
            self.values[(step, micro, param, stage)] = value.detach().clone()

    def scalar(self, step: int, name: str, value: torch.Tensor) -> None:
        self.scalars[(step, name)] = value.reshape(value.shape[:2]).clone()

    def rank_traces(self, item: int) -> list[Trace]:
        """Batch item ``item`` as one `Trace` per rank, comparable with `train_rank`'s traces."""
        ranks = next(iter(self.values.values())).shape[1] if self.values else 0
        if not ranks and self.scalars:
            ranks = next(iter(self.scalars.values())).shape[1]
        traces = [Trace(rank, self.keep) for rank in range(ranks)]
        for key, value in self.values.items():
            for rank, trace in enumerate(traces):
                trace.values[key] = value[item, rank]
        for scalar_key, scalar in self.scalars.items():
            for rank, trace in enumerate(traces):
                trace.scalars[scalar_key] = float(scalar[item, rank])
        return traces


def initial_buffer(
    spec: ParallelSpec,
    params: Sequence[ParamSpec],
    initial: Sequence[Callable[[int, ParamSpec], torch.Tensor]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The flat ``[batch, rank, N]`` initial parameter buffer: ``initial[b](rank, param)`` for every item, rank,
    parameter (in parameter order), in ``dtype``."""
    return torch.stack(
        [
            torch.stack(
                [
                    torch.cat([init(rank, p).to(dtype).reshape(-1) for p in params])
                    if params
                    else torch.zeros(0, dtype=dtype)
                    for rank in range(spec.world_size)
                ]
            )
            for init in initial
        ]
    )


BatchedGrads = Callable[[int, int], Mapping[str, torch.Tensor]]
"""``(step, micro) -> {param: BF16 local gradient [batch, rank, *shape]}``."""


class BatchedPath:
    """`GradPath` on `BatchedOps`: one policy's runs for every batch item and rank, stepped together.

    ``initial`` gives each batch item's ``(rank, param) -> initial weight`` (one callable per item, e.g.
    `simdist.sources.synthetic.InitialWeights` per seed), or is the flat ``[batch, rank, N]`` buffer
    (`initial_buffer`; it is copied); ``seeds`` are the items' ``PathConfig.seed``
    (default: ``config.seed`` for every item). ``reduction`` goes to `BatchedOps`. ``keep`` selects captures
    (default none); ``norm`` computes the global gradient norm (always when ``config.max_norm > 0``).
    """

    def __init__(
        self,
        spec: ParallelSpec,
        params: Sequence[ParamSpec],
        policy: Policy,
        config: PathConfig,
        initial: Sequence[Callable[[int, ParamSpec], torch.Tensor]] | torch.Tensor,
        seeds: Sequence[int] | None = None,
        *,
        reduction: ReductionChoice | None = None,
        keep: frozenset[str] | None = frozenset(),
        norm: bool = False,
    ) -> None:
        seeds = [config.seed] * len(initial) if seeds is None else list(seeds)
        if len(seeds) != len(initial):
            raise UsageError(f"{len(initial)} initial-weight sets but {len(seeds)} seeds")
        self.spec, self.config = spec, config
        self.ops = BatchedOps(spec, seeds, reduction=reduction)
        self.trace = BatchedTrace(keep)
        if isinstance(initial, torch.Tensor):
            lp = initial.to(policy.grad_dtype, copy=True)
        else:
            lp = initial_buffer(spec, params, initial, policy.grad_dtype)
        self.path = GradPath(
            self.ops,
            params,
            policy,
            config,
            lp,
            tp=spec.tp,
            dp=spec.dp,
            capture=self.trace.capture if keep != frozenset() else None,  # keeps nothing: no capture calls
            scalar=self.trace.scalar,
            norm=norm,
        )
        self.step = 0

    def run_step(self, grads: BatchedGrads) -> None:
        """One optimizer step: ``config.gas`` micro-steps of ``grads(step, micro)``, then the boundary."""
        path, step = self.path, self.step
        for micro in range(self.config.gas):
            local = grads(step, micro)
            path.begin_micro()
            for slot in path.delivery_order():
                path.deliver(slot.spec.name, local[slot.spec.name], step, micro)
            path.end_micro(step, micro)
        path.boundary(step)
        self.step += 1

    def run(self, grads: BatchedGrads, steps: int | None = None) -> BatchedTrace:
        """``steps`` (default ``config.steps``) optimizer steps; the captures."""
        for _ in range(self.config.steps if steps is None else steps):
            self.run_step(grads)
        return self.trace

    def state(self) -> dict[str, torch.Tensor]:
        return self.path.state()

    def load(self, state: dict[str, torch.Tensor], step: int) -> None:
        self.path.load(state)
        self.step = step

    def per_param(self, which: str) -> dict[str, torch.Tensor]:
        """``{param: copy [batch, rank, *shape]}`` of ``master``, ``adam_m``, ``adam_v`` or ``lp``."""
        attr = {"master": "master", "adam_m": "m", "adam_v": "v", "lp": "lp"}[which]
        return {name: value.clone() for name, value in self.path.params(attr).items()}
