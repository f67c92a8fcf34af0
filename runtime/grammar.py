"""Structured output: a grammar that decides which tokens may come next, through llguidance.

Why llguidance (argued in docs/structured.md): it needs nothing but its own wheel (xgrammar
needs torch, which the runtime never imports), builds a JSON schema's matcher in about a
millisecond over SmolLM2's 49,152 tokens (outlines-core compiles an index over the whole
vocabulary first), computes a mask in about 0.1 ms, and can roll back consumed tokens, which
is what verifying drafts needs: the state after each draft, then back to the accepted ones.

A ``GrammarSpec`` is what a request asks for (kind + source); ``Grammars`` compiles specs for
one tokenizer; a ``GrammarState`` follows one sequence: its committed tokens, plus the
tentative ones (drafts) the current verify pass has looked past.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specexport.errors import BadInput, missing_extra


@dataclass(frozen=True)
class GrammarSpec:
    """What one request constrains its output to. ``kind`` is a key of ``GRAMMAR_KINDS``."""

    kind: str
    source: str  # the schema (JSON text), regex, choices (a JSON list) or Lark grammar
    field: str = "grammar"  # the request field it came from: named in errors

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise BadInput(f"{self.field}: unknown grammar kind '{self.kind}' (known: {', '.join(GRAMMAR_KINDS)})")


def _llguidance():
    try:
        import llguidance
    except ModuleNotFoundError as err:
        raise missing_extra("llguidance", "structured") from err
    return llguidance


# JSON as one line with ", " and ": " between items (a schema's own "x-guidance" may change it).
# llguidance's default allows any whitespace between tokens, and a model stuck on a newline
# then never finishes its object (vLLM added disable-any-whitespace for this).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_schema(source: str) -> str:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as err:
        raise BadInput(f"the JSON schema is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise BadInput("the JSON schema must be an object")
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)


def _json_object(source: str) -> str:
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)


def _regex(source: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(source)


def _choice(source: str) -> str:
    choices = json.loads(source)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise BadInput("a choice needs a list of non-empty strings")
    # Lark string literals take JSON's escapes
    return _llguidance().LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _lark(source: str) -> str:
    if "::=" in source:  # GBNF (llama.cpp's, vLLM's EBNF examples): llguidance converts it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        source = gbnf_to_lark(source)
    return _llguidance().LLMatcher.grammar_from_lark(source)


# kind -> the llguidance grammar for a source
GRAMMAR_KINDS: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema,
    "json_object": _json_object,
    "regex": _regex,
    "choice": _choice,
    "grammar": _lark,
}


class Grammars:
    """Compiles specs for one tokenizer (its llguidance form is built once, ~0.35 s for SmolLM2)."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: frozenset[int]):
        self._tokenizer_json, self.vocab, self.eos_ids = tokenizer_json, vocab, eos_ids
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llg = _llguidance()
            self._tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab,
                                              eos_token=sorted(self.eos_ids) or None)
        return self._tokenizer

    def check(self, spec: GrammarSpec) -> str:
        """The spec's llguidance grammar, or BadInput naming the field and what is wrong."""
        llg = _llguidance()
        try:
            grammar = GRAMMAR_KINDS[spec.kind](spec.source)
        except BadInput as err:
            raise BadInput(f"{spec.field}: {err}") from None
        except (ValueError, RuntimeError, TypeError, json.JSONDecodeError) as err:
            raise BadInput(f"{spec.field}: {err}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise BadInput(f"{spec.field}: {error.strip().splitlines()[0]}")
        return grammar

    def start(self, spec: GrammarSpec) -> GrammarState:
        matcher = _llguidance().LLMatcher(self.tokenizer, self.check(spec), log_level=0)
        if matcher.is_error():
            raise BadInput(f"{spec.field}: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab)


class GrammarState:
    """One sequence's place in its grammar. ``allowed(extra)`` is the mask after the committed
    tokens and then ``extra`` (a verify pass's drafts before a position); ``commit`` makes
    tokens final. The matcher holds committed + tentative tokens; moving between tentative
    prefixes rolls back only what differs."""

    def __init__(self, matcher, vocab: int):
        self._matcher, self.vocab = matcher, vocab
        self._tentative: list[int] = []
        self._bits = np.full((vocab + 31) // 32, -1, dtype=np.int32)  # [ceil(V/32)] llguidance's bitmask

    def _follow(self, extra: Sequence[int]) -> bool:
        """Put the matcher after committed + extra; False if the grammar refuses a token of extra."""
        extra = [int(t) for t in extra]
        same = 0
        while same < min(len(extra), len(self._tentative)) and extra[same] == self._tentative[same]:
            same += 1
        if len(self._tentative) > same:
            self._matcher.rollback(len(self._tentative) - same)
            del self._tentative[same:]
        for token in extra[same:]:
            if self._matcher.validate_tokens([token]) != 1:
                return False
            self._matcher.consume_token(token)
            self._tentative.append(token)
        return True

    def allowed(self, extra: Sequence[int] = ()) -> np.ndarray:
        """Which tokens may follow committed + extra: bool [V] (none, if extra leaves the grammar)."""
        if not self._follow(extra):
            return np.zeros(self.vocab, dtype=bool)
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), count=self.vocab, bitorder="little").view(bool)  # [V]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (after the committed ones) the grammar takes."""
        self._follow(())
        return int(self._matcher.validate_tokens([int(t) for t in tokens]))

    def commit(self, tokens: Sequence[int]) -> None:
        if not self._follow(tokens):
            raise RuntimeError(f"the grammar refused committed tokens {list(tokens)}: {self._matcher.get_error()}")
        self._tentative = []

    @property
    def done(self) -> bool:
        """Nothing may follow (the grammar is complete and ended)."""
        return bool(self._matcher.is_stopped())
