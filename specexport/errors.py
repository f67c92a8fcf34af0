"""Errors shared by the exporter, the runtime and the CLI.

The CLI turns these into one line on stderr and an exit code; nothing else should print a
traceback for a problem the user can fix.
"""

import importlib.util

from specexport.backends import BACKENDS


class SpecexportError(Exception):
    """A failure reported to the user as one line. ``exit_code`` is what the CLI returns."""

    exit_code = 1


class BadInput(SpecexportError):
    """The user's input (recipe, path, argument, engine directory) is wrong: exit code 2."""

    exit_code = 2


class MissingDependency(BadInput):
    """An optional package is not installed; the message names the extra or pip command."""


def missing_extra(package: str, extra: str) -> MissingDependency:
    return MissingDependency(
        f"{package} is not installed: pip install 'specexport[{extra}]'"
    )


# The optional packages commands import when they run, and the extra that installs each
# (pyproject.toml; tests/test_packaging.py keeps the two in step).
EXTRA_OF_MODULE = {
    **{package: b.extra for b in BACKENDS.values() for package in b.packages},
    **dict.fromkeys(("torch", "transformers", "onnx", "onnxscript", "safetensors", "gguf", "accelerate"), "export"),
    **dict.fromkeys(("fastapi", "uvicorn", "prometheus_client", "httpx"), "serve"),
    "ray": "ray",
    "matplotlib": "bench",
    "jsonschema": "bench",
    "llguidance": "structured",
}


def missing_module(err: BaseException) -> MissingDependency | None:
    """The one-line error for an optional package a command failed to import; None for
    anything else (a real internal error)."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    package = err.name.split(".")[0]
    extra = EXTRA_OF_MODULE.get(package)
    if extra is None or importlib.util.find_spec(package) is not None:  # installed: a broken install
        return None
    return missing_extra(package, extra)
