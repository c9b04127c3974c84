"""Run the #8913 production-shape simulator study (`simdist.studies.production`) and save its tables.

    python bench/production_study.py OUT MODEL:STEPS:SEEDS [MODEL:STEPS:SEEDS ...]
    e.g. python bench/production_study.py docs/production Mixtral-8x7B:1000:2 GPT-OSS-20B:1000:1

Writes ``OUT/<model>.json`` (the steps, seeds, wall seconds and every family's row) and ``OUT/<model>.md``
(the table) as each model finishes, and prints progress every 100 steps. docs/production.md's study table
was made this way (the steps and seeds of each model are in its table).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from simdist.studies.production import format_table, study_model


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    plan = [(name, int(steps), int(seeds)) for name, steps, seeds in (item.split(":") for item in argv[1:])]
    for name, steps, seeds in plan:
        start = time.time()

        def progress(step: int, name: str = name, start: float = start) -> None:
            if step % 100 == 0:
                print(f"{name} step {step} ({time.time() - start:.0f} s)", flush=True)

        rows = study_model(name, steps, seeds, progress=progress)
        summary = {"steps": steps, "seeds": seeds, "wall_s": time.time() - start, "rows": [asdict(r) for r in rows]}
        (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
        (out / f"{name}.md").write_text(format_table(rows) + "\n")
        print(f"done {name} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
