"""DeepSpeed 0.19.8: under AutoEP+AutoTP folding, ZeRO-1/2's global gradient norm leaves out the routed experts
held by TP ranks other than 0, so gradient clipping uses a norm that is too small.

Standalone: torch and deepspeed only. Run with torchrun (gloo on CPU, NCCL when CUDA is present):

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
    torchrun --standalone --nproc-per-node 4 deepspeed_zero_norm_experts.py [--stage 1|2] [--bf16-optimizer]

Layout TP2/EP2/ETP1 on 4 ranks (``tensor_parallel.autotp_size: 2``, ``expert_parallel.autoep_size: 2``):
TP groups {0,1} {2,3}, EP groups {0,1} {2,3}, EDP groups {0,2} {1,3}. So TP rank 0 (ranks 0 and 2) holds
expert 0 and TP rank 1 (ranks 1 and 3) holds expert 1: under folding the EP group lies inside the TP group.

The model has one replicated parameter, one TP-sharded parameter (``tensor_model_parallel``) and one
routed-expert parameter (``allreduce=False``, MoE param group). Every gradient is a small multiple of
2**-5, identical on the ranks that share a parameter, so every sum, average and square below is exact: no
rounding is involved.

Expected: ``engine.get_global_grad_norm()`` = sqrt(||dense||^2 + ||shard 0||^2 + ||shard 1||^2 +
||expert 0||^2 + ||expert 1||^2).

Observed with ZeRO-1 or ZeRO-2: the same without ||expert 1||^2. In ``get_grad_norm_direct``
(``runtime/zero/stage_1_and_2.py``) a parameter without ``tensor_model_parallel`` is counted only where
``model_parallel_rank == 0``; the routed expert is not TP-sharded but differs across TP ranks under folding,
so expert 1 (TP rank 1 only) is never counted. With ``--bf16-optimizer`` (``grad_accum_dtype: fp32``, which
selects ``BF16_Optimizer``) the norm is the expected one.

Two steps that the real AutoEP/AutoTP injection would do are done by hand, because they recognise Hugging
Face model classes (``transformers`` is not needed here): ``AutoEP.ep_parser`` finds no MoE block and
``DeepSpeedEngine._apply_autotp_partitioning`` shards nothing; the parameters are marked as the replaced
layers would mark them, and ``engine.has_moe_layers`` is set. The folding spec, its validation, every process
group and the optimizer wrapper are DeepSpeed's own.

Exit status 1 when the norm is not the expected one. Nothing is compiled (the CPU shared-memory
communication op, used only by ``inference_all_reduce``, is disabled).
"""

import argparse
import importlib
import logging

import torch
import torch.distributed as dist


class Leaf(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(value)

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.weight * grad.to(self.weight)).sum()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = Leaf(torch.zeros(4))
        self.sharded = Leaf(torch.zeros(4))
        self.expert = Leaf(torch.zeros(4))
        self.grads: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(getattr(self, name)(grad) for name, grad in self.grads.items())


def init_deepspeed() -> str:
    """The default process group (NCCL with one GPU per rank, else gloo) and DeepSpeed's comm on it; the backend."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    from deepspeed import comm as ds_comm
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    # (through the module's namespace: the untyped module declares no such attribute)
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
    ds_comm.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)
    return backend


def inject_by_hand() -> None:
    """The two injection steps that recognise Hugging Face classes, done by hand (see the module docstring):
    AutoEP finds no MoE block, AutoTP shards nothing, and the engine is told it has MoE layers."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_layer import ReplacementSourceMap
    from deepspeed.runtime.engine import DeepSpeedEngine

    AutoEP.ep_parser = lambda self: []
    DeepSpeedEngine._apply_autotp_partitioning = lambda self, model, tp_config: ReplacementSourceMap()
    configure_ep = DeepSpeedEngine._configure_expert_parallel

    def configure_ep_with_moe(self, model, collect_sources=None):
        sources = configure_ep(self, model, collect_sources=collect_sources)
        self.has_moe_layers = True
        return sources

    DeepSpeedEngine._configure_expert_parallel = configure_ep_with_moe


def make_engine(stage: int, bf16_optimizer: bool):
    """The engine: the model's parameters marked as the replaced layers would mark them, TP2/EP2 folding,
    ZeRO ``stage`` (or BF16_Optimizer), gradient clipping at 1.0."""
    import deepspeed

    model = Model()
    # a TP-sharded weight (one shard per TP rank); DeepSpeed reads ad-hoc attributes that Parameter does not declare
    model.sharded.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    model.expert.weight.allreduce = False  # type: ignore[attr-defined]
    model.expert.weight.group_name = "ep_size_2"  # type: ignore[attr-defined]
    groups: list[dict[str, object]] = [
        {"params": [model.dense.weight, model.sharded.weight], "name": "dense"},
        {"params": [model.expert.weight], "moe": True, "name": "ep_size_2"},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "tensor_parallel": {"autotp_size": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
        "zero_allow_untested_optimizer": True,
    }
    if bf16_optimizer:
        config["zero_optimization"] = {"stage": 1}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2))
    parser.add_argument("--bf16-optimizer", action="store_true", help="grad_accum_dtype fp32: BF16_Optimizer")
    args = parser.parse_args()

    init_deepspeed()
    rank = dist.get_rank()
    inject_by_hand()
    engine = make_engine(args.stage, args.bf16_optimizer)

    tp_rank = rank % 2  # TP groups {0,1} {2,3}
    dense = torch.tensor([1.0, 2.0, 3.0, 4.0]) / 32
    # The expert of EP rank e (= TP rank here); the folding correction divides it by TP=2, the EDP average
    # of two equal values keeps it, so the reduced expert gradient is exactly (e + 1) * ones / 32.
    expert = torch.full((4,), (tp_rank + 1) * 2.0 / 32)
    sharded = torch.full((4,), (tp_rank + 1) / 16)
    engine.module.grads = {"dense": dense, "sharded": sharded, "expert": expert}
    loss = engine(torch.zeros(1, device=engine.device))
    engine.backward(loss)
    engine.step()

    expert_norms_sq = [float(((e + 1) * torch.ones(4) / 32).square().sum()) for e in range(2)]
    shards_sq = sum(float(((t + 1) * torch.ones(4) / 16).square().sum()) for t in range(2))
    expected = (float(dense.square().sum()) + shards_sq + sum(expert_norms_sq)) ** 0.5
    without_expert_1 = (float(dense.square().sum()) + shards_sq + expert_norms_sq[0]) ** 0.5
    got = float(engine.get_global_grad_norm())
    ok = abs(got - expected) <= 1e-6 * expected
    wrapper = type(engine.optimizer).__name__
    print(
        f"rank {rank} {wrapper}: global grad norm {got:.7f}, expected {expected:.7f} "
        f"(without expert 1: {without_expert_1:.7f}) -> {'OK' if ok else 'WRONG'}",
        flush=True,
    )
    dist.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
