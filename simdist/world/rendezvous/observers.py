"""Who sees every collective of both front ends: `Observers` (the audit and blame subscribe) and `observed`.

Each front end calls `observed` before a collective runs
(`simdist.world.simworld.SimComm._run`, `simdist.world.backend.process_group.SimProcessGroup._go`),
in thread and process mode alike; with nobody subscribed that is one attribute
test. Observers are an explicit list: nothing swaps
methods at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from simdist.world.rendezvous.calls import Call


class CollectiveEvent:
    """One rank's collective as an observer sees it, before it runs.

    ``call`` is the rank's `Call` (its ``signature[0]`` the collective's name),
    ``front`` the front end (``"comm"`` for `SimComm`, ``"dist"`` for the
    ``torch.distributed`` backend), ``group`` the group as text, and
    ``complete`` the function that will compute the collective's result: an
    observer may replace it with one that wraps it (blame measures there).
    """

    __slots__ = ("call", "complete", "front", "group")

    def __init__(self, call: Call, front: str, group: str, complete: Callable) -> None:
        self.call = call
        self.front = front
        self.group = group
        self.complete = complete


Observer = Callable[[CollectiveEvent], Callable[[], None] | None]
"""Called on the calling rank's thread before the collective runs; may return a function called after it returns
(or raises)."""


class Observers:
    """The observers of every collective of both front ends, shared by every run of the process."""

    subscribed: ClassVar[list[Observer]] = []
    """Replaced (never changed in place) by `subscribe`/`unsubscribe`: a collective in flight keeps iterating the
    list it read."""

    @classmethod
    def subscribe(cls, observer: Observer) -> None:
        """Add ``observer`` to `subscribed`."""
        cls.subscribed = [*cls.subscribed, observer]

    @classmethod
    def unsubscribe(cls, observer: Observer) -> None:
        """Remove ``observer`` (once) from `subscribed`."""
        remaining = list(cls.subscribed)
        remaining.remove(observer)
        cls.subscribed = remaining


def observed(
    call: Call, complete: Callable, front: str, group: Callable[[], str], proceed: Callable[[Callable], None]
) -> None:
    """Run ``proceed(complete)`` (the front end's rendezvous) with every subscribed observer told first.

    ``group`` is called only when there are observers (formatting text on every collective would cost).
    """
    observers = Observers.subscribed
    if not observers:
        proceed(complete)
        return
    event = CollectiveEvent(call, front, group(), complete)
    after: list[Callable[[], None]] = []
    try:
        for observer in list(observers):
            done = observer(event)
            if done is not None:
                after.append(done)
        proceed(event.complete)
    finally:
        for done in reversed(after):
            done()
