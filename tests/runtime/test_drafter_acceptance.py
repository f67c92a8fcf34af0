"""Drafters that predict the target are accepted: E[L] floors through the decode loop, greedy at
a fixed depth, for the draft model and the int4 copy of the target (the block heads' floors are
in tests/distill, on the heads distill trains). Losslessness alone cannot show a useless drafter:
drafts that are all wrong are all rejected and the output is still the target's."""

from specexport.runtime import load
from tests.conftest import TINY_SHAPE
from tests.expected_length import acceptance_length

# short enough for the near copy's 64 positions with 32 new tokens
PROMPTS = ["1, 2, 1, 2, 1, 2, 1,", "Once upon a time", "def add(a, b):\n    return", "The quick brown fox"]


def test_a_near_copy_draft_model_is_mostly_accepted(near_copy_engines):
    """The target's twin at 0.9 of its weights (conftest.NEAR_COPY) as the draft model: most
    drafts are kept (measured 3.37 of at most 5 at D = 4)."""
    pipe = load(near_copy_engines)
    pooled, each = acceptance_length(pipe, "near-copy", PROMPTS, draft_len=4, max_new_tokens=32)
    assert pooled > 2.5, f"E[L] {pooled:.2f} <= 2.5 at D = 4; per prompt: {each}"


def test_the_int4_copy_of_the_target_is_accepted(tiny_engines):
    """quantized-self (int4, blocks of 32) on the shared tiny llama build: its drafts are often
    the random target's argmax (measured 1.56 at D = 4; drafts all wrong give 1.0)."""
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    pooled, each = acceptance_length(pipe, "quantized-self", PROMPTS, draft_len=4, max_new_tokens=48)
    assert pooled > 1.25, f"E[L] {pooled:.2f} <= 1.25 at D = 4; per prompt: {each}"
