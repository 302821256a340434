"""A frozen config dataclass as JSON and back: how ``pdserve launch`` hands each child
process its whole config, built and checked once in the launcher, instead of turning it
back into flags for the child to parse again.

It travels in the child's environment, not its argv: argv is visible to every user of the
machine, and the router's config holds its API key.
"""
from __future__ import annotations

import dataclasses
import json
import os

ENV = "PDSERVE_CONFIG"


def child_env(config, log_level: str) -> dict[str, str]:
    """This process's environment plus ``config`` (and the log level) for a child."""
    text = json.dumps({"log_level": log_level, "config": dataclasses.asdict(config)})
    return {**os.environ, ENV: text}


def from_env(config_class, nested: dict[str, type] | None = None):
    """(config, log_level) from $PDSERVE_CONFIG; ``nested``: the fields that are config
    dataclasses themselves. ValueError if it is missing or does not fit ``config_class``."""
    text = os.environ.get(ENV)
    if text is None:
        raise ValueError(f"--config-env: ${ENV} is not set (pdserve launch sets it)")
    raw = json.loads(text)
    return _build(config_class, raw["config"], nested or {}), raw["log_level"]


def _build(config_class, data: dict, nested: dict[str, type]):
    try:
        return config_class(**{name: _build(nested[name], value, {})
                               if name in nested and value is not None else value
                               for name, value in data.items()})
    except TypeError as exc:  # a field this version does not know
        raise ValueError(f"${ENV} does not fit {config_class.__name__}: {exc}") from None
