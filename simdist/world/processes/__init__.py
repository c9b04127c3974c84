"""Process mode: the ``simdist`` backend in real processes over an inner gloo group (`transport`), the process
launcher (`launch`: `spawn_processes`), each rank process's body (`rank`), waiting, failures and the deadline
(`supervise`), a forkserver per preload set (`forkservers`, each freezing its objects: `forkserver_freeze`), and
unmodified torchrun scripts on process mode (`script_launch`, behind ``simdist run --nproc N``)."""

from simdist.world.processes.launch import LaunchTimings, spawn_processes
from simdist.world.processes.supervise import RankFailure
from simdist.world.processes.transport import ProcessTransport, process_reduction, use_reduction

__all__ = ["LaunchTimings", "ProcessTransport", "RankFailure", "process_reduction", "spawn_processes", "use_reduction"]
