"""`MoEGradients`: the folded block as a gradient source of the gradient path."""

from __future__ import annotations

from simdist.gradpath.families import Family
from simdist.sources.moe.block import folded_loss
from simdist.sources.moe.layout import DEFAULT_CONFIG, MoEConfig, MoEInitialWeights, batch, moe_params, replica_of
from simdist.world.spec import ParallelSpec


class MoEGradients:
    """`GradientSource`: BF16 local gradients of the folded MoE block, one forward/backward per micro-step.

    ``backward`` builds the block from the current low-precision weights
    ``lp``, runs the folded forward and backward (the dispatch and combine
    all-to-alls, the restore all-gather and its all-reduce backward, the TP
    MLP's all-reduces) and delivers each parameter's BF16 ``.grad``: from a
    ``register_post_accumulate_grad_hook`` during backward when ``hooks``,
    else after backward in parameter order. It returns this rank's loss (a
    float; `train_rank` ignores it). The loss is scaled by ``1/gas`` as
    DeepSpeed's engine does, and DP normalisation (``1/dp``) is the gradient
    path's, so the reduced gradient is that of the mean over DP replicas and
    micro-steps of the per-replica loss.

    A plain class: it pickles into rank processes (``simdist.run(where="gloo")``) and torchrun processes.
    ``params`` and ``initial`` are what `train_rank` needs.
    """

    def __init__(
        self, spec: ParallelSpec, cfg: MoEConfig = DEFAULT_CONFIG, seed: int = 0, gas: int = 1, device: str = "cpu"
    ) -> None:
        cfg.validate(spec)
        self.spec, self.cfg, self.seed, self.gas, self.device = spec, cfg, seed, gas, device
        self.params = moe_params(spec, cfg)
        self.initial = MoEInitialWeights(spec, cfg, seed, device)

    @property
    def families(self) -> dict[str, Family]:
        return {p.name: p.family for p in self.params}

    def backward(self, comm, step, micro, lp, deliver, hooks) -> float:
        leaves = {p.name: lp[p.name].detach().requires_grad_(True) for p in self.params}
        if hooks:
            for name, leaf in leaves.items():
                leaf.register_post_accumulate_grad_hook(lambda p, name=name: deliver(name, p.grad))
        x, target = batch(self.cfg, self.seed, step, micro, replica_of(self.spec, comm.get_rank()))
        device = next(iter(lp.values())).device
        loss = folded_loss(comm, leaves, x.to(device), target.to(device), self.cfg, 1.0 / self.gas)
        loss.backward()
        if not hooks:
            for name, leaf in leaves.items():
                deliver(name, leaf.grad)
        return float(loss.item()) * self.gas
