"""A torchrun script as users write it (tests/integration/test_idioms.py): ``script.py BACKEND OUTDIR``.

It reads its rank from torchrun's environment, initialises the default group with the backend named on its
command line (``env://``), runs collectives on values whose sums round, and saves each rank's tensors.
"""

import sys

import torch
import torch.distributed as dist


def main() -> None:
    backend, outdir = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(65, generator=g) * torch.exp2(torch.randint(-24, 24, (65,), generator=g).float())
    total = x.clone()
    dist.all_reduce(total)
    out = torch.empty(world * 65)
    dist.all_gather_into_tensor(out, x)
    torch.save({"total": total, "gathered": out, "backend": str(dist.get_backend())}, f"{outdir}/{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
