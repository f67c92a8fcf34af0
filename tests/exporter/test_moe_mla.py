"""DeepSeek-V3 / GLM-4.5 MoE layers and DeepSeek's MLA in the static graph, checked in torch against
transformers over the variants a published config may choose (no export: fast). The exported
builds, with parity and losslessness, are tests/exporter/test_archs.py's and
tests/runtime/test_pipeline.py's; MTP heads over these targets are tests/heads/test_mtp.py's."""

from __future__ import annotations

import pytest
import torch

S_MAX = 48

VARIANTS = [
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": True, "norm_topk_prob": False}),
    ("glm4_moe", {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}),  # no group limit, every layer MoE
    ("deepseek_v3", {}),
    ("deepseek_v3", {"q_lora_rank": None}),  # plain q_proj (DeepSeek-V2-Lite's form)
    ("deepseek_v3", {"rope_interleave": False}),
    ("deepseek_v3", {"v_head_dim": 32}),  # V as wide as Q/K: no padding
    ("deepseek_v3", {"attention_bias": True}),  # q_a_proj, kv_a_proj_with_mqa and o_proj biases
]


def _graph_and_reference(arch: str, overrides: dict, attention: str = "standard"):
    from specexport.exporter.archs import read_decoder
    from specexport.exporter.graph_model import StaticDecoder
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import tiny_model

    model, _ = tiny_model(TinySource(source="tiny", arch=arch), overrides)
    decoder = StaticDecoder(read_decoder(model, S_MAX, "t"), S_MAX, attention).eval()
    return decoder, model


def _graph_logits(decoder, ids: torch.Tensor) -> torch.Tensor:
    """The whole sequence through the graph in two chunks (the second reads the first's cache)."""
    past = [torch.zeros(1, decoder.n_kv, S_MAX, decoder.head_dim) for _ in range(2 * decoder.num_layers)]
    cut = ids.shape[1] // 2
    with torch.no_grad():
        first = decoder(ids[:, :cut], torch.tensor([0]), *past)
        presents = first[2:]
        for i, new in enumerate(presents):
            past[i][:, :, :cut] = new
        second = decoder(ids[:, cut:], torch.tensor([cut]), *past)
    return torch.cat((first[0], second[0]), dim=1)[0]  # [S, V]


@pytest.mark.parametrize("arch,overrides", VARIANTS, ids=[f"{a}-{'-'.join(o) or 'default'}" for a, o in VARIANTS])
def test_graph_matches_transformers(arch, overrides):
    decoder, model = _graph_and_reference(arch, overrides)
    ids = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits[0]  # [S, V]
    got = _graph_logits(decoder, ids)
    assert (got - want).abs().max() < 1e-3
    assert bool((got.argmax(-1) == want.argmax(-1)).all())


def test_routing_matches_the_transformers_router():
    """The dense [tokens, experts] weight: the router's top-k weights where it chose, zero elsewhere."""
    decoder, model = _graph_and_reference("glm4_moe", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2})
    x = torch.randn(1, 64, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, weights, chosen = model.model.layers[1].mlp.gate(x)  # [N, k] each
        want = torch.zeros(64, 8).scatter(1, chosen, weights)
        got = decoder.layers[1].moe.routing(x)[0]  # [N, E]
    assert ((got > 0).sum(-1) == 2).all()
    torch.testing.assert_close(got, want)


def test_mla_caches_every_head_at_the_qk_width():
    decoder, model = _graph_and_reference("deepseek_v3", {})
    cfg = model.config
    assert (decoder.n_kv, decoder.head_dim) == (cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    assert cfg.v_head_dim < decoder.head_dim  # the tiny model pads V


def test_a_mis_mapped_expert_breaks_the_match():
    """Two experts' weights exchanged in the description the graph is built from: the graph no
    longer matches transformers (what the build's validation catches)."""
    from specexport.exporter.archs import read_decoder
    from specexport.exporter.graph_model import StaticDecoder

    _, model = _graph_and_reference("glm4_moe", {})
    parts = read_decoder(model, S_MAX, "t")
    moe = parts.layers[1].moe
    moe.gate_w = moe.gate_w[[1, 0, 2, 3]]
    decoder = StaticDecoder(parts, S_MAX, "standard").eval()
    ids = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits[0]
    assert (_graph_logits(decoder, ids) - want).abs().max() > 1e-1
