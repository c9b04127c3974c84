"""Where rank threads meet: the `Rendezvous` (`meeting`), a rank's side of a collective and its call site (`calls`),
what a blocked rank waits on (`waits`), each rank thread's wake-up semaphore (`baton`) and who sees every collective
of both front ends (`observers`)."""

from simdist.world.rendezvous.baton import Batons
from simdist.world.rendezvous.calls import Call, Members
from simdist.world.rendezvous.meeting import Aborted, Rendezvous
from simdist.world.rendezvous.observers import CollectiveEvent, Observers, observed

__all__ = ["Aborted", "Batons", "Call", "CollectiveEvent", "Members", "Observers", "Rendezvous", "observed"]
