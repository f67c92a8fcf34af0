"""A short prompt set for the tiny models' batched bench tests (byte-tokenized: a few dozen
tokens each), written as the bench's JSONL."""

import json
from pathlib import Path

SHORT = [
    {"id": "a", "category": "code", "prompt": "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x):"},
    {"id": "b", "category": "chat", "prompt": "the cat sat on the mat; the cat sat on the"},
    {"id": "c", "category": "chat", "prompt": "one two three one two"},
]


def short_prompts(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in SHORT[:n]))
    return path
