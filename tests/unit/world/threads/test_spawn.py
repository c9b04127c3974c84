"""`simdist.world.threads.spawn.ThreadLocalWorld`: c10d's ``_world`` with one state per rank thread.

Its attributes are C-level reads of the calling thread's state (``operator.attrgetter``); a thread that is not
a rank, or has left its rank, reads and writes the fallback ``_World``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from simdist.world.threads.spawn import ThreadLocalWorld


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_rank_threads_have_their_own_state_and_other_threads_the_fallback():
    # the caller's own c10d state (a stand-in: torch's `_World` writes module globals)
    fallback = SimpleNamespace(default_pg="caller's group", group_count=0, pg_map={})
    world = ThreadLocalWorld(fallback)  # type: ignore[arg-type]

    def rank(name: str):
        world.enter_rank()
        fresh = (world.default_pg, world.group_count, dict(world.pg_map))
        world.default_pg = name
        world.group_count = 7
        world.pg_map["k"] = name
        seen = (world.default_pg, world.group_count, world.pg_map["k"])
        world.leave_rank()
        return fresh, seen, world.default_pg

    left = "caller's group"  # after leave_rank: the fallback again
    assert _in_thread(lambda: rank("a")) == ((None, 0, {}), ("a", 7, "a"), left)
    assert _in_thread(lambda: rank("b")) == ((None, 0, {}), ("b", 7, "b"), left)  # nothing left from "a"
    assert fallback == SimpleNamespace(default_pg="caller's group", group_count=0, pg_map={})  # never written

    def other() -> bool:  # not a rank: the fallback, read and written
        world.group_count = 3
        return world.group_count == fallback.group_count == 3

    assert _in_thread(other)
    assert world.group_count == 3  # this thread (not a rank either) sees the same fallback
