"""Text in and out: the engine directory's tokenizer.json and chat template.

The chat template is rendered with jinja2 in a sandbox set up as transformers does
(trim_blocks, lstrip_blocks, loop controls, tojson without HTML escaping), so the token ids
equal what ``apply_chat_template`` produces.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from specexport.errors import BadInput


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class TextCodec:
    def __init__(self, root: Path, info: dict):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(root / info["file"]))
        self.special_tokens = dict(info.get("special_tokens", {}))
        self.eos_ids = frozenset(int(i) for i in info.get("eos_token_ids", []))
        self._template = None
        if info.get("chat_template"):
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string((root / info["chat_template"]).read_text())

    def encode(self, text: str) -> list[int]:
        """A plain prompt, with the special tokens the tokenizer adds (BOS where it uses one)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict]) -> str:
        if self._template is None:
            raise BadInput("this engine directory has no chat template; drop --chat and give a plain prompt")
        return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes the special tokens itself, as apply_chat_template assumes.
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stream(self):
        """An incremental detokenizer: ``step(id) -> str | None``."""
        from tokenizers.decoders import DecodeStream

        decoder = DecodeStream(skip_special_tokens=True)
        return lambda token: decoder.step(self.tokenizer, token)
