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

import itertools
import json
import re

GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GUIDE_BYTES = 256 * 1024   # a guide's spec on the wire and in the compile cache
# Checked before any parser or compiler sees a spec: llguidance segfaults on ~3,000
# chained Lark rules (2,000 pass, in 50 ms), Python's json.loads raises RecursionError
# near 1,000 levels, and compile time grows with a schema's objects (1,000: 65 ms in
# the router, 10,000: seconds in every node's compute loop).
MAX_GUIDE_DEPTH = 64           # nested brackets ({[( outside strings) in any spec
MAX_SCHEMA_OBJECTS = 1000      # JSON objects in a schema (each property's is one)
MAX_GRAMMAR_RULES = 1000       # rule and terminal definitions in a Lark/GBNF grammar
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' "|" r"'(?:[^'\\]|\\.)*'")
_ESCAPED = re.compile(r"\\.")
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w]*(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_OPEN, _CLOSE = "{[(", "}])"
# JSON is written compactly with Python's separators and no free whitespace: a small or
# undertrained model let loose on "any whitespace" may emit it forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of a guide; ValueError saying why it has none."""
    from llguidance import LLMatcher

    check_guide_size(kind, spec)
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


def check_guide_size(kind: str, spec: str) -> None:
    """ValueError naming the limit a spec is over: size, nesting depth, and a schema's
    objects or a grammar's rules. Linear in the spec and recursion-free, so no parser or
    compiler meets a spec that would crash it or stall a loop."""
    if len(spec.encode()) > MAX_GUIDE_BYTES:
        raise ValueError(f"the {kind} spec is over {MAX_GUIDE_BYTES} bytes "
                         f"(MAX_GUIDE_BYTES)")
    if kind == "json_object":
        return
    # Quoted text holds no structure (JSON strings, Lark/GBNF literals); in a regex an
    # escaped bracket is a plain character and its quotes are too.
    if kind == "regex":
        bare = _ESCAPED.sub("", spec)
    else:
        bare = (_JSON_STRING if kind == "json" else _STRING).sub("", spec)
    steps = (1 if ch in _OPEN else -1 for ch in bare if ch in _OPEN or ch in _CLOSE)
    depth = max(itertools.accumulate(steps, initial=0))
    if depth > MAX_GUIDE_DEPTH:
        raise ValueError(f"the {kind} spec nests {depth} deep; at most {MAX_GUIDE_DEPTH} "
                         f"(MAX_GUIDE_DEPTH)")
    if kind == "json" and bare.count("{") > MAX_SCHEMA_OBJECTS:
        raise ValueError(f"the JSON schema has {bare.count('{')} objects; at most "
                         f"{MAX_SCHEMA_OBJECTS} (MAX_SCHEMA_OBJECTS)")
    if kind == "grammar":
        rules = bare.count("::=") + len(_LARK_RULE.findall(bare))
        if rules > MAX_GRAMMAR_RULES:
            raise ValueError(f"the grammar has {rules} rules; at most {MAX_GRAMMAR_RULES} "
                             f"(MAX_GRAMMAR_RULES)")


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
