"""The ``deepspeed-wrappers`` case's oracle and judge: the intended FP32 computation, and its comparison with the
real engine's captures.

`oracle`, written for the case and sharing no code with DeepSpeed or simdist's gradient path: per micro-step
the intended correction in FP32 (TP peers summed in gloo's all-reduce order, `GLOO`, then ``/tp`` for averaged
families; experts ``/tp``; TP-sharded weights untouched), FP32 accumulation over micro-steps, the FP32
data-parallel reduction (the DP group's sum, or the EDP group's for experts, divided by the number of DP
replicas: a folded expert's EDP group holds TP peers' disjoint token slices of one batch as well as other DP
replicas, so its sum over EDP is divided by ``dp``, not by the EDP size), the global norm over the distinct
shards, clipping, and ``torch.optim.AdamW`` on FP32 masters. `OracleControl` puts one deliberate error into it,
for the case's power checks (`simdist.cases.deepspeed_wrappers.checks`).

`judge_run` compares one run's captures on every rank with the oracle: per boundary, how many elements differ,
the largest error over the sum of the absolute terms, and an effect class (``bitwise``, ``fp32-order``, ``bf16``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from simdist.cases.deepspeed.engine import BETAS, EPS, LR, WEIGHT_DECAY, EngineCapture, EngineRun
from simdist.cases.deepspeed.spy import BOUNDARY_PASS
from simdist.gradpath.families import Correction, Family
from simdist.gradpath.oracle import dp_kind
from simdist.numerics.floats import bits
from simdist.reduce import make_reduction
from simdist.sources.synthetic import InitialWeights, Inputs, synthetic_gradients
from simdist.world.spec import ParallelSpec

BF16_LEVEL = 2.0**-16
"""An error above this fraction of sum|terms| is a BF16 rounding; FP32 order effects stay far below it."""

GLOO = make_reduction("gloo")
"""The order of the oracle's TP sums: gloo's (the real engine all-reduces on gloo processes)."""


# -- the oracle (independent: plain loops, FP32, torch.optim.AdamW) ----------------------------------------------


@dataclass
class OracleStep:
    """What the intended FP32 computation gives on every rank for one step (keys carry the rank)."""

    local: dict = field(default_factory=dict)
    """``(micro, rank, param) -> BF16 local gradient`` (``g / GAS``)."""
    corrected: dict = field(default_factory=dict)
    """``(micro, rank, param) -> (FP32 corrected gradient, sum|terms|)``."""
    accumulated: dict = field(default_factory=dict)
    """``(micro, rank, param) -> (FP32 running sum over micro-steps, sum|terms|)``."""
    reduced: dict = field(default_factory=dict)
    """``(rank, param) -> (FP32 DP average, sum|terms|)`` before clipping."""
    norm: float = 0.0
    master: dict = field(default_factory=dict)
    """``(rank, param) -> (FP32 master, lr x steps)``: an AdamW step moves an element by about ``lr``."""
    exp_avg: dict = field(default_factory=dict)
    """``(rank, param) -> (exp_avg, its sum|terms|)`` (the gradient's terms through the moment's recurrence)."""
    exp_avg_sq: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OracleControl:
    """A deliberate error in `oracle`, for the case's power checks (`CONTROLS`); the default is no change."""

    tp_rank_order: bool = False
    """Sum TP peers in a plain rank-order loop (the old oracle's order) instead of gloo's."""
    tp_sum_dtype: torch.dtype = torch.float32
    """The dtype of the TP sum (and ``/tp``): BF16 is the error."""
    corrected_dtype: torch.dtype | None = None
    """Round the corrected value to this dtype before it is accumulated (BF16: the #8913 writeback)."""
    experts_over_dp: bool = False
    """Reduce routed experts over the dense DP group instead of EDP."""
    dp_then_tp: bool = False
    """Apply the TP correction after the DP reduction instead of to each micro-step's gradient."""
    correct_again_at_boundary: bool = False
    """Correct the accumulated gradient once more at the boundary (the correction-once marker never set)."""


NO_CONTROL = OracleControl()


def _correct(
    family: Family, tp: int, own: torch.Tensor, peers: list[torch.Tensor], control: OracleControl = NO_CONTROL
) -> tuple[torch.Tensor, ...]:
    """The intended TP correction of one micro-step in FP32 (``peers`` in TP rank order); value and sum|terms|.

    The TP sum is gloo's all-reduce order (`GLOO`: the model of gloo's order found by experiment and pinned to
    real gloo by ``simdist/testing/_internal/gloo_probe.py``): DeepSpeed all-reduces each parameter's FP32 copy over
    the TP group on gloo, and for more than two members gloo's order is not rank order (the old rank-order loop
    differed from the real engine in 80/6400 elements at TP4 on rounding inputs, issue 30)."""
    correction = family.correction(tp)
    if correction in (Correction.AVERAGE, Correction.SUM):
        terms = torch.zeros_like(own, dtype=torch.float64)
        for peer in peers:
            terms = terms + peer.double().abs()  # exact: BF16 terms of 31 binades fit FP64's 53 bits
        dtype = control.tp_sum_dtype
        if control.tp_rank_order:
            total = torch.zeros_like(own, dtype=dtype)
            for peer in peers:
                total = total + peer.to(dtype)
        else:
            total = GLOO.sum([peer.to(dtype) for peer in peers])
        if correction is Correction.AVERAGE:
            return (total / tp).float(), terms / tp
        return total.float(), terms
    if correction is Correction.EXPERT_TP_CANCEL:
        return own.float() / tp, own.double().abs() / tp
    return own.float(), own.double().abs()


def oracle(
    spec: ParallelSpec,
    run: EngineRun,
    seed: int = 0,
    inputs: Inputs | str = Inputs.ROUNDING,
    control: OracleControl = NO_CONTROL,
    clip_norms: dict[int, float] | None = None,
) -> list[OracleStep]:
    """The intended FP32 computation for ``run`` on ``spec``, step by step, on the ``inputs`` distribution
    (``control``: one deliberate error, for the power checks).

    ``clip_norms`` (``step -> norm``) replaces the oracle's global norm in the clipping coefficient only (the
    ``norm`` it reports stays its own): given the engine's norm, it tells whether the clipping coefficient
    alone explains a difference (`EPILOGUE_MASTERS`)."""
    params = run.params()
    source, initial = synthetic_gradients(spec, seed, inputs), InitialWeights(spec, seed)
    adam = _OracleAdam(spec, params, initial)
    out = []
    for step in range(run.steps):
        o = OracleStep()
        for micro in range(run.gas):
            _micro_step(spec, run, params, source, step, micro, control, o)
        last = run.gas - 1
        if control.correct_again_at_boundary:
            _correct_accumulated(spec, params, o.accumulated, last, control)
        _dp_reduce(spec, params, o, last, control)
        if control.dp_then_tp:
            _correct_reduced(spec, params, o.reduced, control)
        o.norm = _global_norm(spec, params, o.reduced)
        norm = o.norm if clip_norms is None else clip_norms[step]
        scale = run.clip / (norm + 1e-6) if run.clip and norm > run.clip else 1.0
        adam.step(step, o, scale)
        out.append(o)
    return out


def _micro_step(
    spec: ParallelSpec, run: EngineRun, params, source, step: int, micro: int, control: OracleControl, o: OracleStep
) -> None:
    """One micro-step into ``o``: each rank's BF16 local gradient, its TP-corrected FP32 value, the FP32 sum
    over the micro-steps so far (each with the FP64 sum of the magnitudes of its terms)."""
    ranks = range(spec.world_size)
    uncorrected = Family.MODEL_PARALLEL  # a family whose correction is none: what dp_then_tp does per micro-step
    for r in ranks:
        for p in params:
            o.local[(micro, r, p.name)] = (source(step, micro, r, p).float() / run.gas).to(torch.bfloat16)
    for r in ranks:
        for p in params:
            peers = [o.local[(micro, q, p.name)] for q in spec.group_of("tp", r)]
            family = uncorrected if control.dp_then_tp else p.family
            value, terms = _correct(family, spec.tp, o.local[(micro, r, p.name)], peers, control)
            if control.corrected_dtype is not None:
                value = value.to(control.corrected_dtype).float()
            o.corrected[(micro, r, p.name)] = (value, terms)
            if micro == 0:
                acc, acc_terms = value, terms
            else:
                prev, prev_terms = o.accumulated[(micro - 1, r, p.name)]
                acc, acc_terms = prev + value, prev_terms + terms
            o.accumulated[(micro, r, p.name)] = (acc, acc_terms)


def _dp_reduce(spec: ParallelSpec, params, o: OracleStep, last: int, control: OracleControl) -> None:
    """The last micro-step's accumulated gradients averaged over each parameter's data-parallel group, in rank
    order in FP32 (``o.reduced``)."""
    for r in range(spec.world_size):
        for p in params:
            # the independent oracle's own group rule, not the family table the engines read (issue 30)
            group = spec.group_of(dp_kind(p.family), r)
            if control.experts_over_dp and p.family is Family.EXPERT:
                group = spec.group_of("dp", r)
            total = torch.zeros(p.shape, dtype=torch.float32)
            terms = torch.zeros(p.shape, dtype=torch.float64)
            for q in group:
                value, t = o.accumulated[(last, q, p.name)]
                total, terms = total + value, terms + t
            o.reduced[(r, p.name)] = (total / spec.dp, terms / spec.dp)


class _OracleAdam:
    """Each rank's FP32 masters under torch's AdamW, and the FP64 magnitudes of the moments' terms (the error
    scale of the masters and moments rows)."""

    def __init__(self, spec: ParallelSpec, params, initial) -> None:
        ranks = range(spec.world_size)
        self.ranks, self.params = ranks, params
        self.masters = {(r, p.name): initial(r, p).float().clone().requires_grad_(False) for r in ranks for p in params}
        self.optimizers = {
            r: torch.optim.AdamW(
                [self.masters[(r, p.name)] for p in params], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
            )
            for r in ranks
        }
        self.m_terms = {key: torch.zeros(m.shape, dtype=torch.float64) for key, m in self.masters.items()}
        self.v_terms = {key: torch.zeros(m.shape, dtype=torch.float64) for key, m in self.masters.items()}

    def step(self, step: int, o: OracleStep, scale: float) -> None:
        """One optimizer step on ``o.reduced`` clipped by ``scale``; masters and moments recorded in ``o``."""
        masters, m_terms, v_terms = self.masters, self.m_terms, self.v_terms
        for r in self.ranks:
            for p in self.params:
                masters[(r, p.name)].grad = o.reduced[(r, p.name)][0] * scale
            self.optimizers[r].step()
            for p in self.params:
                key = (r, p.name)
                master = masters[key]
                state = self.optimizers[r].state[master]
                g_terms = o.reduced[key][1] * scale
                m_terms[key] = BETAS[0] * m_terms[key] + (1 - BETAS[0]) * g_terms
                v_terms[key] = BETAS[1] * v_terms[key] + (1 - BETAS[1]) * g_terms**2
                o.master[key] = (master.detach().clone(), torch.full(p.shape, LR * (step + 1), dtype=torch.float64))
                o.exp_avg[key] = (state["exp_avg"].clone(), m_terms[key].clone())
                o.exp_avg_sq[key] = (state["exp_avg_sq"].clone(), v_terms[key].clone())


def _correct_accumulated(spec: ParallelSpec, params, accumulated: dict, last: int, control: OracleControl) -> None:
    """Control ``correct_again_at_boundary``: the last micro-step's accumulated gradient corrected once more."""
    before = dict(accumulated)
    for r in range(spec.world_size):
        for p in params:
            peers = [before[(last, q, p.name)][0] for q in spec.group_of("tp", r)]
            value, _ = _correct(p.family, spec.tp, before[(last, r, p.name)][0], peers, control)
            accumulated[(last, r, p.name)] = (value, before[(last, r, p.name)][1])


def _correct_reduced(spec: ParallelSpec, params, reduced: dict, control: OracleControl) -> None:
    """Control ``dp_then_tp``: the TP correction applied to the DP-reduced gradient."""
    before = dict(reduced)
    for r in range(spec.world_size):
        for p in params:
            peers = [before[(q, p.name)][0] for q in spec.group_of("tp", r)]
            value, _ = _correct(p.family, spec.tp, before[(r, p.name)][0], peers, control)
            terms = before[(r, p.name)][1]
            if p.family.correction(spec.tp).divides:
                terms = terms / spec.tp
            reduced[(r, p.name)] = (value, terms)


def _global_norm(spec: ParallelSpec, params, reduced: dict) -> float:
    """The L2 norm of the whole model's gradient: each distinct shard once (FP32 squares, summed in FP64)."""
    total = 0.0
    for p in params:
        if p.family is Family.EXPERT:
            holders = {spec.group_of("edp", r)[0] for r in range(spec.world_size)}  # one per expert shard
        elif p.family is Family.MODEL_PARALLEL:
            holders = {spec.group_of("dp", r)[0] for r in range(spec.world_size)}  # one per TP shard
        else:
            holders = {0}  # replicated after the TP correction and the DP average
        for r in holders:
            total += float((reduced[(r, p.name)][0].float() ** 2).sum())
    return total**0.5


# -- comparison -----------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One boundary (capture) of one run against the oracle."""

    boundary: str
    compared: int
    differing: int
    max_error_over_terms: float
    params_differing: list[str]
    effect: str
    note: str = ""


@dataclass
class RunResult:
    label: str
    optimizer_class: str
    error: str
    rows: list[Row] = field(default_factory=list)
    skipped_corrections: list[str] = field(default_factory=list)
    """``micro m: param`` where the helper skipped the TP correction because the marker was set."""
    correction_sites: list[str] = field(default_factory=list)
    """Which DeepSpeed code applied the TP correction (``bf16_optimizer``, ``stage_1_and_2``, ...)."""
    buffer_dtypes: list[str] = field(default_factory=list)
    """The dtypes of the gradient buffers the correction wrote back into (``torch.bfloat16``: a BF16 boundary)."""
    norms: dict[int, float] = field(default_factory=dict)
    """Each rank's global gradient norm at step 0 (``engine.get_global_grad_norm``)."""
    oracle_norm: float = 0.0
    narrowing: list[str] = field(default_factory=list)
    """The sites ``simdist.audit`` found in rank 0's process during this run's backward and step."""


class _Acc:
    """Accumulates one row: differing elements and the largest error / sum|terms|."""

    def __init__(self) -> None:
        self.compared = self.differing = 0
        self.ratio = 0.0
        self.params: set[str] = set()

    def add(self, param: str, got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor | None) -> None:
        got, want = got.float().reshape(want.shape), want.float()
        self.compared += want.numel()
        differ = bits(got) != bits(want)
        n = int(differ.sum())
        if not n:
            return
        self.differing += n
        self.params.add(param)
        err = (got.double() - want.double()).abs()
        scale = terms.double() if terms is not None else want.double().abs()
        ratio = err / scale.clamp_min(torch.finfo(torch.float64).tiny)
        self.ratio = max(self.ratio, float(ratio[differ].max()))

    def row(self, boundary: str, note: str = "", classify: bool = True) -> Row:
        effect = "bitwise" if not self.differing else "bf16" if self.ratio > BF16_LEVEL else "fp32-order"
        if self.differing and not classify:
            effect = "differs"
        return Row(boundary, self.compared, self.differing, self.ratio, sorted(self.params), effect, note)


def judge_run(
    spec: ParallelSpec,
    run: EngineRun,
    captures: list[EngineCapture],
    seed: int = 0,
    inputs: Inputs | str = Inputs.ROUNDING,
    control: OracleControl = NO_CONTROL,
    engine_norm: bool = False,
) -> RunResult:
    """Compare one run's captures on every rank with `oracle` (with ``control``'s error, for a power check;
    ``engine_norm``: clipping by rank 0's reported global norm instead of the oracle's)."""
    first = captures[0]
    error = next((c.error for c in captures if c.error), "")
    result = RunResult(f"{spec.describe()} {run.label}", first.optimizer_class, error)
    if error:
        return result
    steps = oracle(spec, run, seed, inputs, control, dict(first.norm) if engine_norm else None)
    tally = _Tally()
    for c in captures:
        tally.add(c, steps, run)
        result.norms[c.rank] = c.norm.get(0, float("nan"))
    result.rows = tally.rows()
    result.narrowing = _sites(first)
    result.correction_sites = sorted(tally.sites)
    result.buffer_dtypes = sorted(tally.dtypes)
    result.oracle_norm = steps[0].norm
    result.skipped_corrections = sorted(tally.skipped)
    return result


_LABELS = {
    "local": "BF16 local gradient (input check)",
    "fp32": "FP32 TP-corrected value before write-back",
    "writeback": "corrected gradient after write-back",
    "hp": "FP32 accumulated gradient after each micro-step",
    "reduced": "DP-reduced gradient (safe_get_full_grad)",
    "master": "FP32 master after step",
    "exp_avg": "Adam exp_avg",
    "exp_sq": "Adam exp_avg_sq",
}
"""Each compared boundary's row label, in the table's order."""


class _Tally:
    """Every rank's captures of one run against the oracle's steps: one `_Acc` per boundary, the norm, and
    where (and on what buffers) the engine applied or skipped the TP correction."""

    def __init__(self) -> None:
        self.accs = {name: _Acc() for name in _LABELS}
        self.norm = _Acc()
        self.sites: set[str] = set()
        self.skipped: set[str] = set()
        self.dtypes: set[str] = set()

    def add(self, c: EngineCapture, steps: list[OracleStep], run: EngineRun) -> None:
        """One rank's capture ``c``."""
        r, rows = c.rank, self.accs
        for (step, micro, name), value in c.local.items():
            want = steps[step].local[(micro, r, name)]
            rows["local"].add(name, value, want.float(), None)
        self._add_corrections(c, steps, run)
        for (step, micro, name), value in c.hp.items():
            want, terms = steps[step].accumulated[(micro, r, name)]
            rows["hp"].add(name, value, want, terms)
        for (step, name), value in c.reduced.items():
            want, terms = steps[step].reduced[(r, name)]
            rows["reduced"].add(name, value, want, terms)
        for key, store, boundary in (
            ("master", c.master, "master"),
            ("exp_avg", c.exp_avg, "exp_avg"),
            ("exp_avg_sq", c.exp_avg_sq, "exp_sq"),
        ):
            for (step, name), value in store.items():
                rows[boundary].add(name, value, *getattr(steps[step], key)[(r, name)])
        for step, norm_value in c.norm.items():
            self.norm.add(f"rank {r}", torch.tensor([norm_value]), torch.tensor([steps[step].norm]), None)

    def _add_corrections(self, c: EngineCapture, steps: list[OracleStep], run: EngineRun) -> None:
        """The TP corrections rank ``c.rank`` applied: the FP32 value before and the gradient after write-back."""
        for call in c.calls:
            if call.action == "skipped: marker set":
                self.skipped.add(f"micro {call.micro}: {call.param}")
                continue
            if call.action != "corrected":
                continue
            self.sites.add(call.caller)
            self.dtypes.add(call.buffer_dtype)
            # The engine's boundary pass, and ZeRO-1's reduce hook (it reduces only at the boundary:
            # stage_1_and_2.py reduce_ready_partitions_and_remove_grads), correct the BF16 gradient accumulated
            # over the micro-steps; BF16_Optimizer, ZeRO-2 and ZeRO-3 correct each micro-step's.
            on_accumulated = call.caller == BOUNDARY_PASS or run.wrapper == "zero1"
            table = steps[call.step].accumulated if on_accumulated else steps[call.step].corrected
            value, terms = table[(call.micro, c.rank, call.param)]
            if call.fp32_before_writeback is not None:
                self.accs["fp32"].add(call.param, call.fp32_before_writeback, value, terms)
            if call.after is not None:
                self.accs["writeback"].add(call.param, call.after, value, terms)

    def rows(self) -> list[Row]:
        """The rows of the boundaries compared, then the norm's."""
        rows = []
        for key, acc in self.accs.items():
            if acc.compared:
                # A master's error has no BF16/FP32 scale: Adam's first update is lr * sign(g), so a gradient
                # whose sign a BF16 rounding flips moves the master by 2 lr; the row says only whether it differs.
                note = "error / (lr x steps)" if key == "master" else "error / sum|terms|"
                rows.append(acc.row(_LABELS[key], note, classify=key != "master"))
        if self.norm.compared:
            rows.append(self.norm.row("global grad norm", "error / |value|"))
        return rows


def _sites(capture: EngineCapture) -> list[str]:
    """The audit's floating-point sites of one rank as ``file:line function: op kind dtypes``."""
    out = []
    for s in capture.narrowing:
        if s["kind"] == "collective" and s["dtypes"] not in ("fp32", "bf16", "fp16", "fp64"):
            continue  # object broadcasts (int64, uint8)
        path = s["at"].split("site-packages/")[-1]
        out.append(f"{path} {s['function']}: {s['op']} {s['kind']} {s['dtypes']}")
    return list(dict.fromkeys(out))  # sites differing only in their context read the same
