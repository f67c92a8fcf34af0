"""What a stop string does to the text and to the token ids (engine-free)."""

import numpy as np

from specexport.runtime.acceptance import Sampling
from specexport.runtime.api import TextTracker
from tests.runtime.fakes import OracleDrafter, decode, markov, random_table

LETTERS = "abcdef"


def test_token_ids_keep_the_stop_string_tokens_and_the_text_drops_it():
    table = random_table(6, seed=0)
    prompt = np.array([0], dtype=np.int64)
    full, _ = decode(markov(table), OracleDrafter(table), prompt, draft_len=4, max_new_tokens=8, sampling=Sampling())
    pieces = {t: LETTERS[t] + "-" for t in range(6)}  # each token detokenizes to two characters
    text = "".join(pieces[t] for t in full)
    stop = text[5:8]  # begins inside the third token's text, completes inside the fourth's
    tracker = TextTracker(pieces.get, [stop])
    ids, stats = decode(markov(table), OracleDrafter(table), prompt, draft_len=4, max_new_tokens=8,
                        sampling=Sampling(), stop=tracker.add)
    assert stats.stop_reason == "stop_string"
    assert ids == full[:4]  # up to and including the token that completed the stop string
    assert tracker.text == text[:5]  # the text ends just before the stop string
    assert stats.tokens == len(ids)
