"""MTP heads over Qwen3-Next / Qwen3.5 / Qwen3.5-MoE targets (tiny random checkpoints, hidden 64,
4 experts): the gated full-attention MTP layer (q_proj per head [q | gate], q/k norms, partial
rotary, 1 + w norms) with a softmax-routed MoE and a gated shared expert, or a dense MLP.

Torch-level parity: the head's ChainGraph (catch-up rows through its own KV cache, then step
rows fed the head's own hidden) against MtpReference (vLLM's MTP math around transformers' own
decoder layer loaded from the mtp.layers.0 tensors). Then the one-line errors, a mapping broken
on purpose failing parity, and the whole build with greedy losslessness (which needs the target
graph of these architectures)."""

from __future__ import annotations

import pytest
import torch

from specexport.errors import BadInput
from tests.heads.chain_checkpoints import write_mtp_target

# recipe arch (tiny source) -> transformers model_type of the target
ARCHS = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
S_MAX = 32  # the graph's cache slots
ROWS = 24  # reference rows (tokens 1..24 of the text)


def load_target(folder):
    from specexport.exporter.recipe import HfSource
    from specexport.exporter.sources import load_source

    return load_source(HfSource(source="hf", path=folder), folder.parent, "target")


def load_head(target, folder):
    from specexport.exporter.heads.mtp import load
    from specexport.exporter.recipe import MtpDrafterSpec

    return load(MtpDrafterSpec(kind="mtp"), target, folder.parent, "drafters.0")


def reference_rows(target, head, rows: int = ROWS, seed: int = 0):
    """(ids [rows+1], states, reference logits [rows, V], reference hidden [rows, H]) on random text."""
    from specexport.exporter.heads.chain import TargetStates

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.model.config.vocab_size, (rows + 1,), generator=g)
    model = target.model
    caught = {}
    handle = model.model.layers[-1].register_forward_hook(lambda _m, _i, out: caught.update(out=out))
    try:
        with torch.no_grad():
            out = model(ids[None], use_cache=False, output_hidden_states=True)
    finally:
        handle.remove()
    last = caught["out"][0] if isinstance(caught["out"], tuple) else caught["out"]
    states = TargetStates(tuple(h[0].float() for h in out.hidden_states), last[0].float())
    with torch.no_grad():
        logits, hidden = head.reference.run(ids[1:], states, None)
    return ids, states, logits, hidden


def graph_parity(head, ids, states, ref_logits, ref_hidden, chunks=(5, 1, 7, 3, 4), steps=(4, 11, 16, 20)):
    """The catch-up graph over ``chunks`` rows at a time (its cache filled from its own presents),
    then the step graph at cache lengths ``steps``: (worst relative logit difference, argmax
    agreement, rows compared)."""
    from specexport.exporter.heads.chain import ChainGraph

    spec = head.spec
    taps = spec.taps
    features = torch.cat([states.hidden_states[i] for i in taps], dim=-1)  # [S, F]
    catchup = ChainGraph(spec, taps, S_MAX, step=False).eval()
    step = ChainGraph(spec, taps, S_MAX, step=True).eval()
    k_cache = torch.zeros(1, spec.kv_heads, S_MAX, spec.head_dim)
    v_cache = torch.zeros_like(k_cache)
    worst, agree, total = 0.0, 0, 0

    def compare(got, want):
        nonlocal worst, agree, total
        scale = want.abs().max().item()
        worst = max(worst, (got - want).abs().max().item() / scale)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += got.shape[0]

    length = 0
    with torch.no_grad():
        for count in chunks:
            logits, _, k_new, v_new, _ = catchup(ids[None, length + 1 : length + 1 + count],
                                                 features[None, length : length + count],
                                                 torch.tensor([length]), k_cache, v_cache)
            k_cache[:, :, length : length + count], v_cache[:, :, length : length + count] = k_new, v_new
            compare(logits[0], ref_logits[length : length + count])
            length += count
        for at in steps:
            assert at <= length
            # the cache of rows 0..at-1 (the catch-up's), the head's own hidden of row at-1
            logits, _, _, _, _ = step(ids[None, at + 1 : at + 2], ref_hidden[None, at - 1 : at], torch.tensor([at]),
                                      k_cache, v_cache)
            want, _ = head.reference.run(ids[1 : at + 2], states, ref_hidden[at - 1])
            compare(logits[0], want[-1:])
    return worst, agree / total, total


@pytest.fixture(scope="module", params=sorted(ARCHS))
def gated(request, tmp_path_factory):
    """(arch, target folder, target, head) per architecture."""
    folder = write_mtp_target(tmp_path_factory.mktemp(request.param) / "t", request.param, "qwen3-next")
    target = load_target(folder)
    return request.param, folder, target, load_head(target, folder)


def test_the_gated_layer_is_read(gated):
    arch, _, target, head = gated
    cfg = target.model.config
    assert cfg.model_type == ARCHS[arch]
    layer = head.spec.layers[0]
    q = cfg.num_attention_heads * cfg.head_dim
    assert layer.out_gate_w.shape == layer.q_w.shape == (q, cfg.hidden_size)
    assert layer.q_norm is not None and layer.k_norm is not None
    assert head.spec.rope[0].shape[-1] < cfg.head_dim  # partial rotary
    if arch == "qwen3_5":
        assert layer.moe is None and layer.gate_w.shape[0] == cfg.intermediate_size
    else:
        assert layer.moe.scoring == "softmax" and layer.moe.shared_gate_w.shape == (1, cfg.hidden_size)
        assert layer.gate_w.shape[0] == cfg.shared_expert_intermediate_size


def test_graph_matches_the_reference(gated):
    """Catch-up chunks of 5, 1, 7, 3 and 4 rows through the head's own cache, then step rows:
    every row within 1e-4 of the reference, the same argmax."""
    _, _, target, head = gated
    ids, states, logits, hidden = reference_rows(target, head)
    worst, agreement, rows = graph_parity(head, ids, states, logits, hidden)
    assert rows == 24
    assert worst <= 1e-4 and agreement == 1.0, (worst, agreement)


def test_fused_experts_read_as_the_per_expert_names(tmp_path):
    """Qwen3.5-MoE checkpoints may store the MTP experts stacked (mlp.experts.gate_up_proj,
    down_proj): the same head as from the per-expert names."""
    heads = []
    for fused in (False, True):
        folder = write_mtp_target(tmp_path / str(fused) / "t", "qwen3_5_moe", "qwen3-next", fused_experts=fused)
        target = load_target(folder)
        heads.append((target, load_head(target, folder)))
    a, b = (h.spec.layers[0].moe for _, h in heads)
    for field in ("gate_w", "up_w", "down_w", "router_w"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    target, head = heads[1]
    ids, states, logits, hidden = reference_rows(target, head)
    worst, agreement, _ = graph_parity(head, ids, states, logits, hidden)
    assert worst <= 1e-4 and agreement == 1.0, (worst, agreement)


def _misread(edit):
    """A monkeypatch-taking break: read_gated_layer (ours) returns the layer after ``edit``."""

    def apply(monkeypatch):
        from specexport.exporter.heads import mtp

        real = mtp.read_gated_layer

        def wrong(*args, **kwargs):
            layer = real(*args, **kwargs)
            edit(layer)
            return layer

        monkeypatch.setattr(mtp, "read_gated_layer", wrong)

    return apply


def _swap_q_and_gate(layer):
    """q_proj's per-head halves read the wrong way round: [gate | q]."""
    layer.q_w, layer.out_gate_w = layer.out_gate_w, layer.q_w


def _drop_shared_gate(layer):
    """The shared expert's sigmoid gate left out (the DeepSeek-V3 reading of a shared expert)."""
    layer.moe.shared_gate_w = None


def _sigmoid_router(layer):
    """The router read as DeepSeek-V3's sigmoid scoring instead of the softmax."""
    layer.moe.scoring = "sigmoid"


BROKEN = {"q and gate swapped": _misread(_swap_q_and_gate), "shared gate dropped": _misread(_drop_shared_gate),
          "sigmoid router": _misread(_sigmoid_router)}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_mapping_fails_parity(tmp_path, monkeypatch, what):
    """Each mistake alone takes the graph away from the reference (so the parity test above
    would catch it): the q/gate split, the shared expert's gate, the router's scoring."""
    folder = write_mtp_target(tmp_path / "t", "qwen3_next", "qwen3-next")
    target = load_target(folder)
    BROKEN[what](monkeypatch)
    head = load_head(target, folder)
    ids, states, logits, hidden = reference_rows(target, head)
    worst, agreement, _ = graph_parity(head, ids, states, logits, hidden)
    assert worst > 1e-2, (what, worst, agreement)


@pytest.mark.parametrize("what", ["q and gate swapped", "shared gate dropped"])
def test_a_broken_mapping_fails_the_builds_validation(tmp_path, monkeypatch, what):
    """The same mistakes through the build (the head alone): its validation against the
    reference refuses the head."""
    from specexport.errors import SpecexportError
    from tests.heads.common import build_head_only

    write_mtp_target(tmp_path / "t", "qwen3_next", "qwen3-next")
    BROKEN[what](monkeypatch)
    with pytest.raises(SpecexportError, match="validation failed for mtp"):
        build_head_only({"name": "mtp", "target": {"source": "hf", "path": "t"}, "drafters": [{"kind": "mtp"}]},
                        tmp_path, tmp_path / "out")


MALFORMED = [
    ("qwen3_next", {"drop": "mtp.fc.weight"}, "no MTP weights found"),
    ("qwen3_next", {"reshape": "mtp.layers.0.mlp.shared_expert_gate.weight"},
     r"tensor 'mtp.layers.0.mlp.shared_expert_gate.weight' in model.safetensors has shape \[1, 63\], expected \[1, 64\]"),
    ("qwen3_next", {"drop": "mtp.layers.0.mlp.experts.3.down_proj.weight"},
     "tensor 'mtp.layers.0.mlp.experts.3.down_proj.weight' is missing"),
    ("qwen3_5", {"reshape": "mtp.layers.0.self_attn.q_proj.weight"},
     r"tensor 'mtp.layers.0.self_attn.q_proj.weight' in model.safetensors has shape \[128, 63\], expected \[128, 64\]"),
    ("qwen3_5_moe", {"drop": "mtp.layers.0.mlp.shared_expert_gate.weight"},
     "tensor 'mtp.layers.0.mlp.shared_expert_gate.weight' is missing"),
]


@pytest.mark.parametrize("arch,broken,message", MALFORMED, ids=[f"{a}-{list(b.values())[0]}" for a, b, _ in MALFORMED])
def test_malformed_checkpoints_are_one_line_errors(tmp_path, arch, broken, message):
    folder = write_mtp_target(tmp_path / "t", arch, "qwen3-next", **broken)
    target = load_target(folder)
    with pytest.raises(BadInput, match=message) as err:
        load_head(target, folder)
    assert "\n" not in str(err.value) and str(err.value).startswith("drafters.0")


def test_unreachable_layers_are_refused(tmp_path):
    """A linear-attention MTP layer, an MoE MTP layer over the dense Qwen3.5, an MoE MTP layer
    where the target's config builds a dense one, and a Qwen3-Next checkpoint's MTP layer read
    over a plain qwen3 target: one line each."""
    import json

    from safetensors.torch import load_file, save_file

    folder = write_mtp_target(tmp_path / "t", "qwen3_next", "qwen3-next")
    weights = load_file(str(folder / "model.safetensors"))
    weights["mtp.layers.0.linear_attn.A_log"] = torch.zeros(4)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(BadInput, match="linear attention"):
        load_head(load_target(folder), folder)

    dense = write_mtp_target(tmp_path / "d", "qwen3_5", "qwen3-next")
    weights = load_file(str(dense / "model.safetensors"))
    weights["mtp.layers.0.mlp.gate.weight"] = torch.zeros(4, 64)
    save_file(weights, str(dense / "model.safetensors"))
    with pytest.raises(BadInput, match="mixture-of-experts router.*'qwen3_5_text' target"):
        load_head(load_target(dense), dense)

    # vLLM builds the MTP layer as the target config's layer 0 would be: dense here, the checkpoint MoE
    target = load_target(write_mtp_target(tmp_path / "m", "qwen3_next", "qwen3-next"))
    target.model.config.mlp_only_layers = [0]
    with pytest.raises(BadInput, match="do not fit a Qwen3NextDecoderLayer of the target's config") as err:
        load_head(target, tmp_path / "m")
    assert "\n" not in str(err.value)

    plain = write_mtp_target(tmp_path / "p", "qwen3", "qwen3-next")
    config = json.loads((plain / "config.json").read_text())
    target = load_target(plain)
    (plain / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_next"}))
    with pytest.raises(BadInput, match="'qwen3_next' model .* this target is 'qwen3'") as err:
        load_head(target, plain)
    assert "\n" not in str(err.value)


def check_drafts(pipe, folder) -> None:
    """The runtime's drafts (drafter "m") are the reference's greedy chain, round by round."""
    from tests.heads.chain_reference import check_drafts_are_the_reference_chain

    target = load_target(folder)
    check_drafts_are_the_reference_chain(pipe, "m", load_head(target, folder), target)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_build_with_parity_and_greedy_lossless_decode(tmp_path, arch):
    """The whole build of a tiny Qwen3-Next / Qwen3.5 / Qwen3.5-MoE target with its MTP head: the head's graphs pass
    validation against the reference (1e-4, 100% argmax), decode greedily losslessly, and
    draft the reference's greedy chain through the decode loop. Needs the target graph of
    Qwen3-Next (gated attention, Gated DeltaNet layers) and the runtime's recurrent-state cache."""
    from specexport.runtime import load
    from tests.heads.common import build, check_greedy_lossless, check_parity

    folder = write_mtp_target(tmp_path / "t", arch, "qwen3-next")
    engines = build({"name": "mtp", "target": {"source": "hf", "path": "t"}, "drafters": [{"kind": "mtp", "name": "m"}]},
                    tmp_path, tmp_path / "out")
    check_parity(engines, "m")
    pipe = load(engines)
    check_greedy_lossless(pipe, "m")
    check_drafts(pipe, folder)


def write_qwen3_5_wrapper(folder, seed: int = 0):
    """A published-style Qwen3.5 folder: the multimodal wrapper (model_type qwen3_5, the text
    model's settings under text_config, its weights under model.language_model.*, a vision
    tower) with the text weights of a tiny qwen3_5 model and the MTP module's mtp.* tensors."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import tiny_model
    from tests.heads.chain_checkpoints import mtp_tensors

    text, tokenizer = tiny_model(TinySource(source="tiny", arch="qwen3_5", seed=seed))
    config = Qwen3_5Config(text_config=text.config.to_dict(),
                           vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=text.config.hidden_size))
    wrapper = Qwen3_5ForConditionalGeneration(config)
    state = {f"model.language_model.{k[len('model.'):]}" if k.startswith("model.") else k: v
             for k, v in text.state_dict().items()}
    missing, _ = wrapper.load_state_dict(state, strict=False)
    assert all(k.startswith("model.visual.") for k in missing), missing  # every text weight placed
    wrapper.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    weights = load_file(str(files[0]))
    weights.update(mtp_tensors(text.config, "qwen3-next")[0])
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    return folder


def test_a_published_qwen3_5_folder_builds_its_text_model_and_mtp_head(tmp_path):
    """The published Qwen3.5 checkpoints are the multimodal wrapper: build exports its text
    model (transformers' AutoModelForCausalLM reads it) and the MTP head inside it, which drafts
    the reference's greedy chain."""
    import json

    from specexport.runtime import load
    from tests.heads.common import build, check_greedy_lossless, check_parity

    folder = write_qwen3_5_wrapper(tmp_path / "t")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    engines = build({"name": "qwen3.5", "target": {"source": "hf", "path": "t"},
                     "drafters": [{"kind": "mtp", "name": "m"}, {"kind": "ngram"}]}, tmp_path, tmp_path / "out")
    manifest = json.loads((engines / "manifest.json").read_text())
    assert manifest["models"]["target"]["model_type"] == "qwen3_5_text"
    assert manifest["models"]["target"]["state"]["num_layers"] >= 1
    check_parity(engines, "m")
    pipe = load(engines)
    check_greedy_lossless(pipe, "m")
    check_drafts(pipe, folder)
