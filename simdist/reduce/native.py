"""An optional C kernel for fold plans: a `FoldPlan` applied with gloo's hop rule in one loop, same bits.

Why: at the sizes the rank-batched gradient path and the front ends reduce (a few hundred to a few thousand elements
per rank) the eager path (`Gloo.fold_hops_trimmed`: the plan's copy, the adds, a NaN screen, the trim) is
mostly torch's fixed cost per operation, 5-8x the plain fold. This kernel walks the plan in C, a block of
elements at a time: the first hop's member copied, then each hop's member combined with the partial,
``local (op) acc``; a NaN is absorbing, so the elements whose fold ends NaN are walked again hop by hop with
the NaN bits of `simdist.reduce.gloo.arith.nan_bits` (the eager path's own strategy). It is a fast path only: the
eager path stays the reference, and ``tests/unit/reduce/test_native.py`` compares the two bit for bit (NaN
payloads included) on adversarial values.

What it computes, per dtype (the eager reduction's statements, written out in integer bit operations, never
left to the C compiler's NaN propagation, which treats ``+`` as commutative):

* fp32 / fp64: one IEEE add (or multiply) in the type; a NaN result takes ``local``'s NaN quieted, else
  ``acc``'s quieted, else the default NaN (sign set, quiet bit set, payload zero);
* bf16: both operands widened to fp32 (exact), one fp32 add, rounded to nearest-even back to bf16 (c10's
  rounding; the double rounding torch's bf16 add does); every NaN result is ``0x7FC0``;
* fp16: the same through fp32 with an IEEE round-to-nearest-even conversion (subnormals, overflow to
  infinity); a NaN result is ``0x7E00`` with the sign of ``local``'s NaN, else ``acc``'s, else negative.

The C source is built with flags that keep IEEE semantics (no ``-ffast-math``, ``-ffp-contract=off``: no fused
multiply-add) and refuses to compile where float expressions are evaluated in a wider format
(``FLT_EVAL_METHOD != 0``, e.g. x87).

The plain left folds (`Sequential`, `Ring`, any reduction that keeps `Reduction.fold_hops`) use it too
(``gloo_nan=False``): their values are the same IEEE left fold, but their NaN bits are whatever torch's adds
give, so the kernel declines any reduction with a NaN result and the eager path produces it.

What it covers: `FoldPlan`s of SUM and PRODUCT on CPU tensors of those four dtypes, given as a list of ``n``
contiguous members of one shape, or one stacked ``[n, *batch, *member]`` tensor whose member dimensions are
contiguous (the batch dimensions may have any strides: the rank-batched gradient path's group views), optionally
writing the result into every member row of an output view (`Reduction.sum_many_into`). Everything else
(other dtypes, ops, devices, layouts, empty tensors, members that require grad: the eager path's result
would carry autograd history) returns None and the caller runs the eager path.

How it is built: at install, from ``simdist/reduce/_fold.c``, as the optional extension
``simdist.reduce._simdist_fold`` (``setup.py``; a failed build does not fail the install). Where the install built
none, on first use (the first `available`, `fold`, `fold_to` or `fold_into` call: importing this module builds and
loads nothing), with the system C compiler (``$CC``, else ``cc``) and Python's
headers (no torch headers: a build takes well under a second), as a CPython extension module cached by the hash of
the source, flags, compiler, machine and Python in ``$XDG_CACHE_HOME/simdist/native`` (default
``~/.cache/simdist/native``; a per-user temporary directory if that is not writable). Concurrent builders (rank
processes) each compile to a private file and rename it into place atomically. The hop loops are compiled twice, for
the baseline instruction set and (x86-64) for AVX2, chosen at load time by the CPU; both give the same bits (no FMA,
IEEE adds). Without a compiler or headers, or if the build fails, the eager path runs (`STATUS` says why, ``simdist
doctor`` prints it, and one ``RuntimeWarning`` says so: reductions are then 5-8x slower). ``SIMDIST_NATIVE=0``
disables the kernel; ``SIMDIST_NATIVE=1`` makes a failed build an error instead of a fallback;
``SIMDIST_NATIVE=build`` ignores an installed extension and builds (the fallback, as its tests exercise it). A
CPython extension rather than `ctypes`: reading the tensors' pointers, shapes and strides through the C API costs
about 1 us a call, `ctypes` argument conversion about 4 us, which at these sizes is the whole difference between the
targets met and missed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from simdist.reduce.plan import FoldPlan

SOURCE_FILE = Path(__file__).with_name("_fold.c")
"""The kernel's C source (shipped in the wheel and the sdist): what setup.py builds and the fallback compiles."""


FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off")
"""Compiler flags: optimised (the hop loops vectorise), IEEE arithmetic kept (no fast-math, no FMA contraction)."""

_CODES = {torch.float32: 0, torch.float64: 2, torch.bfloat16: 4, torch.float16: 6}
"""dtype -> the kernel's code (``+ 1`` for PRODUCT, ``+ _BAIL`` for torch's NaN bits)."""
_BAIL = 8
_INTO = 4
"""Mode bit of the kernel: listed members, the result written into each tensor of a sequence (`fold_to`)."""

STATUS = "not loaded"
"""Why the kernel is or is not in use: ``"loaded <path>"``, ``"disabled (SIMDIST_NATIVE=0)"``, or the failure;
``"not loaded"`` until the first use (`loaded`)."""

_enabled = True


def _cache_dir() -> Path:
    """``$XDG_CACHE_HOME/simdist/native`` (default ``~/.cache``), or a per-user temporary directory."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    for folder in (Path(root) / "simdist" / "native", Path(tempfile.gettempdir()) / f"simdist-native-{user}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise OSError("no writable cache directory for the native kernel")


def _build() -> ModuleType:
    """The kernel module: from the cache, else compiled into it (an atomic rename: concurrent builders are safe)."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        raise OSError("no C compiler (set CC, or install cc)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"no Python.h in {include} (install the Python development headers)")
    flags = (*FLAGS, f"-I{include}", *(("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    source = SOURCE_FILE.read_text()
    flags = (*flags, f'-DSIMDIST_FOLD_SOURCE="{source_sha256()}"')
    key = "\0".join((source, *flags, os.path.realpath(compiler), platform.machine(), suffix, sys.version))
    library = _cache_dir() / f"fold-{hashlib.sha256(key.encode()).hexdigest()[:20]}{suffix}"
    if not library.exists():
        fd, partial = tempfile.mkstemp(prefix=library.name + ".", suffix=".partial", dir=library.parent)
        os.close(fd)
        try:
            command = [compiler, *flags, "-x", "c", "-", "-o", partial]
            result = subprocess.run(command, input=source, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(partial, library)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
    spec = importlib.util.spec_from_file_location("_simdist_fold", library)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    global STATUS
    STATUS = f"loaded {library} (built on first use: the install built no extension)"
    return module


def source_sha256() -> str:
    """The SHA-256 of ``_fold.c`` as it is now: what a loaded kernel must have been built from."""
    return hashlib.sha256(SOURCE_FILE.read_bytes()).hexdigest()


def _installed() -> ModuleType | None:
    """The extension built at install (``simdist.reduce._simdist_fold``), or None where the install built none
    or built it from another version of ``_fold.c`` (an editable install after a pull: its functions may not be
    the ones this module calls, so the kernel is built again on first use instead)."""
    try:
        module = importlib.import_module("simdist.reduce._simdist_fold")
    except ImportError:
        return None
    if getattr(module, "SOURCE_SHA256", None) != source_sha256():
        return None
    global STATUS
    STATUS = f"loaded {module.__file__} (built at install)"
    return module


def _load(installed_first: bool = True) -> ModuleType | None:
    """The extension built at install, else one built into the cache now, else None (`STATUS` says which)."""
    global STATUS
    switch = os.environ.get("SIMDIST_NATIVE", "").strip()
    if switch == "0":
        STATUS = "disabled (SIMDIST_NATIVE=0)"
        return None
    installed = _installed() if installed_first and switch != "build" else None
    if installed is not None:
        return installed
    try:
        return _build()
    except Exception as exc:  # no compiler or headers, a failed build, an unloadable library: the eager path runs
        if switch == "1":
            raise RuntimeError(f"SIMDIST_NATIVE=1 but the native fold kernel is unavailable: {exc}") from exc
        STATUS = f"unavailable ({exc})"
        warnings.warn(
            f"simdist: no native fold kernel ({exc}); reductions run the eager path, 5-8x slower, same bits "
            "(simdist doctor; SIMDIST_NATIVE=0 silences this)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


_KERNEL: ModuleType | None = None
"""The loaded kernel module; None before the first use (`_tried` unset) and where none is available."""
_tried = False
_loading = threading.Lock()


def loaded() -> ModuleType | None:
    """The kernel module, loaded (or built) on the first call of the process (`_load`, once, under a lock: rank
    threads may all ask at once); None where none is available (`STATUS` says why)."""
    global _KERNEL, _tried
    if not _tried:
        with _loading:
            if not _tried:
                _KERNEL = _load()
                _tried = True
    return _KERNEL


def available() -> bool:
    """Whether the kernel is built, loaded and enabled (else every `fold` returns None); loads it on first use."""
    return (_KERNEL if _tried else loaded()) is not None and _enabled


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the eager path within the block (tests compare the two; one process-wide flag, not per thread)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _packed(plan: FoldPlan) -> bytes:
    """The plan as the kernel reads it (int64 ``n, numel, length, period, descending, *rows``), kept on the plan."""
    packed = plan.packed
    if packed is None:
        packed = struct.pack(f"<{5 + len(plan.rows)}q", plan.n, plan.numel, plan.length, plan.period,
                             int(plan.descending), *plan.rows)  # fmt: skip
        object.__setattr__(plan, "packed", packed)
    return packed  # type: ignore[return-value]


def fold(
    plan: FoldPlan,
    members: torch.Tensor | Sequence[torch.Tensor],
    multiply: bool = False,
    flat: bool = False,
    gloo_nan: bool = True,
) -> torch.Tensor | None:
    """``plan``'s fold of ``members`` with gloo's hop rule (`Gloo.fold_hops_trimmed`'s bits), or None where the
    kernel does not apply (then run the eager path).

    ``members``: ``n`` contiguous CPU tensors of one dtype and shape (``[numel]`` unless the plan is uniform;
    any shape with ``flat``, read in memory order as gloo reads them), or one stacked ``[n, *batch, *member]``
    tensor (``member`` holding ``numel`` contiguous elements, the batch dimensions of any strides). The result
    is a new contiguous tensor of shape ``members[0].shape`` (`fold_into` writes it into every member row of a
    given tensor instead: an all-reduce's writes). ``gloo_nan=False`` is for a plain left fold whose NaN bits
    are torch's (`Reduction.fold_hops`): its values are the same, and where a result is NaN the kernel
    gives up (None) for the eager path to produce torch's bits.
    """
    kernel = _KERNEL if _tried else loaded()
    if kernel is None or not _enabled or not plan.numel:
        return None
    mode = int(multiply) + (0 if gloo_nan else _BAIL)
    if isinstance(members, torch.Tensor):
        dtype = members.dtype
        code = _CODES.get(dtype)
        if code is None or not members.is_cpu or members.requires_grad:
            return None
        result = torch.empty(members.shape[1:], dtype=dtype)
        return result if kernel.fold(plan.packed or _packed(plan), code + mode, members, result, 0) else None
    if not members:
        return None
    first = members[0]
    code = _CODES.get(first.dtype)
    if code is None:
        return None
    result = torch.empty_like(first, memory_format=torch.contiguous_format)
    return result if kernel.fold(_packed(plan), code + mode, members, result, 2 if flat else 0) else None


def fold_to(
    plan: FoldPlan, members: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], multiply: bool = False
) -> bool:
    """`fold` of listed ``members`` (contiguous, read in memory order, gloo's hop rule) written into each of
    ``outs`` instead of a new tensor: an in-place all-reduce in one pass, one read of each member and one write
    of each out, block by block (an out may be one of the members). False where the kernel does not apply
    (nothing written; run `fold` or the eager path): no kernel, another dtype, an out not contiguous or of
    another dtype or element count, an out partly overlapping a member or another out, or a plan of short
    chunks (`fold`'s element-by-element path)."""
    kernel = _KERNEL if _tried else loaded()
    if kernel is None or not _enabled or not plan.numel or not members:
        return False
    code = _CODES.get(members[0].dtype)
    if code is None:
        return False
    return kernel.fold(plan.packed or _packed(plan), code + int(multiply), members, outs, _INTO | 2)


def fold_into(plan: FoldPlan, members: torch.Tensor, out: torch.Tensor) -> bool:
    """`fold` of a stacked ``members`` (SUM, gloo's hop rule) into every member row of ``out``; False where the
    kernel does not apply (nothing written; run the eager path). The rank-batched all-reduce's one call."""
    kernel = _KERNEL if _tried else loaded()
    if kernel is None or not _enabled or not plan.numel:
        return False
    dtype = members.dtype
    code = _CODES.get(dtype)
    if code is None or out.dtype is not dtype or not members.is_cpu or not out.is_cpu or members.requires_grad:
        return False
    return kernel.fold(plan.packed or _packed(plan), code, members, out, 1)
