"""Prefix caching across processes: a prefill node skips a shared prefix it computed
before, and a decode node killed while its requests share cached blocks loses no token."""
from pdserve.common.sampling import SamplingParams


def test_prefill_node_reuses_a_shared_prefix(tiny_model, tmp_path):
    import httpx

    from pdserve import LLM
    from tests.cluster import launched
    from tests.e2e.test_metrics import eventually, scrape, value

    model_dir = tiny_model("llama")
    prefix = [(7 * i) % 900 + 3 for i in range(400)]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]]
    body = {"model": model_dir.name, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with launched(model_dir, 1, 1, log_dir=tmp_path) as cluster:
        urls = cluster.metrics_urls()
        prefill, decode = urls["prefill-0"], urls["decode-0"]
        with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
            outs = []
            for prompt in prompts:  # one after the other: the second finds the first's blocks
                r = client.post("/v1/completions", json={**body, "prompt": prompt})
                assert r.status_code == 200, r.text
                outs.append(r.json()["choices"][0]["text"])

        def counted():
            _, s = scrape(prefill)
            assert value(s, "pdserve_prefix_cache_queries_tokens_total") == 403 + 405
            assert value(s, "pdserve_prefix_cache_hits_tokens_total") == 400
            # The decode node held the prefix's 25 blocks too: only the 26th crossed the wire.
            assert value(s, "pdserve_kv_blocks_sent_total") == 26 + 1
            assert value(s, "pdserve_kv_blocks_skipped_total") == 25
            _, s = scrape(decode)
            assert value(s, "pdserve_prefix_cache_hits_tokens_total") == 400

        eventually(counted)
    off = LLM(dtype="float32", model=model_dir, enable_prefix_caching=False)
    ref = off.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert outs == [o.text for o in ref]


def test_decode_node_killed_while_its_requests_share_cached_blocks(tiny_model, tmp_path):
    """Requests sharing a cached prefix on two decode nodes; one node is SIGKILLed mid-stream.
    Every request still ends with the tokens of a run without failure, and the survivors'
    blocks all come back (a shared block is freed only with its last reference)."""
    import asyncio

    from pdserve import LLM
    from pdserve.router import streams as S
    from tests.integration.test_router_core import (
        Harness,
        _kill,
        collect,
        greedy,
        streaming_decode_node,
        until,
    )

    model = tiny_model("llama")
    prefix = [(11 * i) % 900 + 3 for i in range(48)]
    prompts = [prefix + [100 + i, 200 + i] for i in range(6)]
    want = [o.token_ids for o in LLM(dtype="float32", model=model).generate(prompts, greedy(40))]
    h = Harness(model, tmp_path)
    try:
        h.start_nodes([("prefill", "sp"), ("decode", "sd0"), ("decode", "sd1")])

        async def run(kill: bool):
            streams = [h.core.submit(S.GenerationRequest(p, greedy(40))) for p in prompts]
            tasks = [asyncio.create_task(collect(s)) for s in streams]
            victim = None
            if kill:  # the node streaming the most, as soon as one streams (test_router_core)
                victim = await until(lambda: streaming_decode_node(h.core.requests.values()),
                                     "no decode node streamed")
                assert h.core.dispatch.placement.num_requests(victim)
                _kill(h.procs[victim])
            return victim, await asyncio.gather(*tasks)

        assert [g[0] for g in h.run(run(kill=False))[1]] == want   # fills both nodes' caches
        victim, got = h.run(run(kill=True))
        assert [g[0] for g in got] == want
        survivor = h.core.registry.nodes[{"sd0": "sd1", "sd1": "sd0"}[victim]]
        h.wait(lambda: survivor.stats.num_free_blocks == survivor.stats.num_total_blocks)
    finally:
        h.close()
