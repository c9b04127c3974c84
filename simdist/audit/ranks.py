"""Auditing rank programs: `AuditedComm` records a communicator's collectives, `audited` wraps a rank program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from simdist.audit.mode import Audit
from simdist.audit.report import AuditReport

_COMM_COLLECTIVES = {  # method -> position of the tensor whose dtype the collective runs in
    "all_reduce": 0,
    "reduce_scatter_tensor": 1,
    "all_gather_into_tensor": 1,
    "all_to_all_single": 1,
    "broadcast": 0,
}
_COMM_TENSOR_NAMES = {"all_reduce": "tensor", "broadcast": "tensor"}


class AuditedComm:
    """A `Comm` wrapper: records each collective (dtype, group kind) and pauses the audit during it.

    Works over `SimComm` (whose collectives are Python, not dispatched) and
    `TorchComm` alike, so one rank program gives the same report in both worlds.
    """

    def __init__(self, comm, audit: Audit) -> None:
        self._comm = comm
        self._audit = audit
        self.spec = comm.spec

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def get_rank(self) -> int:
        return self._comm.get_rank()

    def get_world_size(self, group=None) -> int:
        return self._comm.get_world_size(group)

    def group(self, kind: str):
        return self._comm.group(kind)

    def barrier(self, *args, **kwargs):
        with self._audit.paused():
            return self._comm.barrier(*args, **kwargs)

    def _collective(self, name: str, args: tuple, kwargs: dict):
        index = _COMM_COLLECTIVES[name]
        tensor = args[index] if index < len(args) else kwargs.get(_COMM_TENSOR_NAMES.get(name, "input"))
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if hasattr(a, "ranks") and hasattr(a, "kind")), None)
        self._audit.record_collective(f"comm.{name}", tensor, f"group={group.kind if group is not None else 'world'}")
        with self._audit.paused():
            return getattr(self._comm, name)(*args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        return self._collective("all_reduce", args, kwargs)

    def reduce_scatter_tensor(self, *args, **kwargs):
        return self._collective("reduce_scatter_tensor", args, kwargs)

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._collective("all_gather_into_tensor", args, kwargs)

    def all_to_all_single(self, *args, **kwargs):
        return self._collective("all_to_all_single", args, kwargs)

    def broadcast(self, *args, **kwargs):
        return self._collective("broadcast", args, kwargs)


class audited:
    """Wrap a rank program ``fn(comm, ...)``: each rank runs it under its own `Audit` (tagged with the rank),
    with an `AuditedComm`, and returns ``(result, report)``.

    Picklable when ``fn`` is (a top-level function), so it also runs in
    ``simdist.run(where="gloo")`` children; there ``report.to_dict()`` is the portable form.
    ``options`` are `Audit`'s (``skip``, ``errors``, ``collectives``, ``max_records``).
    """

    def __init__(self, fn: Callable[..., Any], **options: Any) -> None:
        self.fn = fn
        self.options = options

    def __call__(self, comm, *args: Any, **kwargs: Any) -> tuple[Any, AuditReport]:
        with Audit(rank=comm.get_rank(), **self.options) as a:
            result = self.fn(AuditedComm(comm, a), *args, **kwargs)
        return result, a.report()
