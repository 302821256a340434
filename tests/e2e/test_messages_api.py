"""Anthropic's Messages API as its users see it against `pdserve launch` (1 prefill + 1
decode) on the default model, SmolLM2-135M-Instruct: the anthropic client's
messages.create and messages.stream (text equal to chat completions', token for
token), tool use (tool_choice any and tool, a tool_result turn), count_tokens equal to
what a request is billed, and bad input answered in Anthropic's error shape while the
server goes on serving. It serves the dtype a user gets (tests/cluster.py, USERS_DTYPE)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pdserve.model.default_model import bundled_model
from pdserve.model.loader import model_name
from tests.cluster import USERS_DTYPE, launched
from tests.e2e.test_metrics import eventually, scrape, value

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather of a city.",
        "input_schema": WEATHER}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, why = bundled_model()
    if path is None:
        pytest.skip(f"the bundled model is not installed: {why}")
    with launched(path, 1, 1, *USERS_DTYPE, log_dir=tmp_path_factory.mktemp("launch")) as c:
        c.model = model_name(path)
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0,
                               timeout=120)


def test_text_equals_chat_created_and_streamed(cluster, client):
    system, user = "Answer in one sentence.", "Name three primary colors."
    chat = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=120).chat.completions.create(
        model=cluster.model, messages=[{"role": "system", "content": system},
                                       {"role": "user", "content": user}],
        max_tokens=16, temperature=0)
    # temperature is not a parameter of this anthropic client: sent as the API's field.
    greedy = {"extra_body": {"temperature": 0}}
    m = client.messages.create(model=cluster.model, max_tokens=16, system=system,
                               messages=[{"role": "user", "content": user}], **greedy)
    assert m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content != ""
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)

    kinds, deltas = [], []
    with client.messages.stream(model=cluster.model, max_tokens=16, system=system,
                                messages=[{"role": "user", "content": user}],
                                **greedy) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert len(deltas) > 1 and "".join(deltas) == final.content[0].text == m.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == \
        m.usage.output_tokens and final.usage.input_tokens == m.usage.input_tokens


def test_tool_use_created_streamed_and_answered(client, cluster):
    m = client.messages.create(model=cluster.model, max_tokens=60, tools=[TOOL],
                               tool_choice={"type": "any"}, messages=QUESTION)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)

    # The tool's result as the next user turn: answered with text.
    follow = client.messages.create(
        model=cluster.model, max_tokens=24, tools=[TOOL], messages=QUESTION + [
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "Sunny, 21 C"}]}])
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")

    pieces, starts = [], []
    with client.messages.stream(model=cluster.model, max_tokens=60, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]
                                ) as stream:
        for event in stream:
            if event.type == "content_block_start":
                starts.append(event.content_block)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert starts[-1].type == "tool_use" and starts[-1].name == "get_weather"
    assert len(pieces) > 1   # streamed in pieces, not one blob
    (block,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads("".join(pieces)) == block.input and block.id == starts[-1].id
    assert final.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER)


def test_stop_sequence_is_named_created_and_streamed(client, cluster):
    """A stop sequence that ends the text is Anthropic's stop_reason "stop_sequence", with
    stop_sequence the one that matched (not "end_turn", as an end of sequence token is)."""
    greedy = {"extra_body": {"temperature": 0}}
    ask = {"model": cluster.model, "max_tokens": 24, "messages": [
        {"role": "user", "content": "Name three primary colors."}], **greedy}
    free = client.messages.create(**ask).content[0].text
    assert len(free) > 8
    stop = free[4:6]     # a sequence the greedy text holds, away from its start
    cut = free[:free.index(stop)]
    m = client.messages.create(stop_sequences=["never said", stop], **ask)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == cut
    with client.messages.stream(stop_sequences=["never said", stop], **ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == cut
    # Chat names it too, as vLLM's choice field stop_reason (where the adapter reads it).
    chat = httpx.post(cluster.http_url + "/v1/chat/completions", timeout=120, json={
        "model": cluster.model, "max_tokens": 24, "temperature": 0, "stop": [stop],
        "messages": ask["messages"]}).json()["choices"][0]
    assert (chat["finish_reason"], chat["stop_reason"]) == ("stop", stop)
    assert chat["message"]["content"] == cut
    # Ended by its end of sequence token (no stop sequence met): end_turn, no sequence.
    short = client.messages.create(**{**ask, "max_tokens": 200})
    assert short.stop_sequence is None and short.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_what_a_request_is_billed(client, cluster):
    for extra in ({}, {"tools": [TOOL], "system": "Be brief."}):
        counted = client.messages.count_tokens(model=cluster.model, messages=QUESTION,
                                               **extra)
        m = client.messages.create(model=cluster.model, max_tokens=1, messages=QUESTION,
                                   **extra)
        assert counted.input_tokens == m.usage.input_tokens > 0


@pytest.mark.parametrize("body, status, kind, says", [
    ({"model": "nope"}, 404, "not_found_error", "nope"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "nope"),
    ({"tools": [{**TOOL, "input_schema": {"type": "strnig"}}], "tool_choice": {"type": "any"}},
     400, "invalid_request_error", "strnig"),
    ({"messages": QUESTION + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "hi"}]}]}, 400,
     "invalid_request_error", "toolu_x"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "image"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error",
     "thinking"),
    ({"thinking": "on"}, 400, "invalid_request_error", "thinking"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     400, "invalid_request_error", "disable_parallel_tool_use must be a boolean"),
    # The chat path's refusals name the field as the client sent it (and where: a skipped
    # server tool keeps its place), not the translated chat field.
    ({"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences=['']"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"},
                {**TOOL, "input_schema": {"type": "strnig"}}]}, 400,
     "invalid_request_error", "tools.1.input_schema is not"),
])
def test_bad_input_in_anthropic_shape(cluster, body, status, kind, says):
    request = {"model": cluster.model, "max_tokens": 8, "messages": QUESTION, **body}
    r = httpx.post(cluster.http_url + "/v1/messages", timeout=60,
                   json={k: v for k, v in request.items() if v is not None})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert says in r.json()["error"]["message"], r.json()
    # ... and the server goes on serving.
    ok = httpx.post(cluster.http_url + "/v1/messages", timeout=60, json={
        "model": cluster.model, "max_tokens": 2, "messages": QUESTION})
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_body_that_is_not_json(cluster, client):
    r = httpx.post(cluster.http_url + "/v1/messages", content=b"{not json", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # A wrong method or an unknown route under /v1/messages: Anthropic's shape too.
    for method, path, status, kind in (("GET", "/v1/messages", 405, "invalid_request_error"),
                                       ("GET", "/v1/messages/count_tokens", 405,
                                        "invalid_request_error"),
                                       ("POST", "/v1/messages/batches", 404,
                                        "not_found_error")):
        r = httpx.request(method, cluster.http_url + path, json={}, timeout=60)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
        assert path in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=8, messages=QUESTION)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_10000_tools_or_a_schema_1000_deep_is_a_400(cluster):
    many = [{**TOOL, "name": f"f{i}"} for i in range(10_000)]
    deep = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + \
        "}}" * 1000
    head = {"model": cluster.model, "max_tokens": 8, "messages": QUESTION}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for content in (json.dumps({**head, "tools": many}),
                        json.dumps(head)[:-1] + ', "tools": [{"name": "f", "input_schema": '
                        + deep + "}]}"):
            r = httpx.post(cluster.http_url + path, content=content, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_client_gone_mid_tool_call_aborts_and_server_serves(cluster, client):
    """A streamed tool call whose client hangs up after its first arguments piece, on
    /v1/messages and /v1/responses: the request is aborted (not generated on for nobody)
    and the server answers the next request."""
    # The grammar holds the call open for 200 characters at least: it is still being
    # written when the client goes, however loaded the host.
    schema = {"type": "object", "properties": {"city": {"type": "string", "minLength": 200}},
              "required": ["city"]}
    for path, body, piece in (
            ("/v1/messages", {"messages": QUESTION, "max_tokens": 400, "tools": [
                {"name": "get_weather", "input_schema": schema}],
                "tool_choice": {"type": "any"}}, "input_json_delta"),
            ("/v1/responses", {"input": "What is the weather in Paris?",
                               "max_output_tokens": 400, "tool_choice": "required",
                               "tools": [{"type": "function", "name": "get_weather",
                                          "parameters": schema}]},
             "response.function_call_arguments.delta")):
        before = value(scrape(cluster.http_url + "/metrics")[1], "pdserve_requests_total",
                       finish_reason="abort")
        with httpx.stream("POST", cluster.http_url + path, timeout=60, json={
                "model": cluster.model, "stream": True, **body}) as r:
            assert r.status_code == 200
            assert any(piece in line for line in r.iter_lines())   # then the client goes

        def gone() -> None:
            _, samples = scrape(cluster.http_url + "/metrics")
            assert value(samples, "pdserve_requests_total", finish_reason="abort") == \
                before + 1
            assert value(samples, "pdserve_requests_running") == 0
        eventually(gone, 60)
    m = client.messages.create(model=cluster.model, max_tokens=2, messages=QUESTION)
    assert m.type == "message" and m.usage.output_tokens >= 1
