"""How far greedy output departs from the dequantized float32 reference, per way of holding
the default model's weights.

The reference is pdserve in float32 with ``--quantization none``, token for token
transformers' output on the same GGUF file (tests/e2e/test_smollm2.py). Each other
configuration generates greedily from the same chat prompts (those of test_smollm2.py);
per prompt: the first position where its tokens differ from the reference's (or "=" when
all are equal), and the texts where they differ. bfloat16 with int4 runs twice: on torch's
kernels only (``PDSERVE_NATIVE_KERNELS=0``) and on the native ones, where this CPU runs them
(pdserve/kernels/native: int8 activations in the int4 GEMM). With ``--llama-server``,
llama.cpp's server greedy on the same file and token ids too (temperature 0), for scale:
what running Q4_1 as llama.cpp does costs.

    python benchmarks/quant_greedy.py [--max-tokens 64] [--threads 2]
        [--llama-server WORK/llama-build/bin/llama-server]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.cluster import started
from pdserve.common.sockets import free_port
from pdserve.kernels import native
from pdserve.model.default_model import bundled_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.chat_prompts import CONVERSATIONS  # noqa: E402 (the checkout's tests/)

# (dtype, --quantization, native kernels)
CONFIGS = [("float32", "none", True), ("bfloat16", "none", True), ("bfloat16", "auto", False),
           ("bfloat16", "auto", True)]


def use_native(on: bool) -> None:
    """The native kernels on or off for the models built next (read when they are packed)."""
    if on:
        os.environ.pop(native.ENV, None)
    else:
        os.environ[native.ENV] = "0"
    native.why_unavailable.cache_clear()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (a length counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def label(on: bool | None) -> str:
    """Which kernels a row ran on: None is llama.cpp's row."""
    if on is None:
        return "llama"
    return "native" if on and native.why_unavailable() is None else "torch"


def content(out) -> list[int]:
    """An output's tokens less the end-of-sequence token it stopped on (llama-server's
    ``tokens`` leave it out)."""
    return out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids


def llama_greedy(server: str, prompts: list[list[int]], max_tokens: int, threads: int
                 ) -> list[tuple[list[int], str]]:
    """llama-server on the bundled GGUF file: each prompt's greedy tokens (without the
    end-of-sequence token it stopped on, as ``content``) and text."""
    path, why = bundled_model()
    if path is None:
        raise SystemExit(f"no bundled GGUF model: {why}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(tempfile.mkdtemp(prefix="quant-greedy-"), "llama-server.log")
    cmd = [server, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t",
           str(threads), "-np", "1", "-c", "2048"]
    out = []
    with started(cmd, url + "/health", log, "llama-server"):
        for ids in prompts:
            body = json.dumps({"prompt": ids, "n_predict": max_tokens, "temperature": 0,
                               "top_k": 1, "cache_prompt": False, "return_tokens": True,
                               "seed": 0}).encode()
            req = urllib.request.Request(url + "/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = json.load(r)
            out.append((list(reply["tokens"]), reply["content"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: a row for it")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    outputs = {}
    for dtype, quant, on in CONFIGS:
        use_native(on)
        llm = LLM(dtype=dtype, quantization=quant, threads=a.threads)
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(m),
                                        add_special_tokens=False) for m in CONVERSATIONS]
        outputs[dtype, quant, on] = [(content(o), o.text) for o in llm.generate(prompts, params)]
        del llm
    if a.llama_server:
        outputs["llama.cpp", "Q4_1", None] = llama_greedy(a.llama_server, prompts,
                                                          a.max_tokens, a.threads)
    ref = outputs[CONFIGS[0]]
    print(f"greedy, {a.max_tokens} new tokens at most, {len(CONVERSATIONS)} chat prompts; "
          f"first differing position against float32 --quantization none "
          f"(transformers' tokens); '=': all equal")
    print(f"native kernels: {native.describe()}")
    for (dtype, quant, on), outs in outputs.items():
        firsts = [first_difference(o[0], r[0]) for o, r in zip(outs, ref)]
        shown = " ".join("=" if f is None else str(f) for f in firsts)
        kernels = label(on)
        print(f"{dtype:>9} --quantization {quant:<5} {kernels:<6} {shown}   "
              f"(lengths {' '.join(str(len(o[0])) for o in outs)})")
    for (dtype, quant, on), outs in list(outputs.items())[1:]:
        for i, (o, r) in enumerate(zip(outs, ref)):
            if o[0] != r[0]:
                print(f"\n[{dtype} {quant} {label(on)}, prompt {i}]\n"
                      f"  ref:  {r[1]!r}\n  ours: {o[1]!r}")


if __name__ == "__main__":
    main()
