"""Click options generated from the config dataclasses' fields, and the configs built back
from parsed flags. A flag is written once, as its field (common/config_fields.py): name,
help, default, range and choices; cli.py puts the generated groups on its commands."""
from __future__ import annotations

import dataclasses

import click

from pdserve.common.config_fields import Flag, flags_of
from pdserve.common.logs import DEFAULT_LEVEL
from pdserve.common.logs import LEVELS as LOG_LEVELS
from pdserve.engine.config import COMPUTE_MODES, DTYPES, EngineConfig
from pdserve.node.config import NodeConfig
from pdserve.router.config import RouterConfig

__all__ = ["COMPUTE_MODES", "DTYPES", "EngineConfig", "NodeConfig", "RouterConfig"]


def default_of(config_class, name: str):
    """A config dataclass field's default: each default is written once, in the dataclass."""
    return config_class.__dataclass_fields__[name].default


def _click_type(spec: Flag, tp: type):
    if spec.choices is not None:
        return click.Choice(spec.choices)
    if spec.kind == "path":
        return click.Path(exists=True)
    if spec.kind == "dir":
        return click.Path(exists=True, file_okay=False)
    if tp is int and (spec.min is not None or spec.max is not None):
        return click.IntRange(spec.min, spec.max, min_open=spec.min_open)
    if tp is float and (spec.min is not None or spec.max is not None):
        return click.FloatRange(spec.min, spec.max, min_open=spec.min_open)
    return tp if tp in (int, float) else None


def option_of(field: dataclasses.Field, spec: Flag, tp: type):
    """The click option of one config field; its parameter is the field's name."""
    name = spec.name or "--" + field.name.replace("_", "-")
    if tp is bool and field.default is True:
        decls = [f"{name}/--no-{name[2:]}", field.name]
    else:
        decls = [name, field.name]
    kw = dict(help=f"{spec.help} [default: {spec.default_text}]" if spec.default_text
              else spec.help)
    if tp is bool:
        kw.update(default=field.default, show_default=field.default is True,
                  is_flag=True)
    else:
        kw.update(type=_click_type(spec, tp), envvar=spec.envvar, metavar=spec.metavar or (
            "JSON" if spec.kind == "json" else None))
        # A default_text stands for a value the config (or the CLI) derives: the flag's
        # own default is then None, "not given".
        kw.update(default=None if spec.default_text else field.default,
                  show_default=not spec.default_text)
    return click.option(*decls, **kw)


def options(config_class, *, role: str | None = None, skip=(), only=None):
    """A decorator adding the options of ``config_class``'s flag fields, in field order;
    ``role``: only the fields that node role takes; ``skip`` / ``only``: field names."""
    opts = [option_of(f, spec, tp) for f, spec, tp in flags_of(config_class)
            if f.name not in skip and (only is None or f.name in only)
            and (role is None or spec.roles is None or role in spec.roles)]

    def decorate(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn
    return decorate


def from_flags(config_class, kw: dict, **fixed):
    """A config from its flags, popped from ``kw``: a flag left at None means the field's
    own default; a ``kind="json"`` flag is parsed by its type's ``from_json``. A bad value
    is a UsageError naming the field."""
    values = dict(fixed)
    for f, spec, tp in flags_of(config_class):
        value = kw.pop(f.name, None)
        if value is not None and f.name not in fixed:
            values[f.name] = flag_value(spec, tp, value)
    try:
        return config_class(**values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def flag_value(spec: Flag, tp: type, value):
    """A parsed flag's value as its field takes it (a UsageError if its JSON is bad)."""
    if spec.kind != "json" or value is None:
        return value
    try:
        return tp.from_json(value)
    except ValueError as exc:
        raise click.UsageError(f"{spec.name}: {exc}") from exc


log_level_option = click.option("--log-level", type=click.Choice(LOG_LEVELS),
                                default=DEFAULT_LEVEL, show_default=True)

config_env_option = click.option(
    "--config-env", is_flag=True, hidden=True,
    help="Take the whole config from $PDSERVE_CONFIG (JSON), as pdserve launch hands it to "
         "its children; the other flags are not read.")

engine_options = options(EngineConfig)


def node_options(role: str):
    """The flags of ``pdserve ROLE``: the engine's, then the node's for that role."""
    def decorate(fn):
        fn = config_env_option(log_level_option(options(NodeConfig, role=role)(fn)))
        return engine_options(fn)
    return decorate


def router_options(fn):
    """Flags of the router; `launch` takes them too."""
    return options(RouterConfig)(log_level_option(fn))


def engine_config(kw: dict) -> EngineConfig:
    """An EngineConfig from the engine flags (popped from kw)."""
    return from_flags(EngineConfig, kw)


def router_config(kw: dict) -> RouterConfig:
    """A RouterConfig from the router flags (popped from kw). --control and --ingress
    default to the HTTP host's interface; --ingress none turns the ingress off."""
    host = kw.get("host") or default_of(RouterConfig, "host")
    bind_host = "*" if host in ("0.0.0.0", "*") else host
    kw["control"] = kw.get("control") or f"tcp://{bind_host}:5556"
    ingress = kw.get("ingress") or f"tcp://{bind_host}:5557"
    kw["api_key"] = kw.get("api_key") or None
    return from_flags(RouterConfig, kw, ingress=None if ingress == "none" else ingress)


def node_config(role: str, kw: dict) -> tuple[NodeConfig, str]:
    """(NodeConfig, log level) from a node command's flags."""
    log_level = kw.pop("log_level")
    kw.pop("config_env", None)
    return from_flags(NodeConfig, kw, role=role, engine=engine_config(kw)), log_level
