"""Structured output guides as the user hands them in: each kind (vLLM's
``structured_outputs`` fields) turned into an llguidance grammar, and a check of a guide
that needs no vocabulary, so the router refuses a bad guide at the edge and a node
compiles the same grammar (engine/grammar.py: why llguidance, and the token masks).

Kinds: ``json`` (a JSON schema as text), ``json_object`` (any JSON object; spec unused),
``regex``, ``choice`` (a JSON array of strings: the output is exactly one of them) and
``grammar`` (Lark, as vLLM's guidance backend takes it; a GBNF grammar, written with
``::=``, is converted).
"""
from __future__ import annotations

import json

GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GUIDE_BYTES = 256 * 1024   # a guide's spec on the wire and in the compile cache
# JSON is written compactly with Python's separators and no free whitespace: a small or
# undertrained model let loose on "any whitespace" may emit it forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of a guide; ValueError saying why it has none."""
    from llguidance import LLMatcher

    if len(spec.encode()) > MAX_GUIDE_BYTES:
        raise ValueError(f"the {kind} spec is over {MAX_GUIDE_BYTES} bytes")
    if kind == "json":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object (or true/false)")
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("choice must be a non-empty array of non-empty strings")
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        if "::=" in spec:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                spec = gbnf_to_lark(spec)
            except Exception as exc:  # the converter raises bare exceptions on bad input
                raise ValueError(f"the GBNF grammar cannot be read: {exc}") from None
        return LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown structured output kind {kind!r}; known: {GUIDE_KINDS}")


def guide_problem(kind: str, spec: str) -> str | None:
    """Why the guide cannot be served (unsupported or invalid), or None; no vocabulary
    needed, so the router checks every guide before dispatch."""
    from llguidance import LLMatcher

    try:
        grammar = to_grammar(kind, spec)
    except ValueError as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None
