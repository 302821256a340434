"""``pdserve bench``: the report's numbers and layout checked by hand, the saved result's
round trip, prompt building, and short real runs against ``pdserve launch``.
No test here asserts a speed."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from pdserve.bench import datasets, metrics, report, runner
from pdserve.bench.cli import bench_cmd
from pdserve.bench.metrics import RequestRecord


def recorded() -> list[RequestRecord]:
    """Four requests; the expected figures below are worked out by hand from these."""
    return [
        # ttft 0.5, itl 0.2 0.3, latency 1.1, 5 tokens (chunks of 2, 2, 1): tpot 0.6/4 = 0.15
        RequestRecord(10, start=0.0, end=1.1, chunk_times=[0.5, 0.7, 1.0],
                      chunk_tokens=[2, 2, 1], output_tokens=5, success=True),
        # ttft 1.1, itl 0.1, latency 1.3, no usage: 2 chunks = 2 tokens, tpot 0.2/1 = 0.2
        RequestRecord(20, start=0.2, end=1.5, chunk_times=[1.3, 1.4], success=True),
        RequestRecord(7, start=0.3, end=0.4, error="HTTP 500: boom"),  # failed
        # starts as the first ends (half-open: never 3 at once); 1 token: no TPOT
        RequestRecord(5, start=1.1, end=2.6, chunk_times=[2.5], output_tokens=1, success=True),
    ]


def test_metrics_by_hand():
    m = metrics.compute_metrics(recorded(), duration=3.0, percentiles=[50, 99],
                                goodput={"ttft": 1200, "tpot": 160})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 8)
    assert m.output_lens == [5, 2, 0, 1]
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(8 / 3)
    assert m.total_token_throughput == pytest.approx(43 / 3)
    # Only the first meets both SLOs (B's TPOT is 200 ms, D's TTFT 1400 ms).
    assert m.request_goodput == pytest.approx(1 / 3)
    # 1 s bins from t=0: [0.5 (2), 0.7 (2)] = 4 tokens; [1.0 (1), 1.3, 1.4] = 3; [2.5] = 1.
    assert m.max_output_tokens_per_s == 4
    assert m.max_concurrent_requests == 2
    s = m.stats
    assert s["ttft"].mean == pytest.approx(1000)            # 500, 1100, 1400 ms
    assert s["ttft"].median == pytest.approx(1100)
    assert s["ttft"].std == pytest.approx(math.sqrt((500**2 + 100**2 + 400**2) / 3))
    assert s["ttft"].percentiles == [(50, pytest.approx(1100)), (99, pytest.approx(1394))]
    assert s["tpot"].mean == pytest.approx(175)             # 150, 200 ms
    assert s["tpot"].percentiles[1][1] == pytest.approx(199.5)
    assert s["itl"].mean == pytest.approx(200)              # 200, 300, 100 ms
    assert s["itl"].percentiles[1][1] == pytest.approx(298)
    assert s["e2el"].mean == pytest.approx(1300)            # 1100, 1300, 1500 ms
    e2el_only = metrics.compute_metrics(recorded(), 3.0, goodput={"e2el": 1300})
    assert e2el_only.request_goodput == pytest.approx(2 / 3)  # an SLO is met when equal
    assert metrics.compute_metrics(recorded(), 3.0).request_goodput is None


def test_report_layout_line_by_line():
    m = metrics.compute_metrics(recorded(), 3.0, [99], {"ttft": 1200, "tpot": 160})
    lines = report.format_report(m, ("ttft", "tpot", "itl"), max_concurrency=4)
    assert lines == [
        "============ Serving Benchmark Result ============",
        "Successful requests:                     3         ",
        "Failed requests:                         1         ",
        "Maximum request concurrency:             4         ",
        "Benchmark duration (s):                  3.00      ",
        "Total input tokens:                      35        ",
        "Total generated tokens:                  8         ",
        "Request throughput (req/s):              1.00      ",
        "Request goodput (req/s):                 0.33      ",
        "Output token throughput (tok/s):         2.67      ",
        "Peak output token throughput (tok/s):    4.00      ",
        "Peak concurrent requests:                2.00      ",
        "Total token throughput (tok/s):          14.33     ",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):                          1000.00   ",
        "Median TTFT (ms):                        1100.00   ",
        "P99 TTFT (ms):                           1394.00   ",
        "-----Time per Output Token (excl. 1st token)------",
        "Mean TPOT (ms):                          175.00    ",
        "Median TPOT (ms):                        175.00    ",
        "P99 TPOT (ms):                           199.50    ",
        "---------------Inter-token Latency----------------",
        "Mean ITL (ms):                           200.00    ",
        "Median ITL (ms):                         200.00    ",
        "P99 ITL (ms):                            298.00    ",
        "==================================================",
    ]
    with_rate = report.format_report(m, ("e2el",), request_rate=2.5)
    assert with_rate[3] == "Request rate configured (RPS):           2.50      "
    assert with_rate[-5:-1] == ["----------------End-to-end Latency----------------",
                                "Mean E2EL (ms):                          1300.00   ",
                                "Median E2EL (ms):                        1300.00   ",
                                "P99 E2EL (ms):                           1496.00   "]


def test_save_result_round_trip(tmp_path):
    records = recorded()
    m = metrics.compute_metrics(records, 3.0, [50, 99])
    result = report.result_dict(m, records, ("ttft", "tpot", "itl", "e2el"), label="x")
    path = report.save_result(tmp_path / "sub" / "r.json", result)
    loaded = report.load_result(path)
    assert loaded == json.loads(json.dumps(result))
    assert loaded["p99_ttft_ms"] == pytest.approx(1394) and loaded["completed"] == 3
    again = metrics.compute_metrics(metrics.records_from_result(loaded), loaded["duration"],
                                    [50, 99])
    lines = report.format_report(m, ("ttft", "tpot", "itl", "e2el"))
    assert report.format_report(again, ("ttft", "tpot", "itl", "e2el")) == lines


def test_plot_or_a_clear_error_without_matplotlib(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # --plot is refused before anything runs
        out = CliRunner().invoke(bench_cmd, ["--plot", str(tmp_path / "p.png")])
        assert out.exit_code != 0 and "pip install matplotlib" in out.output, out.output
        return
    report.plot(tmp_path / "p.png", recorded(), title="by hand")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_arrivals():
    assert runner.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    t = runner.arrival_times(200, 50.0, seed=1)
    assert t == sorted(t) and t[-1] == pytest.approx(4.0)  # n / rate exactly
    assert t == runner.arrival_times(200, 50.0, seed=1) != runner.arrival_times(200, 50.0)
    assert runner.arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([.5, 1, 1.5, 2])


def test_prompts(tiny_model, tmp_path):
    tok = datasets.load_tokenizer(tiny_model("llama"))
    reqs = datasets.random_requests(tok, 20, 40, 8, range_ratio=0.25, prefix_len=6, seed=3)
    assert all(36 <= r.prompt_len == len(r.prompt) <= 56 and 6 <= r.output_len <= 10
               for r in reqs)
    assert len({tuple(r.prompt[:6]) for r in reqs}) == 1       # one shared prefix
    assert not set().union(*(r.prompt for r in reqs)) & tok.special_ids
    assert reqs == datasets.random_requests(tok, 20, 40, 8, 0.25, 6, seed=3)
    text = datasets.random_requests(tok, 5, 30, 4, as_text=True)
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
               and abs(r.prompt_len - 30) <= 2 for r in text)
    conv = [{"conversations": [{"from": "human", "value": "tell me a story " * 3},
                               {"from": "gpt", "value": "once upon a time " * 4}]},
            {"conversations": [{"from": "human", "value": "hi"}]}]  # one turn: skipped
    (tmp_path / "sg.json").write_text(json.dumps(conv))
    sg = datasets.sharegpt_requests(tmp_path / "sg.json", tok, 3, seed=0)
    assert len(sg) == 3 and sg[0].prompt.startswith("tell me")
    assert sg[0].output_len == len(tok.encode("once upon a time " * 4, add_special_tokens=False))


@pytest.mark.parametrize("args, words", [
    (["--goodput", "ttft:1", "ttfx:2"], "KEY must be ttft"),
    (["--goodput", "ttft"], "KEY:MILLISECONDS"),
    (["stray"], "unexpected argument"),
    (["--percentile-metrics", "ttft,foo"], "foo"),
    (["--metric-percentiles", "0,99"], "(0, 100]"),
    (["--backend", "openai-chat"], "--endpoint /v1/chat/completions"),
    (["--metadata", "novalue"], "KEY=VALUE"),
    (["--multi-turn-turns", "3"], "only with --dataset-name multi-turn"),
    (["--dataset-name", "multi-turn", "--multi-turn-turns", "0"],
     "--multi-turn-turns must be at least 1"),
    (["--dataset-name", "multi-turn", "--multi-turn-shared-system", "0"],
     "--multi-turn-shared-system must be at least 1"),
    (["--dataset-name", "multi-turn", "--input-len", "9"], "--multi-turn-user-len"),
])
def test_flags_checked_at_the_edge(args, words):
    out = CliRunner().invoke(bench_cmd, args)
    assert out.exit_code != 0 and words in out.output, out.output


def test_nobody_listening_fails_fast(tiny_model, tmp_path):
    out = CliRunner().invoke(bench_cmd, [
        "--ingress", "tcp://127.0.0.1:9", "--tokenizer", str(tiny_model("llama")),
        "--num-prompts", "2", "--random-input-len", "8", "--ready-check-timeout-sec", "0.5"])
    assert out.exit_code == 1 and "no answer from tcp://127.0.0.1:9" in out.output


# -- short real runs against pdserve launch ------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tiny_model):
    from tests.cluster import launched

    with launched(tiny_model("llama"), 1, 1) as c:
        yield c


def run_bench(*args) -> str:
    out = CliRunner().invoke(bench_cmd, ["--num-prompts", "12", "--random-input-len", "24",
                                         "--random-output-len", "6", "--ignore-eos",
                                         "--disable-tqdm", *args])
    assert out.exit_code == 0, f"{out.output}\n{out.exception!r}"
    assert "Successful requests:                     12" in out.output, out.output
    assert "Failed requests:                         0 " in out.output, out.output
    return out.output


@pytest.mark.timeout(120)
def test_real_run_http_completions_and_chat(cluster, tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    run_bench("--base-url", cluster.http_url, "--model", model, "--max-concurrency", "4",
              "--save-result", str(tmp_path / "r.json"), "--goodput", "ttft:60000",
              "e2el:60000")
    saved = report.load_result(tmp_path / "r.json")
    assert saved["completed"] == 12 and saved["output_lens"] == [6] * 12
    assert saved["input_lens"] == [24] * 12 and saved["request_goodput"] > 0
    run_bench("--base-url", cluster.http_url, "--endpoint", "/v1/chat/completions",
              "--tokenizer", model, "--request-rate", "50", "--seed", "2", "--save-result",
              "--result-dir", str(tmp_path), "--label", "chat", "--metadata", "run=ci")
    (auto,) = tmp_path.glob("chat-50.0qps-*.json")  # vLLM's name when none is given
    saved = report.load_result(auto)
    assert saved["backend"] == "openai-chat" and saved["run"] == "ci"
    assert saved["request_rate"] == 50.0 and saved["completed"] == 12


@pytest.mark.timeout(120)
def test_real_run_ingress(cluster, tiny_model):
    out = run_bench("--ingress", cluster.ingress, "--tokenizer", str(tiny_model("llama")),
                    "--max-concurrency", "6", "--percentile-metrics", "ttft,itl,e2el")
    assert "Total generated tokens:                  72" in out


@pytest.mark.timeout(120)
def test_real_run_multi_turn(tiny_model, tmp_path):
    """Four conversations of three turns, as a user would check them: every turn answered,
    each prompt the one before plus the answer the server gave plus the new user message,
    and the prefill node's prefix cache hit on the resent history. One prefill node
    (--compute none: no forward), so every later turn lands where its history is cached."""
    from pdserve.bench.cluster import metric_totals
    from tests.cluster import launched

    model = tiny_model("llama")
    tok = datasets.load_tokenizer(model)
    hits = ("pdserve_prefix_cache_queries_tokens_total", "pdserve_prefix_cache_hits_tokens_total")
    with launched(model, 1, 1, "--compute", "none", log_dir=tmp_path) as c:
        out = CliRunner().invoke(bench_cmd, [
            "--base-url", c.http_url, "--model", str(model), "--dataset-name", "multi-turn",
            "--num-prompts", "12", "--multi-turn-turns", "3", "--multi-turn-system-len", "40",
            "--multi-turn-user-len", "12", "--multi-turn-shared-system", "2",
            "--random-output-len", "5", "--ignore-eos", "--max-concurrency", "3",
            "--disable-tqdm", "--ready-check-timeout-sec", "0",
            "--save-result", str(tmp_path / "mt.json")])
        assert out.exit_code == 0, f"{out.output}\n{out.exception!r}"
        assert "4 conversations of up to 3 turns" in out.output
        prefill = metric_totals(c.metrics_urls()["prefill-0"], hits)
    r = report.load_result(tmp_path / "mt.json")
    assert r["completed"] == 12 and r["failed"] == 0 and r["output_lens"] == [5] * 12
    assert r["dataset_name"] == "multi-turn" and r["multi_turn"]["turns"] == 3
    assert r["conversation_index"] == [i // 3 for i in range(12)]
    assert r["turn_index"] == [0, 1, 2] * 4
    lens, texts = r["input_lens"], r["generated_texts"]
    for i in range(12):
        if r["turn_index"][i] == 0:
            assert lens[i] == 40 + 12
        else:  # the prompt before, the answer (text, encoded again), a user message
            answer = tok.encode(texts[i - 1], add_special_tokens=False)
            assert lens[i] == lens[i - 1] + len(answer) + 12 and answer
    assert prefill[hits[0]] == sum(lens)  # every prompt was looked up, once
    # every later turn finds at least its history's full 16-token blocks
    resent = sum(lens[i - 1] // 16 * 16 for i in range(12) if r["turn_index"][i])
    assert prefill[hits[1]] >= resent > 0, (prefill, resent)


def test_http_backend_reads_an_sse_line_far_over_aiohttp_default_buffer():
    """One SSE chunk of 1 MiB (a long stall's tokens in one event) is read, not failed:
    aiohttp's default buffer refuses lines over 128 KiB."""
    import asyncio
    import threading
    import time

    import orjson
    import uvicorn

    from pdserve.bench.backends import OpenAIBackend
    from pdserve.bench.cluster import free_port
    from pdserve.bench.standin import sse_app

    text = "x" * (1 << 20)
    body = (b"data: " + orjson.dumps({"choices": [{"index": 0, "text": text}]}) + b"\n\n"
            + b'data: {"choices": [], "usage": {"completion_tokens": 7}}\n\ndata: [DONE]\n\n')

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(sse_app([body]), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "stand-in server did not start"
            time.sleep(0.05)

        async def one():
            backend = OpenAIBackend(f"http://127.0.0.1:{port}", "/v1/completions", "m", {})
            try:
                return await backend.send(datasets.SampleRequest("hi", 1, 7))
            finally:
                await backend.aclose()

        rec = asyncio.run(one())
    finally:
        server.should_exit = True
        thread.join(10)
    assert rec.success, rec.error
    assert rec.generated_text == text and rec.output_tokens == 7
