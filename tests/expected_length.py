"""E[L] floors: a drafter that predicts the target must be accepted, not only stay lossless.

A drafter whose proposals were all wrong (shifted to a neighbouring token id, say) still
decodes losslessly; only the accepted tokens per round show it. ``acceptance_length`` measures
that through the runtime's decode loop, greedy and at a fixed depth, pooled over prompts."""

from __future__ import annotations

from collections.abc import Sequence


def acceptance_length(pipe, drafter: str, prompts: Sequence[str | list[dict] | list[int]], *, draft_len: int,
                      max_new_tokens: int) -> tuple[float, list[float]]:
    """Greedy decoding of each prompt (text, chat messages or token ids) with ``drafter`` at depth
    ``draft_len`` in every round. Returns the pooled E[L] (tokens committed over verify rounds,
    all prompts together) and each prompt's own, for the failure message."""
    tokens = rounds = 0
    each = []
    for prompt in prompts:
        ids = prompt_ids(pipe, prompt)
        stats = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=max_new_tokens, draft_len=draft_len,
                              adaptive=False).stats
        assert stats.proposed_at[0] >= stats.rounds - 1, f"{drafter}: rounds without drafts at a fixed depth"
        tokens, rounds = tokens + stats.tokens, rounds + stats.rounds
        each.append(round(stats.acceptance_length, 2))
    return tokens / rounds, each


def prompt_ids(pipe, prompt: str | list[dict] | list[int]) -> list[int]:
    """Text, chat messages or token ids, as the pipeline's prompt ids."""
    if isinstance(prompt, str):
        return pipe.prompt_ids(prompt)
    if prompt and isinstance(prompt[0], dict):
        return pipe.prompt_ids(messages=prompt)
    return pipe.prompt_ids(ids=prompt)
