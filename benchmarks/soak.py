"""Soak: a cluster under steady load for a long time; requests lost and memory growth.

``pdserve launch`` (1 prefill + 1 decode on the given model) takes requests at a
fixed concurrency through the queue ingress for --minutes. Every request must
end with exactly one done or error; a request with neither within its timeout
is lost. Memory is each process's resident set size, after a warm-up minute
against the end. Goals: 0 lost, growth < 5 %.

    python benchmarks/soak.py [--minutes 10] [--concurrency 64] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.client import AsyncQueueClient, QueueError  # noqa: E402
from tests.cluster import launched  # noqa: E402


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def family(pid: int) -> list[int]:
    """The launcher's children (router and nodes)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def names(pids):
    out = {}
    for p in pids:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        out[p] = args[args.index(b"pdserve.cli") + 1].decode() if b"pdserve.cli" in args else "?"
    return out


async def load(ingress: str, args, stats: dict, stop_at: float) -> None:
    rng = random.Random(args.seed)
    async with AsyncQueueClient(ingress) as client:
        async def worker(w: int) -> None:
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(10, 900) for _ in range(rng.randint(4, args.max_prompt))]
                n = rng.randint(1, args.max_tokens)
                stats["sent"] += 1
                try:
                    res = await client.generate(prompt_token_ids=prompt, max_tokens=n,
                                                temperature=rng.choice([0, 0.8]),
                                                timeout_s=args.request_timeout)
                    stats["done"] += 1
                    stats["tokens"] += len(res.token_ids)
                    if len(res.token_ids) != n and res.finish_reason == "length":
                        stats["wrong_length"] += 1
                except QueueError as exc:
                    stats["errors"][exc.code] = stats["errors"].get(exc.code, 0) + 1
                except (TimeoutError, asyncio.TimeoutError):
                    stats["lost"] += 1
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model", default=None, help="checkpoint (default: make a tiny llama)")
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, made = args.model, None
    if model is None:
        from pdserve.model.make_model import make_model
        made = model = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-soak-{os.getpid()}"
        make_model(model, arch="llama", preset="tiny", seed=0)
    try:
        soak(model, args)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def soak(model, args) -> None:
    stats = {"sent": 0, "done": 0, "lost": 0, "tokens": 0, "wrong_length": 0, "errors": {}}
    with launched(model, 1, 1) as cluster:
        pids = family(cluster.proc.pid)
        warm_end = time.monotonic() + min(60.0, args.minutes * 60 / 5)
        stop_at = time.monotonic() + args.minutes * 60
        mem = {}

        async def run():
            task = asyncio.create_task(load(cluster.ingress, args, stats, stop_at))
            await asyncio.sleep(max(0.0, warm_end - time.monotonic()))
            mem["start"] = {p: rss_kib(p) for p in pids}
            await task
            mem["end"] = {p: rss_kib(p) for p in pids}
        t0 = time.monotonic()
        asyncio.run(run())
        wall = time.monotonic() - t0
        who = names(pids)
    print(f"soak: {args.minutes:g} min at concurrency {args.concurrency}, "
          f"model {Path(model).name}, "
          f"{os.cpu_count()} cores")
    print(f"requests sent {stats['sent']}, done {stats['done']}, errors {stats['errors'] or 0}, "
          f"lost {stats['lost']} (goal 0); {stats['sent'] / wall:.1f} req/s, "
          f"{stats['tokens'] / wall:.1f} tok/s; wrong lengths {stats['wrong_length']}")
    worst = 0.0
    for p in pids:
        a, b = mem["start"].get(p, 0), mem["end"].get(p, 0)
        growth = (b - a) / a * 100 if a else 0.0
        worst = max(worst, growth)
        print(f"  {who.get(p, p):9s} RSS {a / 1024:7.1f} MiB -> {b / 1024:7.1f} MiB "
              f"({growth:+.1f} %)")
    print(f"worst memory growth {worst:+.1f} % (goal < 5 %)")


if __name__ == "__main__":
    main()
