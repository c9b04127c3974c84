"""Mutation testing: break simdist on purpose, one small named edit at a time, and see which tests notice.

    python bench/mutations.py                      # every mutation, each against its own fast tests
    python bench/mutations.py --only gloo-ring-start --only adamw-eps
    python bench/mutations.py --all                # each mutation against the whole default suite (slow)
    python bench/mutations.py --list               # the catalogue, with the equivalence arguments
    python bench/mutations.py --json               # the results as data (stdout); progress goes to stderr
    python bench/mutations.py --jobs 2             # two mutations at once (default 1: the machine is shared)

Each `Mutation` is an exact source edit (``old`` -> ``new``, ``old`` occurring exactly ``count`` times in
``path``) of one rule the project states: a policy stage, the gradient path's optimizer, the correction-once marker,
the DP normalisation and order, a reduction's order or NaN rule, the backend's write-back, a comparison.
The edit is applied to a private copy of the source tree (``simdist/``, ``tests/`` and the
files the tests read; the worktree is never touched), and pytest runs the mutation's tests in that copy with
``-x -q -p no:cacheprovider`` and ``PYTHONPATH`` pointing at it. A mutation is *killed* when the tests fail
(the first failing test is named), *survives* when they pass, and is an *error* when the edit does not apply
(the catalogue no longer matches the source: fix the entry) or pytest cannot start. The baseline (no edit)
runs first over the union of the selected tests: a red baseline makes every kill meaningless, so it stops the
run.

A survivor is either killed by a new test or explained: ``equivalent`` holds the argument that the edit cannot
change any result the project computes (checked by a reader, not by this script), ``awaiting`` names the work
that will kill it. The score counts killed / (total - equivalent).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("simdist", "tests", "pyproject.toml", "experiments", "notebooks", "README.md", "docs")
"""What a mutation's private tree holds: the package, the policies, the tests and what tests read."""

PYTEST = ("-x", "-q", "-p", "no:cacheprovider", "-p", "simdist_mutation_profile", "--hypothesis-profile=mutation")
PLUGIN = """import hypothesis
from hypothesis import Phase, settings

# The ci profile without shrinking: a killed mutant fails at its first failing example at once, instead of
# spending minutes shrinking it (tests/conftest.py loads ci first; --hypothesis-profile loads this after it).
settings.register_profile(
    "mutation", max_examples=40, deadline=None, derandomize=True, print_blob=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
_find = hypothesis.find


def _find_shrinking(specifier, condition, *, settings=None, **kwargs):
    # find() returns the shrunk example, which a test may assert: it keeps every phase
    return _find(specifier, condition, settings=hypothesis.settings(settings, phases=tuple(Phase)), **kwargs)


hypothesis.find = _find_shrinking
"""
"""A pytest plugin written into each private tree (``-p simdist_mutation_profile``)."""

# test selections shared by several mutations (pytest node ids, relative to the repository root)
CHAIN = "tests/unit/gradpath/test_policy_chain.py"
POLICIES = "tests/unit/gradpath/test_policy.py"
PROPERTIES = "tests/unit/gradpath/test_path_properties.py"
GLOO = "tests/integration/test_gloo_reduction.py"
NCCL = "tests/integration/test_nccl_reduction.py"
REDUCTION = "tests/unit/reduce/test_textbook.py"
COMPARE = ("tests/unit/numerics/test_compare.py", "tests/unit/numerics/test_compare_nan.py")
BACKEND = "tests/unit/world/backend/test_process_group.py"
SIMWORLD = "tests/unit/world/test_simworld.py"
BATCHED = "tests/unit/gradpath/test_batched.py"
ORACLE = "tests/unit/gradpath/oracle/test_step.py"
VERDICTS = "tests/unit/studies/repro/test_verdict.py"  # issue 30: rounding inputs, power checks, --expect
DS8913 = "tests/integration/test_cases_deepspeed.py"
WRAPPERS = "tests/integration/test_cases_deepspeed_wrappers.py"  # its default-suite tests: oracle, judge, controls
NATIVE = "tests/unit/reduce/test_native.py"  # the native kernel against the eager gloo path it replaces

FSDP2 = ("tests/integration/test_cases_fsdp2.py", "tests/integration/test_cases_fsdp2_tp.py")

GRADPATH = (CHAIN, POLICIES, PROPERTIES)
REDUCE = (GLOO, REDUCTION, NATIVE)


@dataclass(frozen=True)
class Mutation:
    """One named source edit and the tests that should notice it."""

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    count: int = 1
    equivalent: str = ""
    """Why no result can change (then the mutation is not counted in the score)."""
    awaiting: str = ""
    """What will kill it, where that work is someone else's (it still counts as a survivor)."""

    def apply(self, root: Path) -> None:
        """Edit ``root / path``; ValueError when ``old`` does not occur exactly ``count`` times."""
        file = root / self.path
        text = file.read_text()
        found = text.count(self.old)
        if found != self.count:
            raise ValueError(f"{self.name}: {self.old!r} occurs {found} times in {self.path}, expected {self.count}")
        file.write_text(text.replace(self.old, self.new))


CATALOGUE: tuple[Mutation, ...] = (
    # -- policy stages (simdist/gradpath/policy.py) -------------------------------------------------------------
    Mutation(
        "policy-staging-dtype",
        "the staging cast goes to bf16 instead of the policy's staging dtype (fp32_staging corrects in BF16)",
        "simdist/gradpath/policy.py",
        'stages.append(Stage("cast", "staged", self.staging))',
        'stages.append(Stage("cast", "staged", torch.bfloat16))',
        GRADPATH,
    ),
    Mutation(
        "policy-writeback-skipped",
        "the BF16 writeback never runs (bf16_writeback becomes fp32_staging)",
        "simdist/gradpath/policy.py",
        "if self.writeback is not None and dtype != self.writeback and correction is not Correction.SKIP:",
        "if False:",
        GRADPATH,
    ),
    Mutation(
        "policy-writeback-rounding",
        "the writeback ignores the policy's rounding mode (stochastic rounding becomes round-to-nearest)",
        "simdist/gradpath/policy.py",
        'Stage("cast", "written_back", self.writeback, self.rounding)',
        'Stage("cast", "written_back", self.writeback)',
        GRADPATH,
    ),
    Mutation(
        "policy-correction-divide-by-2",
        "the TP correction divides by 2 whatever the TP size",
        "simdist/gradpath/policy.py",
        'Stage("divide", "corrected", dtype, divisor=tp)',
        'Stage("divide", "corrected", dtype, divisor=2)',
        GRADPATH,
    ),
    Mutation(
        "policy-correction-no-reduce",
        "the TP correction's all-reduce is replaced by the identity (each rank keeps its own slice)",
        "simdist/gradpath/policy.py",
        'stages.append(Stage("all_reduce", "tp_reduced", dtype))',
        'stages.append(Stage("divide", "tp_reduced", dtype, divisor=1))',
        GRADPATH,
    ),
    Mutation(
        "policy-correct-at-ignored",
        "correct_at is ignored on the micro-step: boundary/after_dp policies correct on every micro-step too",
        "simdist/gradpath/policy.py",
        'if self.correct_at != "micro_step":\n            correction = Correction.SKIP',
        "if False:\n            correction = Correction.SKIP",
        (*GRADPATH, "tests/integration/test_cases_megatron.py"),
    ),
    Mutation(
        "policy-dp-reduce-dtype",
        "the DP reduction always runs in fp32 (the bf16-communication policies reduce in FP32)",
        "simdist/gradpath/policy.py",
        'stages.append(Stage("cast", "", self.dp_reduce))',
        'stages.append(Stage("cast", "", torch.float32))',
        (*GRADPATH, *FSDP2),
    ),
    Mutation(
        "policy-dp-not-normalised",
        "the post-scaled DP reduction is not divided by the DP size",
        "simdist/gradpath/policy.py",
        'stages += [reduce, Stage("scale", "", self.dp_reduce, divisor=n, symbol="" if dp else "dp")]',
        'stages += [reduce, Stage("scale", "", self.dp_reduce, divisor=1, symbol="" if dp else "dp")]',
        GRADPATH,
    ),
    Mutation(
        "policy-prescale-is-postscale",
        "dp_scale='prescale' scales after the all-reduce instead of before it",
        "simdist/gradpath/policy.py",
        'stages += [Stage("scale", "", self.dp_reduce, divisor=n, symbol="" if dp else "dp"), reduce]',
        'stages += [reduce, Stage("scale", "", self.dp_reduce, divisor=n, symbol="" if dp else "dp")]',
        GRADPATH,
    ),
    Mutation(
        "policy-predivide-factor",
        "FSDP's pre-divide factor is always 1 (the whole 1/world is a post-divide)",
        "simdist/gradpath/policy.py",
        "    while world % factor == 0 and world / factor > factor:\n        factor *= 2",
        "    while False:\n        factor *= 2",
        (*GRADPATH, *FSDP2),
    ),
    Mutation(
        "policy-dp-at-micro-step-dropped",
        "dp_at='micro_step' runs no DP reduction (FSDP2's per-micro-step reduce-scatter vanishes)",
        "simdist/gradpath/policy.py",
        'if self.dp_at == "micro_step":\n            stages += self.dp_stages(dp_group, dp, self.accumulate)',
        "if False:\n            stages += self.dp_stages(dp_group, dp, self.accumulate)",
        (*GRADPATH, *FSDP2),
    ),
    Mutation(
        "bf16-writeback-tp-sum-in-bf16",
        "bf16_writeback sums over TP in BF16 (no FP32 staging); at TP2 the one rounding of a two-member sum "
        "matches the FP32 sum's writeback, so only TP4 data or the printed chain can tell",
        "simdist/policies/bf16_writeback.py",
        'FP32 accumulation",\n        staging=torch.float32,',
        'FP32 accumulation",\n        staging=None,',
        (*GRADPATH, "tests/integration/test_cases_deepspeed.py"),
    ),
    Mutation(
        "expert-dp-over-dp",
        "experts are reduced over the dense DP group instead of the expert-data-parallel group",
        "simdist/gradpath/families.py",
        'return "edp" if self is Family.EXPERT else "dp"',
        'return "dp"',
        GRADPATH,
    ),
    Mutation(
        "norm-counts-experts-once",
        "the global norm counts expert gradients on TP rank 0 only",
        "simdist/gradpath/families.py",
        "return self in (Family.MODEL_PARALLEL, Family.EXPERT)",
        "return self is Family.MODEL_PARALLEL",
        ("tests/unit/gradpath/test_kernel_norm.py", *GRADPATH, BATCHED),
    ),
    # -- the gradient path (simdist/gradpath/kernel.py) -----------------------------------------------------------
    Mutation(
        "kernel-accumulate-dtype",
        "the high-precision buffer is allocated in the gradient dtype (bf16) instead of the policy's accumulate",
        "simdist/gradpath/kernel.py",
        "self.hp = torch.zeros(lp.shape, dtype=policy.accumulate)",
        "self.hp = torch.zeros(lp.shape, dtype=policy.grad_dtype)",
        GRADPATH,
    ),
    Mutation(
        "kernel-after-dp-order",
        "correct_at='after_dp' (Megatron) runs and prints the TP correction before the DP reduction (the one "
        "statement of the boundary order, Policy.boundary_segments: it was chain-boundary-order too)",
        "simdist/gradpath/policy.py",
        'return [(dp_stages + correction, "dp_reduced")]',
        'return [(correction + dp_stages, "dp_reduced")]',
        # the chain reads it too
        (*GRADPATH, "tests/unit/gradpath/test_path_after_dp.py", "tests/integration/test_cases_megatron.py"),
    ),
    Mutation(
        "kernel-marker-never-set",
        "the correction-once marker is never set (every micro-step is corrected: the GAS marker defect vanishes)",
        "simdist/gradpath/kernel.py",
        'if correcting and self.policy.correct_at == "micro_step":\n            slot.marker = True',
        'if correcting and self.policy.correct_at == "micro_step":\n            slot.marker = False',
        (*GRADPATH, "tests/integration/test_cases_gas_marker.py"),
    ),
    Mutation(
        "kernel-marker-kept-at-boundary",
        "the boundary does not clear the correction-once marker (later steps are never corrected)",
        "simdist/gradpath/kernel.py",
        "clears every set marker\n            slot.marker = False",
        "clears every set marker\n            slot.marker = slot.marker",
        (*GRADPATH, "tests/integration/test_cases_gas_marker.py"),
    ),
    Mutation(
        "kernel-marker-kept-by-hooks",
        "the hooks update path does not clear the marker after each hook call",
        "simdist/gradpath/kernel.py",
        "after every hook call\n            slot.marker = False",
        "after every hook call\n            slot.marker = slot.marker",
        (*GRADPATH, "tests/integration/test_cases_gas_marker.py"),
    ),
    # the gradient path's AdamW is torch's own functional adam (kernel.adamw_step);
    # tests/unit/gradpath/oracle/test_step.py judges
    # it with the independent oracle (torch.optim.AdamW on FP32 masters, simdist.gradpath.oracle)
    Mutation(
        "adamw-eps",
        "AdamW's epsilon is ten times too large",
        "simdist/gradpath/kernel.py",
        "eps=h.eps,",
        "eps=h.eps * 10,",
        (*GRADPATH, ORACLE),
    ),
    Mutation(
        "adamw-beta1-is-beta2",
        "the first moment decays with beta2",
        "simdist/gradpath/kernel.py",
        "beta1=h.beta1,",
        "beta1=h.beta2,",
        (*GRADPATH, ORACLE),
    ),
    Mutation(
        "adamw-step-counter",
        "the step counter is one ahead (bias correction of the next step)",
        "simdist/gradpath/kernel.py",
        "[torch.tensor(float(step - 1))]",
        "[torch.tensor(float(step))]",
        (*GRADPATH, ORACLE),
    ),
    Mutation(
        "adamw-coupled-weight-decay",
        "weight decay is added to the gradient (Adam) instead of decoupled (AdamW)",
        "simdist/gradpath/kernel.py",
        "decoupled_weight_decay=True,",
        "decoupled_weight_decay=False,",
        (*GRADPATH, ORACLE),
    ),
    Mutation(
        "kernel-clip-threshold",
        "clipping scales buffers even when the coefficient is above 1",
        "simdist/gradpath/kernel.py",
        "self.hp.copy_(torch.where(coef < 1, scaled, self.hp))",
        "self.hp.copy_(scaled)",
        (*GRADPATH, BATCHED),
    ),
    # -- reductions (simdist/reduce/) -----------------------------------------------------------------------
    Mutation(
        "gloo-ring-start",
        "gloo's chunk c starts its walk at rank c instead of c-1",
        "simdist/reduce/gloo/schedule.py",
        "tuple(t % n for t in range(n + chunks - 1))",
        "tuple((t + 1) % n for t in range(n + chunks - 1))",
        (*REDUCE, BATCHED),
    ),
    Mutation(
        "gloo-single-chunk-ascending",
        "with one chunk, gloo folds x[0] + ... + x[n-1] instead of x[n-1] + ... + x[0]",
        "simdist/reduce/gloo/schedule.py",
        "descending=True)",
        "descending=chunks > 1)",
        (*REDUCE, BATCHED),
    ),
    Mutation(
        "gloo-chunking",
        "gloo cuts at least n segments instead of at least 2n",
        "simdist/reduce/gloo/schedule.py",
        "segments = max(-(-numel // m), 2 * n)",
        "segments = max(-(-numel // m), n)",
        (*REDUCE, BATCHED),
    ),
    Mutation(
        "gloo-nan-operand-order",
        "gloo's fp32/fp64 NaN payload comes from the received partial before the local value",
        "simdist/reduce/gloo/arith.py",
        "return torch.where(local.isnan(), lb | quiet, torch.where(acc.isnan(), ab | quiet, default))",
        "return torch.where(acc.isnan(), ab | quiet, torch.where(local.isnan(), lb | quiet, default))",
        REDUCE,
    ),
    Mutation(
        "gloo-nan-not-quieted",
        "gloo's NaN results keep a signalling NaN signalling",
        "simdist/reduce/gloo/arith.py",
        "return torch.where(local.isnan(), lb | quiet, torch.where(acc.isnan(), ab | quiet, default))",
        "return torch.where(local.isnan(), lb, torch.where(acc.isnan(), ab, default))",
        REDUCE,
    ),
    Mutation(
        "gloo-max-nan",
        "gloo's MAX/MIN propagate NaN from either side (torch.maximum) instead of std::max's comparison",
        "simdist/reduce/gloo/arith.py",
        "acc = torch.where(keep, acc, local)",
        "acc = torch.where(keep | acc.isnan(), acc, local)",
        REDUCE,
    ),
    Mutation(
        "native-nan-operand-order",
        "the native kernel's fp32 NaN payload comes from the received partial before the local value",
        "simdist/reduce/_fold.c",
        "return nan32(l) ? (l | 0x00400000u) : nan32(a) ? (a | 0x00400000u) : 0xFFC00000u;",
        "return nan32(a) ? (a | 0x00400000u) : nan32(l) ? (l | 0x00400000u) : 0xFFC00000u;",
        (NATIVE,),
    ),
    Mutation(
        "native-bf16-ties-away",
        "the native kernel rounds bf16 ties away from zero instead of to even",
        "simdist/reduce/_fold.c",
        "return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);",
        "return (uint16_t)((u + 0x8000u) >> 16);",
        (NATIVE,),
    ),
    Mutation(
        "native-fp16-subnormal-ties-away",
        "the native kernel rounds fp16 subnormal ties up instead of to even",
        "simdist/reduce/_fold.c",
        "if (rest > half || (rest == half && (q & 1u))) q++;",
        "if (rest >= half) q++;",
        (NATIVE,),
    ),
    Mutation(
        "native-walk-ascending",
        "the native kernel starts every chunk's walk at the plan's first row instead of its last",
        "simdist/reduce/_fold.c",
        "const T *first = (const T *)members[rows[(descending ? n - 1 : 0) + p]] + lo;",
        "const T *first = (const T *)members[rows[0 + p]] + lo;",
        (NATIVE, BATCHED),
    ),
    Mutation(
        "native-one-copy-missing",
        "the native kernel's all-reduce writes leave the second member's copy unwritten",
        "simdist/reduce/_fold.c",
        "for (int64_t r = 1; r < n; r++)\n                memcpy",
        "for (int64_t r = 2; r < n; r++)\n                memcpy",
        (NATIVE, BATCHED),
    ),
    Mutation(
        "batched-gloo-single-chunk-ascending",
        "the rank-batched path (`Reduction.sum_many`) folds a one-chunk (uniform) order reversed",
        "simdist/reduce/base.py",
        "                return self.fold_hops_trimmed(plan, stacked)\n",
        "                return self.fold_hops_trimmed(plan, stacked.flip(0))\n",
        (BATCHED, *GRADPATH),
    ),
    Mutation(
        "ring-shift-ignored",
        "the Ring model ignores its start shift",
        "simdist/reduce/textbook.py",
        "rows = tuple(ring[(self.shift + t) % n] for t in range(n + period - 1))",
        "rows = tuple(ring[t % n] for t in range(n + period - 1))",
        (*REDUCE, BATCHED),
    ),
    Mutation(
        "tree-pairing",
        "the Tree model pairs (x0+x2), (x1+x3) instead of neighbours",
        "simdist/reduce/textbook.py",
        "combined = combine(level[0 : 2 * pairs : 2], level[1 : 2 * pairs : 2])",
        "combined = combine(level[0:pairs], level[pairs : 2 * pairs])",
        (*REDUCE, BATCHED),
    ),
    Mutation(
        "sequential-reversed",
        "the Sequential model folds in descending rank order",
        "simdist/reduce/textbook.py",
        '        return "sequential"\n\n    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan:\n'
        "        return FoldPlan.uniform(range(n), numel)\n",
        '        return "sequential"\n\n    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan:\n'
        "        return FoldPlan.uniform(range(n)[::-1], numel)\n",
        (*REDUCE, BATCHED),
    ),
    Mutation(
        "nccl-ring-fold-reversed",
        "NCCL's ring fold adds the ranks in the reverse of the ring order",
        "simdist/reduce/nccl/reduction.py",
        "    acc = arith.own(rows[order[0]])\n    for r in order[1:]:",
        "    order = order[::-1]\n    acc = arith.own(rows[order[0]])\n    for r in order[1:]:",
        (NCCL,),
    ),
    Mutation(
        "nccl-tree-children-reversed",
        "NCCL's tree adds a node's children in reverse order",
        "simdist/reduce/nccl/reduction.py",
        "children = [partial.pop(child) for child in down[r]]",
        "children = [partial.pop(child) for child in reversed(down[r])]",
        (NCCL,),
    ),
    Mutation(
        "nccl-premul-unfused",
        "NCCL's AVG pre-multiply is rounded before the first add instead of fused with it",
        "simdist/reduce/nccl/arith.py",
        "return self.combine(x, received) if self.scale is None else fma_round(x, self.scale, received)",
        "return self.combine(x, received) if self.scale is None else self.combine(x * self.scale, received)",
        (NCCL,),
    ),
    # -- the front ends' write-back (world/collectives/reductions.py; the rendezvous' targets)
    # ---------------------------------
    Mutation(
        "backend-writeback-first-only",
        "the torch.distributed backend writes an all-reduce's result into the first waiting member only",
        "simdist/world/collectives/reductions.py",
        "            for i in targets:\n                write_bytes(members[i], result)",
        "            for i in targets[:1]:\n                write_bytes(members[i], result)",
        (BACKEND,),
    ),
    Mutation(
        "backend-writeback-bf16",
        "the backend's all-reduce result goes through bf16 on its way into the tensor",
        "simdist/world/collectives/reductions.py",
        "            for i in targets:\n                write_bytes(members[i], result)",
        "            for i in targets:\n                write_bytes(members[i], result.to(torch.bfloat16))",
        (BACKEND,),
    ),
    Mutation(
        "rendezvous-writeback-first-only",
        "the rendezvous hands a collective's completion only the first member as a target (SimWorld, spawn)",
        "simdist/world/rendezvous/meeting.py",
        "complete([pending.calls[r] for r in members], range(len(members)))",
        "complete([pending.calls[r] for r in members], range(1))",
        (SIMWORLD, *GRADPATH),
    ),
    # -- issue 30: the review's survivors (oracle order and group, experts over DP, marker, staging rounded) ---------
    Mutation(
        "oracle-dp-before-tp",
        "the repro's independent oracle runs the TP correction after the DP reduction (DP-then-TP)",
        "simdist/gradpath/oracle/step.py",
        "if self.control.dp_then_tp:",
        "if not self.control.dp_then_tp:",
        (POLICIES, VERDICTS),
        count=2,
    ),
    Mutation(
        "oracle-experts-over-dp",
        "the repro's independent oracle reduces routed experts over the dense DP group instead of EDP",
        "simdist/gradpath/oracle/rules.py",
        'return "edp" if family is Family.EXPERT else "dp"',
        'return "dp"',
        (POLICIES, VERDICTS),
    ),
    Mutation(
        "oracle-bf16-tp-sum",
        "the repro's independent oracle sums over TP in BF16",
        "simdist/gradpath/oracle/step.py",
        'value = group_sums(self.spec, self.tp_reduction, "tp", value, p.shape)',
        'value = group_sums(self.spec, self.tp_reduction, "tp", value.to(torch.bfloat16), p.shape).to(self.dtype)',
        (POLICIES, VERDICTS),
    ),
    Mutation(
        "gradpath-experts-over-dp-repro",
        "experts are reduced over the dense DP group instead of EDP, against the default repro only (TP4/DP2/EP2/EDP4 "
        "on 8 ranks; on TP2/EP2 on 4 ranks DP and EDP are the same groups)",
        "simdist/gradpath/families.py",
        'return "edp" if self is Family.EXPERT else "dp"',
        'return "dp"',
        (POLICIES,),
    ),
    Mutation(
        "kernel-marker-never-set-8913-case",
        "the correction-once marker is never set, against the deepspeed-8913 case's default run only (epilogue, GAS 3)",
        "simdist/gradpath/kernel.py",
        'if correcting and self.policy.correct_at == "micro_step":\n            slot.marker = True',
        'if correcting and self.policy.correct_at == "micro_step":\n            slot.marker = False',
        (DS8913,),
    ),
    Mutation(
        "fp32-staging-rounded-to-bf16",
        "the #8913 fix's staging is rounded to BF16 after the correction (fp32_staging writes back like the bug)",
        "simdist/policies/fp32_staging.py",
        "writeback=None,",
        "writeback=torch.bfloat16,",
        (POLICIES, DS8913),
    ),
    Mutation(
        "wrappers-oracle-experts-over-dp",
        "the deepspeed-wrappers case's oracle reduces experts over the dense DP group",
        "simdist/cases/deepspeed_wrappers/oracle.py",
        "group = spec.group_of(dp_kind(p.family), r)",
        'group = spec.group_of("dp", r)',
        (WRAPPERS,),
    ),
    Mutation(
        "wrappers-oracle-tp-reversed",
        "the deepspeed-wrappers case's oracle sums TP peers in gloo's order over the reversed peers",
        "simdist/cases/deepspeed_wrappers/oracle.py",
        "total = GLOO.sum([peer.to(dtype) for peer in peers])",
        "total = GLOO.sum([peer.to(dtype) for peer in reversed(peers)])",
        (WRAPPERS,),
    ),
    Mutation(
        "wrappers-oracle-tp-rank-order",
        "the deepspeed-wrappers case's oracle sums TP peers in a rank-order loop (the old oracle), not gloo's order",
        "simdist/cases/deepspeed_wrappers/oracle.py",
        "tp_rank_order: bool = False",
        "tp_rank_order: bool = True",
        (WRAPPERS,),
    ),
    Mutation(
        "wrappers-oracle-dp-before-tp",
        "the deepspeed-wrappers case's oracle applies the TP correction after the DP reduction",
        "simdist/cases/deepspeed_wrappers/oracle.py",
        "dp_then_tp: bool = False",
        "dp_then_tp: bool = True",
        (WRAPPERS,),
    ),
    Mutation(
        "wrappers-oracle-staging-rounded",
        "the deepspeed-wrappers case's oracle rounds the corrected gradient to BF16 (the #8913 write-back)",
        "simdist/cases/deepspeed_wrappers/oracle.py",
        "corrected_dtype: torch.dtype | None = None",
        "corrected_dtype: torch.dtype | None = torch.bfloat16",
        (WRAPPERS,),
    ),
    Mutation(
        "wrappers-control-experts-over-dp-blind",
        "the case's experts-over-DP control reduces experts over EDP after all (a control without power)",
        "simdist/cases/deepspeed_wrappers/oracle.py",
        'group = spec.group_of("dp", r)',
        "group = spec.group_of(dp_kind(p.family), r)",
        (WRAPPERS,),
    ),
    # -- comparisons (simdist/numerics/) --------------------------------------------------------------------------
    Mutation(
        "compare-values-not-bits",
        "difference() counts differing elements by value (NaN == NaN whatever the payload, -0 == +0)",
        "simdist/numerics/compare.py",
        "differing = bits(actual) != bits(expected)",
        "differing = ~torch.isclose(actual, expected, rtol=0, atol=0, equal_nan=True)",
        (*COMPARE, POLICIES),
    ),
    Mutation(
        "bitwise-equal-by-value",
        "bitwise_equal compares values (NaN never equal, -0 == +0)",
        "simdist/numerics/floats.py",
        "torch.equal(bits(a.detach().cpu()), bits(b.detach().cpu()))",
        "torch.equal(a.detach().cpu(), b.detach().cpu())",
        (*COMPARE, REDUCTION, GLOO),
    ),
    Mutation(
        "ulp-nan-is-zero",
        "ulp_distance gives 0 where exactly one side is NaN",
        "simdist/numerics/floats.py",
        "        return (oa - ob).abs()",
        "        return torch.where(a.isnan() ^ b.isnan(), 0, (oa - ob).abs())",
        COMPARE,
    ),
)


@dataclass
class Result:
    name: str
    status: str  # killed | survived | error | equivalent-survived
    killed_by: list[str] = field(default_factory=list)
    seconds: float = 0.0
    detail: str = ""


def make_tree(dest: Path) -> Path:
    """A private copy of what the tests need (no ``__pycache__``: edits must never meet a stale pyc)."""
    dest.mkdir(parents=True, exist_ok=True)
    # no extension built in place (pip install -e): the tree's native kernel is built from its own _fold.c
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.so", "*.pyd")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    (dest / "simdist_mutation_profile.py").write_text(PLUGIN)
    return dest


def run_pytest(tree: Path, tests: tuple[str, ...], timeout_s: float, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """pytest in ``tree`` on ``tests`` with ``PYTHONPATH=tree``; (exit code, output)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", *PYTEST, *extra, *tests]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout_s:.0f} s\n{exc.stdout or ''}"
    return done.returncode, done.stdout + done.stderr


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_one(mutation: Mutation, tree: Path, tests: tuple[str, ...], timeout_s: float) -> Result:
    """Apply ``mutation`` to ``tree``, run ``tests``, restore the file; the result."""
    file = tree / mutation.path
    original = file.read_text()
    start = time.perf_counter()
    try:
        mutation.apply(tree)
    except ValueError as exc:
        return Result(mutation.name, "error", detail=str(exc))
    try:
        code, output = run_pytest(tree, tests, timeout_s)
    finally:
        file.write_text(original)
    seconds = time.perf_counter() - start
    killers = FAILED.findall(output)
    if code == 0:
        status = "equivalent-survived" if mutation.equivalent else "survived"
        return Result(mutation.name, status, seconds=seconds)
    if code in (1, 124) or killers:  # tests failed (or hung: a mutation that deadlocks is caught too)
        return Result(mutation.name, "killed", killers or [f"exit {code}"], seconds)
    return Result(mutation.name, "error", seconds=seconds, detail=output[-2000:])


def select(names: list[str] | None) -> list[Mutation]:
    if not names:
        return list(CATALOGUE)
    by_name = {m.name: m for m in CATALOGUE}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutation(s) {', '.join(unknown)}; see --list")
    return [by_name[n] for n in names]


def score(results: list[Result]) -> tuple[int, int]:
    """(killed, counted): equivalent mutations are not counted."""
    counted = [r for r in results if r.status != "equivalent-survived"]
    return sum(r.status == "killed" for r in counted), len(counted)


def table(results: list[Result], mutations: dict[str, Mutation]) -> str:
    lines = [f"{'mutation':36} {'status':10} {'s':>6}  killed by / why it survives"]
    for r in results:
        m = mutations[r.name]
        if r.status == "killed":
            why = ", ".join(r.killed_by[:2])
        elif r.status == "error":
            why = r.detail.strip().splitlines()[-1] if r.detail.strip() else "error"
        elif m.equivalent:
            why = "equivalent: " + m.equivalent
        elif m.awaiting:
            why = "awaiting: " + m.awaiting
        else:
            why = "SURVIVED"
        status = "equivalent" if r.status == "equivalent-survived" else r.status
        lines.append(f"{r.name:36} {status:10} {r.seconds:6.1f}  {why}")
    killed, counted = score(results)
    lines.append(f"score: {killed} / {counted} killed ({len(results) - counted} equivalent not counted)")
    return "\n".join(lines)


def _report():
    """bench/report.py (the results schema), imported on demand: the catalogue's users need none of it."""
    sys.path.append(str(Path(__file__).resolve().parent))  # also when this file is loaded by path
    import report

    return report


def results_table(results: list[Result], mutations: dict[str, Mutation], seconds: float, whole: bool):
    """The run as one table of bench/report.py's schema: each mutation, its outcome and what killed it."""
    report = _report()
    killed, counted = score(results)
    table = report.Table(
        f"Mutation testing: {killed} of {counted} mutations killed",
        ["mutation", "outcome", "seconds", "killed by (first failing test) or why it survives"],
        notes=f"{len(results)} mutations in {seconds:.0f} s, each against "
        f"{'the whole default suite' if whole else 'its own fast tests'} with `-x` (only the first failing test "
        "is named); equivalent mutations are not counted. `python bench/mutations.py --list` prints the "
        "catalogue: what each edit breaks and its tests.",
    )
    for r in results:
        m = mutations[r.name]
        if r.status == "killed":
            why = ", ".join(r.killed_by[:2])
        elif r.status == "error":
            why = r.detail.strip().splitlines()[-1] if r.detail.strip() else "error"
        else:
            why = f"equivalent: {m.equivalent}" if m.equivalent else (f"awaiting: {m.awaiting}" if m.awaiting else "")
        status = "equivalent" if r.status == "equivalent-survived" else r.status
        table.add(r.name, status, round(r.seconds, 1), why or "-")
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--all", action="store_true", help="run the whole default suite for every mutation")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--results", metavar="PATH", help="also write the results table as bench/report.py's schema (the docs page)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    return parser


def run_all(
    mutations: list[Mutation],
    tests_of: Callable[[Mutation], tuple[str, ...]],
    jobs: int,
    timeout_s: float,
    baseline: bool,
) -> dict[str, Result] | None:
    """Every mutation's result (by name), run in ``jobs`` private trees (each holds one mutation at a time), after
    the baseline over the union of their tests; None (its output printed) when the baseline fails."""
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="simdist-mutations-") as tmp:
        trees = [make_tree(Path(tmp) / f"tree{j}") for j in range(max(1, jobs))]
        for m in mutations:  # a catalogue entry that no longer matches the source is reported before any run
            text = (ROOT / m.path).read_text()
            if text.count(m.old) != m.count:
                print(f"error: {m.name} does not apply: {m.old!r} occurs {text.count(m.old)} times", file=sys.stderr)
        if baseline:
            union = tuple(dict.fromkeys(t for m in mutations for t in tests_of(m)))
            print(f"baseline: {' '.join(union)}", file=sys.stderr)
            code, output = run_pytest(trees[0], union, timeout_s)
            if code != 0:
                print(output[-4000:], file=sys.stderr)
                print("baseline failed: the unmutated tests must pass first", file=sys.stderr)
                return None
        results: dict[str, Result] = {}
        free = list(trees)
        with (
            tqdm(total=len(mutations), desc="mutations", file=sys.stderr, unit="mut") as bar,
            concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool,
        ):
            pending = {}
            queue = list(mutations)
            while queue or pending:
                while queue and free:
                    m = queue.pop(0)
                    tree = free.pop()
                    pending[pool.submit(run_one, m, tree, tests_of(m), timeout_s)] = (m, tree)
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    m, tree = pending.pop(future)
                    free.append(tree)
                    results[m.name] = future.result()
                    bar.set_postfix_str(f"{m.name}: {results[m.name].status}")
                    bar.update()
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    mutations = select(args.only)
    if args.list:
        for m in mutations:
            note = f"\n    equivalent: {m.equivalent}" if m.equivalent else ""
            note += f"\n    awaiting: {m.awaiting}" if m.awaiting else ""
            print(f"{m.name}: {m.what}\n    {m.path}; tests: {' '.join(m.tests)}{note}")
        return 0
    started_on = _report().machine()

    def tests_of(m: Mutation) -> tuple[str, ...]:
        return ("tests",) if args.all else m.tests

    started = time.perf_counter()
    results = run_all(mutations, tests_of, args.jobs, args.timeout, not args.no_baseline)
    if results is None:
        return 2
    ordered = [results[m.name] for m in mutations]
    elapsed = time.perf_counter() - started
    by_name = {m.name: m for m in CATALOGUE}
    if args.json:
        killed, counted = score(ordered)
        payload = {
            "killed": killed,
            "counted": counted,
            "seconds": round(elapsed, 1),
            "results": [
                dataclasses.asdict(r) | {"equivalent": by_name[r.name].equivalent, "awaiting": by_name[r.name].awaiting}
                for r in ordered
            ],
        }
        print(json.dumps(payload, indent=2))
    else:
        print(table(ordered, by_name))
        print(f"{len(ordered)} mutations in {elapsed:.0f} s ({'whole default suite' if args.all else 'fast tests'})")
    if args.results:
        _report().write(args.results, [results_table(ordered, by_name, elapsed, args.all)], machine_text=started_on)
    return 0 if all(r.status != "error" for r in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
