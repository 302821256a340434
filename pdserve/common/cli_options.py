"""Command-line flags more than one command takes, defined once (click decorators)."""
from __future__ import annotations

import click
import msgspec

from pdserve.common.sampling import SamplingParams

_SAMPLING = {f.name: f.type for f in msgspec.inspect.type_info(SamplingParams).fields}


def _range(name: str) -> click.ParamType:
    """The click type of SamplingParams' field ``name``, with its limits (so a flag out of
    range is refused by click, naming the flag, with the range SamplingParams has)."""
    t = _SAMPLING[name]
    t = t.types[0] if isinstance(t, msgspec.inspect.UnionType) else t  # Optional[...]
    t = getattr(t, "type", t)                                            # Metadata(...)
    if isinstance(t, msgspec.inspect.IntType):
        return click.IntRange(t.ge if t.ge is not None else t.gt + 1,
                              t.le if t.le is not None else t.lt - 1)
    return click.FloatRange(t.ge if t.ge is not None else t.gt,
                            t.le if t.le is not None else t.lt,
                            min_open=t.gt is not None, max_open=t.lt is not None)


def sampling_options(fn):
    """--max-tokens, --temperature, --top-p, --top-k, --seed, checked at the edge."""
    opts = [
        click.option("--max-tokens", type=_range("max_tokens"), default=64, show_default=True),
        click.option("--temperature", type=_range("temperature"), default=0.0,
                     show_default=True, help="0 is greedy."),
        click.option("--top-p", type=_range("top_p"), default=1.0, show_default=True),
        click.option("--top-k", type=_range("top_k"), default=0, show_default=True,
                     help="0 or -1: off."),
        click.option("--seed", type=_range("seed"), default=None),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn
