"""Several routers on the same nodes (issue 31): what a second router gives and costs, and
how long a new router takes to be ready with N blocks cached on the nodes.

1. Routers. ``pdserve launch --compute none --prefill 1 --decode 1`` with ``--routers 1``
   and with ``--routers 2``, both clusters up at once, rounds alternating between them
   so that the machine's noise hits both alike. The same load each time: two synchronous
   pyzmq producers (control_plane.py's), each a process of its own with half the requests
   in flight; with 1 router both send to it, with 2 each sends to one. Then HTTP the same
   way (two asyncio OpenAI clients, control_plane.py's, in this process). Figures: the
   cluster's requests/s, and CPU ms per request of the routers (all of them together) and
   of each node, from /proc/PID/stat of every process.
2. A new router's readiness. etcd, a cache_aware router, a prefill node (``--compute
   none`` on the tiny random checkpoint, prefix caching on) and a decode node, each a
   process on this machine (tests/fleet.py). The prefill node's cache is filled with
   distinct 1,008-token prompts (63 blocks each) through the first router until it holds
   N blocks; then a second cache_aware router is started, and the time until its /health
   first answers (up, 503: not every node's index dump is in) and until it answers 200
   (every dump in) is taken, and the router is stopped. N grows through --blocks. From
   the new router's log (millisecond stamps): the time from the prefill node's Hello
   (``joined``) to its dump being in the index (``dump of N blocks``), which is asking
   for the dump, the node building it, sending it and the router indexing it.

    python benchmarks/fleet.py [--rounds 2] [--ingress-requests 6000] [--http-requests 1500]
        [--blocks 0,1000,10000,100000] [--part routers|ready|both]
"""
from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import random
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from control_plane import sync_client, through  # noqa: E402 (beside this script)

from pdserve.bench import datasets  # noqa: E402
from pdserve.bench.backends import OpenAIBackend  # noqa: E402
from pdserve.bench.cluster import launched, machine, metric_totals  # noqa: E402
from tests.fleet import fleet, healthy, wait_for  # noqa: E402

PROMPT_BLOCKS = 63  # 1,008 tokens: the tiny checkpoint's 1,024 positions, one to generate
BLOCK = 16
ROLES = ("router", "prefill", "decode")  # Cluster.cpu_seconds' keys: "router" is all routers


# -- 1. one router against two --------------------------------------------------------------
def second_router(c) -> str:
    """Router 1's (HTTP URL, ingress) from launch's ready table."""
    c.metrics_urls(timeout_s=120)
    found = re.search(r"router 1\s+(http://\S+)/v1, ingress (\S+), control", c.log())
    return found.group(1), found.group(2)


def ingress_round(c, targets: list[str], prompts, tokens: int, concurrency: int):
    """(requests/s, {process: CPU ms per request}) of two synchronous producers at once,
    one per entry of ``targets``, half the prompts and half the concurrency each."""
    spawn = mp.get_context("spawn")
    before = c.cpu_seconds()
    half = len(prompts) // 2
    pipes, procs = [], []
    for k, address in enumerate(targets):
        mine, theirs = spawn.Pipe()
        proc = spawn.Process(target=sync_client, daemon=True, args=(
            address, prompts[k * half:(k + 1) * half], tokens, concurrency // 2, theirs))
        pipes.append(mine)
        procs.append(proc)
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    try:
        failed = 0
        for mine in pipes:
            if not mine.poll(600):
                raise RuntimeError("a producer did not finish in 600 s")
            failed += mine.recv()[1]
    finally:
        for proc in procs:
            proc.kill()
    seconds = time.perf_counter() - t0  # (both producers' start-up in it, alike for both)
    if failed:
        print(f"  {failed} failed")
    return 2 * half / seconds, cpu_per_request(before, c.cpu_seconds(), 2 * half)


def http_round(c, urls: list[str], model: str, reqs, concurrency: int):
    """(requests/s, {process: CPU ms per request}) of two asyncio OpenAI clients at once in
    this process, one per entry of ``urls``."""
    sampling = {"temperature": 0.0, "ignore_eos": True}
    half = len(reqs) // 2
    before = c.cpu_seconds()
    t0 = time.perf_counter()

    async def both():
        return await asyncio.gather(*(through(
            OpenAIBackend(url, "/v1/completions", model, sampling, concurrency // 2),
            reqs[k * half:(k + 1) * half], concurrency // 2) for k, url in enumerate(urls)))
    failed = sum(r[2] for r in asyncio.run(both()))
    seconds = time.perf_counter() - t0
    if failed:
        print(f"  {failed} failed")
    return 2 * half / seconds, cpu_per_request(before, c.cpu_seconds(), 2 * half)


def cpu_per_request(before: dict, after: dict, n: int) -> dict[str, float]:
    return {k: (v - before.get(k, 0.0)) / n * 1e3 for k, v in after.items() if k != "launch"}


def routers_part(a) -> None:
    from pdserve.model.default_model import default_model_dir
    from pdserve.model.loader import model_name

    base = ["--prefill", "1", "--decode", "1", "--compute", "none", "--threads", "1"]
    tok = datasets.load_tokenizer(default_model_dir())
    model = model_name(default_model_dir())

    def reqs(n, seed):
        return datasets.random_requests(tok, n, a.prompt_len, a.tokens, seed=seed)
    results = {}  # (routers, path) -> [(req/s, cpu)]
    with launched(*base, "--routers", "1") as one, launched(*base, "--routers", "2") as two:
        http1, ingress1 = second_router(two)
        setups = {1: (one, [one.ingress] * 2, [one.http_url] * 2),
                  2: (two, [two.ingress, ingress1], [two.http_url, http1])}
        for n, (c, ingresses, urls) in setups.items():  # warm-up: imports, sockets, JIT
            ingress_round(c, ingresses, [r.prompt for r in reqs(1000, 1)], a.tokens,
                          a.concurrency)
            http_round(c, urls, model, reqs(200, 2), a.concurrency)
        for r in range(a.rounds):
            order = list(setups.items())  # 1, 2 then 2, 1: a drift in the load hits both
            for n, (c, ingresses, urls) in order if r % 2 == 0 else order[::-1]:
                got = ingress_round(c, ingresses, [q.prompt for q in reqs(
                    a.ingress_requests, 10 + r)], a.tokens, a.concurrency)
                results.setdefault((n, "ingress"), []).append(got)
                got = http_round(c, urls, model, reqs(a.http_requests, 20 + r),
                                 a.concurrency)
                results.setdefault((n, "http"), []).append(got)
            print(f"round {r + 1}: " + "; ".join(
                f"{n} router{'s' * (n > 1)} {path} {v[-1][0]:,.0f} req/s (CPU ms/req: "
                + ", ".join(f"{k} {v[-1][1].get(k, 0.0):.2f}" for k in ROLES) + ")"
                for (n, path), v in sorted(results.items())), flush=True)
    print(f"pdserve launch {' '.join(base)}, --routers 1 and 2; {a.concurrency} in flight "
          f"in all, {a.prompt_len}-token prompts, {a.tokens} tokens each; medians of "
          f"{a.rounds} rounds")
    print("| routers | path | req/s | routers' CPU ms/req | prefill ms/req | decode ms/req |")
    print("|---|---|---|---|---|---|")
    for (n, path), runs in sorted(results.items()):
        cpu = {k: statistics.median(run[1].get(k, 0.0) for run in runs) for k in ROLES}
        print(f"| {n} | {path} | {statistics.median(run[0] for run in runs):,.0f} | "
              f"{cpu['router']:.3f} | {cpu['prefill']:.3f} | {cpu['decode']:.3f} |")


# -- 2. a new router's readiness ------------------------------------------------------------
def status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def fill(router, prompts: list[list[int]], concurrency: int) -> None:
    """The prompts through ``router``'s ingress, one token each (the prefill node caches
    every full block of each)."""
    mine, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=sync_client, daemon=True, args=(
        router.ingress, prompts, 1, concurrency, theirs))
    proc.start()
    try:
        if not mine.poll(1200):
            raise RuntimeError("filling did not finish in 1200 s")
        _, failed = mine.recv()
    finally:
        proc.kill()
    if failed:
        raise RuntimeError(f"{failed} fill requests failed")


def ready_part(a) -> None:
    sizes = [int(b) for b in a.blocks.split(",")]
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp:
        from pdserve.model.make_model import make_model
        model = make_model(Path(tmp) / "tiny", arch="llama", preset="tiny", seed=0)
        with fleet(Path(tmp), model) as f:
            first = f.router("router-0", "--policy", "cache_aware")
            blocks = max(sizes) + 4 * PROMPT_BLOCKS * 16 + 1024  # room beyond the fill
            nodes = [f.node("prefill", "prefill-0", "--compute", "none",
                            "--num-kv-blocks", str(blocks)),
                     f.node("decode", "decode-0", "--compute", "none")]
            wait_for(lambda: healthy(first), 180, "router-0 not healthy", first, *nodes)
            cached, rows = 0, []
            for n in sizes:
                need = math.ceil(max(0, n - cached) / PROMPT_BLOCKS)
                fill(first, [[rng.randrange(5, 1000) for _ in range(PROMPT_BLOCKS * BLOCK)]
                             for _ in range(need)], a.concurrency // 4 or 1)
                cached += need * PROMPT_BLOCKS
                wait_for(lambda: index_blocks(first) >= cached, 60,
                         "router-0's index lacks the fill", first, *nodes)
                for k in range(a.rounds):
                    rows.append((n, *new_router(f, f"router-{n}-{k}", nodes)))
                    print(f"N={n}: up {rows[-1][1]:.2f} s, ready {rows[-1][2]:.2f} s, "
                          f"joined -> dump in {rows[-1][4] * 1e3:.0f} ms, index "
                          f"{rows[-1][3]:,.0f} blocks", flush=True)
    print(f"medians of {a.rounds} new routers per size")
    print("| blocks cached | started -> /health answers | -> 200 (ready) | prefill node "
          "joined -> its dump in | blocks in the new router's index |")
    print("|---|---|---|---|---|")
    for n in sizes:
        mine = [r for r in rows if r[0] == n]
        print(f"| {n:,} | {statistics.median(r[1] for r in mine):.2f} s | "
              f"{statistics.median(r[2] for r in mine):.2f} s | "
              f"{statistics.median(r[4] for r in mine) * 1e3:.0f} ms | "
              f"{statistics.median(r[3] for r in mine):,.0f} |")


def index_blocks(router) -> float:
    return metric_totals(router.http_url + "/metrics", ("pdserve_prefix_index_blocks",))[
        "pdserve_prefix_index_blocks"]


STAMP = r"(\d\d):(\d\d):(\d\d),(\d{3}) "


def stamp(log: str, pattern: str) -> float:
    """Seconds of the day of the first log line matching ``pattern``."""
    h, m, s, ms = re.search(STAMP + r".*" + pattern, log).groups()
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1e3


def new_router(f, name: str, nodes) -> tuple[float, float, float, float]:
    """(seconds until /health answers, until it answers 200, blocks in its index, seconds
    from the prefill node's Hello to its dump in the index) of a cache_aware router
    started now; it is stopped before returning."""
    t0 = time.perf_counter()
    r = f.router(name, "--policy", "cache_aware")
    up = None
    try:
        while (code := status(r.http_url)) != 200:
            if code is not None and up is None:
                up = time.perf_counter() - t0
            if r.popen.poll() is not None or time.perf_counter() - t0 > 300:
                raise RuntimeError(f"{name} never got ready:\n{r.log()[-3000:]}")
            time.sleep(0.01)
        ready = time.perf_counter() - t0
        log = r.log()
        dump = stamp(log, r"prefix index of node prefill-0: dump of") - \
            stamp(log, r"node prefill-0 joined")
        return up if up is not None else ready, ready, index_blocks(r), dump
    finally:
        r.popen.kill()
        r.popen.wait()
        f.procs.remove(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("routers", "ready", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=128, help="in flight, in all")
    ap.add_argument("--tokens", type=int, default=8, help="streamed tokens per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--ingress-requests", type=int, default=6000)
    ap.add_argument("--http-requests", type=int, default=1500)
    ap.add_argument("--blocks", default="0,1000,10000,100000",
                    help="blocks cached on the prefill node, growing")
    a = ap.parse_args()
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}", flush=True)
    if a.part in ("routers", "both"):
        routers_part(a)
    if a.part in ("ready", "both"):
        ready_part(a)
    print(f"done; {machine()}")


if __name__ == "__main__":
    main()
