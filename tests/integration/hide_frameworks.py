"""``python hide_frameworks.py deepspeed,megatron -- PYTEST ARGS``: run pytest as if the named frameworks were
not installed (an install of simdist without those extras), in this interpreter.

A finder at the front of ``sys.meta_path`` answers ``ModuleNotFoundError`` for each hidden top-level package and
its submodules, as Python does when a package is absent (``megatron`` for ``megatron.core``). Used by
tests/integration/test_extras_installs.py for the installs CI does not build a venv for.
"""

import sys

import pytest

PACKAGES = {"deepspeed": "deepspeed", "megatron": "megatron"}
"""Extra -> the top-level package it installs."""


class Hidden:
    def __init__(self, packages: set[str]) -> None:
        self.packages = packages

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.packages:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by hide_frameworks.py)", name=name)
        return None


if __name__ == "__main__":
    hidden, _, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.meta_path.insert(0, Hidden({PACKAGES[extra] for extra in hidden.split(",") if extra}))
    sys.exit(pytest.main(args))
