"""What DeepSpeed's TP-correction helper did, call by call: `HelperSpy` records each call as a `HelperCall`.

DeepSpeed applies the AutoEP+AutoTP folding correction through one helper,
``apply_folding_correction_to_grad_buffer``, which each optimizer wrapper (BF16_Optimizer, ZeRO-1/2, ZeRO-3)
imported by name, and the engine's boundary pass through ``reduce_autoep_folding_gradient``.
`spy_on_corrections` replaces every one of those names by a `HelperSpy` wrapper for the length of a run; the
wrapper records the step and micro-step, the parameter, the caller, whether the correction-once marker made
the helper skip, the FP32 value the helper reduced before writing it back and the buffer after the write-back,
then returns what the real helper returned. Used by `simdist.cases.deepspeed.engine`'s rank program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BOUNDARY_PASS = "engine boundary pass"
"""The caller name of ``DeepSpeedEngine._reduce_autoep_folding_tp_replicated_gradients``'s corrections."""


@dataclass
class HelperCall:
    """One call of ``apply_folding_correction_to_grad_buffer`` (or the boundary pass's reduce)."""

    step: int
    micro: int
    param: str
    caller: str
    action: str
    """``corrected``, ``skipped: marker set`` or DeepSpeed's strategy ``skip``."""
    buffer_dtype: str
    fp32_before_writeback: torch.Tensor | None
    after: torch.Tensor | None


@contextlib.contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    """``obj.name`` is ``value`` within the block, and what it was again after it."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class HelperSpy:
    """Wraps the folding helper where each wrapper imported it; records every call, then calls the real one."""

    def __init__(self, calls: list[HelperCall], names: dict) -> None:
        self.calls, self.names = calls, names
        self.step_micro: tuple[int, int] = (0, 0)

    def wrap(self, real, caller: str):
        def spy(folding_spec, param, grad, **kwargs):
            from deepspeed import comm as ds_comm
            from deepspeed.module_inject.auto_ep_folding import is_autoep_folding_gradient_corrected

            was_set = caller != BOUNDARY_PASS and is_autoep_folding_gradient_corrected(param)
            reduced: list[torch.Tensor] = []
            real_all_reduce = ds_comm.all_reduce

            def all_reduce(tensor, *args, **kw):
                reduced.append(tensor)
                return real_all_reduce(tensor, *args, **kw)

            with patched(ds_comm, "all_reduce", all_reduce):
                strategy = real(folding_spec, param, grad, **kwargs)
            data = grad.data if grad is not None else None
            action = "skipped: marker set" if was_set else ("skip" if strategy == "skip" else "corrected")
            fp32 = reduced[0].detach().clone() if reduced and reduced[0].dtype == torch.float32 else None
            after = data.detach().clone() if data is not None and action == "corrected" else None
            self.calls.append(
                HelperCall(
                    *self.step_micro,
                    self.names.get(param, "?"),
                    caller,
                    action,
                    str(data.dtype) if data is not None else "",
                    fp32,
                    after,
                )
            )
            return strategy

        return spy


def spy_on_corrections(stack: contextlib.ExitStack, spy: HelperSpy) -> None:
    """Within ``stack``: every caller of DeepSpeed's TP-correction helper (BF16_Optimizer, ZeRO-1/2, ZeRO-3) and
    the engine's boundary pass call it through ``spy``, which records each call under its caller's name."""
    from deepspeed.runtime import bf16_optimizer as bf16_module
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import stage3 as stage3_module
    from deepspeed.runtime.zero import stage_1_and_2 as stage12_module

    helper = bf16_module.apply_folding_correction_to_grad_buffer
    for mod in (bf16_module, stage12_module, stage3_module):
        caller = mod.__name__.rsplit(".", 1)[-1]
        stack.enter_context(patched(mod, "apply_folding_correction_to_grad_buffer", spy.wrap(helper, caller)))
    boundary = spy.wrap(engine_module.reduce_autoep_folding_gradient, BOUNDARY_PASS)
    stack.enter_context(patched(engine_module, "reduce_autoep_folding_gradient", boundary))
