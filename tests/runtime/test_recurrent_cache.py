"""The recurrent-state cache of linear-attention targets (Qwen3-Next, Qwen3.5), engine-free.

A fake graph stands in for a hybrid model: one attention layer (its K/V: the token ids) and one
linear layer whose state after each position it returns, as the exported graphs do
(present_state.* [B, T, ...]). Its next token depends on the whole history through the state,
so keeping the state of any position but the last accepted one changes the output.
"""

from __future__ import annotations

import numpy as np
import pytest

from specexport.contract import (
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    StateLayout,
    TensorSpec,
    past_names,
    present_names,
    state_past_names,
    state_present_names,
)
from specexport.runtime.acceptance import Draft, Sampling
from specexport.runtime.drafters import Stateless
from specexport.runtime.kv_cache import KVCache, RecurrentCache, open_host_cache
from specexport.runtime.model import Model, SlotCaches
from specexport.runtime.runner import ModelRunner
from tests.runtime.fakes import decode

VOCAB = 50
LAYOUT = StateLayout(num_layers=1, conv_channels=1, conv_kernel=3, heads=1, key_dim=1, value_dim=1)
S_MAX = 64


def _step(state: float, window: tuple[float, float], token: int) -> tuple[float, tuple[float, float], int]:
    """The fake model's recurrence: (state, last two inputs) -> after ``token``, and its next token."""
    state = 0.75 * state + token
    window = (window[1], float(token))
    return state, window, int(round(state * 7 + window[0] * 3)) % VOCAB


def reference_greedy(prompt: list[int], new: int) -> list[int]:
    state, window, out = 0.0, (0.0, 0.0), []
    nxt = 0
    for token in prompt:
        state, window, nxt = _step(state, window, token)
    for _ in range(new):
        out.append(nxt)
        state, window, nxt = _step(state, window, nxt)
    return out


class FakeHybridEngine:
    """T tokens per call; reads past_state.0.*, returns the state after each position."""

    def __init__(self, tokens: int):
        self.name = f"fake.t{tokens}"
        self.tokens = tokens
        kv = (1, 1, S_MAX, 1)
        self.inputs = {INPUT_IDS: TensorSpec("int64", (1, tokens)), CACHE_LENGTH: TensorSpec("int64", (1,)),
                       **{n: TensorSpec("float32", kv) for n in past_names(1)},
                       **{n: TensorSpec("float32", s) for n, s in LAYOUT.shapes(1).items()}}
        conv, rec = state_present_names(1)
        self.outputs = {LOGITS: TensorSpec("float32", (1, tokens, VOCAB)), NEXT_TOKENS: TensorSpec("int64", (1, tokens)),
                        **{n: TensorSpec("float32", (1, 1, tokens, 1)) for n in present_names(1)},
                        conv: TensorSpec("float32", (1, tokens, 1, 2)), rec: TensorSpec("float32", (1, tokens, 1, 1, 1))}

    def run(self, feeds, outputs=None, bound=None):
        conv_past, rec_past = (feeds[n] for n in state_past_names(1))
        state, window = float(rec_past[0, 0, 0, 0]), (float(conv_past[0, 0, 0]), float(conv_past[0, 0, 1]))
        t = self.tokens
        conv = np.zeros((1, t, 1, 2), np.float32)  # [B, T, C, K-1]
        rec = np.zeros((1, t, 1, 1, 1), np.float32)  # [B, T, Hv, dk, dv]
        nxt = np.zeros((1, t), np.int64)
        for i, token in enumerate(feeds[INPUT_IDS][0]):
            state, window, nxt[0, i] = _step(state, window, int(token))
            conv[0, i, 0], rec[0, i, 0, 0, 0] = window, state
        logits = np.zeros((1, t, VOCAB), np.float32)
        logits[0, np.arange(t), nxt[0]] = 1.0
        k = feeds[INPUT_IDS].astype(np.float32).reshape(1, 1, t, 1)
        everything = {LOGITS: logits, NEXT_TOKENS: nxt, **dict(zip(present_names(1), (k, k))),
                      **dict(zip(state_present_names(1), (conv, rec)))}
        return {n: everything[n] for n in (outputs or everything)}


def hybrid_runner(sizes=(1, 4, 8), keep: int = 64) -> ModelRunner:
    engines = [FakeHybridEngine(t) for t in sizes]
    cache = open_host_cache(1, 1, 1, S_MAX, 1, state=LAYOUT, keep=keep)
    return ModelRunner("fake", engines, cache, {e.name: e.tokens for e in engines})


def test_the_host_cache_of_a_model_with_a_state_is_recurrent():
    assert isinstance(open_host_cache(1, 1, 1, S_MAX, 1, state=LAYOUT), RecurrentCache)
    assert type(open_host_cache(1, 1, 1, S_MAX, 1)) is KVCache


def test_chunked_prefill_carries_the_state_of_each_chunks_last_real_token():
    prompt = list(range(3, 22))  # 19 tokens: two chunks of 8 and a padded one
    runner = hybrid_runner()
    out = runner.forward(prompt)
    assert out.next_tokens[-1] == reference_greedy(prompt, 1)[0]
    assert runner.calls >= 3  # it did run in pieces


@pytest.mark.parametrize("keep", [0, 1, 3, 4])
def test_rewind_selects_the_state_after_the_kept_tokens(keep):
    prompt = [5, 9, 2, 7, 11]
    drafts = [13, 4, 8, 1]
    runner = hybrid_runner()
    runner.forward(prompt[:-1])
    runner.forward([prompt[-1], *drafts])  # a verify pass of 1+4
    runner.cache.set_length(len(prompt) + keep)  # keep the last prompt token and `keep` drafts
    history = prompt + drafts[:keep]
    out = runner.forward([3])  # the next round's first token
    assert out.next_tokens[0] == reference_greedy([*history, 3], 1)[0]


def test_rewind_reaches_back_only_over_the_kept_positions():
    runner = hybrid_runner(sizes=(1,), keep=4)
    runner.forward(list(range(1, 11)))
    runner.cache.set_length(7)  # within the last 4
    with pytest.raises(ValueError, match="only the last 4 positions"):
        runner.cache.set_length(2)
    runner.cache.set_length(0)  # the empty state is always reachable
    assert runner.forward([5]).next_tokens[0] == reference_greedy([5], 1)[0]


class CorruptOracle(Stateless):
    """Drafts the target's true continuation, wrong from a random position on: every round
    keeps a different number of drafts, so the target's state is selected at every depth."""

    name = "corrupt-oracle"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def chain(self, context, k):
        tokens = np.array(reference_greedy(context.tolist(), k), dtype=np.int64)
        cut = int(self.rng.integers(0, k + 1))
        tokens[cut:] = (tokens[cut:] + 1) % VOCAB
        return Draft(tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_greedy_over_a_recurrent_state_equals_the_target_alone(seed):
    prompt = np.array([4, 17, 23, 8, 30, 2, 19, 41, 6], dtype=np.int64)
    runner = hybrid_runner()
    target = Model("fake", [runner], {}, SlotCaches([runner.cache], None), S_MAX)
    out, stats = decode(target, CorruptOracle(seed), prompt, draft_len=4, max_new_tokens=40, sampling=Sampling(),
                        rng=np.random.default_rng(seed))
    assert out == reference_greedy(prompt.tolist(), 40)
    accepted = [i for i, a in enumerate(stats.accepted_at) if a]
    assert stats.rounds < 40 and len(accepted) >= 3  # drafts were kept at several depths


@pytest.mark.parametrize("largest", [16, 100])
def test_a_loaded_models_cache_can_undo_one_run_of_its_largest_graph(largest):
    """open_kv_cache (what Pipeline opens) sizes the reach from the model's largest graph: a
    verify graph wider than the default reach (1+D = 128 at G = 1) must still be rewindable."""
    from specexport.contract import KVLayout, ModelEntry
    from specexport.runtime.engine import EngineOptions, open_kv_cache

    entry = ModelEntry("target", "target", KVLayout(1, 1, 1, 256), VOCAB, state=LAYOUT)
    cache = open_kv_cache("onnxruntime", entry, EngineOptions(), largest_graph=largest)
    presents = {present: np.arange(largest, dtype=np.float32).reshape(1, largest, *([1] * (len(shape) - 1)))
                * np.ones((1, 1, *shape[1:]), dtype=np.float32)
                for present, shape in zip(state_present_names(1), LAYOUT.shapes(1).values())}
    cache.store(presents, largest, in_place=True)  # the K/V written by the graph itself
    cache.rewind(3)  # all but the run's first 3 positions rejected
    assert float(cache.view()["past_state.0.recurrent"].ravel()[0]) == 2.0  # the state after 3 tokens


def _presents(rows: int, tokens: int, values: dict[int, list[float]]) -> dict[str, np.ndarray]:
    """present_state.* [rows, T, ...] whose row r holds ``values[r][t]`` after position t."""
    out = {}
    for present, shape in zip(state_present_names(1), LAYOUT.shapes(rows).values()):
        array = np.zeros((rows, tokens, *shape[1:]), dtype=np.float32)  # [B, T, ...]
        for r, seq in values.items():
            for t, value in enumerate(seq):
                array[r, t] = value
        out[present] = array
    return out


def test_a_slots_row_shares_its_kept_states_with_the_batched_store():
    """A slot's view (its runner's row) and the [slots] store the batched calls feed are one
    state row: what one writes or selects the other sees; a move hands a row's kept states on."""
    from specexport.runtime.state_store import HostStateStore

    states = HostStateStore.allocate(LAYOUT, 3, keep=8)
    rec = state_past_names(1)[1]
    view = states.slot(1)
    states.write(_presents(3, 3, {0: [1, 2, 3], 1: [10, 20, 30]}), [(0, 0, 3), (1, 0, 3)])  # a batched call
    assert view.rows()[rec].ravel()[0] == 30.0  # the slot sees the state after its last position
    view.set_length(0, 1)  # the slot's runner rolls back: a kept state chosen
    assert states.rows()[rec][:, 0, 0, 0].tolist() == [3.0, 10.0, 0.0]
    view.write(_presents(1, 2, {0: [11, 12]}), [(0, 1, 2)])  # the runner goes on from there
    assert states.reaches(1, 3) and states.rows()[rec][1].ravel()[0] == 12.0
    states.move(1, 2, 2)  # row 1 leaves its slot to row 2, at 2 tokens
    assert states.rows()[rec][2].ravel()[0] == 11.0 and states.reaches(2, 1) and not states.reaches(2, 3)
    states.set_length(1, 0)
    assert view.rows()[rec].ravel()[0] == 0.0 and not view.reaches(0, 1)
    # row 0 fed again from 1 token: its states after 2 and 3 were another path's, now unreachable
    states.write(_presents(3, 1, {0: [7]}), [(0, 1, 1)])
    assert states.reaches(0, 2) and not states.reaches(0, 3) and states.rows()[rec][0].ravel()[0] == 7.0


def test_a_batched_write_leaves_each_rows_state_to_be_chosen_when_it_is_next_fed():
    """A batched call's rows (``select=False``) are set to their lengths before the next call:
    the choice copies a kept state in once, and a row fed again from a shorter length never keeps
    feeding the other path's state it held at the same length."""
    from specexport.runtime.state_store import HostStateStore

    states = HostStateStore.allocate(LAYOUT, 2, keep=8)
    rec = state_past_names(1)[1]
    states.write(_presents(2, 3, {0: [1, 2, 3]}), [(0, 0, 3)], select=False)
    assert states.rows()[rec][0].ravel()[0] == 0.0  # still the state it was fed
    states.set_length(0, 3)
    assert states.rows()[rec][0].ravel()[0] == 3.0
    states.write(_presents(2, 2, {0: [8, 9]}), [(0, 1, 2)], select=False)  # fed again from 1 token
    states.set_length(0, 3)  # the new path's state after 3 tokens, not the one the feed held
    assert states.rows()[rec][0].ravel()[0] == 9.0
