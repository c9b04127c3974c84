"""What a rank thread blocked in the rendezvous waits on: a collective some members entered, a posted receive,
or a sent message not yet taken (`simdist.world.rendezvous.meeting.Rendezvous` keeps one per blocked rank).

Each says in one line what its rank waits for (``waiting_line``), which is how a deadlock or a timeout names
every rank's place.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from simdist.world.rendezvous.calls import Call


class PendingCollective:
    """A collective some members of a group have entered."""

    __slots__ = ("calls", "error", "members", "signature")

    def __init__(self, members: tuple[int, ...], signature: tuple) -> None:
        self.members = members
        self.signature = signature  # the first arrival's: every later one must equal it
        self.calls: dict[int, Call] = {}
        self.error: BaseException | None = None

    def waiting_line(self, rank: int) -> str:
        missing = [r for r in self.members if r not in self.calls]
        return f"{self.calls[rank].describe()}  [waiting for ranks {missing}]"


class PostedRecv:
    """A posted receive: filled by a matching send, waited on by its rank.

    ``src`` is the global rank it receives from (``None``: any source); ``source`` the sender's channel key
    part (its group rank) once a message has filled it."""

    __slots__ = ("call", "done", "source", "src", "tensor")

    def __init__(self, call: Call, src: int | None, tensor: torch.Tensor) -> None:
        self.call = call
        self.src = src
        self.tensor = tensor
        self.done = False
        self.source: Hashable = None

    def waiting_line(self, rank: int) -> str:
        sender = "any rank" if self.src is None else f"rank {self.src}"
        return f"{self.call.describe()}  [waiting for a message from {sender}]"


class SentMessage:
    """A sent message: ``done`` once a receive took it. Waiting on it is gloo's blocking send, which returns
    only after the peer posted the matching receive (so sends received in another order deadlock, as on gloo)."""

    __slots__ = ("call", "done", "dst")

    def __init__(self, call: Call, dst: int) -> None:
        self.call = call
        self.dst = dst
        self.done = False

    def waiting_line(self, rank: int) -> str:
        return (
            f"{self.call.describe()}  [a blocking send: on gloo it returns only once rank {self.dst} posts the "
            "matching recv (same tag)]"
        )
