"""A tiny MoE transformer block in BF16, laid out as DeepSpeed's AutoEP+AutoTP folding lays it out.

One block, every folding family present (``MoEConfig`` sizes; defaults are
small for fast CPU runs)::

    a = LN1(x);  h = x + W2 silu(W1 a)                 dense MLP            DENSE (replicated)
    b = LN2(h);  gate, experts = top_k(softmax(R b))   router               ROUTER_GATE_REPLICATED
    y = sum_k gate_k * Expert_e(b)                     routed experts       EXPERT (E/ep per EP rank)
    m = h + y;   c = LN3(m)                            post-MoE LayerNorm   DENSE
    out = m + g(V2_i silu(V1_i f(c)))                  TP-sharded MLP       MODEL_PARALLEL
    loss = mean((out - target)^2) / gas

Folded semantics (modelled on ``deepspeed/moe/ep_tp_dispatch.py`` and
``deepspeed/module_inject/auto_ep_folding.py``; no code copied):

* route-full: every TP peer holds the same tokens and runs LN1, the dense MLP,
  LN2 and the router redundantly, so all peers see identical routing;
* partition-dispatch: the routed (token, expert) assignments are split across
  TP peers by their stable ordinal within each expert (``ordinal % tp``); each
  peer dispatches only its slice over the EP group with ``all_to_all_single``
  (uneven splits, no token dropping; split sizes are exchanged first with an
  ``all_to_all_single`` of counts), the owning EP rank runs its ``E/ep``
  experts, and a second ``all_to_all_single`` returns the outputs;
* restore_combined: a custom autograd function all-gathers the peers'
  combined slices (expert output and gate weight) into the full, replicated
  view; its backward all-reduces (SUM) the replicated ``grad_output`` over TP
  and keeps this peer's rows, so each peer's slice gradient is ``tp x`` the
  true one.

That last factor is what the folding correction removes: the router (and
every parameter upstream of the MoE) holds ``tp x`` the gradient of its own
slice, so ``all_reduce[tp] / tp`` (AVERAGE) gives the full gradient; experts
hold ``tp x`` their true gradient and are not TP-replicated, so a plain
``/tp`` (EXPERT_TP_CANCEL) is right. Note a consequence the synthetic
gradients do not show: DENSE parameters *upstream* of the MoE (LN1, the dense
MLP, LN2) also hold *different* local gradients on TP peers (the residual
path's gradient is replicated, the MoE path's is partitioned), so AVERAGE is
not a no-op for them; only the post-MoE LayerNorm gets identical peer
gradients. The TP-sharded MLP sits after the restore, where ``grad_output`` is
replicated, with Megatron's f (identity / all_reduce) and g (all_reduce /
identity), so its shards get exact gradients and SKIP is right for them.
(Upstream of the MoE it would not be: a column shard there sees ``tp x`` a
slice of the gradient, which no family's correction repairs.)

Modules: `layout` (sizes, the one parameter table, initial weights, shards, batches), `collectives`
(the collectives as autograd functions), `block` (the folded forward), `source` (`MoEGradients`, the
`simdist.gradpath.path.GradientSource` that runs this block inside `train_rank`) and `reference` (the
unsharded FP64 reference and the error check against it).
"""

from simdist.sources.moe.block import folded_loss, partition, route
from simdist.sources.moe.layout import (
    MoEConfig,
    MoEInitialWeights,
    batch,
    moe_params,
    replica_of,
    shard,
    unshard,
)
from simdist.sources.moe.reference import gradient_errors, reference_gradients
from simdist.sources.moe.source import MoEGradients

__all__ = [
    "MoEConfig",
    "MoEGradients",
    "MoEInitialWeights",
    "batch",
    "folded_loss",
    "gradient_errors",
    "moe_params",
    "partition",
    "reference_gradients",
    "replica_of",
    "route",
    "shard",
    "unshard",
]
