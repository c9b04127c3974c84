"""What the ``deepspeed-wrappers`` case asserts in its default run: its findings and its power checks (issue 30).

Findings (`findings`), each measured on DeepSpeed 0.19.8 and asserted, so that the case's ``ok`` is false when
one fails:

* ``runs_captured``: every run captured (or was refused with a refusal the engine gives on this setup), and the
  engine was fed the oracle's BF16 local gradients bit for bit;
* ``writeback_site``: which DeepSpeed code applies the TP correction, per wrapper (`expected_site`);
* ``shipped_rounds_router``: every shipped run writes the router's FP32-corrected gradient back into BF16;
* ``writeback_cast_in_rank``: `simdist.audit` finds that cast inside the rank processes unless the fix is in;
* ``fix_bitwise``: with the FP32-staging fix and FP32 communication (BF16_Optimizer), every gradient stage (FP32
  TP value, write-back, accumulation, DP reduction) is bitwise the oracle, whose TP sums run in gloo's order;
* ``clip_explains_masters``: in the same runs, masters and both Adam moments are bitwise the oracle once the
  oracle clips with the engine's reported global norm (`EPILOGUE_MASTERS` says which operation and which order
  the remaining differences come from);
* ``zero_buffer_bf16``: every ZeRO run (1, 2, 3; ``overlap_comm``, buckets, FP32 communication and
  ``grad_accum_dtype: fp32`` alike) applies the correction to a BF16 buffer (``param.grad`` or the reduce
  bucket: ZeRO-2 uses its ``grad_accum`` copy only when it does not partition gradients), so an FP32 staging
  copy has no FP32 buffer to land in: the write-back's BF16 rounding moves, it does not go away;
* ``zero_norm_defect``: at GAS 1, ZeRO's global norm leaves out the expert of TP rank 1 (relative error above
  ``1e-2``), BF16_Optimizer's does not (below ``1e-3``).

Power checks (`CONTROLS`): the oracle with one deliberate error, judged against the real fixed run the findings
call bitwise (clipping by the engine's norm, as ``clip_explains_masters`` does); each must change some compared
element (gradient stages, masters, moments), or the case could not see that error and ``ok`` is false.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.cases.deepspeed.engine import EngineRun
from simdist.cases.deepspeed_wrappers.oracle import OracleControl, RunResult, judge_run
from simdist.sources.synthetic import Inputs
from simdist.studies.power import PowerCheck
from simdist.world.spec import ParallelSpec

GRADIENT_ROWS = (
    "FP32 TP-corrected value before write-back",
    "corrected gradient after write-back",
    "FP32 accumulated gradient after each micro-step",
    "DP-reduced gradient (safe_get_full_grad)",
)
STEP_ROWS = ("FP32 master after step", "Adam exp_avg", "Adam exp_avg_sq")

WRITE_BACK = "auto_ep_folding.py:452 reduce_autoep_folding_gradient: aten._to_copy cast fp32->bf16"
"""The #8913 write-back as `simdist.audit` names it in DeepSpeed 0.19.8."""

EPILOGUE_MASTERS = (
    "the FP32 masters (and Adam moments) of a fixed run differ from the oracle only through the clipping "
    "coefficient max_norm / (norm + 1e-6): DeepSpeed (clip_tensors_by_global_norm) computes it in FP64 from its "
    "own norm and mul_ rounds it to FP32; its norm is get_norm_with_moe_layers': FP32 torch.norm per tensor, "
    "the group norms squared and summed in FP32, .item() ** 0.5 in FP64, while the oracle sums the FP32 squares "
    "in FP64. The two norms agree to about 1e-8 relative, and the coefficient rounds to a neighbouring FP32 value "
    "(1 ulp) or to the same one: where it differs by 1 ulp, the clipped gradient differs by up to 1 ulp, m and v "
    "at FP32 order, and a master where Adam's update rounds the other way (94/4160 at TP2, 79/4160 at TP4, epilogue "
    "and immediate path alike at GAS 1 on narrow inputs; the immediate GAS 4 run was bitwise because its norm, "
    "0.038, is below the clip 0.05). With the engine's norm in the oracle's coefficient every master and moment "
    "is bitwise: the gradient path itself is not involved"
)
"""Which operation and which order explain the fixed runs' master differences (issue 30 item 4)."""


def expected_site(run: EngineRun) -> list[str]:
    """Where DeepSpeed 0.19.8 applies the TP correction for ``run`` (measured; `findings` asserts it)."""
    if run.wrapper == "bf16_optimizer":
        return ["bf16_optimizer"]
    if run.wrapper == "zero1" and not run.overlap_comm:
        return ["engine boundary pass"]  # ZeRO-1's reduce hook returns early without overlap_comm
    if run.wrapper == "zero3":
        return ["stage3"]
    return ["stage_1_and_2"]


def fixed_run(run: EngineRun) -> bool:
    """A run the findings call bitwise: BF16_Optimizer with the FP32-staging fix and FP32 communication."""
    return run.wrapper == "bf16_optimizer" and run.fix == "fp32_staging" and run.comm_dtype == "fp32"


@dataclass
class Finding:
    """One claim of the case, whether it held, and what was measured."""

    name: str
    holds: bool
    detail: str
    applies: bool = True
    """False where no run of the verdict can show it (a subset of `audit_runs`)."""


def _row(result: RunResult, boundary: str):
    return next((row for row in result.rows if row.boundary == boundary), None)


def _differing(result: RunResult, boundaries: tuple[str, ...]) -> int:
    return sum(row.differing for row in result.rows if row.boundary in boundaries)


Judged = tuple[ParallelSpec, EngineRun, RunResult, RunResult | None]
"""One judged run: ``(spec, run, result, result clipping by the engine's norm or None)``."""
Cases = list[tuple[str, bool]]
"""A finding's evidence: ``(run label, whether the claim holds in that run)`` per run that can show it."""


def _finding(name: str, cases: Cases, what: str, measured: str = "") -> Finding:
    """The finding ``name``: it holds where every case holds, and applies where some run shows it."""
    failed = [label for label, ok in cases if not ok]
    detail = f"{what}: {len(cases) - len(failed)}/{len(cases)} runs" + (
        f"; FAILS in {'; '.join(failed)}" if failed else ""
    )
    detail += f"; {measured}" if measured else ""
    return Finding(name, not failed, detail if cases else f"{what}: no run shows it", bool(cases))


def _captured(judged: list[Judged], expected_refusals: tuple[str, ...]) -> Cases:
    """Per run: refused with an expected refusal, or fed the oracle's BF16 local gradients bit for bit."""
    return [
        (
            r.label,
            (bool(r.error) and any(x in r.error for x in expected_refusals))
            or (not r.error and getattr(_row(r, "BF16 local gradient (input check)"), "differing", 1) == 0),
        )
        for _, _, r, _ in judged
    ]


def _shipped_rounds_router(ran: list[Judged]) -> Cases:
    """Per shipped run (no fix): the router's corrected gradient differs after a write-back into BF16."""
    return [
        (
            r.label,
            (row := _row(r, "corrected gradient after write-back")) is not None
            and row.effect == "bf16"
            and "router.weight" in row.params_differing,
        )
        for _, run, r, _ in ran
        if run.fix == "none"
    ]


def _clip_explains_masters(fixed: list[Judged]) -> tuple[Cases, str]:
    """Per fixed run: masters and moments bitwise once clipped by the engine's norm; and, as the measured
    figure, how many masters differ with the oracle's own norm."""
    clip, own_norm = [], []
    for _, _, r, e in fixed:
        clip.append((r.label, e is not None and _differing(e, STEP_ROWS) == 0))
        master = _row(r, "FP32 master after step")
        own_norm.append(f"{r.label}: {master.differing if master else 0}")
    return clip, "masters differing with the oracle's own norm: " + "; ".join(own_norm)


def _zero_norm_defect(ran: list[Judged]) -> Cases:
    """Per GAS-1 run with experts: ZeRO's norm error above 1e-2, BF16_Optimizer's below 1e-3."""
    cases = []
    for _, run, r, _ in ran:
        if run.gas != 1 or not run.experts or (norm := _row(r, "global grad norm")) is None:
            continue
        error = norm.max_error_over_terms
        cases.append(
            (f"{r.label} (norm error {error:.1e})", error < 1e-3 if run.wrapper == "bf16_optimizer" else error > 1e-2)
        )
    return cases


def findings(judged: list[Judged], expected_refusals: tuple[str, ...]) -> list[Finding]:
    """Every finding over ``judged``: ``(spec, run, result, result clipping by the engine's norm or None)``."""
    ran = [(spec, run, r, e) for spec, run, r, e in judged if not r.error]
    fixed = [(spec, run, r, e) for spec, run, r, e in ran if fixed_run(run)]
    clip, own_norm = _clip_explains_masters(fixed)
    return [
        _finding(
            "runs_captured",
            _captured(judged, expected_refusals),
            "captured with the oracle's inputs bit for bit, or refused as expected",
        ),
        _finding(
            "writeback_site",
            [(r.label, r.correction_sites == expected_site(run)) for _, run, r, _ in ran],
            "the TP correction applied where expected_site says",
        ),
        _finding(
            "shipped_rounds_router",
            _shipped_rounds_router(ran),
            "shipped: the router's corrected gradient written back into BF16",
        ),
        _finding(
            "writeback_cast_in_rank",
            [
                (r.label, any(s.endswith(WRITE_BACK) for s in r.narrowing) == (run.fix == "none"))
                for _, run, r, _ in ran
            ],
            "simdist.audit finds the write-back cast inside the ranks iff the fix is not in",
        ),
        _finding(
            "fix_bitwise",
            [
                (r.label, _differing(r, GRADIENT_ROWS) == 0 and _row(r, GRADIENT_ROWS[0]) is not None)
                for _, _, r, _ in fixed
            ],
            "fix + FP32 comm: every gradient stage bitwise the gloo-ordered oracle",
        ),
        _finding(
            "clip_explains_masters",
            clip,
            "fix + FP32 comm: masters and moments bitwise with the engine's norm in the clip",
            own_norm,
        ),
        _finding(
            "zero_buffer_bf16",
            [
                (r.label, r.buffer_dtypes == ["torch.bfloat16"])
                for _, run, r, _ in ran
                if run.wrapper != "bf16_optimizer"
            ],
            "ZeRO: the correction's target buffer is BF16 (no FP32 buffer for staging; grad_accum fp32 too)",
        ),
        _finding(
            "zero_norm_defect",
            _zero_norm_defect(ran),
            "GAS 1: ZeRO's norm misses an expert (error > 1e-2), BF16_Optimizer's not (< 1e-3)",
        ),
    ]


CONTROLS: dict[str, tuple[OracleControl, str]] = {
    "tp_dp_order_swapped": (OracleControl(dp_then_tp=True), "the TP correction after the DP reduction"),
    "experts_over_dp": (OracleControl(experts_over_dp=True), "routed experts reduced over the dense DP group"),
    "bf16_tp_sum": (OracleControl(tp_sum_dtype=torch.bfloat16), "the TP sum (and /tp) in BF16"),
    "tp_rank_order": (OracleControl(tp_rank_order=True), "the TP sum in rank order, not gloo's"),
    "staging_rounded_to_bf16": (
        OracleControl(corrected_dtype=torch.bfloat16),
        "the corrected gradient rounded to BF16 before it is accumulated (the #8913 write-back)",
    ),
    "marker_never_set": (
        OracleControl(correct_again_at_boundary=True),
        "the accumulated gradient corrected again at the boundary (the correction-once marker never set)",
    ),
}
"""``name -> (control, what it breaks)``: the case's power checks."""


def control_applies(name: str, spec: ParallelSpec) -> bool:
    """Whether control ``name`` can change anything on ``spec``."""
    if name == "experts_over_dp":
        return spec.groups("dp") != spec.groups("edp")
    if name == "tp_rank_order":
        return spec.tp > 2  # two members: one addition in either order
    return spec.tp > 1


def power_checks(
    spec: ParallelSpec, run: EngineRun, captures: list, seed: int = 0, inputs: Inputs | str = Inputs.ROUNDING
) -> list[PowerCheck]:
    """Every control of `CONTROLS` that applies to ``spec``, judged against ``run``'s real ``captures`` with the
    engine's norm in the clip (the comparison ``clip_explains_masters`` finds bitwise)."""
    checks = []
    rows = GRADIENT_ROWS + STEP_ROWS
    for name, (control, what) in CONTROLS.items():
        if not control_applies(name, spec):
            checks.append(PowerCheck(name, what, applies=False, layout=spec.describe()))
            continue
        result = judge_run(spec, run, captures, seed, inputs, control, engine_norm=True)
        changed = _differing(result, rows)
        total = sum(row.compared for row in result.rows if row.boundary in rows)
        checks.append(
            PowerCheck(name, what, True, changed > 0, changed, total, run.label, spec.describe(), unit="elements")
        )
    return checks
