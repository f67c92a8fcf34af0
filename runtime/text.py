"""Text in and out: the engine directory's tokenizer.json and chat template.

The chat template is rendered with jinja2 in a sandbox set up as transformers does
(trim_blocks, lstrip_blocks, loop controls, tojson without HTML escaping), so the token ids
equal what ``apply_chat_template`` produces.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from specexport.errors import BadInput


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Private-use characters put around each message's content while the template renders, so the
# content's span in the rendered prompt is known and encoded as text (never as control tokens).
CONTENT_OPEN, CONTENT_CLOSE = "\ue000", "\ue001"
_MARKED = re.compile(f"{CONTENT_OPEN}([^{CONTENT_OPEN}{CONTENT_CLOSE}]*){CONTENT_CLOSE}")


class TextCodec:
    def __init__(self, root: Path, info: dict):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(root / info["file"]))
        # the same vocabulary, but a special token's text in the input is encoded as plain text
        self._as_text = Tokenizer.from_file(str(root / info["file"]))
        self._as_text.encode_special_tokens = True
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

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it (special tokens included; a token holding part
        of a UTF-8 character shows U+FFFD, as transformers' decode does)."""
        return self.tokenizer.decode([int(token)], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """A plain prompt, with the special tokens the tokenizer adds (BOS where it uses one)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict]) -> str:
        if self._template is None:
            raise BadInput("this engine directory has no chat template; drop --chat and give a plain prompt")
        return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)

    def encode_chat(self, messages: list[dict], content_as_text: bool = True) -> list[int]:
        """The rendered chat's ids. The template writes the special tokens itself, as
        apply_chat_template assumes; with ``content_as_text`` (the default) the messages' own
        text is encoded as text, so a message holding "<|im_end|>" cannot close its turn and
        open another (False: as transformers does, special tokens' text anywhere becomes them)."""
        if not content_as_text:
            return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids
        marked = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, str) and content:
                if CONTENT_OPEN in content or CONTENT_CLOSE in content:
                    raise BadInput(f"messages[{i}].content holds U+E000 or U+E001, characters reserved here; "
                                   "remove them")
                message = {**message, "content": f"{CONTENT_OPEN}{content}{CONTENT_CLOSE}"}
            marked.append(message)
        ids: list[int] = []
        for text, is_content in _segments(self.render_chat(marked)):
            ids += (self._as_text if is_content else self.tokenizer).encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stream(self):
        """An incremental detokenizer: ``step(id) -> str | None``."""
        from tokenizers.decoders import DecodeStream

        decoder = DecodeStream(skip_special_tokens=True)
        return lambda token: decoder.step(self.tokenizer, token)


def _segments(rendered: str) -> list[tuple[str, bool]]:
    """The rendered prompt cut at the content marks: (text, is it a message's content), marks
    removed. A template that cuts or reorders content leaves unpaired marks: refused."""
    pieces = _MARKED.split(rendered)  # template text, content, template text, content, ...
    if any(CONTENT_OPEN in text or CONTENT_CLOSE in text for text in pieces[::2]):
        raise BadInput("the chat template rewrites the messages' content, so it cannot be encoded as text; "
                       "encode the rendered prompt whole instead (serve --special-tokens-in-content, or "
                       "encode_chat(..., content_as_text=False))")
    return [(text, i % 2 == 1) for i, text in enumerate(pieces) if text]
