"""Tool calling on /v1/chat/completions as the clients people use see it, against `pdserve
launch` on the bundled SmolLM2-135M-Instruct (1 prefill, 2 decode nodes): the openai
client's tools streamed and not, in OpenAI's exact stream shape; LangChain's bind_tools and
with_structured_output; LiteLLM with tools; an openai-agents Agent through chat
completions; a conversation with a tool result; bad tools refused with an error naming
the field while the server goes on serving; and a decode node SIGKILLed while a call's
arguments stream, which still gives the arguments whole, once, equal to a run without the
fault. Greedy decoding throughout, so runs are comparable; the dtype a user gets
(tests/cluster.py, USERS_DTYPE)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from pdserve.model.default_model import bundled_model
from tests.cluster import USERS_DTYPE, launched
from tests.e2e.test_structured_output import decode_steps, kill_busy_decode_node

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, why = bundled_model()
    if path is None:
        pytest.skip(f"the bundled model is not installed: {why}")
    # Three SmolLM2 processes on a shared 2-core host: a 3 s heartbeat window, not 1.5 s
    # (once, under a load of 8, every node was declared dead just after start).
    with launched(path, 1, 2, *USERS_DTYPE, log_dir=tmp_path_factory.mktemp("launch"),
                  heartbeat=1.0) as c:
        yield c


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return httpx.get(cluster.http_url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=300)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def ask(client, model, **kw):
    return client.chat.completions.create(model=model, messages=kw.pop("messages", ASK),
                                          tools=kw.pop("tools", TOOLS), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 80), **kw)


def test_named_and_required_calls(client, model):
    for choice in (named("get_weather"), "required"):
        r = ask(client, model, tool_choice=choice)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        (call,) = msg.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"  # the one that fits the question
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    # n choices: each its own parser and its own call.
    r = ask(client, model, tool_choice="required", n=2)
    assert [c.message.tool_calls[0].function.name for c in r.choices] == ["get_weather"] * 2
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    # A tool without parameters is called with {} (never an empty or missing arguments).
    r = ask(client, model, tool_choice=named("get_time"))
    assert r.choices[0].message.tool_calls[0].function.arguments == "{}"


def sse_chunks(cluster, body: dict) -> list[dict]:
    with httpx.stream("POST", cluster.http_url + "/v1/chat/completions", json=body,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_streamed_call_is_in_openais_exact_shape(cluster, client, model):
    want = ask(client, model, tool_choice=named("get_weather")).choices[0].message
    chunks = sse_chunks(cluster, {
        "model": model, "messages": ASK, "tools": TOOLS, "tool_choice": named("get_weather"),
        "temperature": 0, "max_tokens": 80, "stream": True,
        "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    head = calls[0][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [e for entries in calls[1:] for e in entries]
    assert len(pieces) > 1 and all(e.keys() == {"index", "function"} and e["index"] == 0
                                   and e["function"].keys() == {"arguments"} for e in pieces)
    args = "".join(e["function"]["arguments"] for e in pieces)
    assert args == want.tool_calls[0].function.arguments   # greedy: the same call
    assert not any(d.get("content") for d in deltas[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    # The openai client's own stream reading gets the same call.
    stream = ask(client, model, tool_choice="required", stream=True)
    got = {}
    for chunk in stream:
        for e in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got.setdefault(e.index, {"name": e.function.name, "arguments": ""})
            got[e.index]["arguments"] += e.function.arguments or ""
    assert list(got.values()) == [{"name": "get_weather", "arguments": args}]


def test_auto_answers_text_or_a_valid_call_streamed_as_not(cluster, client, model):
    for prompt in ("What is the weather in Paris?", "Hi! Tell me a joke.",
                   "What time is it?"):
        messages = [{"role": "user", "content": prompt}]
        r = ask(client, model, messages=messages, tool_choice="auto", max_tokens=60)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        if msg.tool_calls:
            assert finish == "tool_calls"
            for call in msg.tool_calls:
                schema = WEATHER if call.function.name == "get_weather" else \
                    {"type": "object", "maxProperties": 0}
                jsonschema.validate(json.loads(call.function.arguments), schema)
        else:
            assert finish in ("stop", "length") and "<tool_call>" not in msg.content
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(
            client, model, messages=messages, tool_choice="auto", max_tokens=60,
            stream=True) if c.choices)
        assert streamed == (msg.content or "")


def test_a_conversation_with_a_tool_result_goes_on_in_text(cluster, client, model):
    call = ask(client, model, tool_choice=named("get_weather")).choices[0].message
    messages = ASK + [call.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                       "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = ask(client, model, messages=messages, tool_choice="none", max_tokens=40)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    # /tokenize counts the prompt as the request rendered it: the tools included.
    count = httpx.post(cluster.http_url + "/tokenize", json={
        "messages": messages, "tools": TOOLS}).json()["count"]
    assert count == r.usage.prompt_tokens
    assert httpx.post(cluster.http_url + "/tokenize", json={
        "messages": messages}).json()["count"] < count


@pytest.mark.parametrize("extra, param, why", [
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strnig"}}}]},
     "tools[0].function.parameters", "Invalid type: strnig"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {
        "name": "g", "parameters": {"type": "object", "required": "city"}}}]},
     "tools[1].function.parameters", "Expected array for 'required'"),
    ({"tool_choice": named("nope")}, "tool_choice", "not in tools"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages[1].tool_call_id", "matches no tool call"),
    ({"tools": [TOOLS[1]] * 10_000}, "tools", "at most 128"),
    ({"response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
])
def test_bad_tools_are_a_400_naming_the_field(client, model, extra, param, why):
    body = {"messages": ASK, "tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, max_tokens=5, **body)
    assert err.value.body["param"] == param and why in err.value.body["message"], \
        err.value.body


def test_hostile_tools_do_not_stall_other_requests(cluster, client, model):
    """10,000 tools and a schema nested 1,000 deep, sent over and over, while another
    request runs: each is refused and the other request completes."""
    deep = '{"type": "object", "properties": {"a": ' * 1000 + "{}" + "}}" * 1000
    tools_10k = json.dumps([{"type": "function", "function": {"name": f"f{i}"}}
                            for i in range(10_000)])
    head = f'{{"model": "{model}", "messages": {json.dumps(ASK)}, "tools": '
    bodies = [head + tools_10k + "}", head + '[{"type": "function", "function": {"name": '
              '"deep", "parameters": ' + deep + "}}]}"]
    statuses, done = [], threading.Event()

    def hammer():
        try:
            with httpx.Client(timeout=120) as h:
                while not done.is_set():
                    for body in bodies:
                        r = h.post(cluster.http_url + "/v1/chat/completions", content=body)
                        statuses.append((r.status_code, r.json()["error"]["message"][:60]))
        except Exception as e:  # seen by the assert below, never a hang
            statuses.extend([(repr(e), "")] * 4)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        while len(statuses) < 4:
            time.sleep(0.05)
        r = ask(client, model, tool_choice=named("get_weather"))
    finally:
        done.set()
        thread.join()
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert {s for s, _ in statuses} == {400}, statuses[:4]
    assert {m for _, m in statuses} == {
        "tools has 10000 tools; at most 128 are accepted",
        "the request body nests arrays/objects too deep to read"}, statuses[:4]


def test_langchain_bind_tools_and_with_structured_output(cluster, model):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""
        city: str = Field(max_length=20)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    llm = ChatOpenAI(base_url=cluster.http_url + "/v1", api_key="none", model=model,
                     temperature=0, max_tokens=80, max_retries=0)
    msg = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "Weather" and Weather(**call["args"])
    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(out, Weather), method


def test_litellm_with_tools(cluster, model):
    import litellm

    kw = {"model": f"openai/{model}", "api_base": cluster.http_url + "/v1", "api_key": "none",
          "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
          "max_tokens": 80}
    r = litellm.completion(**kw)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    args = "".join(d.function.arguments or "" for c in litellm.completion(**kw, stream=True)
                   for d in (c.choices[0].delta.tool_calls or []))
    assert args == call.function.arguments


def test_openai_agents_through_chat_completions(cluster, model):
    """An Agent with one function tool on OpenAIChatCompletionsModel: the first turn must
    call (required; the SDK resets tool_choice to auto after the call), the tool runs
    once, and the run ends with text."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="none",
                                max_retries=0)
    agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=80))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert cities == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.strip()


# Last: it leaves the cluster one decode node short.
def test_decode_node_killed_while_arguments_stream(cluster, client, model):
    numbers = {"type": "object", "properties": {"numbers": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 60, "maxItems": 60}}, "required": ["numbers"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "record", "parameters": numbers}}]
    kw = {"messages": [{"role": "user", "content": "Record sixty numbers."}], "tools": tools,
          "tool_choice": named("record"), "max_tokens": 400}
    want = ask(client, model, **kw).choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(want), numbers)
    before, heads, pieces, killed = decode_steps(cluster), [], [], False
    for chunk in ask(client, model, stream=True, **kw):
        for e in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            (heads if e.id else pieces).append(e)
        if len(pieces) == 3 and not killed:
            kill_busy_decode_node(cluster, before)
            killed = True
        time.sleep(0.01)  # let the node be killed while the request is still running
    assert killed and len(heads) == 1 and heads[0].function.name == "record"
    got = "".join(e.function.arguments for e in pieces)
    assert got == want
    jsonschema.validate(json.loads(got), numbers)
    assert "moves to other nodes" in cluster.log()
