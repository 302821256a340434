"""Tool calls without processes: each family's parser reads back what the family writes,
streamed in pieces of any size (no argument byte lost or repeated, a marker's start held
back, text before a call kept); the grammar llguidance compiles accepts exactly those
calls; the request's tools and tool_choice are checked with errors that name the field;
and a chat template that knows no tools gets the documented default rendering."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from pdserve.router.http.openai_schema import chat_messages
from pdserve.router.http.tool_parsers import (
    FAMILIES,
    ToolStream,
    default_family,
    grammar,
    parse,
)
from pdserve.router.http.tools import for_template, tool_plan
from pdserve.router.streams import RequestError

ARGS = '{"city": "Pa}ris \\"<tool_call>\\"", "n": [1, {"a": [2]}]}'
CALLS = [("get_weather", ARGS), ("now", "{}")]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def streamed(family, text: str, step: int) -> tuple[str, list[dict], list[dict]]:
    stream, content, entries = ToolStream(family), "", []
    for i in range(0, len(text), step):
        c, d = stream.feed(text[i:i + step], final=i + step >= len(text))
        content += c
        entries += d
    return content, entries, stream.calls


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_every_split_reads_back_the_calls(name, step):
    family = FAMILIES[name]
    before = "Let me check <tool" if family.open else ""
    text = before + family.write(CALLS)
    content, entries, calls = streamed(family, text, step)
    assert content == before
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == CALLS
    # OpenAI's stream: a call's first entry is its head (id, type, name, arguments ""),
    # then only argument pieces of that index, which join into the whole arguments.
    heads = [e for e in entries if "id" in e]
    assert [(h["index"], h["type"], h["function"]) for h in heads] == \
        [(i, "function", {"name": n, "arguments": ""}) for i, (n, _) in enumerate(CALLS)]
    assert [h["id"] for h in heads] == [c["id"] for c in calls]
    for i, (_, args) in enumerate(CALLS):
        pieces = [e["function"]["arguments"] for e in entries
                  if e["index"] == i and "id" not in e]
        assert "".join(pieces) == args and set(pieces[0]) <= set(args)
        assert all(set(e) == {"index", "function"} for e in entries
                   if e["index"] == i and "id" not in e)
    assert parse(family, text)[0] == before


def test_text_that_only_looks_like_a_marker_is_released():
    stream = ToolStream(FAMILIES["hermes"])
    assert stream.feed("a <tool_c") == ("a ", [])       # may open a call: held
    assert stream.feed("ar>") == ("<tool_car>", [])     # it did not
    assert stream.feed("x <tool", final=True) == ("x <tool", [])
    assert parse(FAMILIES["llama3"], "Hello {json}") == ("Hello {json}", [])


@pytest.fixture(scope="module")
def smollm2():
    """The bundled model's tokenizer, as a node's grammar sees it (engine/grammar.py)."""
    from llguidance import LLTokenizer

    from pdserve.model.default_model import bundled_model
    from pdserve.model.tokenizer import Tokenizer

    path, why = bundled_model()
    if path is None:
        pytest.skip(f"the bundled model is not installed: {why}")
    tok = Tokenizer(path)
    return tok, LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size, eos_token=2)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_grammar_accepts_the_calls_and_nothing_else(name, smollm2):
    family, (tok, lltok) = FAMILIES[name], smollm2
    schemas = [("get_weather", WEATHER),
               ("now", {"type": "object", "properties": {}, "additionalProperties": False})]

    def accepts(forced, parallel, text) -> bool:
        g = LLMatcher.grammar_from_lark(grammar(family, schemas, forced, parallel))
        assert not LLMatcher.validate_grammar_with_warnings(g)[0]
        m = LLMatcher(lltok, g, log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) \
            and m.is_accepting()

    one = family.write([("get_weather", '{"city": "Paris"}')])
    two = family.write([("get_weather", '{"city": "Paris"}'), ("now", "{}")])
    assert accepts("", False, one) and accepts("get_weather", False, one)
    assert not accepts("now", False, one)
    assert not accepts("", False, two) and accepts("", True, two)
    assert not accepts("", False, family.write([("get_weather", '{"town": "Paris"}')]))
    assert not accepts("", False, family.write([("other", "{}")]))
    assert accepts(None, False, "Plain text.") and accepts(None, True, two)
    assert not accepts(None, False, two)
    if family.open:
        assert accepts(None, False, "Sure. " + one)
        assert not accepts(None, False, "Sure. " + one + " more")


def test_default_family_follows_the_template():
    assert default_family(None).name == "hermes"
    assert default_family("{{ '<tool_call>' }}").name == "hermes"
    assert default_family("{{ '<|python_tag|>' }}").name == "llama3"
    assert default_family("{{ '[TOOL_CALLS]' }}").name == "mistral"


@pytest.mark.parametrize("body, param, why", [
    ({"tools": {"a": 1}}, "tools", "must be an array"),
    ({"tools": [{"type": "function", "function": {"name": "x"}}] * 10_000}, "tools",
     "at most 128"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "letters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]},
     "tools[0].function.parameters", "JSON schema object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be none"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tools_name_the_field(body, param, why):
    with pytest.raises(RequestError) as err:
        tool_plan(body, None, None)
    assert err.value.param == param and why in err.value.message, err.value.message


def test_tool_choice_defaults_and_forms():
    assert tool_plan({}, None, None) is None
    auto = tool_plan({"tools": TOOLS}, None, None)
    assert (auto.choice, auto.forced, auto.parallel) == ("auto", None, False)
    named = tool_plan({"tools": TOOLS, "parallel_tool_calls": True, "tool_choice": {
        "type": "function", "function": {"name": "now"}}}, "mistral", None)
    assert (named.choice, named.forced, named.parallel, named.family.name) == \
        ("function", "now", True, "mistral")
    assert named.schemas[1] == ("now", {"type": "object", "properties": {},
                                        "additionalProperties": False})
    assert tool_plan({"tools": TOOLS, "tool_choice": "none"}, None, None).stream() is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_messages_with_calls_and_results_are_checked():
    checked = chat_messages(CONVERSATION)
    assert checked[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert checked[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    for messages, param in [
            (CONVERSATION[:1] + [{**CONVERSATION[2], "tool_call_id": "call_9"}],
             "messages[1].tool_call_id"),
            ([CONVERSATION[0], {"role": "tool", "content": "x"}], "messages[1].tool_call_id"),
            ([{**CONVERSATION[1], "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": "not json"}}]}],
             "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(RequestError) as err:
            chat_messages(messages)
        assert err.value.param == param, err.value.message


def test_the_default_rendering_of_a_template_that_knows_no_tools():
    messages, tools = for_template(chat_messages(CONVERSATION), TOOLS, "{{ messages }}")
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2]["content"] == \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>"
    # A template that knows tools gets them as transformers passes them, messages as given.
    knows = "{% for t in tools %}{{ t | tojson }}{% endfor %}"
    assert for_template(chat_messages(CONVERSATION), TOOLS, knows) == \
        (chat_messages(CONVERSATION), TOOLS)
    # No tools anywhere: the messages are untouched.
    plain = [{"role": "user", "content": "hi"}]
    assert for_template(plain, None, "{{ messages }}") == (plain, None)
