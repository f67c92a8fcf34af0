"""What a server is started with. Plain data (it is pickled to each Ray Serve replica)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specexport.backends import TENSORRT
from specexport.errors import BadInput


@dataclass(frozen=True)
class ServeConfig:
    engine_dir: str
    model_name: str = ""  # the name clients ask for; default: the engine directory's name
    # none or any drafter of the directory (all run in the batched loop); several, comma-separated:
    # each request drafts with the one its speculation.drafter names (default the first)
    drafter: str = "ngram"
    max_batch: int | None = None  # sequences per round (default: the largest batch size built)
    max_waiting: int = 64  # requests queued beyond the running ones; more get 429
    threads: int | None = None
    api_key: str | None = None  # clients send "Authorization: Bearer KEY"
    schedule: bool = True  # depth by batch size (the plan's draft.schedule)
    per_sequence: bool = False  # each round's width from the rows' own acceptance
    adaptive: bool = True  # each request's own adaptive depth under the schedule (as `generate`)
    # a message's "<|im_end|>" etc. become control tokens, as transformers renders them (default:
    # content is encoded as text, so a user cannot write a system turn)
    special_tokens_in_content: bool = False
    tree_nodes: int | None = None  # draft nodes per row as a token tree (0: chains; default: the recipe's)
    check_prices: bool = True  # adaptive depth checks its round prices against the clock (False: seeded runs repeat)
    backend: str | None = None  # onnxruntime | tensorrt (None: as load() picks, onnxruntime where the directory has it)
    # vLLM's --per-request-spec-decode-metrics: "summary" or "detailed" adds metrics.speculative_decoding
    # to every response (runtime/spec_metrics.py); None: responses as OpenAI's
    spec_metrics: str | None = None
    store_tokens: int | None = None  # a suffix drafter's store of earlier responses: its budget (0: off; None: the recipe's)

    @property
    def drafters(self) -> list[str]:
        """The drafters the server runs, the default first."""
        return list(dict.fromkeys(name.strip() for name in self.drafter.split(",") if name.strip()))

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.engine_dir).resolve().name


def refuse_recurrent_backend(manifest, engine_dir: str | Path, backend: str | None) -> None:
    """A target with linear-attention layers (Qwen3-Next, Qwen3.5: a recurrent state per row) is
    served batched on onnxruntime; the TensorRT path (device-resident caches) does not carry
    the state yet, and the build refuses to make its engines. Refused before the port opens, in
    one line, rather than with the generic "rebuild with backend: tensorrt", which cannot help.
    ``manifest``: the directory's runtime Manifest; ``backend``: the one asked for (None: the default)."""
    if backend == TENSORRT and manifest.models["target"].state is not None:
        raise BadInput(f"{engine_dir}: the target has linear-attention layers (a recurrent state per sequence), "
                       "which the TensorRT path does not carry yet; serve it on onnxruntime (leave out --backend)")
