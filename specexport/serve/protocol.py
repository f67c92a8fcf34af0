"""The OpenAI request bodies the server accepts, and its error bodies.

Every field of OpenAI's chat-completions and completions bodies (and the vLLM extensions clients
send most) is either honoured or refused with a 400 naming it: nothing is accepted and ignored.
A field this server does not do yet passes only at its neutral value, what a client asking for
nothing sends (``NOT_YET``); a field it has never heard of is refused as unknown.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
    "n": (_neutral(1), "only n=1 is supported; send one request per completion"),
    "logprobs": (_neutral(False, 0), "logprobs are not implemented yet"),
    "top_logprobs": (_neutral(0), "top_logprobs are not implemented yet"),
    "logit_bias": (lambda v: not v, "logit_bias is not implemented yet"),
    "presence_penalty": (_neutral(0, 0.0), "presence_penalty is not implemented yet"),
    "frequency_penalty": (_neutral(0, 0.0), "frequency_penalty is not implemented yet"),
    "repetition_penalty": (_neutral(1, 1.0), "repetition_penalty is not implemented yet"),
    "min_p": (_neutral(0, 0.0), "min_p is not implemented yet"),
    "min_tokens": (_neutral(0), "min_tokens is not implemented yet"),
    "ignore_eos": (_neutral(False), "ignore_eos is not implemented"),
    "stop_token_ids": (lambda v: not v, "stop_token_ids is not implemented; use stop strings"),
    "include_stop_str_in_output": (_neutral(False), "include_stop_str_in_output is not implemented"),
    "skip_special_tokens": (_neutral(True), "special tokens are always left out of the text"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "structured output (json_object, json_schema) is not implemented yet"),
    "guided_json": (_neutral(), "guided decoding is not implemented yet"),
    "guided_regex": (_neutral(), "guided decoding is not implemented yet"),
    "guided_choice": (_neutral(), "guided decoding is not implemented yet"),
    "guided_grammar": (_neutral(), "guided decoding is not implemented yet"),
    "structured_outputs": (_neutral(), "structured output is not implemented yet"),
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
    "best_of": (_neutral(1), "best_of is not supported"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported"),
}


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
    # not done yet: refused unless neutral (NOT_YET)
    n: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    store: Any = None
    service_tier: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first thing asked for that this server does not do."""
        for name, (neutral, why) in NOT_YET.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                return name, why
        return None

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
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if (found := super().unsupported()) is not None:
            return found
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            return "prompt", "one prompt per request (a list of strings is a batch: send them as separate requests)"
        return None


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

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def finish_reason(stop_reason: str) -> str | None:
    """OpenAI's finish_reason for a DecodeStats.stop_reason."""
    return {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "kv_full": "length"}.get(stop_reason)
