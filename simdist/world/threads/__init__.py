"""Thread mode: unmodified ``torch.distributed`` code on one thread per rank (`spawn`: `spawn_threads`, the
thread-local c10d world), each rank's copies of process-global state (`isolation`), Python's and NumPy's global
generators per rank (`rank_rngs`), and the frameworks refused on rank threads (`frameworks`)."""

from simdist.world.threads.isolation import RankIsolation
from simdist.world.threads.rank_rngs import RankGenerators, SharedGlobalStateError
from simdist.world.threads.spawn import RankExitError, ThreadLocalWorld, check_world_size, spawn_threads

__all__ = [
    "RankExitError",
    "RankGenerators",
    "RankIsolation",
    "SharedGlobalStateError",
    "ThreadLocalWorld",
    "check_world_size",
    "spawn_threads",
]
