"""Reproduce DeepSpeed #8913 in the simulator (same as ``simdist repro 8913``; takes the same options)."""

import sys

from simdist.cli import main

if __name__ == "__main__":
    sys.exit(main(["repro", "8913", *sys.argv[1:]]))
