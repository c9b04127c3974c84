"""DeepSpeed 0.19.8 (#8913): under AutoEP+AutoTP folding with FP32 gradient accumulation, ``BF16_Optimizer``
rounds the FP32 TP reduction of a replicated parameter's gradient to BF16 before adding it to the FP32
accumulation buffer.

Standalone: torch and deepspeed only. Run with torchrun (gloo on CPU; NCCL when CUDA is present with a GPU per rank,
else gloo with every rank's tensors on the one GPU):

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
    torchrun --standalone --nproc-per-node 4 deepspeed_8913_bf16_writeback.py [--size 4096] [--seed 0]

Layout TP2/EP2/ETP1 on 4 ranks (TP groups {0,1} {2,3}), built by DeepSpeed's own ``build_folding_spec`` and
group constructors. One router parameter, marked ``router_gate_replicated`` (correction AVERAGE: FP32 TP
all-reduce, then divide by the TP size). The two TP peers hold different BF16 local gradients, drawn over a
16-binade spread (2**-8 .. 2**8, both signs): the FP32 sum of two such BF16 values and its half are exact, so
the TP average in FP32 is one exact value whatever the order; most of those averages need more than BF16's
8 significant bits.

Expected after one micro-step: the FP32 accumulation buffer equals that exact FP32 TP average, bit for bit.

Observed as shipped: ``_update_hp_grad`` passes ``lp.grad`` (BF16) to ``apply_folding_correction_to_grad_buffer``,
whose ``reduce_autoep_folding_gradient`` reduces in FP32 and then writes the result back with
``grad_data.copy_(reduced.to(grad_data.dtype))``; ``_update_hp_grad`` then adds that BF16 value to the FP32
buffer. Most elements differ, by up to 2**-8 relative (BF16's unit roundoff,
half an ulp).

Exit status 1 when some element of the buffer is not the exact FP32 average. Nothing is compiled (the CPU
shared-memory communication op, used only by ``inference_all_reduce``, is disabled).
"""

import argparse
import importlib
import logging
import os
import sys

import torch
import torch.distributed as dist


def local_gradient(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """BF16 values with exponents in [-8, 8) and random signs and significands (the seed gives each rank its own)."""
    generator = torch.Generator().manual_seed(seed)
    significand = 1.0 + torch.randint(0, 128, (numel,), generator=generator).double() / 128  # 8 bits: exact in BF16
    exponent = torch.randint(-8, 8, (numel,), generator=generator).double()
    sign = torch.randint(0, 2, (numel,), generator=generator).double() * 2 - 1
    return (sign * significand * torch.exp2(exponent)).to(torch.bfloat16).to(device)


def init_groups(backend: str):
    """DeepSpeed's comm on ``backend`` and the AutoEP/AutoTP folding groups of TP2/EP2/ETP1 on 4 ranks;
    (folding spec, TP group)."""
    from deepspeed import comm as ds_comm
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec
    from deepspeed.utils import groups, logger

    logger.setLevel(logging.ERROR)
    # (through the module's namespace: the untyped module declares no such attribute)
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
    ds_comm.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)
    world = dist.get_world_size()
    folding = build_folding_spec(world_size=world, pp_size=1, tp_size=2, ep_size=2, etp_size=1, mp_mode="tp")
    groups._init_tp_groups_with_new_group(2)
    groups._create_expert_and_data_parallel(2, mp_size=2, pp_size=1, mp_mode="tp", folding_spec=folding)
    return folding, groups.get_tensor_model_parallel_group()


def make_optimizer(router: torch.nn.Parameter, folding):
    """BF16_Optimizer over the router alone (an SGD at lr 0 inside: only the FP32 gradient is read), FP32
    accumulation, the folding TP correction configured."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.utils import groups

    optimizer = BF16_Optimizer(
        torch.optim.SGD([router], lr=0.0),
        {router: "router.weight"},
        DeepSpeedBF16Config(enabled=True),
        dp_process_group=groups.get_data_parallel_group(),
        grad_acc_dtype=torch.float32,
    )
    optimizer.configure_autoep_folding_tp_gradient_reduction(folding)
    return optimizer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4096, help="router elements (e.g. 8 x 4096 for Mixtral)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    # NCCL needs a GPU per rank; with fewer GPUs gloo all-reduces the CUDA tensors (ranks share a GPU)
    backend = "nccl" if cuda and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1")) else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run on 4 ranks: torchrun --standalone --nproc-per-node 4 ...")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    folding, tp_group = init_groups(backend)
    from deepspeed.module_inject.auto_ep_folding import mark_autoep_folding_router_parameter

    router = torch.nn.Parameter(torch.zeros(args.size, dtype=torch.bfloat16, device=device))
    mark_autoep_folding_router_parameter(router)
    optimizer = make_optimizer(router, folding)
    hp_grad = optimizer.fp32_groups_gradients[0][0].view(router.shape)

    local = local_gradient(args.size, 1000 * args.seed + rank, device)
    peers = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(peers, local, group=tp_group)
    expected = (peers[0].float() + peers[1].float()) / 2  # exact (see the docstring)

    optimizer.backward_prologue()
    (router * local).sum().backward()  # router.grad == local exactly
    optimizer.backward_epilogue()  # update_hp_grads(): _update_hp_grad with the folding correction

    differ = hp_grad.view(torch.int32) != expected.view(torch.int32)
    relative = ((hp_grad.double() - expected.double()).abs() / expected.double().abs().clamp_min(2.0**-126))[differ]
    figures = torch.tensor([float(differ.sum()), float(relative.max()) if relative.numel() else 0.0], device=device)
    counts = figures[:1].clone()
    dist.all_reduce(counts)
    dist.all_reduce(figures[1:], op=dist.ReduceOp.MAX)
    wrong = int(counts.item())
    if rank == 0:
        print(f"{world} ranks, {backend} on {hp_grad.device.type}", flush=True)
        if wrong:
            print(
                f"DEFECT: {wrong} of {world * args.size} router hp-gradient elements over {world} ranks are the "
                f"BF16-rounded TP average, not the FP32 one (max relative error {figures[1].item():.3g}; "
                f"BF16's unit roundoff is {2.0**-8:.3g})",
                flush=True,
            )
        else:
            print(f"OK: all {world * args.size} router hp-gradient elements are the exact FP32 TP average", flush=True)
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # DeepSpeed's TP and expert groups are never destroyed; letting the interpreter tear down their gloo threads
    # at exit sometimes aborts the rank ("terminate called without an active exception", seen once in 3 CI runs)
    os._exit(status)
