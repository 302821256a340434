"""The Responses and Anthropic adapters' translations, without processes: request bodies
into chat bodies, chat chunks back into a turn, Anthropic's error types, and the API key
as either client sends it."""
from __future__ import annotations

import pytest
from starlette.requests import Request

from pdserve.router.http.api import make_authorize
from pdserve.router.http.chat_reading import ARGS, CALL, TEXT, Turn, read_chunk, renamed
from pdserve.router.http.messages_input import chat_body as messages_body
from pdserve.router.http.messages_input import chat_names as messages_names
from pdserve.router.http.messages_input import error_type
from pdserve.router.http.responses_input import chat_body as responses_body
from pdserve.router.http.responses_input import chat_names as responses_names
from pdserve.router.streams import RequestError

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_responses_items_become_chat_messages():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "reasoning", "summary": []}],
        "tools": [{"type": "function", "name": "get", "parameters": PARAMS},
                  {"type": "web_search"}],
        "tool_choice": {"type": "function", "name": "get"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": PARAMS}}}
    chat, conversation = responses_body(body, [], "resp_1")
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1:] == conversation
    user, assistant, tool = conversation
    assert user == {"role": "user", "content": "Weather?"}
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]   # one turn
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "get",
                                                               "parameters": PARAMS}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert chat["response_format"]["json_schema"] == {"name": "x", "schema": PARAMS}
    assert chat["max_tokens"] == 9 and chat["stream"] is False


def test_responses_call_output_needs_its_call():
    body = {"model": "m", "input": [{"type": "function_call_output", "call_id": "c9",
                                     "output": "x"}]}
    with pytest.raises(RequestError) as e:
        responses_body(body, [], "r")
    assert e.value.param == "input[0].call_id"
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    chat, conversation = responses_body(body, history, "r")
    assert conversation[0] is history[0] and conversation[1]["tool_call_id"] == "c9"


def test_anthropic_blocks_become_chat_messages():
    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Hi."}],
            "stop_sequences": ["\n\n"], "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me see."},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [{"name": "get", "input_schema": PARAMS}, {"type": "bash_20250124",
                                                               "name": "bash"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    chat = messages_body(body, "msg_1")
    system, user, assistant, tool, user2 = chat["messages"]
    assert system == {"role": "system", "content": "Hi."}
    assert assistant["content"] == "Let me see."
    assert assistant["tool_calls"][0]["function"] == {"name": "get", "arguments": "{}"}
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "Sunny"}
    assert user2 == {"role": "user", "content": "And tomorrow?"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["get"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["\n\n"] and chat["max_tokens"] == 5


@pytest.mark.parametrize("code, kind", [
    ("bad_request", "invalid_request_error"), ("model_not_found", "not_found_error"),
    ("invalid_api_key", "authentication_error"), ("overloaded", "overloaded_error"),
    ("no_nodes", "overloaded_error"), ("timeout", "timeout_error"),
    ("node_error", "api_error"), ("request_too_large", "request_too_large")])
def test_anthropic_error_types(code, kind):
    assert error_type(RequestError(code, "x")) == kind


def test_chat_chunks_read_back_as_a_turn():
    turn, calls = Turn(), {}
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                "function": {"name": "get",
                                                             "arguments": ""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
            "arguments": "{\"a\""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
            "arguments": ": 1}"}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}]
    steps = [s for c in chunks for s in read_chunk(c, turn, calls)]
    assert [s[0] for s in steps] == [TEXT, CALL, ARGS, ARGS]
    assert turn.text == "Hi" and turn.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [("c1", "get", "{\"a\": 1}")]
    assert (turn.prompt_tokens, turn.completion_tokens) == (7, 5)


def _request(headers: dict) -> Request:
    return Request({"type": "http", "headers": [(k.encode(), v.encode())
                                                for k, v in headers.items()]})


def test_api_key_as_bearer_or_x_api_key():
    authorize = make_authorize("sekret")
    authorize(_request({"authorization": "Bearer sekret"}))
    authorize(_request({"x-api-key": "sekret"}))
    for wrong in ({}, {"x-api-key": "nope"}, {"authorization": "Bearer nope"}):
        with pytest.raises(RequestError) as e:
            authorize(_request(wrong))
        assert e.value.code == "invalid_api_key"


def test_chat_refusals_name_the_clients_fields():
    hosted_first = {"tools": [{"type": "web_search"}, {"type": "function", "name": "f"}]}
    err = renamed(RequestError("bad_request", "tools[0].function.parameters is not a JSON "
                               "schema; max_tokens=0 is invalid", "tools[0].function"
                               ".parameters"), *responses_names(hosted_first))
    assert err.message == "tools[1].parameters is not a JSON schema; max_output_tokens=0 " \
        "is invalid" and err.param == "tools[1].parameters" and err.code == "bad_request"
    err = renamed(RequestError("bad_request", "response_format.json_schema.schema bad",
                               "response_format.json_schema.schema"), *responses_names({}))
    assert (err.message, err.param) == ("text.format.schema bad", "text.format.schema")
    server_first = {"tools": [{"type": "bash_20250124", "name": "bash"}, {"name": "f"}]}
    err = renamed(RequestError("bad_request", "stop=[''] is invalid; tools[0].function."
                               "parameters bad; 16 stop strings at most", "stop"),
                  *messages_names(server_first))
    assert err.message == "stop_sequences=[''] is invalid; tools.1.input_schema bad; 16 " \
        "stop strings at most" and err.param == "stop_sequences"


def test_many_hosted_tools_are_skipped_in_one_short_log_line(caplog):
    """A body may list any number of tools only their own platform runs: both adapters
    skip them (the function tool is kept) and name a few in one log line of bounded size."""
    hosted = [{"type": f"hosted_{i}_" + "x" * 500} for i in range(10_000)]
    function = {"type": "function", "name": "get", "parameters": PARAMS}
    custom = {"name": "get", "input_schema": PARAMS}
    with caplog.at_level("INFO", logger="pdserve.router.http.adapter_input"):
        chat, _ = responses_body({"model": "m", "input": "Hi", "tools": [*hosted, function]},
                                 [], "resp_1")
        assert [t["function"]["name"] for t in chat["tools"]] == ["get"]
        chat = messages_body({"model": "m", "max_tokens": 5, "tools": [*hosted, custom],
                              "messages": [{"role": "user", "content": "Hi"}]}, "msg_1")
        assert [t["function"]["name"] for t in chat["tools"]] == ["get"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("skipped tool types" in line for line in lines), lines
    assert all(len(line) < 1000 for line in lines), [len(line) for line in lines]
