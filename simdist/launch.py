"""``python -m simdist.launch``: run a rank program under torchrun (`simdist.world.launch`, re-exported here).

torchrun --nproc-per-node 4 -m simdist.launch mypkg.study:rank_fn --tp 2 --ep 2
"""

from __future__ import annotations

from simdist.world.launch import RankFailure, main, run_torchrun, spawn_gloo, spawn_procs

__all__ = ["RankFailure", "main", "run_torchrun", "spawn_gloo", "spawn_procs"]

if __name__ == "__main__":
    main()
