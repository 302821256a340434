"""A config dataclass field that is also a command-line flag, written once.

    block_size: int = flag(16, "Tokens per KV block.", min=1)

The field's metadata holds the flag's name, help, range or choices; ``check_fields``
checks a config against them (each config's ``__post_init__`` calls it, so a value that
did not come through the CLI is held to the same rule), and cli_config.py builds the
click options from them. No click here: the configs are imported by processes that
parse no flags.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    ``name`` defaults to ``--field-name``; a bool field with default True becomes the pair
    ``--name/--no-name``, one with default False a plain switch. ``kind``: "path" (must
    exist), "dir" (an existing folder) or "json" (the field's type is built from the text
    by its ``from_json``). ``default_text`` is what help shows as the default when the
    value itself says little (None, or a value the CLI derives). ``roles``: the node roles
    that take it (None: every role)."""
    help: str = ""
    name: str | None = None
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    choices: tuple | None = None
    kind: str | None = None
    roles: tuple[str, ...] | None = None
    default_text: str | None = None
    envvar: str | None = None
    metavar: str | None = None

    def range_text(self) -> str:
        """The range as words: "in [0, 65535]", "> 0", ">= 1" ("" when unbounded)."""
        if self.min is not None and self.max is not None:
            return f" in [{self.min:g}, {self.max:g}]"
        if self.min is not None:
            return f" {'>' if self.min_open else '>='} {self.min:g}"
        return "" if self.max is None else f" <= {self.max:g}"


def flag(default: Any = dataclasses.MISSING, help: str = "", *, repr: bool = True,
         **spec) -> Any:
    """A dataclass field with its flag (see ``Flag`` for ``spec``)."""
    return dataclasses.field(default=default, repr=repr, metadata={"flag": Flag(help, **spec)})


def flags_of(config_class) -> list[tuple[dataclasses.Field, Flag, type]]:
    """(field, Flag, the field's type without None) of every field that has a flag."""
    hints = typing.get_type_hints(config_class)
    return [(f, f.metadata["flag"], _non_none(hints[f.name]))
            for f in dataclasses.fields(config_class) if "flag" in f.metadata]


def _non_none(tp) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def check_fields(config) -> None:
    """ValueError naming the field and what is allowed, for a value outside its flag's
    choices or range, or of the wrong type."""
    for f, spec, tp in flags_of(type(config)):
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        if spec.choices is not None:
            if value not in spec.choices:
                raise ValueError(f"{f.name} must be one of {spec.choices}, got {value!r}")
        elif tp in (int, float):
            _check_number(f.name, value, spec, tp is int)


def _check_number(name: str, value, spec: Flag, is_int: bool) -> None:
    numeric = (int,) if is_int else (int, float)
    ok = isinstance(value, numeric) and not isinstance(value, bool) and (
        is_int or math.isfinite(value))
    if ok and spec.min is not None:
        ok = value > spec.min if spec.min_open else value >= spec.min
    if ok and spec.max is not None:
        ok = value <= spec.max
    if not ok:
        what = "an integer" if is_int else "a finite number"
        raise ValueError(f"{name} must be {what}{spec.range_text()}, got {value!r}")
