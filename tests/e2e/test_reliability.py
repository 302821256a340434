"""What a user of a loaded cluster checks: overload is refused with 429 and Retry-After
while everything accepted finishes; a client that goes away frees its KV at once."""
import asyncio
import json
import time

import httpx
import pytest

from tests.cluster import launched
from tests.e2e.test_metrics import scrape, value


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with launched(tiny_model("llama"), 1, 1, "--max-pending-requests", "4",
                  log_dir=tmp_path_factory.mktemp("launch")) as c:
        yield c


def body(max_tokens, **kw):
    return {"model": "llama-0", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **kw}


def test_overload_is_429_with_retry_after_and_loses_nothing_accepted(cluster):
    async def go():
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body(150))
                                          for _ in range(12)))
    replies = asyncio.run(go())
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(ok) + len(refused) == 12 and ok and refused
    for r in refused:
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "overloaded" and "retry later" in err["message"]
    for r in ok:  # every accepted request ran to its end
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 150


def test_client_disconnect_frees_kv_within_a_second(cluster):
    decode = cluster.metrics_urls()["decode-0"]

    def usage():
        return value(scrape(decode)[1], "pdserve_kv_cache_usage_ratio")

    assert usage() == 0.0
    with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions",
                           json=body(900, prompt=list(range(3, 200)), stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    # Streaming has started, so the KV is on the decode node (the gauge
                    # follows the node's loop).
                    deadline = time.monotonic() + 5
                    while usage() == 0:
                        assert time.monotonic() < deadline, "no KV in use while streaming"
                        time.sleep(0.02)
                    break  # httpx closes the connection here: the client is gone mid-stream
    gone = time.monotonic()
    while usage() > 0:
        assert time.monotonic() - gone < 1.0, "KV blocks still held a second after disconnect"
        time.sleep(0.05)
