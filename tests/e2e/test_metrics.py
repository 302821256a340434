"""/metrics of every process of a real `pdserve launch` cluster, after real HTTP requests.

The point: the numbers add up. Requests counted at the router equal requests sent,
token counters equal the usage clients were told, and each node counted what it did
for them (prefill steps, KV transfers, decode steps). Names and labels are checked
against the contract in pdserve/common/metrics.py (the dashboard and alerts use them).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common import metrics as M
from tests.cluster import launched

ROUTER = {
    "pdserve_time_to_first_token_seconds": "histogram",
    "pdserve_time_per_output_token_seconds": "histogram",
    "pdserve_inter_token_latency_seconds": "histogram",
    "pdserve_e2e_request_latency_seconds": "histogram",
    "pdserve_request_queue_time_seconds": "histogram",
    "pdserve_requests": "counter",
    "pdserve_prompt_tokens": "counter",
    "pdserve_generation_tokens": "counter",
    "pdserve_request_errors": "counter",
    "pdserve_requests_running": "gauge",
    "pdserve_nodes": "gauge",
    "pdserve_responses_stored": "gauge",
    "pdserve_internal_errors": "counter",
}
NODE = {"pdserve_kv_cache_usage_ratio": "gauge", "pdserve_requests_waiting": "gauge",
        "pdserve_prefix_cache_queries_tokens": "counter",
        "pdserve_prefix_cache_hits_tokens": "counter",
        "pdserve_internal_errors": "counter"}
PREFILL = {**NODE, "pdserve_prefill_batch_size": "histogram",
           "pdserve_prefill_time_seconds": "histogram",
           "pdserve_kv_transfer_seconds": "histogram",
           "pdserve_kv_transfer_bytes": "counter",
           "pdserve_kv_transfer_failures": "counter",
           "pdserve_kv_blocks_sent": "counter", "pdserve_kv_blocks_skipped": "counter"}
DECODE = {**NODE, "pdserve_decode_step_seconds": "histogram",
          "pdserve_decode_batch_size": "histogram"}
# Label keys each process may use besides model_name (le: histogram buckets).
EXTRA_LABELS = {"router": {"finish_reason", "code", "role", "state", "le", "process", "where",
                           "node", "reason"},  # (node, reason: the prefix index's, cache_aware)
                "prefill-0": {"node", "le", "process", "where", "path"},
                "decode-0": {"node", "le", "process", "where"}}

# (endpoint, body, max_tokens): completions and chat, streamed and not; max_tokens=1
# ends at the first token (no KV transfer, no decode).
REQUESTS = [("completions", {"prompt": "The quick brown fox"}, 12),
            ("completions", {"prompt": "Once upon a time", "stream": True}, 9),
            ("completions", {"prompt": "Hello"}, 1),
            ("chat/completions", {"messages": [{"role": "user", "content": "Hi there"}]}, 7),
            ("chat/completions", {"messages": [{"role": "user", "content": "Count to ten"}],
                                  "stream": True}, 10),
            ("completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}, 5)]


def scrape(url: str) -> tuple[dict[str, str], list]:
    """(family name -> type, [(sample name, labels, value)]) of the pdserve_ families."""
    text = httpx.get(url, timeout=5).text
    types, samples = {}, []
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("pdserve_"):
            types[fam.name] = fam.type
            samples += [(s.name, s.labels, s.value) for s in fam.samples]
    return types, samples


def value(samples, name: str, **labels) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == w for k, w in labels.items()))


def eventually(check, timeout_s: float = 10.0):
    """``check()`` until it stops raising AssertionError (nodes publish on their own clock)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def send_all(base: str, model: str) -> list[dict]:
    """Sends REQUESTS at once; returns each one's usage."""
    async def one(client, endpoint, body, max_tokens):
        body = {**body, "model": model, "max_tokens": max_tokens, "temperature": 0}
        if not body.get("stream"):
            resp = await client.post(f"{base}/v1/{endpoint}", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]
        body["stream_options"] = {"include_usage": True}
        usage = None
        async with client.stream("POST", f"{base}/v1/{endpoint}", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[len("data: "):]).get("usage") or usage
        assert usage is not None, "the stream ended without usage"
        return usage

    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(one(client, *r) for r in REQUESTS))


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """A launched cluster after REQUESTS: (usages, {process: /metrics URL}, model name,
    HTTP URL)."""
    model = tiny_model("llama")
    with launched(model, 1, 1, log_dir=tmp_path_factory.mktemp("logs")) as cluster:
        urls = cluster.metrics_urls()
        usages = asyncio.run(send_all(cluster.http_url, model.name))
        yield usages, urls, model.name, cluster.http_url


def test_launch_prints_every_metrics_endpoint(served):
    _, urls, _, http_url = served
    assert set(urls) == {"router", "prefill-0", "decode-0"}
    assert urls["router"] == f"{http_url}/metrics"      # the router's own HTTP port
    for url in urls.values():
        assert httpx.get(url, timeout=5).status_code == 200


@pytest.mark.parametrize("process, expected", [("router", ROUTER), ("prefill-0", PREFILL),
                                               ("decode-0", DECODE)])
def test_names_types_and_labels(served, process, expected):
    _, urls, model, _ = served
    types, samples = scrape(urls[process])
    missing = {n: t for n, t in expected.items() if types.get(n) != t}
    assert not missing, f"{process} lacks (or mistypes) {missing}; it has {types}"
    allowed = {"model_name"} | EXTRA_LABELS[process]
    for name, labels, _ in samples:
        assert labels.get("model_name") == model, (name, labels)
        assert set(labels) <= allowed, f"{name} has labels {set(labels) - allowed}"
        if process != "router":
            assert labels["node"] == process, (name, labels)


def test_router_counts_match_what_clients_got(served):
    usages, urls, _, _ = served
    _, s = scrape(urls["router"])
    completions = [u["completion_tokens"] for u in usages]
    assert value(s, "pdserve_requests_total") == len(REQUESTS)
    assert value(s, "pdserve_requests_total", finish_reason="error") == 0
    assert value(s, "pdserve_request_errors_total") == 0
    assert value(s, "pdserve_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value(s, "pdserve_generation_tokens_total") == sum(completions)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert value(s, f"pdserve_{name}_seconds_count") == len(REQUESTS), name
    assert value(s, "pdserve_inter_token_latency_seconds_count") == sum(c - 1 for c in completions)
    assert value(s, "pdserve_time_per_output_token_seconds_count") == \
        sum(c > 1 for c in completions)
    assert value(s, "pdserve_requests_running") == 0
    assert value(s, "pdserve_nodes", role="prefill", state="live") == 1
    assert value(s, "pdserve_nodes", role="decode", state="live") == 1
    # Buckets are the documented ones, the +Inf bucket holds every observation.
    les = [lab["le"] for n, lab, _ in s if n == "pdserve_time_to_first_token_seconds_bucket"]
    assert [float(x) for x in les[:-1]] == list(M.TTFT_BUCKETS) and les[-1] == "+Inf"


def test_nodes_count_what_they_did(served):
    usages, urls, _, _ = served
    shipped = sum(u["completion_tokens"] > 1 for u in usages)   # the others ended at token 1
    decoded = sum(max(0, u["completion_tokens"] - 1) for u in usages)

    def prefill_done():
        _, s = scrape(urls["prefill-0"])
        assert value(s, "pdserve_prefill_time_seconds_count") == len(REQUESTS)
        assert value(s, "pdserve_prefill_batch_size_sum") == len(REQUESTS)  # no chunking
        assert value(s, "pdserve_kv_transfer_seconds_count") == shipped
        # One host: the router passed the decode node's host id on, the KV went through
        # the prefill node's /dev/shm segment, none over TCP.
        assert value(s, "pdserve_kv_transfer_bytes_total", path="shm") > 0
        assert value(s, "pdserve_kv_transfer_bytes_total", path="tcp") == 0
        assert value(s, "pdserve_kv_transfer_failures_total") == 0
        assert value(s, "pdserve_kv_cache_usage_ratio") == 0   # every block given back

    def decode_done():
        _, s = scrape(urls["decode-0"])
        assert value(s, "pdserve_decode_batch_size_sum") == decoded   # a token per seq-step
        assert 1 <= value(s, "pdserve_decode_step_seconds_count") <= decoded
        assert value(s, "pdserve_kv_cache_usage_ratio") == 0
        assert value(s, "pdserve_requests_waiting") == 0

    eventually(prefill_done)
    eventually(decode_done)


def test_router_metrics_unit():
    """Refusals and errors count as ended requests, by code; timing needs no cluster."""
    m = M.RouterMetrics("m", error_codes=("timeout",))
    m.refused("overloaded")
    m.submitted("a")
    m.dispatched(["a"])
    m.dispatched(["a"])                     # a re-dispatch is not queue time again
    m.delivered("a", 1, 5)
    m.delivered("a", 2, 5)
    m.finished("a", "length", None)
    m.submitted("b")
    m.finished("b", None, "timeout")
    get = m.registry.get_sample_value
    assert get("pdserve_requests_total", {"model_name": "m", "finish_reason": "error"}) == 2
    assert get("pdserve_requests_total", {"model_name": "m", "finish_reason": "length"}) == 1
    assert get("pdserve_request_errors_total", {"model_name": "m", "code": "overloaded"}) == 1
    assert get("pdserve_request_queue_time_seconds_count", {"model_name": "m"}) == 1
    assert get("pdserve_generation_tokens_total", {"model_name": "m"}) == 3
    assert get("pdserve_prompt_tokens_total", {"model_name": "m"}) == 5
    assert get("pdserve_e2e_request_latency_seconds_count", {"model_name": "m"}) == 1
    assert get("pdserve_time_per_output_token_seconds_count", {"model_name": "m"}) == 1
    assert not m._timing                    # nothing kept after the requests ended


def test_every_refusal_is_counted_by_code(tiny_model):
    """Refusals the HTTP layer answers itself (bad JSON, an unknown model, a body over the
    limit, no API key, an unknown path) count in pdserve_request_errors_total as the
    refusals the core makes do: one per refused request, by the code the client got."""
    from pdserve.router.http.openai_schema import MAX_BODY_BYTES

    key = "k" * 32
    with launched(tiny_model("llama"), 1, 1, "--compute", "none", "--api-key", key) as cluster:
        base, auth = cluster.http_url, {"Authorization": f"Bearer {key}"}
        model = tiny_model("llama").name
        sent = [
            httpx.post(f"{base}/v1/completions", content=b"{not json", headers=auth),
            httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "hi"},
                       headers=auth),
            httpx.post(f"{base}/v1/chat/completions", json={"model": model},
                       headers=auth),                                      # no messages
            httpx.post(f"{base}/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1),
                       headers=auth),
            httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi"}),
            httpx.get(f"{base}/v1/models/nope", headers=auth),
            httpx.post(f"{base}/tokenize", json={"model": "nope", "prompt": "hi"},
                       headers=auth),
            httpx.post(f"{base}/v1/completions", headers=auth, json={
                "model": model, "prompt": "hi", "max_tokens": 10 ** 9}),   # core refuses
            httpx.get(f"{base}/v1/no-such-route", headers=auth),
        ]
        codes: dict[str, int] = {}
        for resp in sent:
            assert resp.status_code >= 400, resp.text
            code = resp.json()["error"]["code"]
            codes[code] = codes.get(code, 0) + 1
        _, s = scrape(f"{base}/metrics")
    assert value(s, "pdserve_request_errors_total") == len(sent), codes
    for code, n in codes.items():
        assert value(s, "pdserve_request_errors_total", code=code) == n, code
    assert value(s, "pdserve_requests_total", finish_reason="error") == len(sent)
