"""Command-line flags more than one command takes, defined once (click decorators)."""
from __future__ import annotations

import click


def sampling_options(fn):
    """--max-tokens, --temperature, --top-p, --top-k, --seed, checked at the edge."""
    opts = [
        click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True),
        click.option("--temperature", type=click.FloatRange(0, 100), default=0.0,
                     show_default=True, help="0 is greedy."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
                     show_default=True),
        click.option("--top-k", type=click.IntRange(min=-1), default=0, show_default=True,
                     help="0 or -1: off."),
        click.option("--seed", type=int, default=None),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn
