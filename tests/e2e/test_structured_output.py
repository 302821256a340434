"""Structured output as a user of the openai client sees it against `pdserve launch`:
json_schema output parses and validates on 8 of 8 prompts, a choice is always one of the
choices, regex and grammar output match, a bad schema is a 400 that says why, and a decode
node killed mid-request still yields the same valid JSON. The model is the tiny random one:
only the grammar can make its output valid."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import jsonschema
import openai
import pytest

from tests.cluster import child_config, launched
from tests.e2e.test_attack import process_tree
from tests.e2e.test_metrics import scrape, value

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["id", "ok", "color", "name", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a user.", "hello", "The weather today", "1 2 3 4", "JSON please:",
           "Once upon a time", "a b c", "Give me data"]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with launched(tiny_model("llama"), 1, 2, log_dir=tmp_path_factory.mktemp("launch")) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "user", "schema": schema,
                                                   "strict": True}}


def test_json_schema_validates_on_8_of_8_prompts(client):
    for i, prompt in enumerate(PROMPTS):
        if i % 2:
            r = client.chat.completions.create(
                model="llama-0", messages=[{"role": "user", "content": prompt}],
                response_format=json_schema_format(), max_tokens=200, temperature=0.8,
                seed=i)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(
                model="llama-0", prompt=prompt, max_tokens=200, temperature=0.8, seed=i,
                extra_body={"response_format": json_schema_format()})
            text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_streamed_json_schema(cluster, client):
    # Any object: the random model would write one forever, so '"' and '}' are made likelier.
    ids = [httpx.post(cluster.http_url + "/tokenize", json={
        "prompt": c, "add_special_tokens": False}).json()["tokens"][0] for c in '"}']
    r = client.chat.completions.create(
        model="llama-0", messages=[{"role": "user", "content": "an object"}],
        response_format={"type": "json_object"}, max_tokens=300, temperature=0,
        logit_bias={str(i): 20 for i in ids})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = client.chat.completions.create(
        model="llama-0", messages=[{"role": "user", "content": "stream it"}],
        response_format=json_schema_format(), max_tokens=200, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_is_always_one_of_the_choices(client):
    choices = ["yes", "no", "maybe later"]
    seen = set()
    for seed in range(8):
        r = client.completions.create(model="llama-0", prompt=PROMPTS[seed], max_tokens=20,
                                      temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
        seen.add(r.choices[0].text)
    # vLLM's older spelling of the same constraint
    r = client.completions.create(model="llama-0", prompt="x", max_tokens=20, temperature=0,
                                  extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices


def test_regex_and_grammar_output_match(client):
    pattern = r"[a-c]{2}-\d{3}(-[xyz])?"
    for seed in range(4):
        r = client.completions.create(model="llama-0", prompt=PROMPTS[seed], max_tokens=30,
                                      temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"regex": pattern}})
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    lark = 'start: "(" num "+" num ")" | num\nnum: /[0-9]{1,2}/'
    gbnf = 'root ::= "<" [a-z] [a-z]? ">"'
    for grammar, check in ((lark, r"\(\d{1,2}\+\d{1,2}\)|\d{1,2}"), (gbnf, r"<[a-z]{1,2}>")):
        r = client.chat.completions.create(
            model="llama-0", messages=[{"role": "user", "content": "sum"}], max_tokens=40,
            temperature=0.7, seed=3, extra_body={"structured_outputs": {"grammar": grammar}})
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(check, r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("extra, param, why", [
    ({"response_format": json_schema_format({"type": "object",
                                             "dependentSchemas": {"a": {}}})},
     "response_format.json_schema.schema", "dependentSchemas"),
    ({"response_format": json_schema_format({"type": "strnig"})},
     "response_format.json_schema.schema", "Invalid type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar",
     "unknown name"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "only one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs.regex", "only one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ({"guided_json": {"type": "strnig"}}, "guided_json", "Invalid type"),
    ({"structured_outputs": {"json": {"type": "object"}}, "ignore_eos": True}, "ignore_eos",
     "structured output"),
])
def test_a_bad_constraint_is_a_400_that_says_why(client, extra, param, why):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama-0", prompt="x", max_tokens=5, extra_body=extra)
    body = err.value.body
    assert body["param"] == param and why in body["message"], body


def decode_steps(cluster) -> dict[str, float]:
    """Decode steps run so far, by each decode node's metrics URL."""
    return {url: value(scrape(url)[1], "pdserve_decode_step_seconds_count")
            for name, url in cluster.metrics_urls().items() if name.startswith("decode")}


def kill_busy_decode_node(cluster, before: dict[str, float]) -> None:
    """SIGKILLs the one decode node that stepped since ``before`` (decode_steps)."""
    busy = [url for url, n in decode_steps(cluster).items() if n > before[url]]
    assert len(busy) == 1, f"cannot tell the request's decode node: {busy}"
    os.kill(_decode_pid(cluster, busy[0]), signal.SIGKILL)


def _decode_pid(cluster, busy_url: str) -> int:
    port = int(busy_url.split(":")[-1].split("/")[0])
    for pid in process_tree(cluster.proc.pid):
        handed = child_config(pid)
        if handed and handed["config"].get("role") == "decode" \
                and handed["config"]["metrics_port"] == port:
            return pid
    raise AssertionError(f"no decode process serves metrics on port {port}")


def test_decode_node_killed_mid_request_keeps_the_same_valid_json(cluster, client):
    """Greedy, so a run without the failure is the reference: the killed run must give the
    same text (no token lost or repeated) and it validates."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 250, "maxItems": 250}  # long enough to be killed half-way

    def ask(stream: bool):
        return client.completions.create(
            model="llama-0", prompt="Numbers:", max_tokens=1000, temperature=0,
            stream=stream, extra_body={"response_format": json_schema_format(schema)})

    want = ask(False).choices[0].text
    jsonschema.validate(json.loads(want), schema)
    before, parts, killed = decode_steps(cluster), [], False
    for chunk in ask(True):
        parts.append(chunk.choices[0].text if chunk.choices else "")
        if len(parts) == 3 and not killed:
            kill_busy_decode_node(cluster, before)
            killed = True
        time.sleep(0.01)  # let the node be killed while the request is still running
    assert killed
    got = "".join(parts)
    assert got == want
    jsonschema.validate(json.loads(got), schema)
    assert "moves to other nodes" in cluster.log()
