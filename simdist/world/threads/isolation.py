"""Process-global state made per rank for `simdist.run`'s rank threads, or refused.

A rank of a real job is a process: its default random generator, default
dtype, deterministic-algorithms flags and the other settings below are its
own. Rank threads share one process, so `RankIsolation` keeps one copy of
each per rank and swaps them in and out at every baton handoff of the
`simdist.world.rendezvous.meeting.Rendezvous`: rank threads of `simdist.run` run one
at a time (the rendezvous starts them one after another and wakes a rank only
when the running one blocks in a collective or a receive, or returns), so the
global state always holds the running rank's values.

A swap is the cost of that guarantee, paid at every handoff (four per 4-rank
collective): the rank giving the baton away saves the generator's state and
reads every setting (`read_settings`: one tuple of direct C calls); the rank
taking it installs its generator state and sets only the settings that differ
from what the process holds (one tuple comparison when none do). torch offers
no cheap "unchanged" check for the generator or the settings, and no cheaper
exact read of the generator (``clone_state`` is slower, ``graphsafe_get_state``
is refused on the CPU generator; docs/perf.md), so both are read at every
handoff: about 1.9 us a handoff on a bare rendezvous (``get_state`` 0.8 us, the
settings 0.6 us, ``set_state`` 0.2 us; 2-vCPU machine, loaded;
``bench/collectives.py --per-call`` prints the swaps of one collective).

What a rank starts with is what a fresh process has (found by experiment with
torch 2.13 on CPU, each value checked against a new interpreter by
tests/integration/test_isolation.py): a default CPU generator seeded from OS entropy (a
new interpreter's ``torch.initial_seed()`` differs from run to run; it is not
the fixed seed of ``torch.Generator()``), float32 default dtype,
deterministic algorithms off, ``"highest"`` float32 matmul precision, and the
backend flags as torch ships them. The caller's own values are restored when
the spawn returns.

The table was found by experiment: every ``torch._C._get_X``/``_set_X`` pair
and the Python-level flags, set on one thread and read on another; the
process-global ones that can change a CPU result (or a CUDA one, cheaply) are
in `SETTINGS`. Left out: print options and warning switches (text, not bits),
the CUDA-only preferred BLAS/linalg backends and TF32 switches (linked to the
matmul precision; not settable on a CPU build).

Found thread-local by experiment (nothing to do): grad and inference mode,
autocast, ``set_default_device``, ``set_num_threads`` (OpenMP, per thread),
``set_flush_denormal`` (per-thread CPU flags).

Python's global ``random`` and NumPy's global ``np.random`` are per rank too,
by dispatch rather than by swapping (`simdist.world.threads.rank_rngs`): what cannot
be dispatched is refused by name (`SharedGlobalStateError`), and so is
``torch.compile`` (dynamo's code caches are one per process), found when the
spawn ends.

Not covered: CUDA's default generators (no GPU was at hand to find a fresh
process's CUDA generator state by experiment), and threads that a rank
program starts itself (they run beside the rank that holds the baton).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import torch

from simdist.world.threads.rank_rngs import FIX, RankGenerators, SharedGlobalStateError

__all__ = ["SETTINGS", "RankIsolation", "SharedGlobalStateError", "read_settings"]


def _deterministic() -> tuple[bool, bool]:
    return torch._C._get_deterministic_algorithms(), torch._C._get_deterministic_algorithms_warn_only()


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


_SDP = torch.backends.cuda

# name -> (get, set, value in a fresh process); every entry is process-global (tests/integration/test_isolation.py
# checks both). The getters are torch's C functions where torch's Python getter only wraps one: they run at every
# handoff.
SETTINGS: dict[str, tuple[Callable[[], Any], Callable[[Any], None], Any]] = {
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype, torch.float32),
    "deterministic_algorithms": (_deterministic, _set_deterministic, (False, False)),
    "float32_matmul_precision": (torch._C._get_float32_matmul_precision, torch.set_float32_matmul_precision, "highest"),
    "fill_uninitialized_memory": (
        torch._C._get_deterministic_fill_uninitialized_memory,
        torch._C._set_deterministic_fill_uninitialized_memory,
        True,
    ),
    "anomaly_detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled, False),
    "mkldnn_enabled": (torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled, True),
    "flash_sdp": (torch._C._get_flash_sdp_enabled, _SDP.enable_flash_sdp, True),
    "mem_efficient_sdp": (torch._C._get_mem_efficient_sdp_enabled, _SDP.enable_mem_efficient_sdp, True),
    "math_sdp": (torch._C._get_math_sdp_enabled, _SDP.enable_math_sdp, True),
    "cudnn_sdp": (torch._C._get_cudnn_sdp_enabled, _SDP.enable_cudnn_sdp, True),
    "math_sdp_allow_fp16_bf16_reduction": (
        torch._C._get_math_sdp_allow_fp16_bf16_reduction,
        torch._C._set_math_sdp_allow_fp16_bf16_reduction,
        False,
    ),
    "sdp_priority_order": (torch._C._get_sdp_priority_order, torch._C._set_sdp_priority_order, [1, 2, 0, 3, 4]),
    "mkldnn_deterministic": (torch._C._get_mkldnn_deterministic, torch._C._set_mkldnn_deterministic, False),
    "nnpack_enabled": (torch._C._get_nnpack_enabled, torch._C._set_nnpack_enabled, True),
    "cublas_allow_fp16_accumulation": (
        torch._C._get_cublas_allow_fp16_accumulation,
        torch._C._set_cublas_allow_fp16_accumulation,
        False,
    ),
    "cudnn_enabled": (torch._C._get_cudnn_enabled, torch._C._set_cudnn_enabled, True),
    "cudnn_deterministic": (torch._C._get_cudnn_deterministic, torch._C._set_cudnn_deterministic, False),
    "cudnn_benchmark": (torch._C._get_cudnn_benchmark, torch._C._set_cudnn_benchmark, False),
}

_SETTERS = tuple(set_ for _, set_, _ in SETTINGS.values())

_C = torch._C
_dtype, _det, _det_warn, _matmul = (
    torch.get_default_dtype,
    _C._get_deterministic_algorithms,
    _C._get_deterministic_algorithms_warn_only,
    _C._get_float32_matmul_precision,
)
_fill, _anomaly, _mkldnn, _flash = (
    _C._get_deterministic_fill_uninitialized_memory,
    torch.is_anomaly_enabled,
    _C._get_mkldnn_enabled,
    _C._get_flash_sdp_enabled,
)
_mem_sdp, _math_sdp, _cudnn_sdp, _math_low = (
    _C._get_mem_efficient_sdp_enabled,
    _C._get_math_sdp_enabled,
    _C._get_cudnn_sdp_enabled,
    _C._get_math_sdp_allow_fp16_bf16_reduction,
)
_sdp_order, _mkldnn_det, _nnpack, _cublas_fp16 = (
    _C._get_sdp_priority_order,
    _C._get_mkldnn_deterministic,
    _C._get_nnpack_enabled,
    _C._get_cublas_allow_fp16_accumulation,
)
_cudnn, _cudnn_det, _cudnn_bench = _C._get_cudnn_enabled, _C._get_cudnn_deterministic, _C._get_cudnn_benchmark


def read_settings() -> tuple:
    """Every setting's current value, in `SETTINGS` order (what its getters return).

    Written out as one tuple of direct calls, because it runs at every handoff: a loop over `SETTINGS`' getters
    costs 1.6 times as much (0.98 against 0.61 us on the 2-vCPU machine). tests/integration/test_isolation.py
    checks it against `SETTINGS`, each setting changed alone.
    """
    return (
        _dtype(),
        (_det(), _det_warn()),
        _matmul(),
        _fill(),
        _anomaly(),
        _mkldnn(),
        _flash(),
        _mem_sdp(),
        _math_sdp(),
        _cudnn_sdp(),
        _math_low(),
        _sdp_order(),
        _mkldnn_det(),
        _nnpack(),
        _cublas_fp16(),
        _cudnn(),
        _cudnn_det(),
        _cudnn_bench(),
    )


def fresh_generator_state() -> torch.Tensor:
    """The default CPU generator's state in a new interpreter: seeded from OS entropy."""
    g = torch.Generator()
    g.seed()
    return g.get_state()


def _dynamo_frames() -> int:
    dynamo = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo is None else int(dynamo.counters["frames"]["total"])


_get_state = torch.default_generator.get_state
_set_state = torch.default_generator.set_state


class RankIsolation:
    """Per-rank copies of torch's process-global generator and settings, swapped at baton handoffs.

    `resume` installs a rank's copy (called when the rank gets the baton),
    `suspend` saves it (called when it gives the baton away), `finish`
    restores the caller's and raises `SharedGlobalStateError` for what a rank
    touched that cannot be per rank.
    """

    def __init__(self, world_size: int, rank_of: Callable[[], int | None] = lambda: None) -> None:
        self.rngs = RankGenerators(world_size, rank_of)
        self.generators = [fresh_generator_state() for _ in range(world_size)]
        fresh = tuple(value for _, _, value in SETTINGS.values())
        self.settings = [fresh] * world_size  # tuples: replaced at every suspend, never changed in place
        self.caller_generator = torch.default_generator.get_state()
        self.caller_settings = read_settings()
        self.caller_random = random.getstate()
        self.caller_frames = _dynamo_frames()
        self.current = self.caller_settings[:]  # what the process holds now

    def start(self) -> None:
        """Put Python's and NumPy's global generators per rank (`simdist.world.threads.rank_rngs`) for the spawn."""
        self.rngs.install()

    def resume(self, rank: int) -> None:
        rngs = self.rngs
        if not rngs.numpy_patched and "numpy.random" in sys.modules:  # `refresh`'s test, without its call
            rngs.refresh()  # NumPy imported by a rank since: per rank from now on
        _set_state(self.generators[rank])
        values = self.settings[rank]
        if values != self.current:  # one tuple comparison; the setters run only for what differs
            self._apply(values)

    def suspend(self, rank: int) -> None:
        self.generators[rank] = _get_state()
        self.settings[rank] = self.current = read_settings()

    def _apply(self, values: tuple) -> None:
        current = self.current
        for i, value in enumerate(values):
            if current[i] != value:
                _SETTERS[i](value)
        self.current = values

    def finish(self) -> None:
        """Give the caller its own state back; refuse (raise) if a rank used state that is one per process."""
        used = self.restore()
        if used:
            raise SharedGlobalStateError(
                f"rank threads used {' and '.join(used)}: one per process, shared by every rank thread; {FIX}"
            )

    def restore(self) -> list[str]:
        """Give the caller its own state back (also after a failed run); return what ranks used that is shared."""
        numpy_shared = self.rngs.give_back_shared_numpy()
        self.rngs.uninstall()
        torch.default_generator.set_state(self.caller_generator)
        self.current = read_settings()
        self._apply(self.caller_settings)
        used = []
        if random.getstate() != self.caller_random:
            random.setstate(self.caller_random)
            used.append("Python's shared `random` generator through a reference taken before the spawn")
        if numpy_shared:
            used.append(
                "NumPy's shared global generator through a reference taken before the spawn "
                "(e.g. `from numpy.random import rand`; call np.random.rand(...) instead)"
            )
        if _dynamo_frames() != self.caller_frames:
            used.append("torch.compile (dynamo's caches are one per process)")
        return used
