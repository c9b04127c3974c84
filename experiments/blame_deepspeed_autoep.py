"""A DeepSpeed AutoEP+AutoTP BF16_Optimizer training script, torchrun-style, for ``simdist blame --processes``.

    simdist blame --nproc 4 --processes experiments/blame_deepspeed_autoep.py
    simdist blame --nproc 4 --processes --promote auto_ep_folding.py:452 experiments/blame_deepspeed_autoep.py
    simdist blame --nproc 4 --processes experiments/blame_deepspeed_autoep.py --fix     # the #8913 fix

Nothing here knows simdist's blame. The setup is the one the ``deepspeed-8913`` case drives
(`simdist.cases.deepspeed.harness`): DeepSpeed 0.19.8's own groups for TP2/EP2/ETP1 folding on 4 ranks
(``groups._init_tp_groups_with_new_group``, ``groups._create_expert_and_data_parallel(folding_spec=...)``),
a module with one parameter of each folding family marked as AutoEP/AutoTP injection marks them
(`simdist.cases.deepspeed.harness.mark_family`), BF16 weights from simdist's seeded synthetic model, a real
``BF16_Optimizer`` over ``torch.optim.SGD`` with ``configure_autoep_folding_tp_gradient_reduction``, and a
loss whose backward gives each rank simdist's seeded BF16 local gradient (``rounding`` inputs: the router's
TP peers differ, so the FP32 TP average does not fit in BF16). Each step runs what the engine runs:
``backward_prologue``, backward, ``backward_epilogue`` (DeepSpeed's ``update_hp_grads``: the folding
correction of the router gradients in ``auto_ep_folding.py``, whose FP32 TP average is written back into the
BF16 gradient -- the #8913 writeback -- and then added to the FP32 gradient buffer), the engine's folding
pass at the boundary, a data-parallel average of the FP32 gradients (dense over DP, experts over EDP), and
``BF16_Optimizer.step`` (SGD on the FP32 masters, BF16 weights updated from them).

``--fix``: the #8913 fix instead of DeepSpeed's ``_update_hp_grad`` (FP32 staging: the BF16 gradient is
widened, corrected in FP32 and added to the FP32 buffer; never written back to BF16).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import types

import torch
import torch.distributed as dist
from deepspeed import comm as ds_comm
from deepspeed.module_inject import auto_ep_folding
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.precision_config import DeepSpeedBF16Config
from deepspeed.utils import groups, logger

from simdist.cases.deepspeed.harness import mark_family
from simdist.gradpath.families import Family
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, synthetic_gradients
from simdist.world.spec import ParallelSpec

TP, EP = 2, 2


def setup(world_size: int):
    """DeepSpeed's comm layer and its folding groups on the default group; the folding spec."""
    logger.setLevel(logging.ERROR)
    # the shared-memory CPU op compiles on first use and serves only inference_all_reduce
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    folding = auto_ep_folding.build_folding_spec(
        world_size=world_size, pp_size=1, tp_size=TP, ep_size=EP, etp_size=1, mp_mode="tp"
    )
    groups._init_tp_groups_with_new_group(TP)
    groups._create_expert_and_data_parallel(EP, mp_size=TP, pp_size=1, mp_mode="tp", folding_spec=folding)
    return folding


def model(spec: ParallelSpec, rank: int, seed: int):
    """A module with one parameter of each folding family (BF16), marked; ``(module, optimizer param groups)``."""
    initial = InitialWeights(spec, seed)
    root = torch.nn.Module()
    dense, experts = [], []
    for p in DEFAULT_PARAMS:
        *path, leaf = p.name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        param = torch.nn.Parameter(initial(rank, p).to(torch.bfloat16).clone())
        owner.register_parameter(leaf, param)
        mark_family(param, p.family, EP)
        (experts if p.family is Family.EXPERT else dense).append(param)
    return root, [{"params": dense}, {"params": experts, "moe": True, "name": f"ep_size_{EP}"}]


def staged_update_hp_grad(self, lp, group_idx, param_idx, clear_lp_grads):
    """The #8913 fix of ``BF16_Optimizer._update_hp_grad``: correct an FP32 copy of the BF16 gradient, add it."""
    if lp.grad is None:
        return
    hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
    staging = lp.grad.data.to(hp_grad.dtype, copy=True)
    if self.autoep_folding_tp_group is not None and getattr(lp, "ds_grad_is_ready", True):
        auto_ep_folding.apply_folding_correction_to_grad_buffer(
            self.autoep_folding_spec, lp, staging, tp_group=self.autoep_folding_tp_group,
            param_name=self.param_names.get(lp),
        )  # fmt: skip
    hp_grad.data.add_(staging.view(hp_grad.shape))
    lp._hp_grad = hp_grad
    self.fp32_groups_has_gradients[group_idx][param_idx] = True
    if clear_lp_grads:
        lp.grad.zero_()


def average_over_data_parallel(optimizer) -> None:
    """The engine's data-parallel gradient reduction, per tensor: dense over DP, experts over EDP, averaged."""
    dense, experts = optimizer.get_grads_for_reduction()
    dp = groups.get_data_parallel_group()
    for g in dense:
        dist.all_reduce(g, group=dp)
        g.div_(dist.get_world_size(dp))
    for name, grads in experts.items():
        edp = groups._get_expert_data_parallel_group(name)
        for g in grads:
            dist.all_reduce(g, group=edp)
            g.div_(dist.get_world_size(edp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--fix", action="store_true", help="the #8913 fix (FP32 staging) instead of the writeback")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = ParallelSpec(world_size, tp=TP, ep=EP)
    folding = setup(world_size)
    module, param_groups = model(spec, rank, args.seed)
    names = {p: n for n, p in module.named_parameters()}
    by_name = {n: p for p, n in names.items()}
    optimizer = BF16_Optimizer(
        torch.optim.SGD(param_groups, lr=args.lr),
        names,
        DeepSpeedBF16Config(enabled=True),
        dp_process_group=groups.get_data_parallel_group(),
        grad_acc_dtype=torch.float32,
        has_moe_layers=True,
    )
    optimizer.configure_autoep_folding_tp_gradient_reduction(folding)
    if args.fix:
        optimizer._update_hp_grad = types.MethodType(staged_update_hp_grad, optimizer)
    engine = types.SimpleNamespace(  # what the engine's folding pass reads of the engine
        _autoep_folding_spec=folding,
        optimizer=optimizer,
        module=module,
        zero_optimization_partition_weights=lambda: False,
    )
    local_gradient = synthetic_gradients(spec, args.seed, "rounding")
    for step in range(args.steps):
        optimizer.backward_prologue()
        loss = sum((by_name[p.name] * local_gradient(step, 0, rank, p)).sum() for p in DEFAULT_PARAMS)
        loss.backward()
        optimizer.backward_epilogue()
        DeepSpeedEngine._reduce_autoep_folding_tp_replicated_gradients(engine)
        average_over_data_parallel(optimizer)
        optimizer.step()
    if rank == 0:
        print(f"trained {args.steps} steps on {world_size} ranks ({'fix' if args.fix else 'DeepSpeed as shipped'})")


if __name__ == "__main__":
    main()
