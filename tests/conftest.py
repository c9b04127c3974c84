"""Shared test set-up for ``tests/unit`` and ``tests/integration``: Hypothesis profiles, the ``slow`` and
``nightly`` markers, and a clean policy registry per test.

``tests/unit`` runs in one process (no child process, no subprocess, no gloo; its own conftest.py refuses
them) and takes well under a minute; ``tests/integration`` holds the rest (real gloo, process mode, the real
frameworks, the CLI as a subprocess, scripts). The rank programs both use (``backend_programs.py``,
``isolation_programs.py``) sit here, beside this file: pytest's default ``prepend`` import mode puts this
folder on ``sys.path`` when it loads this conftest, so tests and the processes they spawn import them by name.
``tests/integration/conftest.py`` keeps torch's C++ extension builds in a private folder; process launches
fork their ranks from a forkserver per preload set (`simdist.world.processes.forkservers`), kept between tests.

``ci`` (default) keeps the suite within CI's budget on 2 cores; ``nightly``
runs the same properties with many more examples and also runs the tests
marked ``slow`` (subprocess, notebook, SIGKILL and exhaustive sweeps):

    pytest                                   # the default suite
    pytest tests/unit                        # ... its in-process part only
    pytest --run-slow                        # ... plus the slow tests
    HYPOTHESIS_PROFILE=nightly pytest        # many more examples, slow and nightly-only tests included
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("nightly", max_examples=2000, deadline=None, print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PROFILE == "nightly":
        return
    nightly = pytest.mark.skip(reason="nightly: run with HYPOTHESIS_PROFILE=nightly (too long for CI's budget)")
    slow = pytest.mark.skip(reason="slow: run with --run-slow or HYPOTHESIS_PROFILE=nightly")
    run_slow = config.getoption("--run-slow")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(nightly)
        elif "slow" in item.keywords and not run_slow:
            item.add_marker(slow)


@pytest.fixture(autouse=True)
def _restore_policy_registry():
    """A policy a test registers is gone after it: no test leaks a policy into later ones."""
    from simdist.gradpath.policy import registry_scope
    from simdist.policies.catalogue import policy_names

    policy_names()  # load the catalogue first, so it is part of what is kept
    with registry_scope():
        yield
