"""Importing ``simdist.world`` has no side effect: no registration, no ``torch.distributed``; the one place that
registers the backend (`simdist._autoregister`) also wraps DDP's ZeRO overlap hooks when a program imports them.

Each check runs in a fresh interpreter and reads its ``sys.modules``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

ZERO_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"


def _fresh(code: str) -> list[str]:
    """Run ``code`` in a new interpreter; its stdout lines (fails the test with stderr when it fails)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_the_layout_imports_no_torch():
    """`ParallelSpec` is pure Python: importing it (and the world package) loads neither torch nor the backend."""
    out = _fresh(
        """
        import sys
        from simdist.world.spec import ParallelSpec
        import simdist.world
        ParallelSpec(tp=2, ep=2, etp=1, world_size=4).groups("tp")
        print(sorted(m for m in ("torch", "torch.distributed", "simdist.world.backend") if m in sys.modules))
        """
    )
    assert out == ["[]"]


def test_the_zero_hooks_are_wrapped_when_imported_and_never_imported_to_be_wrapped():
    """``import torch`` after ``import simdist`` registers the backend without importing the ZeRO hook module
    (about 1 s); a program that then imports a hook by name gets simdist's wrapper, with no simdist group yet."""
    out = _fresh(
        f"""
        import sys
        import simdist
        import torch.distributed as dist
        print("SIMDIST" in dist.Backend._plugins, {ZERO_HOOK!r} in sys.modules, "simdist.world" in sys.modules)
        from {ZERO_HOOK} import hook_with_zero_step, hook_with_zero_step_interleaved
        print(hasattr(hook_with_zero_step, "simdist_original"), hasattr(hook_with_zero_step_interleaved,
              "simdist_original"))
        """
    )
    assert out == ["True False False", "True True"]


def test_a_hook_module_loaded_before_simdist_is_wrapped_by_import_simdist():
    """Imported before simdist, the hooks are wrapped by ``import simdist`` itself (the module is loaded: wrapping
    costs nothing more)."""
    out = _fresh(
        f"""
        import torch.distributed
        from {ZERO_HOOK.rsplit(".", 1)[0]} import ddp_zero_hook
        print(hasattr(ddp_zero_hook.hook_with_zero_step, "simdist_original"))
        import simdist
        print(hasattr(ddp_zero_hook.hook_with_zero_step, "simdist_original"))
        """
    )
    assert out == ["False", "True"]


def test_the_watched_module_is_the_backends():
    from simdist import _autoregister
    from simdist.world.backend.gloo_names import ZERO_HOOK_MODULE

    assert _autoregister._ZERO_HOOK == ZERO_HOOK_MODULE == ZERO_HOOK
