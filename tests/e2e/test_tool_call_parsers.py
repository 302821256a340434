"""`pdserve launch --tool-call-parser NAME`: the llama3 and mistral families end to end, on
the tiny random model (its template knows no tools, so the default rendering shows the
model that family's syntax; only the grammar can make its calls valid): a required call
and a named one are valid for the tool's schema, streamed as not, and an auto answer is
text or such a call. (The hermes default is test_tool_calls.py's, on SmolLM2.)"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.cluster import launched
from tests.e2e.test_tool_calls import ASK, TOOLS, WEATHER, named

NONE = {"type": "object", "maxProperties": 0}


@pytest.mark.parametrize("parser", ["llama3", "mistral"])
def test_a_family_chosen_by_flag_makes_valid_calls(parser, tiny_model, tmp_path):
    with launched(tiny_model("llama"), 1, 1, "--tool-call-parser", parser,
                  log_dir=tmp_path) as cluster:
        client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none",
                               max_retries=0, timeout=300)
        model = httpx.get(cluster.http_url + "/v1/models").json()["data"][0]["id"]
        kw = {"model": model, "messages": ASK, "tools": TOOLS, "temperature": 0,
              "max_tokens": 80}
        for choice in ("required", named("get_weather")):
            r = client.chat.completions.create(tool_choice=choice, **kw)
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name in ("get_weather", "get_time")
            assert r.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER
                                if call.function.name == "get_weather" else NONE)
            args = "".join(e.function.arguments or "" for c in client.chat.completions.create(
                tool_choice=choice, stream=True, **kw) if c.choices
                for e in c.choices[0].delta.tool_calls or [])
            assert args == call.function.arguments
        r = client.chat.completions.create(tool_choice="auto", **kw)
        msg = r.choices[0].message
        assert msg.tool_calls or (msg.content and "[TOOL_CALLS]" not in msg.content)
