"""The OpenAI request bodies the server accepts, and its error bodies.

Every field of OpenAI's chat-completions and completions bodies (and the vLLM extensions clients
send most) is either honoured or refused with a 400 naming it: nothing is accepted and ignored.
A field this server does not do yet passes only at its neutral value, what a client asking for
nothing sends (``NOT_YET``); a field it has never heard of is refused as unknown.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specexport.runtime.grammar import GrammarSpec
from specexport.runtime.rules import MAX_TOP_LOGPROBS, Controls, Penalties

MAX_N = 16  # completions per request (each is a row of the batch)


class ApiError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, not ignored


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: running usage on every chunk


def _neutral(*values):
    return lambda value: any(value == v and type(value) is type(v) for v in values) or value is None


# field -> (is the value neutral, why anything else is refused). Checked in this order.
NOT_YET: dict[str, tuple] = {
    "ignore_eos": (_neutral(False), "ignore_eos is not implemented"),
    "stop_token_ids": (lambda v: not v, "stop_token_ids is not implemented; use stop strings"),
    "include_stop_str_in_output": (_neutral(False), "include_stop_str_in_output is not implemented"),
    "skip_special_tokens": (_neutral(True), "special tokens are always left out of the text"),
    "tools": (lambda v: not v, "tool calling is not implemented yet"),
    "tool_choice": (_neutral("none"), "tool calling is not implemented yet"),
    "functions": (lambda v: not v, "function calling is not implemented"),
    "function_call": (_neutral("none"), "function calling is not implemented"),
    "audio": (_neutral(), "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "prediction": (_neutral(), "predicted outputs are not implemented yet"),
    "web_search_options": (_neutral(), "web search is not supported"),
    "reasoning_effort": (_neutral(), "reasoning_effort: this server has no reasoning model setting"),
    "verbosity": (_neutral(), "verbosity: this server has no verbosity setting"),
    "prompt_cache_key": (_neutral(), "prompt caching is not implemented"),
    "store": (_neutral(False), "this server stores no completions"),
    "service_tier": (_neutral("auto", "default"), "this server has one service tier, 'default'"),
    "echo": (_neutral(False), "echo is not supported"),
    "best_of": (_neutral(1), "best_of is not supported: ask for n completions and rank them yourself"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported"),
}


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # OpenAI: an empty schema allows any JSON
    strict: bool | None = None  # always enforced: the output cannot leave the schema either way


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class Speculation(_Body):
    """How this request speculates (both optional): ``drafter``, the server's drafter or "none"
    (the target alone); ``max_depth``, at most this many drafts a round (0: none)."""

    drafter: str | None = None
    max_depth: int | None = Field(None, ge=0)


class _Sampled(_Body):
    """What both endpoints share: sampling, stops, streaming, and every field either endpoint
    may carry that NOT_YET refuses unless neutral."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: the choice carries its token ids too
    # who asked: written to the server's log with the request id (the only use a local server has)
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # rows of the batch sharing the prompt's prefill
    # rules on the target's logits, exact under speculation (runtime/rules.py)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's
    min_tokens: int = Field(0, ge=0)  # vLLM's
    # structured output: at most one of these (runtime/grammar.py)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None  # vLLM's older spellings
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    speculation: Speculation | None = None  # this request's drafter and depth cap (the others keep theirs)
    # not done: refused unless neutral (NOT_YET)
    ignore_eos: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    store: Any = None
    service_tier: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first thing asked for that this server does not do."""
        for name, (neutral, why) in NOT_YET.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                return name, why
        return None

    def grammar(self) -> GrammarSpec | None:
        """The one structured-output constraint asked for (None: free text)."""
        asked = []
        if self.response_format is not None and self.response_format.type == "json_object":
            asked.append(GrammarSpec("json_object", "", "response_format"))
        if self.response_format is not None and self.response_format.json_schema is not None:
            asked.append(GrammarSpec("json_schema", json.dumps(self.response_format.json_schema.schema_),
                                     "response_format.json_schema.schema"))
        so = self.structured_outputs
        for field, value, kind in (("guided_json", self.guided_json, "json_schema"),
                                   ("guided_regex", self.guided_regex, "regex"),
                                   ("guided_choice", self.guided_choice, "choice"),
                                   ("guided_grammar", self.guided_grammar, "grammar"),
                                   ("structured_outputs.json", so and so.json_, "json_schema"),
                                   ("structured_outputs.regex", so and so.regex, "regex"),
                                   ("structured_outputs.choice", so and so.choice, "choice"),
                                   ("structured_outputs.grammar", so and so.grammar, "grammar"),
                                   ("structured_outputs.json_object", so and so.json_object, "json_object")):
            if value is None or value is False:
                continue
            source = value if isinstance(value, str) and kind != "choice" else json.dumps(value)
            asked.append(GrammarSpec(kind, "" if kind == "json_object" else source, field))
        if len(asked) > 1:
            raise ValueError(f"{asked[1].field}: give one structured-output constraint, not "
                             f"{' and '.join(a.field for a in asked)}")
        return asked[0] if asked else None

    def penalties(self, vocab: int) -> Penalties:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias: keys are token ids (got '{key}')")
            bias[int(key)] = float(value)
        penalties = Penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty, bias,
                              self.min_tokens)
        penalties.check_vocab(vocab)
        return penalties

    def _controls(self, vocab: int, logprobs: int | None) -> Controls:
        """The request's rules and grammar; ``logprobs``: each endpoint's own field (None: none;
        k: each token's logprob and the k most likely)."""
        return Controls(self.penalties(vocab), self.grammar(), logprobs)

    @property
    def identity(self) -> dict:
        """The caller's identifiers, for the request log."""
        return {k: v for k, v in (("user", self.user), ("safety_identifier", self.safety_identifier),
                                  ("metadata", self.metadata)) if v}

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, value):
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the k most likely at each token too
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if (found := super().unsupported()) is not None:
            return found
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            return "prompt", "one prompt per request (a list of strings is a batch: send them as separate requests)"
        return None

    def controls(self, vocab: int) -> Controls:
        return self._controls(vocab, self.logprobs)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Any = None
    refusal: str | None = None  # an earlier assistant turn's refusal, sent back as history: its text
    tool_calls: Any = None
    tool_call_id: Any = None

    @model_validator(mode="after")
    def _nothing_ignored(self) -> ChatMessage:
        if self.name:
            raise ValueError("name: a participant's name has no place in this model's chat template; drop it")
        if self.tool_calls or self.tool_call_id:
            raise ValueError("tool_calls / tool_call_id: tool calling is not implemented yet")
        return self

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        content = content or self.refusal or ""
        # the templates know "system", not OpenAI's newer "developer"
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # qualifies tools, which are refused
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    echo: Any = None  # vLLM's chat extension
    add_generation_prompt: Literal[True] = True  # vLLM's: the template always ends with the assistant's turn opened

    @model_validator(mode="after")
    def _top_with_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true to get top_logprobs")
        return self

    def controls(self, vocab: int) -> Controls:
        return self._controls(vocab, (self.top_logprobs or 0) if self.logprobs else None)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def finish_reason(stop_reason: str) -> str | None:
    """OpenAI's finish_reason for a DecodeStats.stop_reason."""
    return {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "kv_full": "length"}.get(stop_reason)
