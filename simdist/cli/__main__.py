"""``python -m simdist.cli``: the same as the ``simdist`` command."""

import sys

from simdist.cli import main

sys.exit(main())
