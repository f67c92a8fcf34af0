"""The OpenAI request bodies the server accepts, and its error bodies.

Fields clients send that change nothing here (user, presence_penalty 0, ...) are accepted and
ignored, as vLLM does; fields asking for what this server cannot do (n > 1, logprobs, echo,
penalties, logit_bias) get a 400 naming the field rather than being silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: running usage on every chunk


class _Sampled(BaseModel):
    """What both endpoints share: sampling, stops, streaming."""

    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    logit_bias: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_token_ids: bool = False  # vLLM's extension: the choice carries its token ids too

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first thing asked for that this server does not do."""
        if self.n != 1:
            return "n", "only n=1 is supported; send one request per completion"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported (they are not lossless)"
        return None

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
    echo: bool = False
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            return "prompt", "one prompt per request (a list of strings is a batch: send them as separate requests)"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # the templates know "system", not OpenAI's newer "developer"
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def finish_reason(stop_reason: str) -> str | None:
    """OpenAI's finish_reason for a DecodeStats.stop_reason."""
    return {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "kv_full": "length"}.get(stop_reason)
