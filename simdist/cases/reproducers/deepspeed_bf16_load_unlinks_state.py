"""DeepSpeed 0.19.8: after ``engine.load_checkpoint`` into a ``BF16_Optimizer`` engine that has already stepped,
``safe_get_full_optimizer_state`` raises ``TypeError: argument of type 'NoneType' is not iterable`` for good
(the next steps do not repair it); in a multi-rank run the ranks holding no fragment of that parameter then
wait in its all-reduce (a hang).

Standalone: torch and deepspeed only. Run with torchrun (gloo on CPU, NCCL when CUDA is present):

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
    torchrun --standalone --nproc-per-node 1 deepspeed_bf16_load_unlinks_state.py [--fresh]

Why: ``BF16_Optimizer._load_legacy_checkpoint`` calls ``_link_all_hp_params()``, which gives every parameter a
new ``_hp_mapping`` whose ``optim_fragment`` is ``None``; the optimizer-state fragments are linked lazily in
``step()`` by ``_lazy_init_hp_params_optimizer_state``, which runs only while ``_hp_optimizer_states_linked``
is False. The load does not reset that flag, so an engine that stepped before the load never relinks, and
``get_optim_state_fragment`` evaluates ``key in None``. Training is not affected (the base optimizer's state
is loaded and used); only DeepSpeed's accessor is.

With ``--fresh`` (the control) a newly built engine loads the checkpoint: its flag is still False, so the
first step after the load links the fragments and the accessor works (before that step it raises the same
``TypeError``: the state is loaded but not linked).

Exit status 1 when the accessor raises after the load and one step.
"""

import argparse
import importlib
import logging
import tempfile

import torch
import torch.distributed as dist


def build():
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},  # bf16 + ZeRO-1 + FP32 accumulation: BF16_Optimizer
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(engine) -> None:
    loss = engine(torch.ones(1, 4, dtype=torch.bfloat16, device=engine.device)).float().sum()
    engine.backward(loss)
    engine.step()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fresh", action="store_true", help="load into a newly built engine (the control)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    from deepspeed import comm as ds_comm
    from deepspeed.utils import logger, safe_get_full_optimizer_state

    logger.setLevel(logging.ERROR)
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None  # nothing to compile
    ds_comm.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)

    engine = build()
    train_step(engine)
    weight = engine.module.weight
    before = float(safe_get_full_optimizer_state(weight, "exp_avg").sum())
    print(f"{type(engine.optimizer).__name__}: exp_avg before save, sum {before:.6g}")
    with tempfile.TemporaryDirectory() as root:
        engine.save_checkpoint(root, tag="t")
        if args.fresh:
            engine = build()
            weight = engine.module.weight
        engine.load_checkpoint(root, tag="t")
    train_step(engine)
    try:
        state = safe_get_full_optimizer_state(weight, "exp_avg")
    except TypeError as exc:
        print(f"after load_checkpoint + 1 step: safe_get_full_optimizer_state raised TypeError: {exc} -> DEFECT")
        return 1
    print(f"after load_checkpoint + 1 step: exp_avg sum {float(state.sum()):.6g} -> OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
