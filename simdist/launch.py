"""``python -m simdist.launch``: run a rank program under torchrun (`simdist.world.launch` under a shorter name).

torchrun --nproc-per-node 4 -m simdist.launch mypkg.study:rank_fn --tp 2 --ep 2
"""

from __future__ import annotations

from simdist.world.launch import main, run_torchrun

__all__ = ["main", "run_torchrun"]

if __name__ == "__main__":
    main()
