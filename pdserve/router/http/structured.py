"""The request fields of the logits-processing stage (engine/logits_processors.py), read and
checked at the edge as vLLM takes them: penalties, logit_bias, min_tokens and structured
output (``response_format``, ``structured_outputs``, the older ``guided_*`` fields). A guide
is validated here, before dispatch, so an unsupported schema is a 400 that says why."""
from __future__ import annotations

import json

from pdserve.common.guides import guide_problem
from pdserve.router.streams import BAD_REQUEST, RequestError

# structured_outputs' constraint fields -> our guide kind (exactly one may be set)
_CONSTRAINTS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                "json_object": "json_object"}
# its other fields -> the values that change nothing; anything else is refused
_OPTIONS = {"disable_fallback": (False, True), "disable_any_whitespace": (False, True),
            "disable_additional_properties": (False,), "whitespace_pattern": (),
            "structural_tag": ()}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _bad(message: str, param: str) -> RequestError:
    return RequestError(BAD_REQUEST, message, param)


# The body fields that are SamplingParams' own, taken as they are: its types, limits and
# defaults apply (absent or null: its default).
SAMPLING_FIELDS = ("min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty")


def logits_processing(body: dict) -> dict:
    """SamplingParams keyword arguments of the logits-processing fields of ``body``."""
    out = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if body.get("logit_bias") is not None:
        out["logit_bias"] = _logit_bias(body["logit_bias"])
    guide = _guide(body)
    if guide is not None:
        out["guide"] = guide
    return out


def _logit_bias(raw) -> dict:
    """The map with its keys as token ids: JSON object keys are strings (the one way the
    HTTP form differs from SamplingParams'); the ids' and biases' limits are its."""
    if not isinstance(raw, dict):
        raise _bad(f"logit_bias must be an object, got {json.dumps(raw)[:60]}", "logit_bias")
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise _bad(f"logit_bias keys must be token ids (integers as strings), got "
                       f"{key!r}", "logit_bias") from None
    return bias


# The body's own note that its guide was checked off the event loop (vet_guide): an
# object, so that no JSON key can forge it.
_VETTED = object()


async def vet_guide(body: dict, checker) -> None:
    """Checks the body's guide in ``checker`` (router/guide_check.py: child processes
    under a deadline), before the synchronous parse, which then trusts the verdict."""
    found = find_guide(body)
    if found is not None:
        param, kind, spec = found
        problem = await checker.problem(kind, spec)
        if problem:
            raise _bad(f"{param} cannot be used: {problem}", param)
        body[_VETTED] = (kind, spec)


def _guide(body: dict) -> tuple[str, str] | None:
    """The request's one structured-output constraint as (kind, spec), checked."""
    found = find_guide(body)
    if found is None:
        return None
    param, kind, spec = found
    if body.get(_VETTED) != (kind, spec):
        problem = guide_problem(kind, spec)
        if problem:
            raise _bad(f"{param} cannot be used: {problem}", param)
    return kind, spec


def find_guide(body: dict) -> tuple[str, str, str] | None:
    """The request's one structured-output constraint as (param, kind, spec), unchecked."""
    found = []  # (param, kind, value)
    fmt = body.get("response_format")
    if fmt is not None:
        found += _response_format(fmt)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs must be an object", "structured_outputs")
        for name, value in so.items():
            if name in _CONSTRAINTS:
                if value is not None and value is not False:
                    found.append((f"structured_outputs.{name}", _CONSTRAINTS[name], value))
            elif name not in _OPTIONS:
                raise _bad(f"structured_outputs.{name} is not a field of structured_outputs; "
                           f"known: {', '.join([*_CONSTRAINTS, *_OPTIONS])}",
                           f"structured_outputs.{name}")
            elif value is not None and not any(value is v for v in _OPTIONS[name]):
                raise _bad(f"structured_outputs.{name}={json.dumps(value)} is not supported by "
                           "this server; leave it out", f"structured_outputs.{name}")
    found += [(name, kind, body[name]) for name, kind in _GUIDED.items()
              if body.get(name) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise _bad("only one structured output constraint is allowed per request; got "
                   + ", ".join(param for param, _, _ in found), found[1][0])
    param, kind, value = found[0]
    return param, kind, _spec_text(param, kind, value)


def _response_format(fmt) -> list[tuple[str, str, object]]:
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
        raise _bad(f"response_format must be an object with type one of {', '.join(kinds)} "
                   f"(structural_tag is not supported); got {json.dumps(fmt)[:80]}",
                   "response_format")
    if fmt["type"] == "text":
        return []
    if fmt["type"] == "json_object":
        return [("response_format", "json_object", True)]
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise _bad("response_format.json_schema must be an object {name, schema, strict}",
                   "response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise _bad("response_format.json_schema.schema must be a JSON schema object",
                   "response_format.json_schema.schema")
    return [("response_format.json_schema.schema", "json", schema)]


def _spec_text(param: str, kind: str, value) -> str:
    """The guide's spec as the wire carries it (a string)."""
    if kind == "json_object":
        return ""
    if kind == "json":
        if isinstance(value, str):
            return value
        if isinstance(value, (dict, bool)):
            return json.dumps(value)
        raise _bad(f"{param} must be a JSON schema (an object or its JSON text)", param)
    if kind == "choice":
        if not (isinstance(value, list) and value
                and all(isinstance(c, str) and c for c in value)):
            raise _bad(f"{param} must be a non-empty array of non-empty strings", param)
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise _bad(f"{param} must be a non-empty string", param)
    return value
