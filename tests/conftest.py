"""Shared test set-up: Hypothesis profiles.

``ci`` (default) keeps the suite within CI's budget on 2 cores; ``nightly``
runs the same properties with many more examples:

    HYPOTHESIS_PROFILE=nightly pytest
"""

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("nightly", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
