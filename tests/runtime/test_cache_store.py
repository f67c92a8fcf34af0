"""The host cache stores' verbs (K/V and recurrent state) and the one graph call over them, on small
arrays and a fake engine."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.contract import (
    CACHE_LENGTH,
    INPUT_IDS,
    NEXT_TOKENS,
    VALID_TOKENS,
    StateLayout,
    TensorSpec,
    past_names,
    state_past_names,
    state_present_names,
    state_present_of,
)
from specexport.runtime.cache_store import HostStore
from specexport.runtime.graph_call import GraphCall
from specexport.runtime.state_store import HostStateStore

SLOTS, KV, S_MAX, HD = 3, 2, 8, 4


def _store() -> HostStore:
    rng = np.random.default_rng(0)
    return HostStore({name: rng.normal(size=(SLOTS, KV, S_MAX, HD)).astype(np.float32) for name in past_names(1)})


def _presents(store: HostStore, tokens: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {p: rng.normal(size=(SLOTS, KV, tokens, HD)).astype(np.float32) for p in store.presents}  # [B, n_kv, T, hd]


def test_rows_are_views_made_once_and_a_slot_is_a_one_row_store():
    store = _store()
    assert store.rows(2) is store.rows(2)
    name = store.names[0]
    store.slot(1).rows()[name][0, 0, 0, 0] = 42.0
    assert store.rows()[name][1, 0, 0, 0] == 42.0 and store.rows(2)[name].shape == (2, KV, S_MAX, HD)


def test_write_move_and_compact():
    store = _store()
    before = {n: a.copy() for n, a in store.rows().items()}
    out = _presents(store, 4)
    store.write(out, [(2, 3, 2)])  # row 2's first two positions at 3 and 4
    for name, array in store.rows().items():
        new = out[store.presents[store.names.index(name)]]
        assert np.array_equal(array[2, :, 3:5], new[2, :, :2])
        assert np.array_equal(array[2, :, :3], before[name][2, :, :3]) and np.array_equal(array[:2], before[name][:2])
    store.move(2, 0, 5)
    for array in store.rows().values():
        assert np.array_equal(array[0, :, :5], array[2, :, :5])
    # in place: the pass wrote rows 0..3 at 1..4; the path keeps rows 0, 2, 3 at 1, 2, 3
    written = {n: a[1].copy() for n, a in store.rows().items()}
    store.compact(1, 1, [0, 2, 3])
    for name, array in store.rows().items():
        assert np.array_equal(array[1, :, 1:4], written[name][:, [1, 3, 4]])
    # appended: taken from the pass's presents
    store.compact(1, 1, [0, 2], out)
    for name, array in store.rows().items():
        assert np.array_equal(array[1, :, 1:3], out[store.presents[store.names.index(name)]][1][:, [0, 2]])


def test_save_and_restore_put_back_what_a_timing_run_overwrites():
    store = _store()
    before = {n: a.copy() for n, a in store.rows().items()}
    saved = store.save(2, 5)
    for array in store.rows().values():
        array[:2, :, 5:] = 0.0
    store.restore(saved, 2, 5)
    assert all(np.array_equal(store.rows()[n], before[n]) for n in before)
    # ``count`` positions only: those after them keep what the block wrote
    saved = store.save(1, 2, 3)
    for array in store.rows().values():
        array[:1, :, 2:] = 0.0
    store.restore(saved, 1, 2)
    for name, array in store.rows().items():
        assert np.array_equal(array[:1, :, :5], before[name][:1, :, :5]) and not array[:1, :, 5:].any()


class _Engine:
    """Returns its input ids as next tokens and a present per past input; records the feeds."""

    name = "fake"

    def __init__(self, store: HostStore, batch: int, tokens: int):
        self.inputs = {INPUT_IDS: TensorSpec("int64", (batch, tokens)), CACHE_LENGTH: TensorSpec("int64", (batch,)),
                       VALID_TOKENS: TensorSpec("int64", (batch,))}
        self.store, self.seen = store, []

    def run(self, feeds, outputs, bound=None):
        self.seen.append({k: v.copy() for k, v in feeds.items() if k in self.inputs})
        ids = feeds[INPUT_IDS]
        out = {NEXT_TOKENS: ids.copy()}
        for p in self.store.presents:
            out[p] = np.broadcast_to(ids[:, None, :, None], (ids.shape[0], KV, ids.shape[1], HD)).astype(np.float32)
        return {name: out[name] for name in outputs}


def test_a_graph_call_feeds_rows_in_place_and_appends_their_real_positions():
    store = _store()
    engine = _Engine(store, 2, 3)
    call = GraphCall.over(engine, store, 2, in_place=False)
    feeds = call.feeds
    call.clear()
    call.feed_row(1, 4, np.array([7, 8]), valid=2)
    out = call.run([NEXT_TOKENS], [(1, 4, 2)])
    assert call.feeds is feeds and call.calls == 1 and call.seconds > 0
    seen = engine.seen[-1]
    assert seen[INPUT_IDS].tolist() == [[0, 0, 0], [7, 8, 0]] and seen[CACHE_LENGTH].tolist() == [0, 4]
    assert seen[VALID_TOKENS].tolist() == [0, 2] and out[NEXT_TOKENS].tolist() == [[0, 0, 0], [7, 8, 0]]
    for array in store.rows().values():
        assert array[1, 0, 4:6, 0].tolist() == [7.0, 8.0]  # the real positions only
    assert call.time([NEXT_TOKENS]) > 0 and call.calls == 1  # a timing run is not counted


# -- the recurrent state's store ----------------------------------------------------------------

LAYOUT = StateLayout(num_layers=1, conv_channels=2, conv_kernel=3, heads=1, key_dim=2, value_dim=2)


def _states(tokens: int, seed: int) -> dict[str, np.ndarray]:
    """A graph's present_state.* over SLOTS rows: the state after each of ``tokens`` positions."""
    rng = np.random.default_rng(seed)
    return {state_present_of(name): rng.normal(size=(SLOTS, tokens, *shape[1:])).astype(np.float32)
            for name, shape in LAYOUT.shapes(SLOTS).items()}  # [B, T, ...]


def _row(store: HostStateStore, row: int) -> dict[str, np.ndarray]:
    return {name: array[row].copy() for name, array in store.rows().items()}


def _after(out: dict[str, np.ndarray], row: int, t: int) -> dict[str, np.ndarray]:
    """The state ``out`` holds for ``row`` after its position ``t`` (0-based), by past name."""
    return {name: out[state_present_of(name)][row, t] for name in state_past_names(LAYOUT.num_layers)}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_a_state_row_holds_the_state_after_its_last_committed_position():
    store = HostStateStore.allocate(LAYOUT, SLOTS, keep=8)
    feeds = store.rows(2)
    assert store.rows(2) is feeds and store.presents == state_present_names(1)
    out = _states(4, 0)
    store.write(out, [(1, 5, 3)])  # row 1: three of four positions committed after 5 tokens
    assert _same(_row(store, 1), _after(out, 1, 2))
    assert all(not array[[0, 2]].any() for array in store.rows().values())  # rows not written stay empty
    assert all(np.array_equal(feeds[n][1], array[1]) for n, array in store.rows().items())  # the feeds see it


def test_setting_a_rows_length_selects_a_kept_state_and_forgets_the_later_ones():
    store = HostStateStore.allocate(LAYOUT, SLOTS, keep=8)
    first, second = _states(4, 0), _states(4, 1)
    store.write(first, [(0, 0, 4), (2, 0, 4)])
    store.write(second, [(0, 4, 4)])
    store.set_length(0, 6)  # two of the second run's four kept
    assert _same(_row(store, 0), _after(second, 0, 1))
    assert _same(_row(store, 2), _after(first, 2, 3))  # another row untouched
    assert not store.reaches(0, 7)  # forgotten: position 7 was after 6
    store.set_length(0, 3)
    assert _same(_row(store, 0), _after(first, 0, 2))
    store.set_length(0, 0)
    assert all(not array[0].any() for array in store.rows().values())


def test_a_state_reaches_back_only_over_the_kept_positions():
    store = HostStateStore.allocate(LAYOUT, SLOTS, keep=2)
    store.write(_states(4, 0), [(0, 0, 4)])  # positions 1..4 seen, 2..4 kept
    assert [store.reaches(0, p) for p in range(5)] == [True, False, True, True, True]
    with pytest.raises(ValueError, match="only the last 2 positions"):
        store.set_length(0, 1)


def test_moving_a_state_row_takes_its_state_and_what_it_kept():
    store = HostStateStore.allocate(LAYOUT, SLOTS, keep=8)
    out = _states(4, 0)
    store.write(out, [(2, 0, 4)])
    store.move(2, 0, 3)
    assert _same(_row(store, 0), _after(out, 2, 2))
    assert _same(_row(store, 2), _after(out, 2, 3))  # the source keeps its own
    assert store.reaches(0, 2) and not store.reaches(0, 4)
    store.set_length(0, 1)
    assert _same(_row(store, 0), _after(out, 2, 0))
