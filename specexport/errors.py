"""Errors shared by the exporter, the runtime and the CLI.

The CLI turns these into one line on stderr and an exit code; nothing else should print a
traceback for a problem the user can fix.
"""


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
