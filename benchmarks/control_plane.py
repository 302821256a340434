"""Requests/s the control plane sustains, against a bare pyzmq echo on the same machine.

``pdserve launch --compute none`` (1P1D; nodes skip the forward and emit a fixed
token, so only routing, batching, KV messages and streaming are measured);
128 requests in flight, 8 streamed tokens each, the load generator
(pdserve.bench) in this process. The same run measures a bare pyzmq asyncio
DEALER/ROUTER echo at the same concurrency, shaped like a client: 128
coroutines, each sending one small msgpack request and awaiting its reply,
one reader task routing replies by id; the server echoes from asyncio. And a
fake ingress: a stand-in that answers each submit at once with the messages
the ingress would send, measured through the same load generator, which
gives the most this client can measure here; the same two again with a plain
synchronous pyzmq producer in a process of its own (no asyncio: its ceiling is
higher); and a stand-in HTTP server answering each completion at once, the ceiling
of the HTTP client. Rounds alternate echo / fake / ingress / sync fake / sync
ingress / fake HTTP / HTTP so machine noise hits each alike. Each round also prints
where the asyncio ingress run's requests spent their time, from the cluster's own
histograms (router queue time, TTFT, the prefill node's KV transfer, end to end).

    python benchmarks/control_plane.py [--concurrency 128] [--tokens 8] [--rounds 2]
        [--node-arg=--max-num-seqs=256 ...]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from datetime import datetime
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

from pdserve.bench import datasets, metrics, runner
from pdserve.bench.backends import IngressBackend, OpenAIBackend
from pdserve.bench.cluster import free_port, launched, machine, metric_totals
from pdserve.bench.standin import sse_app


def echo_server(address: str) -> None:
    async def serve():
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(address)
        while True:
            await sock.send_multipart(await sock.recv_multipart())
    asyncio.run(serve())


def fake_ingress(address: str, tokens: int) -> None:
    """Answers every submit at once with ``tokens`` one-token messages and a done, as the
    ingress would: the ceiling the load generator and the wire format allow here."""
    async def serve():
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.router_mandatory = 1  # a full pipe makes the send wait, never drop
        sock.bind(address)
        while True:
            peer, data = await sock.recv_multipart()
            rid = msgpack.unpackb(data)["id"]
            for _ in range(tokens):
                await sock.send_multipart([peer, msgpack.packb(
                    {"type": "tokens", "id": rid, "token_ids": [42], "text": " x"})])
            await sock.send_multipart([peer, msgpack.packb(
                {"type": "done", "id": rid, "finish_reason": "length",
                 "usage": {"prompt_tokens": 32, "completion_tokens": tokens}})])
    asyncio.run(serve())


def fake_http(port: int, tokens: int) -> None:
    """A stand-in OpenAI completions endpoint (a bare ASGI app on uvicorn with httptools and
    uvloop, as the router serves): answers every request at once with ``tokens`` SSE text
    chunks, a usage chunk and [DONE], each its own write. The ceiling of the HTTP client."""
    import orjson
    import uvicorn

    chunk = b"data: " + orjson.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [
        {"index": 0, "text": " x", "logprobs": None, "finish_reason": None}]}) + b"\n\n"
    last = b"data: " + orjson.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [],
                                     "usage": {"prompt_tokens": 32, "completion_tokens": tokens,
                                               "total_tokens": 32 + tokens}}) + b"\n\n"
    app = sse_app([chunk] * tokens + [last, b"data: [DONE]\n\n"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools",
                loop="uvloop", lifespan="off", access_log=False)


def sync_client(address: str, prompts: list[list[int]], tokens: int, concurrency: int,
                conn) -> None:
    """A plain synchronous pyzmq DEALER producer (no asyncio), in a process of its own:
    keeps ``concurrency`` submits in flight, reads every frame of every answer, sends the
    next submit when one ends. Sends (requests/s, failed) through ``conn``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    packed = [msgpack.packb({"type": "submit", "id": str(i), "prompt_token_ids": p,
                             "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True})
              for i, p in enumerate(prompts)]
    sent = done = failed = 0
    t0 = time.perf_counter()
    while sent < min(concurrency, len(packed)):
        sock.send(packed[sent])
        sent += 1
    while done < len(packed):
        for frame in sock.recv_multipart():
            kind = msgpack.unpackb(frame)["type"]
            if kind in ("done", "error"):
                done += 1
                failed += kind == "error"
                if sent < len(packed):
                    sock.send(packed[sent])
                    sent += 1
    conn.send((len(packed) / (time.perf_counter() - t0), failed))
    sock.close(linger=0)
    ctx.term()


def sync_through(address: str, reqs, tokens: int, concurrency: int, cluster=None, cpu=None):
    """(requests/s, 0, failed) of the synchronous producer; with ``cluster``, adds each of
    its processes' CPU ms per request to ``cpu``."""
    before = cluster.cpu_seconds() if cluster else {}
    mine, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=sync_client, args=(
        address, [r.prompt for r in reqs], tokens, concurrency, theirs), daemon=True)
    proc.start()
    try:
        if not mine.poll(600):
            raise RuntimeError("the synchronous client did not finish in 600 s")
        rate, failed = mine.recv()
    finally:
        proc.kill()
    if cluster:
        used = {k: v - before.get(k, 0.0) for k, v in cluster.cpu_seconds().items()}
        for k, v in used.items():
            cpu.setdefault(k, []).append(v / len(reqs) * 1e3)
    if failed:
        print(f"  {failed} failed (synchronous client)")
    return rate, 0.0, failed


async def echo_client(address: str, concurrency: int, seconds: float) -> float:
    """Round trips/s over ``seconds``, ``concurrency`` requests in flight."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    waiting: dict[int, asyncio.Future] = {}
    done = 0

    async def reader():
        while True:
            msg = msgpack.unpackb(await sock.recv())
            waiting.pop(msg["id"]).set_result(msg)

    async def worker(k: int, stop: float):
        nonlocal done
        i = k
        while time.perf_counter() < stop:
            fut = asyncio.get_running_loop().create_future()
            waiting[i] = fut
            await sock.send(msgpack.packb({"type": "submit", "id": i, "max_tokens": 8,
                                           "prompt_token_ids": list(range(32))}))
            await fut
            done += 1
            i += concurrency

    task = asyncio.create_task(reader())
    await asyncio.gather(*(worker(k, time.perf_counter() + 0.5) for k in range(concurrency)))
    done, t0 = 0, time.perf_counter()
    await asyncio.gather(*(worker(k, t0 + seconds) for k in range(concurrency)))
    rate = done / (time.perf_counter() - t0)
    task.cancel()
    sock.close(linger=0)
    ctx.term()
    return rate


# Where an ingress round's requests spent their time, from the cluster's own histograms:
# (process, histogram, label). A round whose rate falls while the CPU per request does not
# shows here which hop waited.
STAGES = (("router", "pdserve_request_queue_time_seconds", "queue"),
          ("router", "pdserve_time_to_first_token_seconds", "TTFT"),
          ("prefill-0", "pdserve_kv_transfer_seconds", "KV transfer"),
          ("router", "pdserve_e2e_request_latency_seconds", "e2e"))


def stage_totals(urls: dict[str, str]) -> dict[str, float]:
    """Each STAGES histogram's sum and count, keyed "process histogram_sum" etc."""
    out = {}
    for proc in {p for p, _, _ in STAGES}:
        names = tuple(f"{h}_{k}" for p, h, _ in STAGES if p == proc for k in ("sum", "count"))
        out |= {f"{proc} {n}": v for n, v in metric_totals(urls[proc], names).items()}
    return out


def stage_means(before: dict[str, float], after: dict[str, float]) -> str:
    parts = []
    for proc, hist, label in STAGES:
        n = after[f"{proc} {hist}_count"] - before[f"{proc} {hist}_count"]
        total = after[f"{proc} {hist}_sum"] - before[f"{proc} {hist}_sum"]
        parts.append(f"{label} {total / n * 1e3:.1f} ms" if n else f"{label} -")
    return ", ".join(parts)


async def through(backend, reqs, concurrency: int, cluster=None, cpu=None):
    """(requests/s, tokens/s, failed) of one run; with ``cluster``, adds each process's CPU
    ms per request (this one's as "load generator") to ``cpu``."""
    before = cluster.cpu_seconds() if cluster else {}
    mine = time.process_time()
    records, duration = await runner.run_requests(backend, reqs, max_concurrency=concurrency,
                                                  progress=False)
    if cluster:
        used = {k: v - before.get(k, 0.0) for k, v in cluster.cpu_seconds().items()}
        used["load generator"] = time.process_time() - mine
        for k, v in used.items():
            cpu.setdefault(k, []).append(v / len(reqs) * 1e3)
    m = metrics.compute_metrics(records, duration)
    await backend.aclose()
    if m.failed:
        print(f"  {m.failed} failed; the first: {next(r.error for r in records if r.error)}")
    return m.request_throughput, m.output_throughput, m.failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=8, help="streamed tokens per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--ingress-requests", type=int, default=20000)
    ap.add_argument("--http-requests", type=int, default=3000)
    ap.add_argument("--echo-seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per node")
    ap.add_argument("--compute", choices=("none", "model"), default="none",
                    help="'model': real forwards (use a tiny --model)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bundled model)")
    ap.add_argument("--dtype", default=None, help="the nodes' dtype (sets the KV page size)")
    ap.add_argument("--node-arg", action="append", default=[],
                    help="an extra flag for every node, as launch's --node-arg "
                         "(e.g. --node-arg=--max-num-seqs=256)")
    args = ap.parse_args()

    zero = args.compute == "none"
    launch = ["--prefill", "1", "--decode", "1", "--threads", str(args.threads)]
    launch += ["--compute", "none"] if zero else []
    launch += ["--model", args.model] if args.model else []
    launch += ["--dtype", args.dtype] if args.dtype else []
    launch += [f"--node-arg={a}" for a in args.node_arg]
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    mode = "compute none: nodes skip the forward" if zero else "REAL forwards"
    print(f"cluster: pdserve launch {' '.join(launch)} ({mode})")
    addr = f"tcp://127.0.0.1:{free_port()}"
    fake = f"tcp://127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    http_port = free_port()
    servers = [spawn.Process(target=echo_server, args=(addr,), daemon=True),
               spawn.Process(target=fake_ingress, args=(fake, args.tokens), daemon=True),
               spawn.Process(target=fake_http, args=(http_port, args.tokens), daemon=True)]
    for server in servers:
        server.start()
    results = {"echo": [], "fake ingress": [], "ingress": [], "fake ingress, sync client": [],
               "ingress, sync client": [], "fake http": [], "http": []}
    # path -> process -> CPU ms per request, per round
    cpu = {"ingress": {}, "ingress, sync client": {}, "http": {}}
    try:
        with launched(*launch) as c:
            from pdserve.model.default_model import default_model_dir
            from pdserve.model.loader import model_name
            model_dir = Path(args.model) if args.model else default_model_dir()
            tok = datasets.load_tokenizer(model_dir)
            model = model_name(model_dir)
            sampling = {"temperature": 0.0, "ignore_eos": True}
            urls, stages = c.metrics_urls(), []

            def reqs(n):
                return datasets.random_requests(tok, n, args.prompt_len, args.tokens, seed=n)
            # Warm-up: the first requests pay for imports, JIT and socket set-up.
            asyncio.run(through(IngressBackend(c.ingress, sampling), reqs(500),
                                args.concurrency))
            asyncio.run(through(OpenAIBackend(c.http_url, "/v1/completions", model, sampling,
                                              args.concurrency), reqs(200), args.concurrency))
            for r in range(args.rounds):
                echo = asyncio.run(echo_client(addr, args.concurrency, args.echo_seconds))
                results["echo"].append((echo, 0.0, 0))
                results["fake ingress"].append(asyncio.run(through(
                    IngressBackend(fake, sampling), reqs(args.ingress_requests),
                    args.concurrency)))
                before = stage_totals(urls)
                results["ingress"].append(asyncio.run(through(
                    IngressBackend(c.ingress, sampling), reqs(args.ingress_requests),
                    args.concurrency, c, cpu["ingress"])))
                stages.append(stage_means(before, stage_totals(urls)))
                results["fake ingress, sync client"].append(sync_through(
                    fake, reqs(args.ingress_requests), args.tokens, args.concurrency))
                results["ingress, sync client"].append(sync_through(
                    c.ingress, reqs(args.ingress_requests), args.tokens, args.concurrency, c,
                    cpu["ingress, sync client"]))
                results["fake http"].append(asyncio.run(through(
                    OpenAIBackend(f"http://127.0.0.1:{http_port}", "/v1/completions", model,
                                  sampling, args.concurrency), reqs(args.http_requests),
                    args.concurrency)))
                results["http"].append(asyncio.run(through(
                    OpenAIBackend(c.http_url, "/v1/completions", model, sampling,
                                  args.concurrency), reqs(args.http_requests),
                    args.concurrency, c, cpu["http"])))
                print(f"round {r + 1}: echo {echo:,.0f} rt/s; " + "; ".join(
                    f"{k} {v[-1][0]:,.0f} req/s" for k, v in results.items() if k != "echo"),
                    flush=True)
                print(f"  ingress (asyncio) means: {stages[-1]}", flush=True)
    finally:
        for server in servers:
            server.kill()

    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
               sum(x[2] for x in v)) for k, v in results.items()}
    echo = med["echo"][0]
    print(f"concurrency {args.concurrency}, {args.tokens} streamed tokens/request, "
          f"{args.prompt_len}-token prompts; medians of {args.rounds} rounds")
    print(f"{'bare pyzmq asyncio echo':<24}: {echo:10,.0f} round trips/s")
    for k in [k for k in results if k != "echo"]:
        rps, tps, failed = med[k]
        print(f"{k:<26}: {rps:10,.0f} requests/s  ratio to echo {rps / echo:.3f}  "
              f"failed {failed}")
    print("(fake ingress / fake http: stand-ins answering each request at once with the "
          "same messages; the ceiling of that client here)")
    servers_ms = {}
    for path, per in cpu.items():
        parts = {k: statistics.median(v) for k, v in per.items() if k != "launch"}
        servers_ms[path] = sum(v for k, v in parts.items() if k != "load generator")
        print(f"CPU ms per request through the {path}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in parts.items()) + f"; servers {servers_ms[path]:.2f}")
    ratio = med["ingress"][0] / med["fake ingress"][0]
    ratio_sync = med["ingress, sync client"][0] / med["fake ingress, sync client"][0]
    goals = [
        (f"ingress >= 0.5 of the same client's stand-in ceiling: asyncio {ratio:.2f}, "
         f"sync {ratio_sync:.2f}", min(ratio, ratio_sync) >= 0.5),
        (f"server CPU per request through the ingress <= 0.4 ms: {servers_ms['ingress']:.2f}",
         servers_ms["ingress"] <= 0.4),
        (f"server CPU per request through HTTP <= 1.0 ms: {servers_ms['http']:.2f}",
         servers_ms["http"] <= 1.0),
        (f"HTTP >= 1,000 requests/s: {med['http'][0]:,.0f} (this client's ceiling: "
         f"{med['fake http'][0]:,.0f})", med["http"][0] >= 1000),
    ]
    for what, met in goals:
        print(f"goal: {what}: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
