"""Errors raised by simulated worlds. Each names the ranks and their call sites; each is a
`simdist.errors.SimdistRuntimeError` (a `RuntimeError` under the one root `simdist.errors.SimdistError`)."""

from __future__ import annotations

from simdist.errors import SimdistRuntimeError


class CollectiveMismatchError(SimdistRuntimeError):
    """Members of one group made calls that cannot form one collective.

    Raised when the n-th collective on a group differs between its members in
    op, shape, dtype, device, reduce op, source rank or split sizes. The
    message lists every member's call and source line.
    """


class CollectiveDeadlockError(SimdistRuntimeError):
    """The run can never complete: every live rank waits on a collective that cannot finish.

    Raised, for example, when ranks call collectives on different groups in a
    cyclic order, or when a rank returns while its peers wait for it.
    """


class SimTimeoutError(SimdistRuntimeError):
    """The run exceeded its wall-clock limit; the message shows where each rank was."""
