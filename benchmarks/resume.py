"""How long a queue stream stalls when its router dies: SIGKILL the router mid-stream and
time the gap, at the client, from the last token before the kill to the first one after
it (the connection's end seen by the socket monitor, a resume on the other router, the
decode node's answer), beside the stream's ordinary inter-token gaps in the same run.

    python benchmarks/resume.py [--rounds 5] [--max-tokens 200] [--model DIR]

etcd, 2 routers, 1 prefill and 1 decode node (tests/fleet.py, every process on this
machine); the router that dies is started again for the next round. --model defaults to
a tiny random checkpoint (the model's speed is not what is measured).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.client import Done, QueueClient  # noqa: E402
from tests.fleet import fleet, healthy, wait_for  # noqa: E402


def one_round(routers, prompt, max_tokens) -> tuple[float, list[float], int]:
    """(the stall in s, the stream's other gaps, tokens) of one stream whose router (the
    first of ``routers``) is SIGKILLed after its third token message. The stall is the
    longest gap after the kill, counted from it: messages the dead router had sent still
    arrive first, from the client's socket queue."""
    before, after, last, messages, n = [], [], None, 0, 0
    with QueueClient([r.ingress for r in routers]) as client:
        rid = client.submit(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0,
                            ignore_eos=True)
        for ev in client.stream(rid, timeout_s=120):
            if isinstance(ev, Done):
                break
            now = time.perf_counter()
            if last is not None:
                (after if messages >= 3 else before).append(now - last)
            n += len(ev.token_ids)
            messages += 1
            last = now
            if messages == 3:
                os.kill(routers[0].popen.pid, signal.SIGKILL)
                routers[0].popen.wait()
                last = time.perf_counter()
    stall = max(after)
    after.remove(stall)
    return stall, before + after, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from pdserve.model.make_model import make_model
            model = make_model(Path(tmp) / "tiny", arch="llama", preset="tiny", seed=0)
        with fleet(Path(tmp), model) as f:
            spare = f.router("router-b")
            nodes = [f.node("prefill", "prefill-0"), f.node("decode", "decode-0")]
            stalls, gaps = [], []
            for i in range(args.rounds):
                doomed = f.router(f"router-a{i}")
                for r in (doomed, spare):
                    wait_for(lambda r=r: healthy(r), 120, f"{r.name} not healthy", r, *nodes)
                stall, others, n = one_round([doomed, spare], list(range(5, 25)),
                                             args.max_tokens)
                assert n == args.max_tokens, (n, args.max_tokens)
                stalls.append(stall)
                gaps += others
                print(f"round {i}: {n} tokens, the gap across the kill {stall * 1000:.1f} ms, "
                      f"median other gap {statistics.median(others) * 1000:.2f} ms",
                      flush=True)
    print(f"resume stall: median {statistics.median(stalls) * 1000:.1f} ms, max "
          f"{max(stalls) * 1000:.1f} ms over {len(stalls)} kills; inter-token gap median "
          f"{statistics.median(gaps) * 1000:.2f} ms, p99 "
          f"{sorted(gaps)[int(len(gaps) * 0.99)] * 1000:.2f} ms")


if __name__ == "__main__":
    main()
