"""A batch-1 decode step with its packed weights in 2 MiB pages against 4 KiB ones, side by
side in one engine (issue 34, item 4; engine/host_memory.py's into_huge_pages).

The engine (the default model, bfloat16, int4 projections and the Q8_0 head: launch's
defaults on an AVX512 CPU) loads with PDSERVE_HUGE_PAGES=0, so its weights stay where
loading put them, in 4 KiB pages; then into_huge_pages copies them into its arena, and
the same tensors are switched between the two memories every ``--segment`` steps, ABBA
(decode_step_builds.py's rounds and report: the context grows through a round). Printed
per placement: the step's median and mean; then the median of the paired differences
(2 MiB less 4 KiB), how many rounds the arena won and the ratio of the medians (2 MiB /
4 KiB).

    python benchmarks/huge_pages.py [--batch 1,16] [--rounds 30] [--segment 20]
        [--prompt-len 32] [--max-len 300]
"""
from __future__ import annotations

import argparse
import os
from datetime import datetime

from decode_step_builds import report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1", help="sequences decoded at once, comma-separated")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--segment", type=int, default=20, help="steps before switching")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=300, help="tokens a sequence decodes")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.max_len < 2 * a.segment + 8:
        ap.error(f"--max-len must be at least 2 * --segment + 8 ({2 * a.segment + 8})")

    os.environ["PDSERVE_HUGE_PAGES"] = "0"
    from pdserve.bench.cluster import machine
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.host_memory import into_huge_pages
    from pdserve.kernels.native import decode_step

    engine = Engine(EngineConfig(dtype="bfloat16", quantization="auto", threads=a.threads,
                                 kv_cache_memory_gb=0.5), detokenize=False)
    model = engine.model
    if model.native_step is None:
        raise SystemExit("the native decode step does not serve this model here")
    tensors = model.streamed_weights()
    places = [[(t.untyped_storage(), t.storage_offset()) for t in tensors]]
    del os.environ["PDSERVE_HUGE_PAGES"]
    said = model.place_streamed_weights(into_huge_pages)
    places.append([(t.untyped_storage(), t.storage_offset()) for t in tensors])
    if places[0][0][0].data_ptr() == places[1][0][0].data_ptr():
        raise SystemExit(f"the weights did not move: {said}")
    library, current = decode_step._fn(), [1]

    def use(which: int):
        if current[0] != which:
            for t, (storage, offset) in zip(tensors, places[which]):
                t.set_(storage, offset, t.shape)
            model.native_step.rebind()
            current[0] = which
        return library

    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; threads {a.threads}; {a.rounds} "
          f"rounds of 2 x {a.segment} steps, ABBA; prompt {a.prompt_len}; arena: {said}")
    report(engine, [lambda: use(1), lambda: use(0)], ["2 MiB pages", "4 KiB pages"],
           [int(b) for b in a.batch.split(",")], a)


if __name__ == "__main__":
    main()
