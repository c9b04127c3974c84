"""Scripts as users write them (tests/integration/test_idioms.py): nothing here knows simdist.

``tutorial_worker`` is the torch tutorial's ``mp.spawn`` worker: it initialises its own default group with a
backend name and an init method, builds a subgroup naming the backend again, branches on
``dist.get_backend()``, and destroys the group at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _values(rank: int, n: int) -> torch.Tensor:
    """float32 values over 40 binades: their sums round, so the summation order shows in the bits."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())


def tutorial_worker(rank: int, world_size: int, init_method: str | None = None, backend: str | None = "gloo") -> dict:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    x = _values(rank, 33)
    total = x.clone()
    dist.all_reduce(total)
    pair = dist.new_group([0, 1], backend=backend)
    pair_total = x.clone()
    if rank < 2:
        dist.all_reduce(pair_total, group=pair)
    gathered = [torch.empty(33) for _ in range(world_size)]
    dist.all_gather(gathered, x)
    asked = str(dist.get_backend())
    scaled = total / world_size if asked == "nccl" else total * (1.0 / world_size)  # a path gated on the name
    dist.destroy_process_group()
    return {
        "total": total,
        "pair": pair_total,
        "gathered": torch.stack(gathered),
        "scaled": scaled,
        "initialised_after": dist.is_initialized(),
    }


def reinit_worker(rank: int, world_size: int) -> dict:
    """Init, a collective, destroy, init again, another collective (a script that runs two phases)."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    first = _values(rank, 9)
    dist.all_reduce(first)
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    second = _values(rank + 100, 9)
    dist.all_reduce(second)
    dist.destroy_process_group()
    return {"first": first, "second": second}
