"""The fixes of the DeepSpeed defects simdist found, as line edits of DeepSpeed 0.19.8, rendered as unified diffs.

An edit names a file of the ``deepspeed`` package, a line range, the SHA-256 of exactly those lines as DeepSpeed
0.19.8 ships them, and the replacement (simdist's own lines). The diff is rendered against the installed
package, so no DeepSpeed text is stored here; the hash refuses any other version of those lines (another
DeepSpeed release, or a copy already patched) with a clear error instead of a diff that would not apply.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from pathlib import Path

from simdist.errors import UsageError

DEEPSPEED_VERSION = "0.19.8"


@dataclass(frozen=True)
class LineEdit:
    """Replace lines ``first``..``last`` (1-based, inclusive) of ``path`` (relative to the package's parent)."""

    path: str
    first: int
    last: int
    sha256: str
    """Of the replaced lines joined with ``\\n`` (no trailing newline), as DeepSpeed 0.19.8 ships them."""
    new: tuple[str, ...]


@dataclass(frozen=True)
class Patch:
    """One defect's fix: edits of one or more files (at most one edit per line range, none overlapping)."""

    name: str
    edits: tuple[LineEdit, ...]


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def patched_lines(patch: Patch, path: str, original: list[str]) -> list[str]:
    """``original`` (one file's lines, no newlines) with ``patch``'s edits of ``path`` applied; ``ValueError``
    when a range is out of the file or its lines are not the ones DeepSpeed 0.19.8 ships."""
    edits = sorted((e for e in patch.edits if e.path == path), key=lambda e: e.first, reverse=True)
    result = list(original)
    for edit in edits:
        if not 1 <= edit.first <= edit.last <= len(original):
            raise UsageError(f"{patch.name}: {path} has {len(original)} lines, the edit needs {edit.first}-{edit.last}")
        if _digest(original[edit.first - 1 : edit.last]) != edit.sha256:
            raise UsageError(
                f"{patch.name}: {path}:{edit.first}-{edit.last} is not DeepSpeed {DEEPSPEED_VERSION}'s text "
                "(another version, or already patched)"
            )
        result[edit.first - 1 : edit.last] = edit.new
    return result


def unified_diff(patch: Patch, root: Path) -> str:
    """``patch`` as a ``git apply``/``patch -p1`` unified diff of the ``deepspeed`` package under ``root``."""
    out: list[str] = []
    for path in dict.fromkeys(e.path for e in patch.edits):
        original = (root / path).read_text().splitlines()
        new = patched_lines(patch, path, original)
        out.extend(
            line + "\n" for line in difflib.unified_diff(original, new, f"a/{path}", f"b/{path}", n=3, lineterm="")
        )
    return "".join(out)


def apply(patch: Patch, root: Path) -> None:
    """Apply ``patch`` in place to the ``deepspeed`` package under ``root`` (a copy: never an installed one)."""
    for path in dict.fromkeys(e.path for e in patch.edits):
        file = root / path
        text = file.read_text()
        new = patched_lines(patch, path, text.splitlines())
        file.write_text("\n".join(new) + ("\n" if text.endswith("\n") else ""))


BF16_OPTIMIZER = "deepspeed/runtime/bf16_optimizer.py"
ZERO_1_2 = "deepspeed/runtime/zero/stage_1_and_2.py"

FP32_STAGING = Patch(
    "deepspeed-8913",
    (
        # BF16_Optimizer._update_hp_grad: the folding correction of lp.grad in place (BF16 write-back) ->
        # of an FP32 staging copy, which is then added to the FP32 buffer.
        LineEdit(
            BF16_OPTIMIZER,
            512,
            517,
            "544e01e1ce7ecb5afd67c037013db3c8126139f76e1a2a28043b1ab57f98076d",
            (
                "        # Stage the low-precision gradient in the accumulation dtype and apply the folding correction",
                "        # there: an FP32 TP reduction then reaches the FP32 buffer without a BF16 rounding (#8913).",
                "        # lp.grad keeps the local gradient; the correction-once marker is set as before.",
                "        grad = lp.grad.data.to(self.grad_acc_dtype, copy=True)",
                '        if self.autoep_folding_tp_group is not None and getattr(lp, "ds_grad_is_ready", True):',
                "            apply_folding_correction_to_grad_buffer(self.autoep_folding_spec,",
                "                                                    lp,",
                "                                                    grad,",
                "                                                    tp_group=self.autoep_folding_tp_group,",
                "                                                    param_name=self.param_names.get(lp))",
            ),
        ),
        LineEdit(
            BF16_OPTIMIZER,
            523,
            523,
            "23a7da48801095bd79a27f93d59fcc3c9d37753b47935799a2b3db5184d4f0b4",
            ("        hp_grad.data.add_(grad.view(hp_grad.shape))",),
        ),
    ),
)

ZERO_NORM_EXPERTS = Patch(
    "deepspeed-zero-norm-experts",
    (
        # get_grad_norm_direct: under AutoEP+AutoTP folding the routed experts differ across TP ranks (the EP
        # group lies inside the TP group), so each TP rank counts its own; elsewhere the condition is unchanged.
        LineEdit(
            ZERO_1_2,
            2682,
            2682,
            "b76bb644b8cebe541a33472a89363b1b7c0c44b7238cf2153ac4c8f5ab413384",
            (
                "                folded_expert = self.autoep_folding_tp_group is not None and is_moe_param(p)",
                "                if is_model_parallel_parameter(p) or folded_expert or "
                "(self.model_parallel_rank == 0):",
            ),
        ),
    ),
)

RELINK_STATE = Patch(
    "deepspeed-load-unlinks-state",
    (
        # _load_legacy_checkpoint: _link_all_hp_params() gives every parameter a fresh mapping without its
        # optimizer-state fragment; clear the flag (first, so that
        # the edited range differs from the shipped one) so that the next step links the fragments again.
        LineEdit(
            BF16_OPTIMIZER,
            689,
            689,
            "7cbb5eb0943da949ee602e4c884e672398b60bf3d34343d77f7373c13d4a42d6",
            (
                "            # the mappings made below hold no optimizer-state fragment: link them at the next step",
                "            self._hp_optimizer_states_linked = False",
                "            self._link_all_hp_params()",
            ),
        ),
    ),
)

PATCHES: dict[str, Patch] = {p.name: p for p in (FP32_STAGING, ZERO_NORM_EXPERTS, RELINK_STATE)}
