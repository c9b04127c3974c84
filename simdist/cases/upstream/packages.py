"""Upstream packages: for each DeepSpeed defect, a standalone reproducer, the fix as a unified diff, a report.

`export` writes, under ``DIR/<name>/``: ``reproduce.py`` (imports only torch and deepspeed; torchrun, gloo on
CPU and NCCL on GPUs), ``fix.diff`` (against DeepSpeed 0.19.8, rendered from the installed package by
`simdist.cases.upstream.patches`) and ``REPORT.md`` (what, where, figures, how to run). The reproducers exit 1
on DeepSpeed as shipped and 0 with the diff applied (``tests/integration/test_upstream_packages.py`` checks
both on a patched copy of the installed package).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from simdist.cases.upstream.patches import DEEPSPEED_VERSION, PATCHES, Patch, unified_diff
from simdist.errors import UsageError
from simdist.extras import install_hint

REPRODUCERS = resources.files("simdist.cases") / "reproducers"
"""The standalone scripts, package data of `simdist.cases` (not modules)."""


@dataclass(frozen=True)
class Package:
    """One defect: its reproducer (a file of `REPRODUCERS`), how it is launched, its patch and its report."""

    name: str
    title: str
    reproducer: str
    nproc: int
    patch: Patch
    what: str
    code_lines: tuple[str, ...]
    """``file:line -- what happens there`` (DeepSpeed 0.19.8)."""
    figures: str
    """What the reproducer prints on shipped DeepSpeed and with the diff, as measured."""

    @property
    def command(self) -> str:
        return f"torchrun --standalone --nproc-per-node {self.nproc} reproduce.py"

    def report(self) -> str:
        located = "\n".join(f"- `{at}` -- {why}" for at, why in (line.split(" -- ", 1) for line in self.code_lines))
        return (
            f"# {self.title}\n\nDeepSpeed {DEEPSPEED_VERSION}.\n\n## What\n\n{self.what}\n\n## Where\n\n{located}\n\n"
            f"## Figures\n\n{self.figures}\n\n## How to run\n\n"
            "```sh\n"
            f"DS_BUILD_OPS=0 pip install deepspeed=={DEEPSPEED_VERSION}\n"
            f"{self.command}        # exit 1: the defect\n"
            "# with the fix, on a copy of the package:\n"
            "mkdir ds && cp -r \"$(python -c 'import importlib.util as u, os; "
            'print(os.path.dirname(u.find_spec("deepspeed").origin))\')" ds/\n'
            "(cd ds && patch -p1 < ../fix.diff)\n"
            f"PYTHONPATH=$PWD/ds {self.command}        # exit 0\n"
            "```\n\n"
            "CPU: gloo on 127.0.0.1 (set `GLOO_SOCKET_IFNAME=lo` if the host has no routable interface); with "
            "CUDA the #8913 script uses NCCL with one GPU per rank, or gloo on the one GPU where there are fewer GPUs "
            "than ranks.\n"
        )


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package(
            name="deepspeed-8913",
            title="[Precision] BF16 AutoEP folding rounds the FP32 TP reduction to BF16 before FP32 accumulation",
            reproducer="deepspeed_8913_bf16_writeback.py",
            nproc=4,
            patch=PATCHES["deepspeed-8913"],
            what=(
                "Under AutoEP+AutoTP folding with `grad_accum_dtype: fp32` (`BF16_Optimizer`), the TP correction of "
                "a TP-replicated parameter (router, norm, bias) is computed in FP32 and written back into the "
                "BF16 `lp.grad`, and `_update_hp_grad` then adds that BF16 value to the FP32 accumulation buffer: "
                "one BF16 rounding between an FP32 reduction and an FP32 accumulation. The fix stages `lp.grad` "
                "in the accumulation dtype, corrects the staging tensor (the helper's FP32 branch: FP32 "
                "all-reduce, then the divide) and adds it to the buffer; with `grad_accum_dtype: bf16` the "
                "staging is BF16 and nothing changes. The reproducer drives `BF16_Optimizer` directly, TP2/EP2/"
                "ETP1 on 4 ranks, one router parameter whose TP peers hold different BF16 gradients."
            ),
            code_lines=(
                "deepspeed/runtime/bf16_optimizer.py:512-517 -- `_update_hp_grad` passes `lp.grad` (BF16) to "
                "`apply_folding_correction_to_grad_buffer`",
                "deepspeed/module_inject/auto_ep_folding.py:447-452 -- `reduce_autoep_folding_gradient` promotes "
                "to FP32, all-reduces, divides, then `grad_data.copy_(reduced.to(grad_data.dtype))`",
                "deepspeed/runtime/bf16_optimizer.py:523 -- the BF16 result is cast to FP32 and added to the buffer",
            ),
            figures=(
                "Shipped (4 ranks, 4096 router elements per rank, gloo, CPU): `DEFECT: 13512 of 16384 router "
                "hp-gradient elements over 4 ranks are the BF16-rounded TP average, not the FP32 one (max "
                "relative error 0.00389; BF16's unit roundoff is 0.00391)`, exit 1. With `fix.diff`: `OK: all 16384 "
                "router hp-gradient elements are the exact FP32 TP average`, exit 0."
            ),
        ),
        Package(
            name="deepspeed-zero-norm-experts",
            title="ZeRO-1/2 global gradient norm leaves out the routed experts of TP ranks != 0 under AutoEP folding",
            reproducer="deepspeed_zero_norm_experts.py",
            nproc=4,
            patch=PATCHES["deepspeed-zero-norm-experts"],
            what=(
                "`get_grad_norm_direct` counts a parameter only if it is tensor-parallel or the rank is TP rank 0. "
                "Under AutoEP+AutoTP folding the EP group lies inside the TP group, so the routed experts held by "
                "TP ranks other than 0 are neither: their gradients never enter the global norm, and clipping "
                "uses a norm that is too small. The fix also counts an MoE parameter when folding is configured "
                "(`autoep_folding_tp_group` set); without folding the condition is unchanged. The reproducer uses "
                "the real engine (`deepspeed.initialize`, ZeRO-1; `--stage 2` for ZeRO-2) with TP2/EP2/ETP1 on "
                "4 ranks and gradients that are small multiples of 2**-5 (every sum and square exact)."
            ),
            code_lines=(
                "deepspeed/runtime/zero/stage_1_and_2.py:2682 -- `if is_model_parallel_parameter(p) or "
                "(self.model_parallel_rank == 0):`",
                "deepspeed/runtime/bf16_optimizer.py:573 -- BF16_Optimizer's `get_grads_for_norm` already counts "
                "`is_moe_param(lp)` on every TP rank (its norm is right)",
            ),
            figures=(
                "Shipped, ZeRO-1 (4 ranks, gloo, CPU): every rank prints `global grad norm 0.3336587, expected "
                "0.3563048 (without expert 1: 0.3336587) -> WRONG`, exit 1 (`--stage 2` the same). With "
                "`fix.diff`: `global grad norm 0.3563048, expected 0.3563048 ... -> OK` on every rank, exit 0."
            ),
        ),
        Package(
            name="deepspeed-load-unlinks-state",
            title="load_checkpoint into a BF16_Optimizer engine that has stepped leaves optimizer state unlinked",
            reproducer="deepspeed_bf16_load_unlinks_state.py",
            nproc=1,
            patch=PATCHES["deepspeed-load-unlinks-state"],
            what=(
                "`_load_legacy_checkpoint` calls `_link_all_hp_params()`, which gives every parameter a fresh "
                "`_hp_mapping` without its optimizer-state fragment. The fragments are linked lazily in `step()` "
                "only while `_hp_optimizer_states_linked` is False, and the load never resets that flag: after a "
                "load into an engine that has already stepped, `safe_get_full_optimizer_state` raises "
                "`TypeError` for good (multi-rank: the ranks without a fragment then wait in its all-reduce). "
                "Plain ZeRO-1 + `grad_accum_dtype: fp32`, no AutoEP needed. Training itself is unaffected. The fix "
                "resets the flag after relinking, so the next step links the fragments."
            ),
            code_lines=(
                "deepspeed/runtime/bf16_optimizer.py:689 -- `_load_legacy_checkpoint` relinks without resetting "
                "the flag",
                "deepspeed/runtime/bf16_optimizer.py:357-362 -- `_lazy_init_hp_params_optimizer_state` links only "
                "while the flag is False",
            ),
            figures=(
                "Shipped: `after load_checkpoint + 1 step: safe_get_full_optimizer_state raised TypeError: argument "
                "of type 'NoneType' is not iterable -> DEFECT`, exit 1 (`--fresh`, a newly built engine, exits 0). "
                "With `fix.diff`: `after load_checkpoint + 1 step: exp_avg sum 0.76 -> OK`, exit 0."
            ),
        ),
    )
}


def deepspeed_root() -> Path:
    """The directory holding the installed ``deepspeed`` package; ``ValueError`` naming the extra when absent."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        raise UsageError(f"exporting the packages needs DeepSpeed: {install_hint('deepspeed')}")
    return Path(spec.origin).parent.parent


def export(directory: Path, names: list[str] | None = None, root: Path | None = None) -> list[Path]:
    """Write the packages ``names`` (all by default) under ``directory``; the folders written.

    ``root``: where the ``deepspeed`` package to diff against lies (the installed one by default). ``ValueError``
    for an unknown name or when that package's lines are not DeepSpeed 0.19.8's.
    """
    names = list(PACKAGES) if names is None else names
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        raise UsageError(f"unknown package {unknown[0]!r}; valid: {', '.join(PACKAGES)}")
    root = deepspeed_root() if root is None else root
    diffs = {n: unified_diff(PACKAGES[n].patch, root) for n in names}  # all checked before anything is written
    written = []
    for name in names:
        package = PACKAGES[name]
        folder = directory / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "reproduce.py").write_bytes((REPRODUCERS / package.reproducer).read_bytes())
        (folder / "fix.diff").write_text(diffs[name])
        (folder / "REPORT.md").write_text(package.report())
        written.append(folder)
    return written
