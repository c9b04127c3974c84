"""The optional C extension ``simdist.reduce._simdist_fold`` (the native fold kernel); the rest is pyproject.toml.

``optional=True``: without a compiler or Python's headers the build warns and the install goes on; simdist then
builds the kernel on first use, or runs the eager path (``simdist doctor`` says which). The flags keep IEEE
arithmetic (no fast-math, no fused multiply-add), as `simdist.reduce.native.FLAGS` does for that fallback.
"""

import hashlib
import sys
from pathlib import Path

from setuptools import Extension, setup

FLAGS = ["-O3", "-std=c11", "-fno-fast-math", "-ffp-contract=off"]
SOURCE = "simdist/reduce/_fold.c"
SOURCE_SHA256 = hashlib.sha256(Path(__file__).resolve().parent.joinpath(SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "simdist.reduce._simdist_fold",
            [SOURCE],
            extra_compile_args=[] if sys.platform == "win32" else FLAGS,
            define_macros=[("SIMDIST_FOLD_SOURCE", f'"{SOURCE_SHA256}"')],  # native.py refuses a stale build
            optional=True,
        )
    ]
)
