"""Hybrid linear-attention targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): Gated DeltaNet layers
beside gated full-attention layers, exported to static ONNX graphs and run in onnxruntime
against transformers' own forward pass.

Each tiny model (hidden 64, 4 layers: linear, linear, full, linear; 2 key heads repeated to 4
value heads; a kernel-4 conv; 4 softmax-routed experts and a gated shared expert where the
family has them) gets non-trivial random A_log, dt_bias, conv and norm weights, so that a
mis-read weight shows. The graphs (T = 1, 4 and 8) run a 40-token sequence the way the runtime
does: prefill chunk by chunk (the last one padded), verify steps that keep only some of their
tokens (the state is selected at the last kept position from the per-position outputs, the
KV cache advanced as far), then decode steps; every logit is compared with transformers'
full forward (use_cache=False)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specexport.contract import (
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    StateLayout,
    past_names,
    present_of,
    state_present_of,
)

ort = pytest.importorskip("onnxruntime")

S_MAX = 48
SEQ = 40
OPSET = 18
PREFILL, VERIFY = 8, 4
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
ATTENTIONS = ("standard", "ort-gqa")
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
RTOL = 1e-4  # of the logit scale (max |logit| of the reference)


def tiny_hybrid(model_type: str, seed: int = 0, **overrides):
    """A random-weight transformers model of ``model_type`` (fixed seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, layer_types=LAYER_TYPES,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type != "qwen3_5_text":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48)
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays from mild to strong
                p.copy_(torch.empty(p.shape).uniform_(0.3, 3.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # applied as is: near 1
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # the (1 + w) norms: near 0, so a lost offset shows
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


def assert_close_to_scale(got: np.ndarray, want: np.ndarray, what: str, rtol: float = RTOL) -> None:
    """|got - want| within ``rtol`` of want's scale (its largest magnitude)."""
    diff, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert diff <= rtol * scale, f"{what}: max |diff| {diff:.3g} above {rtol:g} x scale {scale:.3g}"


def _reference_ids() -> np.ndarray:
    return torch.randint(3, 256, (SEQ,), generator=torch.Generator().manual_seed(1)).numpy()


def _reference(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None], use_cache=False).logits[0].numpy()  # [S, V]


class Hybrid:
    """One model: transformers' reference and its parts."""

    def __init__(self, model_type: str):
        from specexport.exporter.archs import read_decoder

        self.model_type = model_type
        self.model = tiny_hybrid(model_type)
        self.parts = read_decoder(self.model, S_MAX, "t")
        self.ids = _reference_ids()
        self.ref = _reference(self.model, self.ids)


class Graphs:
    """The exported T = 1, 4 and 8 graphs of one model and attention kind, and a runner that
    carries the KV cache and the recurrent state between them as the runtime does."""

    def __init__(self, parts, attention: str, sizes=(1, VERIFY, PREFILL)):
        from specexport.exporter.graph_model import StaticDecoder
        from specexport.exporter.onnx_export import export_graph

        self.decoder = StaticDecoder(parts, S_MAX, attention).eval()
        self.attention = attention
        self.protos = {t: export_graph(self.decoder, 1, t, OPSET) for t in sizes}
        from specexport.runtime.ort_engine import session_options

        # the process's one onnxruntime pool, as every session of ours: a session with threads of
        # its own is refused once another test of this worker has made that pool
        options = session_options(ort, 2)
        self.sessions = {t: ort.InferenceSession(p.SerializeToString(), options, providers=["CPUExecutionProvider"])
                         for t, p in self.protos.items()}
        self.reset()

    def reset(self):
        d = self.decoder
        self.kv = {name: np.zeros((1, d.n_kv, S_MAX, d.head_dim), np.float32) for name in past_names(d.kv_layers)}
        self.state = {name: np.zeros(shape, np.float32) for name, shape in d.state_layout.shapes(1).items()}
        self.length = 0

    def snapshot(self):
        return {k: v.copy() for k, v in self.kv.items()}, {k: v.copy() for k, v in self.state.items()}, self.length

    def restore(self, snap):
        kv, state, self.length = snap
        self.kv, self.state = {k: v.copy() for k, v in kv.items()}, {k: v.copy() for k, v in state.items()}

    def run(self, tokens, size: int, pad: int = 0) -> dict[str, np.ndarray]:
        """One graph run on ``tokens`` (at most ``size``, the rest padded with ``pad``) from the
        carried cache and state; returns every output, carries nothing."""
        real = len(tokens)
        ids = np.full((1, size), pad, np.int64)
        ids[0, :real] = tokens
        feeds = {INPUT_IDS: ids, CACHE_LENGTH: np.array([self.length], np.int64), **self.kv, **self.state}
        session = self.sessions[size]
        if VALID_TOKENS in {i.name for i in session.get_inputs()}:
            feeds[VALID_TOKENS] = np.array([real], np.int64)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds)))

    def step(self, tokens, size: int, keep: int | None = None, pad: int = 0) -> np.ndarray:
        """Run ``tokens``, then carry the cache and state as far as the first ``keep`` of them
        (all by default: a verify step's rejected drafts are dropped by keeping fewer). Returns
        the logits of the real tokens [n, V]."""
        out = self.run(tokens, size, pad)
        real = len(tokens)
        keep = real if keep is None else keep
        for name in self.kv:
            present = out[present_of(name)]
            if self.attention == "ort-gqa":  # the whole cache, the new positions written at the length
                self.kv[name] = present.copy()
            else:  # the new positions' K/V [1, n_kv, T, hd]
                self.kv[name][:, :, self.length : self.length + keep] = present[:, :, :keep]
        for name in self.state:  # [1, T, ...]: the state after each position; keep the last kept one
            self.state[name] = out[state_present_of(name)][:, keep - 1].copy()
        self.length += keep
        assert np.array_equal(out[NEXT_TOKENS][0], out[LOGITS][0].argmax(-1))
        return out[LOGITS][0, :real]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def hybrid(request) -> Hybrid:
    return Hybrid(request.param)


_GRAPHS: dict[tuple[str, str], Graphs] = {}


def graphs_for(hybrid: Hybrid, attention: str) -> Graphs:
    """The model's graphs, exported once per module run (the tests of one model run together)."""
    key = (hybrid.model_type, attention)
    if key not in _GRAPHS:
        for other in [k for k in _GRAPHS if k[0] != hybrid.model_type]:
            del _GRAPHS[other]  # one model's graphs at a time
        _GRAPHS[key] = Graphs(hybrid.parts, attention)
    graphs = _GRAPHS[key]
    graphs.reset()
    return graphs


def _run_sequence(graphs: Graphs, ids: np.ndarray) -> list[tuple[int, np.ndarray, str]]:
    """The whole sequence through the graphs as the runtime runs it: every run's first
    position, its real tokens' logits [n, V] (a verify step's dropped drafts included: they
    are the sequence's own next tokens too) and what it was."""
    runs = []
    # prefill 21 tokens: 8, 8 and a padded 5
    for start, stop in ((0, 8), (8, 16), (16, 21)):
        runs.append((start, graphs.step(ids[start:stop], PREFILL), f"prefill {stop - start}/{PREFILL}"))
    # verify 4 tokens, keeping 2, 4, 1, 3, ... of them (the state selected at the last kept one)
    keeps = [2, 4, 1, 3]
    while graphs.length + VERIFY <= 33:
        start, keep = graphs.length, keeps[len(runs) % len(keeps)]
        runs.append((start, graphs.step(ids[start : start + VERIFY], VERIFY, keep), f"verify, keep {keep}"))
    while graphs.length < len(ids):  # decode
        start = graphs.length
        runs.append((start, graphs.step(ids[start : start + 1], 1), "decode"))
    return runs


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_graphs_match_transformers_over_a_sequence(hybrid, attention):
    graphs = graphs_for(hybrid, attention)
    runs = _run_sequence(graphs, hybrid.ids)
    want = hybrid.ref  # [S, V]
    scale = float(np.abs(want).max())
    got = np.concatenate([logits for _, logits, _ in runs])
    ref = np.concatenate([want[start : start + len(logits)] for start, logits, _ in runs])
    assert {start + i for start, logits, _ in runs for i in range(len(logits))} == set(range(SEQ))
    diff = float(np.abs(got - ref).max())
    agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
    print(f"\n{hybrid.model_type} {attention}: max |dlogit| {diff:.3g} (logit scale {scale:.3g}), argmax "
          f"agreement {agreement} over {len(got)} rows in {len(runs)} runs ({', '.join(r for _, _, r in runs[:6])}, ...)")
    assert diff <= RTOL * scale, (diff, scale)
    assert agreement == 1.0


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_per_position_states_are_the_state_after_each_token(hybrid, attention):
    """After a T=4 pass, the state at position t is the state after a separate pass over the
    first t+1 of those tokens (T=1 steps): conv window and recurrent state alike."""
    graphs = graphs_for(hybrid, attention)
    ids = hybrid.ids
    graphs.step(ids[:6], PREFILL)  # a non-trivial state to start from
    start = graphs.snapshot()
    out = graphs.run(ids[6:10], VERIFY)
    for t in range(VERIFY):
        graphs.restore(start)
        for i in range(t + 1):
            graphs.step(ids[6 + i : 7 + i], 1)
        for name, state in graphs.state.items():
            assert_close_to_scale(out[state_present_of(name)][:, t], state, f"{name} at position {t}")


def test_states_match_transformers_cache(hybrid):
    """The state the graphs carry is transformers' own (its conv cache holds K inputs, ours the
    last K-1; its recurrent state is ours)."""
    graphs = graphs_for(hybrid, "standard")
    n = 11
    graphs.step(hybrid.ids[:8], PREFILL)
    graphs.step(hybrid.ids[8:n], VERIFY)
    with torch.no_grad():
        cache = hybrid.model(torch.from_numpy(hybrid.ids[:n])[None], use_cache=True).cache
    kernel = graphs.decoder.state_layout.conv_kernel
    for j, layer in enumerate(hybrid.parts.linear_layers):
        conv = cache.layers[layer].conv_states[0].numpy()[..., -(kernel - 1):]
        recurrent = cache.layers[layer].recurrent_states[0].numpy()
        assert_close_to_scale(graphs.state[f"past_state.{j}.conv"], conv, f"layer {layer} conv")
        assert_close_to_scale(graphs.state[f"past_state.{j}.recurrent"], recurrent, f"layer {layer} recurrent")


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padding_after_the_last_real_token_changes_nothing(hybrid, attention):
    """A prefill of 5 real tokens in the T=8 graph, padded with different ids: the real rows'
    logits and the state at the last real position do not depend on the padding."""
    graphs = graphs_for(hybrid, attention)
    graphs.step(hybrid.ids[:8], PREFILL)
    start = graphs.snapshot()
    runs = []
    for pad in (0, 77, 200):
        graphs.restore(start)
        logits = graphs.step(hybrid.ids[8:13], PREFILL, pad=pad)
        runs.append((logits, graphs.snapshot()[1]))
    for logits, state in runs[1:]:  # the same up to rounding (padded rows meet the real ones only through zeros)
        assert_close_to_scale(logits, runs[0][0], "real rows' logits", rtol=1e-6)
        for name in state:
            assert_close_to_scale(state[name], runs[0][1][name], name, rtol=1e-6)
    want = hybrid.ref[8:13]
    assert np.abs(runs[0][0] - want).max() <= RTOL * np.abs(hybrid.ref).max()


def test_graph_inputs_outputs_and_plain_ops(hybrid):
    """The contract's names and shapes, and the standard graph in plain ONNX (no Loop/Scan,
    no com.microsoft op: TensorRT's parser can take it)."""
    from specexport.contract import graph_inputs, graph_outputs

    graphs = graphs_for(hybrid, "standard")
    d = graphs.decoder
    assert (d.kv_layers, d.state_layers, d.num_layers) == (1, 3, 1)
    assert hybrid.parts.attention_layers == [2] and hybrid.parts.linear_layers == [0, 1, 3]
    assert d.state_layout == StateLayout(num_layers=3, conv_channels=2 * 2 * 16 + 4 * 16, conv_kernel=4, heads=4,
                                         key_dim=16, value_dim=16)
    assert hybrid.parts.summary()["layer_types"] == LAYER_TYPES
    proto = graphs.protos[VERIFY]
    shapes = {v.name: [x.dim_value for x in v.type.tensor_type.shape.dim]
              for v in [*proto.graph.input, *proto.graph.output]}
    assert [v.name for v in proto.graph.input] == graph_inputs(1, False, 3)
    assert [v.name for v in proto.graph.output] == graph_outputs(1, 3)
    assert shapes["past_state.0.conv"] == [1, 128, 3] and shapes["past_state.2.recurrent"] == [1, 4, 16, 16]
    assert shapes["present_state.0.conv"] == [1, VERIFY, 128, 3]
    assert shapes["present_state.2.recurrent"] == [1, VERIFY, 4, 16, 16]
    assert shapes["present.0.key"] == [1, 2, VERIFY, 16]
    ops = {(n.domain, n.op_type) for n in proto.graph.node}
    assert all(domain in ("", "ai.onnx") for domain, _ in ops), ops
    assert not {op for _, op in ops} & {"Loop", "Scan", "If", "Conv"}


def test_a_symbolic_token_count_is_refused(hybrid):
    from specexport.exporter.graph_model import StaticDecoder
    from specexport.exporter.onnx_export import export_graph

    decoder = StaticDecoder(hybrid.parts, S_MAX, "ort-gqa").eval()
    with pytest.raises(ValueError, match="static batch and token count"):
        export_graph(decoder, 1, None, OPSET)
    with pytest.raises(ValueError, match="static batch and token count"):
        export_graph(decoder, None, None, OPSET)


def test_taps_follow_output_hidden_states(hybrid):
    """aux_hidden_states: transformers' output_hidden_states indices (0: the embeddings, i: the
    stream entering layer i, L: after the final norm), linear-attention layers counted."""
    from specexport.exporter.graph_model import StaticDecoder

    taps = (0, 1, 3, 4)
    decoder = StaticDecoder(hybrid.parts, S_MAX, "standard", taps=taps).eval()
    ids = torch.from_numpy(hybrid.ids[:12])[None]
    past, state = _empty_cache(decoder)
    with torch.no_grad():
        aux = decoder(ids, torch.tensor([0]), *past, *state)[-1][0]
        hidden = hybrid.model(ids, use_cache=False, output_hidden_states=True).hidden_states
    want = torch.cat([hidden[t][0] for t in taps], dim=-1)
    torch.testing.assert_close(aux, want, rtol=1e-4, atol=1e-4)


def test_routing_matches_the_softmax_router():
    """The dense [tokens, experts] weight: the softmax router's top-k weights where it chose."""
    from specexport.exporter.graph_model import StaticDecoder

    for model_type in ("qwen3_next", "qwen3_5_moe_text"):
        model = tiny_hybrid(model_type)
        from specexport.exporter.archs import read_decoder

        decoder = StaticDecoder(read_decoder(model, S_MAX, "t"), S_MAX).eval()
        x = torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            gate = model.model.layers[1].mlp.gate
            _, weights, chosen = gate(x)  # [N, k] each
            want = torch.zeros(64, 4).scatter(1, chosen, weights)
            got = decoder.layers[1].moe.routing(x)[0]  # [N, E]
        assert ((got > 0).sum(-1) == 2).all()
        torch.testing.assert_close(got, want)


def _empty_cache(decoder) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An empty KV cache (2 per attention layer) and zero states (conv, recurrent per linear layer)."""
    past = [torch.zeros(1, decoder.n_kv, S_MAX, decoder.head_dim) for _ in range(2 * decoder.kv_layers)]
    return past, [torch.zeros(shape) for shape in decoder.state_layout.shapes(1).values()]


def _torch_logits(parts, ids: torch.Tensor) -> torch.Tensor:
    """The whole sequence in one pass of the (untraced) graph module."""
    from specexport.exporter.graph_model import StaticDecoder

    decoder = StaticDecoder(parts, S_MAX, "standard").eval()
    past, state = _empty_cache(decoder)
    with torch.no_grad():
        return decoder(ids, torch.tensor([0]), *past, *state)[0][0]


def _mis_read(parts, how: str):
    """The description the graph is built from, with one reading mistake made on purpose."""
    attn = parts.layers[parts.attention_layers[0]]
    lin = parts.layers[parts.linear_layers[0]].linear
    if how == "norm offset lost":  # the (1 + w) norms read as plain w
        for layer in parts.layers:
            layer.attn_norm = layer.attn_norm - 1.0
    elif how == "gated norm offset added":  # the linear layer's gated norm given a (1 + w) it has not
        lin.norm_w = lin.norm_w + 1.0
    elif how == "query and gate rows swapped":
        attn.q_w, attn.out_gate_w = attn.out_gate_w, attn.q_w
    elif how == "key head groups swapped":  # qkv rows: q heads, then k heads (2 of 16), then v
        key = lin.k_heads * lin.k_dim
        order = torch.arange(lin.qkv_w.shape[0])
        order[key : key + lin.k_dim], order[key + lin.k_dim : 2 * key] = (torch.arange(key + lin.k_dim, 2 * key),
                                                                          torch.arange(key, key + lin.k_dim))
        lin.qkv_w = lin.qkv_w[order]
        lin.conv_w = lin.conv_w[order]
    elif how == "value heads swapped with z":
        lin.qkv_w = torch.cat((lin.qkv_w[: -lin.z_w.shape[0]], lin.z_w))
    elif how == "decay sign":
        lin.a_log = -lin.a_log
    else:
        raise AssertionError(how)
    return parts


@pytest.mark.parametrize("how", ["norm offset lost", "gated norm offset added", "query and gate rows swapped",
                                 "key head groups swapped", "value heads swapped with z", "decay sign"])
def test_a_mis_read_weight_breaks_the_match(how):
    """What the parity tests would catch: each reading mistake moves the logits far past the
    tolerance (torch, no export)."""
    from specexport.exporter.archs import read_decoder

    model = tiny_hybrid("qwen3_next")
    ids = torch.from_numpy(_reference_ids())[None]
    want = torch.from_numpy(_reference(model, ids[0].numpy()))
    right = _torch_logits(read_decoder(model, S_MAX, "t"), ids)
    scale = want.abs().max()
    assert (right - want).abs().max() <= RTOL * scale
    wrong = _torch_logits(_mis_read(read_decoder(model, S_MAX, "t"), how), ids)
    assert (wrong - want).abs().max() > 100 * RTOL * scale


def test_non_hybrid_models_keep_their_graph_interface():
    """A model without linear-attention layers: no state inputs or outputs, num_layers every layer."""
    from specexport.exporter.archs import read_decoder
    from specexport.exporter.graph_model import StaticDecoder
    from specexport.exporter.onnx_export import example_inputs, graph_io
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import tiny_model

    model, _ = tiny_model(TinySource(source="tiny", arch="qwen3", num_layers=2))
    parts = read_decoder(model, S_MAX, "t")
    assert parts.state_layout() is None and parts.linear_layers == [] and parts.attention_layers == [0, 1]
    assert "layer_types" not in parts.summary()
    decoder = StaticDecoder(parts, S_MAX, "ort-gqa")
    assert (decoder.num_layers, decoder.kv_layers, decoder.state_layers) == (2, 2, 0)
    inputs, outputs = graph_io(decoder.num_layers, (), True, decoder.state_layers)
    assert inputs == graph_io(2, (), True)[0] and not any("state" in n for n in inputs + outputs)
    assert len(example_inputs(decoder, 1, 4)) == 3 + 4
