"""DeepSpeed 0.19.8: with gradient accumulation, BF16_Optimizer's AutoEP+AutoTP folding skips the TP
correction of every micro-step after the first on the default (epilogue) update path.

Standalone: torch and deepspeed only. Run on CPU with gloo:

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
    torchrun --standalone --nproc-per-node 4 deepspeed_gas_marker.py [--gas 2] [--immediate]

Layout TP2/EP2/ETP1 on 4 ranks (TP groups {0,1} {2,3}). One router parameter,
marked ``router_gate_replicated`` (correction AVERAGE: TP all-reduce, then
divide by the TP size). TP peers hold different local gradients, chosen as
small multiples of 2**-10 so that every sum and average below is exact in
BF16 and FP32: no rounding is involved, only which micro-steps are corrected.

Expected after micro-step m: the FP32 hp gradient equals the sum over
micro-steps 0..m of the TP average of the peers' local gradients.

Observed on the epilogue path (``immediate_grad_update: false``, the
default): ``apply_folding_correction_to_grad_buffer`` sets
``ds_autoep_folding_grad_corrected`` on micro-step 0; nothing clears it until
the engine's boundary pass (``_reduce_autoep_folding_tp_replicated_gradients``),
so on micro-steps 1..GAS-1 the helper returns "skip" and ``_update_hp_grad``
adds the raw local gradient. With ``--immediate`` (hooks path,
``accumulate_hp_grads_and_remove_lp`` clears the marker after each hook)
every micro-step is corrected.

Exit status 1 when some micro-step's hp gradient is not the expected one.
The script does not compile any DeepSpeed op: it disables the CPU
shared-memory communication op, which only ``inference_all_reduce`` uses.
"""

import argparse
import importlib
import logging

import torch
import torch.distributed as dist


def init_groups():
    """gloo, DeepSpeed's comm, and the AutoEP/AutoTP folding groups of TP2/EP2/ETP1; (folding spec, TP group)."""
    dist.init_process_group("gloo")
    from deepspeed import comm as ds_comm
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec
    from deepspeed.utils import groups, logger

    logger.setLevel(logging.ERROR)
    # (through the module's namespace: the untyped module declares no such attribute)
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    world = dist.get_world_size()
    folding = build_folding_spec(world_size=world, pp_size=1, tp_size=2, ep_size=2, etp_size=1, mp_mode="tp")
    groups._init_tp_groups_with_new_group(2)
    groups._create_expert_and_data_parallel(2, mp_size=2, pp_size=1, mp_mode="tp", folding_spec=folding)
    return folding, groups.get_tensor_model_parallel_group()


def make_optimizer(router: torch.nn.Parameter, folding, immediate: bool):
    """BF16_Optimizer over the router alone (an SGD at lr 0 inside: only the FP32 gradient is read), FP32
    accumulation, the folding TP correction configured, on the hooks path where ``immediate``."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.utils import groups

    config = DeepSpeedBF16Config(enabled=True, immediate_grad_update=immediate)
    optimizer = BF16_Optimizer(
        torch.optim.SGD([router], lr=0.0),
        {router: "router.weight"},
        config,
        dp_process_group=groups.get_data_parallel_group(),
        grad_acc_dtype=torch.float32,
    )
    optimizer.configure_autoep_folding_tp_gradient_reduction(folding)
    return optimizer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--immediate", action="store_true", help="immediate_grad_update=True (hooks path)")
    args = parser.parse_args()

    folding, tp_group = init_groups()
    from deepspeed.module_inject.auto_ep_folding import (
        is_autoep_folding_gradient_corrected,
        mark_autoep_folding_router_parameter,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    router = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16))
    mark_autoep_folding_router_parameter(router)
    optimizer = make_optimizer(router, folding, args.immediate)
    hp_grad = optimizer.fp32_groups_gradients[0][0].view(router.shape)

    expected = torch.zeros(router.shape, dtype=torch.float32)
    failures = 0
    for micro in range(args.gas):
        generator = torch.Generator().manual_seed(1000 * rank + micro)
        local = (torch.randint(-8, 9, router.shape, generator=generator) * 2.0**-10).to(torch.bfloat16)
        peers = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(peers, local, group=tp_group)
        average = torch.stack([p.float() for p in peers]).sum(0) / len(peers)
        before = hp_grad.clone()

        optimizer.backward_prologue()
        (router * local).sum().backward()  # router.grad == local exactly
        marker_before_update = is_autoep_folding_gradient_corrected(router)
        optimizer.backward_epilogue()  # update_hp_grads() on the epilogue path; a no-op with --immediate

        expected += average
        added = hp_grad - before
        if torch.equal(hp_grad, expected):
            what = "corrected (TP average added)"
        else:
            failures += 1
            raw = torch.equal(added, local.float())
            what = "NOT corrected: the raw local gradient was added" if raw else "NOT the expected value"
            if marker_before_update:
                what += " -- ds_autoep_folding_grad_corrected was still set from an earlier micro-step"
        if rank == 0:
            print(f"micro-step {micro}: {what}", flush=True)
    failed = torch.tensor([failures])
    dist.all_reduce(failed)
    if rank == 0:
        path = "immediate (hooks)" if args.immediate else "epilogue (default)"
        result = "FAIL" if failed.item() else "OK"
        print(
            f"{result}: {args.gas} micro-steps on the {path} path, {failed.item()} wrong hp gradients over "
            f"{world} ranks",
            flush=True,
        )
    dist.destroy_process_group()
    return 1 if failed.item() else 0


if __name__ == "__main__":
    raise SystemExit(main())
