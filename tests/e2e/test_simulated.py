"""``--compute simulated`` through ``pdserve launch``: a 2P2D cluster of simulated GPUs
shows, measured at the client, the time to first token and the inter-token latency its
profile predicts (``pdserve plan --show``, the same roofline), within 10 %; and a fleet of
light simulated nodes serves, without spinning and without model weights, sharing the
memory of torch's import (forked), all gone when launch's process group is killed.

The test profile is a slow made-up accelerator (1.6 s prefills, 77 ms decode steps) with
Llama 3 8B's shape: long enough steps that the cluster's own overhead on this shared
machine (HTTP, dispatch, five messages each way: 30-40 ms measured at a load average of 6
on 2 cores) is small beside 10 % of them.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.bench.cluster import launched
from tests.cluster import alive, node_pids, sim_test_profile

PROMPT_LEN, MAX_TOKENS = 200, 12
KV_SCALE = "0.0078125"  # 1/128: one element per head


@pytest.fixture(scope="module")
def slow_profile(tmp_path_factory):
    return sim_test_profile(tmp_path_factory.mktemp("sim") / "slow.json", "slow-test-gpu",
                            3e12, 0.25e12)


def plan(profile, **shape) -> dict:
    args = [a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", "--sim-profile",
                          str(profile), "--show", "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def stream_times(url: str, model: str, prompt: list[int]) -> tuple[float, list[float]]:
    """(time to first token, the gaps between tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True}
    start, arrivals, n = time.perf_counter(), [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                arrivals.append(time.perf_counter())
                n += 1
    assert n == MAX_TOKENS, n   # one event per decode step: a token each
    return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


@pytest.mark.alone   # its ITL bound is 10 % of a step: no other test's load beside it
def test_2p2d_ttft_and_itl_match_the_profile(slow_profile):
    predicted = plan(slow_profile, prompt_len=PROMPT_LEN, batch=1,
                     context=PROMPT_LEN + MAX_TOKENS // 2)
    assert predicted["prefill_s"] > 1.5 and predicted["decode_step_s"] > 0.07
    with launched("--prefill", "2", "--decode", "2", "--compute", "simulated",
                  "--sim-profile", str(slow_profile), "--sim-kv-bytes-scale", KV_SCALE,
                  "--heartbeat-interval", "0.5", ready_timeout_s=180) as cluster:
        cluster.wait_nodes(4)
        model = model_of(cluster.http_url)
        ttfts, gaps = [], []
        for i in range(4):   # one at a time (low load); distinct prompts: no prefix hits
            ttft, g = stream_times(cluster.http_url, model,
                                   [1000 + 37 * i + (k * 7) % 5000 for k in range(PROMPT_LEN)])
            ttfts.append(ttft)
            gaps += g
        log = cluster.log()
    ttft, itl = statistics.median(ttfts), statistics.median(gaps)
    print(f"TTFT {ttft * 1e3:.1f} ms (predicted {predicted['prefill_s'] * 1e3:.1f}), "
          f"ITL {itl * 1e3:.2f} ms (predicted {predicted['decode_step_s'] * 1e3:.2f})")
    assert "COMPUTE SIMULATED" in log
    # Never faster than the clock the nodes sleep on; slower only by the cluster's own
    # overhead, under 10 % of a step.
    assert predicted["prefill_s"] * 0.99 <= ttft <= predicted["prefill_s"] * 1.10
    assert predicted["decode_step_s"] * 0.90 <= itl <= predicted["decode_step_s"] * 1.10


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def private_mib(pid: int) -> float:
    roll = dict(line.split()[:2] for line in open(f"/proc/{pid}/smaps_rollup")
                if line.split()[1:2] and line.split()[1].isdigit())
    return (int(roll["Private_Clean:"]) + int(roll["Private_Dirty:"])) / 1024


def post_all(url: str, model: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, prompts))


def test_a_light_fleet_serves_with_real_kv_sizes_and_prefix_hits():
    from pdserve.bench.cluster import metric_totals

    n, prompt_len, tokens = 32, 256, 8
    prompts = [[1000 + (i * 7919 + k * 31) % 40000 for k in range(prompt_len)]
               for i in range(n)]
    with launched("--prefill", "4", "--decode", "4", "--compute", "simulated",
                  "--sim-profile", "h100-llama3-8b", "--sim-kv-bytes-scale", KV_SCALE,
                  "--heartbeat-interval", "0.5", ready_timeout_s=300) as cluster:
        cluster.wait_nodes(8)
        pids = node_pids(cluster.proc.pid)
        assert len(pids) == 8, pids
        model = model_of(cluster.http_url)
        first = post_all(cluster.http_url, model, prompts, tokens)
        urls = cluster.metrics_urls()
        names = ("pdserve_kv_transfer_bytes_total", "pdserve_prefix_cache_hits_tokens_total")
        sent = sum(metric_totals(urls[f"prefill-{i}"], names)[names[0]] for i in range(4))
        post_all(cluster.http_url, model, prompts, tokens)   # again: cached prefixes
        hits = sum(metric_totals(urls[f"prefill-{i}"], names)[names[1]] for i in range(4))
        before = {k: cpu_s(p) for k, p in pids.items()}
        time.sleep(3.0)
        idle = {k: cpu_s(p) - before[k] for k, p in pids.items()}
        private = {k: private_mib(p) for k, p in pids.items()}
        os.killpg(cluster.proc.pid, signal.SIGKILL)   # launch dying hard takes every node
        time.sleep(0.5)
        assert not [k for k, p in pids.items() if alive(p)], pids
    print(f"node private MiB: mean {statistics.mean(private.values()):.1f}, "
          f"max {max(private.values()):.1f}")
    assert all(r["usage"]["completion_tokens"] == tokens for r in first)
    # 16 blocks of 16 tokens per prompt, 32 layers x K and V, pages of 16 tokens x 8 KV
    # heads x head_dim 128/128 x 2 bytes: the profile's layout, scaled, every byte sent
    assert sent == n * 16 * 2 * 32 * (16 * 8 * 1 * 2)
    # the second time each prefill node finds (some of) its prompts' blocks: the hashes are
    # of the real token ids
    assert 0 < hits <= n * (prompt_len - 16)
    # light: no node spins while idle (a spinning one takes 3 s of a core here, or its
    # share of 2 cores), and none holds model weights (the bundled model's alone are
    # 540 MiB as float32); forked from one process that has imported torch, the nodes
    # share it: ~20-25 MiB of private memory each, not its ~160 MiB (--no-fork-nodes)
    assert max(idle.values()) < 0.3, idle
    assert statistics.mean(private.values()) < 60 and max(private.values()) < 100, private


def test_a_colocated_simulated_node_serves_and_refuses_what_it_cannot_simulate():
    with launched("--colocated", "--compute", "simulated", "--sim-profile", "a100-llama3-8b",
                  "--sim-kv-bytes-scale", KV_SCALE, ready_timeout_s=180) as cluster:
        url, model = cluster.http_url, model_of(cluster.http_url)
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 24, "ignore_eos": True}
        first = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 24
        plain = {k: v for k, v in chat.items() if k != "ignore_eos"}
        refused = [({**plain, "response_format": {"type": "json_object"}}, "response_format"),
                   ({**plain, "logprobs": True, "top_logprobs": 2}, "logprobs")]
        for body, param in refused:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "simulated" in r.json()["error"]["message"]
        # the same prompt, the same stream; and the server kept serving
        again = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == \
            first.json()["choices"][0]["message"]["content"] != ""
