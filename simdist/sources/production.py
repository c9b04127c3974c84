"""Production MoE shapes as data: published figures of real models and what AutoEP+AutoTP folding makes of them.

Each `MoEShape` holds the figures of one model's MoE layer -- hidden size, routed experts, top-k, expert FFN
size, MoE layers -- with the published source of each (`Figure.source`: the model's ``config.json`` on the
Hugging Face hub and the key read there, or the paper). Every figure was checked against published
configurations (the pages are cited in ``docs/production.md``, section 2). A user adds a model by adding one
entry to `CATALOGUE`; every production study reads its shapes from here (`layer_params`).

`layer_params` gives one MoE layer's parameters as one rank holds them, with simdist's folding families
(`simdist.gradpath.families.Family`):

* router weight ``[experts, hidden]`` (and GPT-OSS's router bias ``[experts]``): ``ROUTER_GATE_REPLICATED``,
  full size -- replicated on TP peers, each peer's gradient from its own routed-token slice (correction:
  FP32 TP all-reduce, then ``/tp``: the #8913 path);
* RMSNorm weights (input, post-attention, and the QK / low-rank norms a model has): ``DENSE``, full size
  (identical on TP peers; correction AVERAGE);
* attention projections: ``MODEL_PARALLEL`` (TP-sharded; no correction) and routed experts: ``EXPERT`` (divided
  by ``tp``: exact) -- neither is on the #8913 path, so the studies hold a slice of one row of ``hidden``
  elements of each (`SLICE_NOTE`), not the full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from simdist.errors import UsageError
from simdist.gradpath.families import Family, ParamSpec

SLICE_NOTE = (
    "attention projection and routed expert sliced to one row of `hidden` elements per rank (families not on "
    "the #8913 path); routers, router biases and norms at full size"
)


@dataclass(frozen=True)
class Figure:
    """One published figure and where it is published."""

    value: int
    source: str


@dataclass(frozen=True)
class MoEShape:
    """One model's MoE layer as published. ``norms``: name -> length of each RMSNorm weight in a MoE layer."""

    name: str
    hidden: Figure
    experts: Figure
    top_k: Figure
    expert_ffn: Figure
    moe_layers: Figure
    norms: tuple[tuple[str, Figure], ...]
    router_bias: bool = False
    router_bias_source: str = ""
    notes: str = ""

    @property
    def router_elements(self) -> int:
        return self.experts.value * self.hidden.value

    @property
    def expert_elements(self) -> int:
        """One routed expert's weights (gate, up, down: ``3 x hidden x expert_ffn``)."""
        return 3 * self.hidden.value * self.expert_ffn.value

    def folded_elements(self) -> dict[Family, int]:
        """Whole-model elements per family on the #8913 path (router weights/biases, norms) over all MoE layers."""
        layers = self.moe_layers.value
        router = self.router_elements + (self.experts.value if self.router_bias else 0)
        norms = sum(f.value for _, f in self.norms)
        return {Family.ROUTER_GATE_REPLICATED: layers * router, Family.DENSE: layers * norms}


def _hf(repo: str, key: str) -> str:
    return f"huggingface.co/{repo} config.json `{key}`"


MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"
DEEPSEEK = "deepseek-ai/DeepSeek-V3"
QWEN3 = "Qwen/Qwen3-30B-A3B"
OLMOE = "allenai/OLMoE-1B-7B-0924"
GPT_OSS = "openai/gpt-oss-20b"

CATALOGUE: dict[str, MoEShape] = {
    s.name: s
    for s in (
        MoEShape(
            "Mixtral-8x7B",
            hidden=Figure(4096, _hf(MIXTRAL, "hidden_size")),
            experts=Figure(8, _hf(MIXTRAL, "num_local_experts")),
            top_k=Figure(2, _hf(MIXTRAL, "num_experts_per_tok")),
            expert_ffn=Figure(14336, _hf(MIXTRAL, "intermediate_size")),
            moe_layers=Figure(32, _hf(MIXTRAL, "num_hidden_layers") + " (every layer is MoE; arXiv:2401.04088)"),
            norms=(
                ("input_layernorm", Figure(4096, _hf(MIXTRAL, "hidden_size"))),
                ("post_attention_layernorm", Figure(4096, _hf(MIXTRAL, "hidden_size"))),
            ),
        ),
        MoEShape(
            "DeepSeek-V3",
            hidden=Figure(7168, _hf(DEEPSEEK, "hidden_size")),
            experts=Figure(256, _hf(DEEPSEEK, "n_routed_experts")),
            top_k=Figure(8, _hf(DEEPSEEK, "num_experts_per_tok")),
            expert_ffn=Figure(2048, _hf(DEEPSEEK, "moe_intermediate_size")),
            moe_layers=Figure(
                58, _hf(DEEPSEEK, "num_hidden_layers") + " 61 - `first_k_dense_replace` 3 (arXiv:2412.19437)"
            ),
            norms=(
                ("input_layernorm", Figure(7168, _hf(DEEPSEEK, "hidden_size"))),
                ("post_attention_layernorm", Figure(7168, _hf(DEEPSEEK, "hidden_size"))),
                ("q_a_layernorm", Figure(1536, _hf(DEEPSEEK, "q_lora_rank"))),
                ("kv_a_layernorm", Figure(512, _hf(DEEPSEEK, "kv_lora_rank"))),
            ),
            notes="1 shared expert (`n_shared_experts`), TP-sharded like a dense MLP; the router's "
            "`e_score_correction_bias` is a buffer updated without a gradient, not on the gradient path",
        ),
        MoEShape(
            "Qwen3-30B-A3B",
            hidden=Figure(2048, _hf(QWEN3, "hidden_size")),
            experts=Figure(128, _hf(QWEN3, "num_experts")),
            top_k=Figure(8, _hf(QWEN3, "num_experts_per_tok")),
            expert_ffn=Figure(768, _hf(QWEN3, "moe_intermediate_size")),
            moe_layers=Figure(48, _hf(QWEN3, "num_hidden_layers") + " (`decoder_sparse_step` 1, `mlp_only_layers` [])"),
            norms=(
                ("input_layernorm", Figure(2048, _hf(QWEN3, "hidden_size"))),
                ("post_attention_layernorm", Figure(2048, _hf(QWEN3, "hidden_size"))),
                ("q_norm", Figure(128, _hf(QWEN3, "head_dim"))),
                ("k_norm", Figure(128, _hf(QWEN3, "head_dim"))),
            ),
        ),
        MoEShape(
            "OLMoE-1B-7B",
            hidden=Figure(2048, _hf(OLMOE, "hidden_size")),
            experts=Figure(64, _hf(OLMOE, "num_experts")),
            top_k=Figure(8, _hf(OLMOE, "num_experts_per_tok")),
            expert_ffn=Figure(1024, _hf(OLMOE, "intermediate_size")),
            moe_layers=Figure(16, _hf(OLMOE, "num_hidden_layers") + " (every layer is MoE; arXiv:2409.02060)"),
            norms=(
                ("input_layernorm", Figure(2048, _hf(OLMOE, "hidden_size"))),
                ("post_attention_layernorm", Figure(2048, _hf(OLMOE, "hidden_size"))),
                ("q_norm", Figure(2048, _hf(OLMOE, "hidden_size") + " (QK-norm over the whole projection)")),
                ("k_norm", Figure(2048, _hf(OLMOE, "num_key_value_heads") + " 16 x head_dim 128")),
            ),
        ),
        MoEShape(
            "GPT-OSS-20B",
            hidden=Figure(2880, _hf(GPT_OSS, "hidden_size")),
            experts=Figure(32, _hf(GPT_OSS, "num_local_experts")),
            top_k=Figure(4, _hf(GPT_OSS, "num_experts_per_tok")),
            expert_ffn=Figure(2880, _hf(GPT_OSS, "intermediate_size")),
            moe_layers=Figure(24, _hf(GPT_OSS, "num_hidden_layers") + " (every layer is MoE; arXiv:2508.10925)"),
            norms=(
                ("input_layernorm", Figure(2880, _hf(GPT_OSS, "hidden_size"))),
                ("post_attention_layernorm", Figure(2880, _hf(GPT_OSS, "hidden_size"))),
            ),
            router_bias=True,
            router_bias_source="transformers GptOssTopKRouter: `bias` of shape [num_local_experts]",
            notes="expert biases (EXPERT family) and per-head attention sinks (TP-sharded) are off the #8913 path",
        ),
    )
}


def get_shape(name: str) -> MoEShape:
    """The catalogue entry ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in CATALOGUE:
        raise UsageError(f"unknown model {name!r}; valid: {', '.join(CATALOGUE)}")
    return CATALOGUE[name]


def layer_params(shape: MoEShape) -> tuple[ParamSpec, ...]:
    """One MoE layer's parameters as one rank holds them (see the module docstring and `SLICE_NOTE`)."""
    hidden = shape.hidden.value
    params = [ParamSpec("router.weight", Family.ROUTER_GATE_REPLICATED, (shape.experts.value, hidden))]
    if shape.router_bias:
        params.append(ParamSpec("router.bias", Family.ROUTER_GATE_REPLICATED, (shape.experts.value,)))
    params += [ParamSpec(f"{name}.weight", Family.DENSE, (f.value,)) for name, f in shape.norms]
    params += [
        ParamSpec("attn.q_proj.weight[slice]", Family.MODEL_PARALLEL, (1, hidden)),
        ParamSpec("expert.w1[slice]", Family.EXPERT, (1, hidden)),
    ]
    return tuple(params)
