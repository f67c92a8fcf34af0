"""`generate`'s options for what a request asks of its output beyond sampling: penalties and
biases, min-p, a grammar (structured output), logprobs. The server takes the same as request
fields (specexport/serve/protocol.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from specexport.errors import BadInput


def output_options(command):
    """Add the options to a click command; it receives them as ``controls`` (a runtime Controls)
    and ``min_p``."""
    options = [
        click.option("--min-p", type=float, default=0.0, show_default=True,
                     help="Keep tokens at least this fraction as likely as the most likely (0 is off)."),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                     help="Divide (multiply, if negative) the logit of every token seen in prompt or output."),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     help="Subtract this times each token's count in the output (-2..2)."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     help="Subtract this from every token already in the output (-2..2)."),
        click.option("--logit-bias", multiple=True, metavar="TOKEN=BIAS",
                     help="Add BIAS (-100..100) to token id TOKEN's logit (repeatable)."),
        click.option("--min-tokens", type=click.IntRange(0), default=0, show_default=True,
                     help="No end-of-sequence before this many tokens."),
        click.option("--json-schema", type=click.Path(path_type=Path), default=None,
                     help="Constrain the output to JSON valid under the schema in this file."),
        click.option("--regex", default=None, help="Constrain the output to match this regular expression."),
        click.option("--choice", multiple=True, help="Constrain the output to one of these strings (repeatable)."),
        click.option("--grammar", type=click.Path(path_type=Path), default=None,
                     help="Constrain the output to this Lark (or GBNF) grammar file."),
        click.option("--logprobs", type=click.IntRange(0, 20), default=None,
                     help="Report each token's log probability and the K most likely (in --json output)."),
    ]

    @functools.wraps(command)
    def wrapped(*args, min_p, repetition_penalty, frequency_penalty, presence_penalty, logit_bias, min_tokens,
                json_schema, regex, choice, grammar, logprobs, **kwargs):
        controls = build_controls(repetition_penalty, frequency_penalty, presence_penalty, logit_bias, min_tokens,
                                  json_schema, regex, choice, grammar, logprobs)
        return command(*args, controls=controls, min_p=min_p, **kwargs)

    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped


def build_controls(repetition: float, frequency: float, presence: float, logit_bias: tuple[str, ...],
                   min_tokens: int, json_schema: Path | None, regex: str | None, choice: tuple[str, ...],
                   grammar: Path | None, logprobs: int | None):
    from specexport.runtime.grammar import GrammarSpec
    from specexport.runtime.rules import Controls, Penalties

    bias = {}
    for item in logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise BadInput(f"--logit-bias: '{item}' is not TOKEN=BIAS (a token id and a number)") from None
    specs = []
    if json_schema is not None:
        specs.append(GrammarSpec("json_schema", _read(json_schema, "--json-schema"), f"--json-schema {json_schema}"))
    if regex is not None:
        specs.append(GrammarSpec("regex", regex, "--regex"))
    if choice:
        specs.append(GrammarSpec("choice", json.dumps(list(choice)), "--choice"))
    if grammar is not None:
        specs.append(GrammarSpec("grammar", _read(grammar, "--grammar"), f"--grammar {grammar}"))
    if len(specs) > 1:
        raise BadInput(f"give one of --json-schema, --regex, --choice, --grammar (got {', '.join(s.field for s in specs)})")
    return Controls(Penalties(repetition, frequency, presence, bias, min_tokens), specs[0] if specs else None, logprobs)


def _read(path: Path, option: str) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise BadInput(f"{option}: cannot read {path} ({err.strerror})") from None
