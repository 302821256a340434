"""What used to block the router's event loop, measured side by side (issue 12, row 7).

1. Tokenizing a big prompt: ``Tokenizer.encode`` (holds the GIL) against the
   ``encode_text`` the router now runs in its tokenizer pool (``tokenizers``' batch
   encode, which releases it), each in a thread while the main thread ticks every
   10 ms: the longest gap between ticks is what the event loop would have stalled.
2. The held-back tail of streamed text with 16 stop strings of 256 characters: the
   old loop over every tail length and stop string against ``_undecided_tail`` now.
3. Decoding a hostile msgpack header ({} repeated): plain ``msgpack.unpackb`` against
   ``codec.check_expansion`` (then msgpack), peak memory / input size (tracemalloc).

    python benchmarks/router_loop.py [--prompt-mib 4]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import msgpack

from pdserve.common.codec import check_expansion
from pdserve.common.protocol import ProtocolError
from pdserve.common.sampling import SamplingParams
from pdserve.model.make_model import make_model
from pdserve.model.text import RequestOutputState
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.http.openai_schema import encode_text


def worst_gap(fn) -> tuple[float, float]:
    """(seconds fn took in a thread, the longest gap between 10 ms ticks meanwhile)."""
    thread = threading.Thread(target=fn)
    started = last = time.monotonic()
    worst = 0.0
    thread.start()
    while thread.is_alive():
        time.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return time.monotonic() - started, worst


def old_tail(text: str, stops: list[str], hold: int) -> int:
    for k in range(min(hold, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-mib", type=float, default=4.0)
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f}")
    model = make_model(Path(tempfile.mkdtemp()) / "m", arch="llama", preset="tiny", seed=0)
    tok = Tokenizer(model)
    text = ("hello world, this is a long prompt. " * 200_000)[:int(args.prompt_mib * 2**20)]
    for name, fn in (("Tokenizer.encode", lambda: tok.encode(text)),
                     ("encode_text (pool)", lambda: encode_text(tok, text))):
        took, gap = worst_gap(fn)
        print(f"tokenize {args.prompt_mib:g} MiB with {name:20s}: {took:6.2f} s, longest "
              f"loop gap {gap:6.3f} s")

    random.seed(0)
    stops = ["".join(random.choice("xyz") for _ in range(256)) for _ in range(16)]
    state = RequestOutputState(None, [1], SamplingParams(stop=stops), (), 100)
    state.text = "the quick brown fox jumps over the lazy dog " * 20
    state.num_emitted_chars = len(state.text) - 10
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        old_tail(state.text, stops, state._hold)
    before = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        state._undecided_tail()
    after = (time.perf_counter() - t) / n
    print(f"stop tail, 16 x 256-char stop strings: before {before * 1e6:.0f} us/token, now "
          f"{after * 1e6:.1f} us/token ({before / after:.0f}x)")

    data = msgpack.packb([{}] * (2 << 20))
    for name, fn in (("msgpack.unpackb", lambda: msgpack.unpackb(data)),
                     ("check_expansion", lambda: (check_expansion(data), msgpack.unpackb(data)))):
        tracemalloc.start()
        try:
            fn()
            outcome = "decoded"
        except ProtocolError as exc:
            outcome = f"refused ({exc.code})"
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{len(data) / 2**20:.0f} MiB header of empty maps, {name:16s}: {outcome}, peak "
              f"{peak / len(data):.1f}x its size")


if __name__ == "__main__":
    main()
