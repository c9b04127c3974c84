"""The production-shape catalogue: published figures with their sources, and one MoE layer's folded parameters."""

import math

import pytest

from simdist.gradpath.families import Family
from simdist.sources.production import CATALOGUE, get_shape, layer_params

REQUIRED = {"Mixtral-8x7B", "DeepSeek-V3", "Qwen3-30B-A3B", "OLMoE-1B-7B", "GPT-OSS-20B"}


def test_the_five_models_are_there_with_a_source_for_every_figure():
    assert set(CATALOGUE) >= REQUIRED
    for shape in CATALOGUE.values():
        figures = [shape.hidden, shape.experts, shape.top_k, shape.expert_ffn, shape.moe_layers]
        figures += [f for _, f in shape.norms]
        for figure in figures:
            assert figure.value > 0
            assert "config.json `" in figure.source and "huggingface.co/" in figure.source
        assert shape.top_k.value < shape.experts.value
        assert not shape.router_bias or shape.router_bias_source


@pytest.mark.parametrize(
    ("name", "router", "layers"),
    [
        ("Mixtral-8x7B", (8, 4096), 32),
        ("DeepSeek-V3", (256, 7168), 58),
        ("Qwen3-30B-A3B", (128, 2048), 48),
        ("OLMoE-1B-7B", (64, 2048), 16),
        ("GPT-OSS-20B", (32, 2880), 24),
    ],
)
def test_layer_params_hold_the_full_router_and_norms(name, router, layers):
    shape = get_shape(name)
    params = {p.name: p for p in layer_params(shape)}
    assert params["router.weight"].shape == router
    assert params["router.weight"].family is Family.ROUTER_GATE_REPLICATED
    assert ("router.bias" in params) == shape.router_bias
    norms = [p for p in params.values() if p.family is Family.DENSE]
    assert [p.shape for p in norms] == [(f.value,) for _, f in shape.norms]
    assert {p.family for p in params.values()} >= {Family.MODEL_PARALLEL, Family.EXPERT}
    assert shape.moe_layers.value == layers
    folded = shape.folded_elements()
    bias = router[0] if shape.router_bias else 0
    assert folded[Family.ROUTER_GATE_REPLICATED] == layers * (math.prod(router) + bias)
    assert folded[Family.DENSE] == layers * sum(p.shape[0] for p in norms)


def test_unknown_model_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: Mixtral-8x7B"):
        get_shape("Mixtral-8x22B")
