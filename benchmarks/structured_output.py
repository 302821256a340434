"""Structured output and the logits-processing stage, on the default model's vocabulary
(SmolLM2, 49,152 tokens).

1. Grammar libraries side by side (each one that imports; pdserve needs only llguidance):
   vocabulary setup, compile of a JSON schema, and the token mask per step while a valid
   JSON document is fed token by token. Two schemas: 4 flat fields, and an array of
   nested objects.
2. pdserve's stage (engine/logits_processors.py) on a batch of 16 rows (the JSON row
   includes unpacking the bit masks into a [16, V] bool mask): no request using it,
   penalties over 512-token histories, logit_bias, a JSON-schema guide; each against the
   sampler on the same logits, interleaved rounds, medians.

    python benchmarks/structured_output.py [--rounds 20]
    (xgrammar and outlines-core are optional: pip install --no-deps them to compare)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from pdserve.common.sampling import SamplingParams
from pdserve.engine.grammar import GrammarBackend, GuideState
from pdserve.engine.logits_processors import LogitsProcessors
from pdserve.engine.sampler import sample
from pdserve.engine.sequence import Sequence
from pdserve.model.config import ModelConfig
from pdserve.model.default_model import default_model_dir
from pdserve.model.gguf_tokenizer import _bytes_to_unicode
from pdserve.model.tokenizer import Tokenizer

SMALL = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
NESTED = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "user": {"type": "object", "properties": {
        "first": {"type": "string"}, "last": {"type": "string"},
        "email": {"type": "string", "format": "email"}},
        "required": ["first", "last", "email"]},
    "score": {"type": "number"}, "kind": {"enum": ["a", "bb", "ccc"]}},
    "required": ["id", "user", "score", "kind"]}}
SMALL_DOC = {"name": "Alice Smith", "age": 42, "tags": ["alpha", "beta gamma"], "ok": True}
NESTED_DOC = [{"id": i, "user": {"first": "Ann", "last": "Lee", "email": f"a{i}@x.org"},
               "score": 1.5 * i, "kind": "bb"} for i in range(4)]


def byte_vocab(tok: Tokenizer) -> list[bytes]:
    """Each token's bytes (byte-level BPE spelling undone); specials as their text."""
    inv = {c: b for b, c in _bytes_to_unicode().items()}
    out = []
    for i in range(tok.vocab_size):
        t = tok._tok.id_to_token(i)
        out.append(t.encode() if i in tok.special_ids or not set(t) <= inv.keys()
                   else bytes(inv[c] for c in t))
    return out


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def bench_llguidance(model, cfg, schema, ids):
    t0 = time.perf_counter()
    backend = GrammarBackend(model, cfg.vocab_size, cfg.eos_token_ids)
    t1 = time.perf_counter()
    state = GuideState(backend.matcher(("json", json.dumps(schema))))
    t2 = time.perf_counter()
    words = (cfg.vocab_size + 31) // 32
    bits, times = torch.zeros(words, dtype=torch.int32), []
    for n in range(len(ids) + 1):
        state.catch_up(ids[:n])
        a = time.perf_counter()
        state.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
        times.append(time.perf_counter() - a)
    return t1 - t0, t2 - t1, times


def bench_xgrammar(vocab, cfg, schema, ids):
    import xgrammar as xg
    t0 = time.perf_counter()
    info = xg.TokenizerInfo(vocab, xg.VocabType.RAW, vocab_size=cfg.vocab_size,
                            stop_token_ids=list(cfg.eos_token_ids))
    compiler = xg.GrammarCompiler(info)
    t1 = time.perf_counter()
    matcher = xg.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema),
                                                             any_whitespace=False))
    t2 = time.perf_counter()
    mask, times = xg.allocate_token_bitmask(1, cfg.vocab_size), []
    for tok in [*ids, None]:
        a = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - a)
        if tok is not None:
            assert matcher.accept_token(tok)
    return t1 - t0, t2 - t1, times


def bench_outlines(vocab, cfg, schema, ids):
    import outlines_core as oc
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask
    t0 = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    eos = cfg.eos_token_ids[0]
    for i, v in enumerate(vocab):
        if i != eos:
            by_bytes.setdefault(v, []).append(i)
    vocabulary = oc.Vocabulary(eos, by_bytes)
    t1 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
    guide = oc.Guide(oc.Index(regex, vocabulary))
    t2 = time.perf_counter()
    mask, times = allocate_token_bitmask(cfg.vocab_size), []
    for tok in [*ids, None]:
        a = time.perf_counter()
        fill_next_token_bitmask(guide, mask)
        times.append(time.perf_counter() - a)
        if tok is not None:
            guide.advance(tok)
    return t1 - t0, t2 - t1, times


def libraries(model, cfg, tok) -> None:
    a = time.perf_counter()
    Tokenizer(model)
    print(f"reading the model's tokenizer (in llguidance's vocabulary setup): "
          f"{ms(time.perf_counter() - a)}")
    a = time.perf_counter()
    vocab = byte_vocab(tok)
    print(f"the byte vocabulary xgrammar and outlines-core take (not in their setup): "
          f"{ms(time.perf_counter() - a)}\n")
    print("| library | schema | tokens | vocabulary setup | compile | mask per token: "
          "median | mean | max |")
    print("|---|---|---|---|---|---|---|---|")
    for name, schema, doc in (("4 fields", SMALL, SMALL_DOC), ("nested array", NESTED,
                                                                NESTED_DOC)):
        ids = tok.encode(json.dumps(doc), add_special_tokens=False)
        for lib, run in (("llguidance", lambda: bench_llguidance(model, cfg, schema, ids)),
                         ("xgrammar", lambda: bench_xgrammar(vocab, cfg, schema, ids)),
                         ("outlines-core", lambda: bench_outlines(vocab, cfg, schema, ids))):
            try:
                setup, compile_s, times = run()
            except ImportError:
                print(f"| {lib} | {name} | not installed |")
                continue
            print(f"| {lib} | {name} | {len(ids)} | {ms(setup)} | {ms(compile_s)} | "
                  f"{us(statistics.median(times))} | {us(statistics.mean(times))} | "
                  f"{us(max(times))} |")


def stage(model, cfg, rounds: int) -> None:
    torch.manual_seed(0)
    vocab, rows = cfg.vocab_size, 16
    procs = LogitsProcessors(model, vocab, cfg.eos_token_ids)
    history = torch.randint(0, vocab, (rows, 512)).tolist()
    doc_ids = Tokenizer(model).encode(json.dumps(SMALL_DOC), add_special_tokens=False)
    cases = {
        "none": dict(),
        "penalties": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
        "logit_bias (10 ids)": dict(logit_bias={i * 97: 1.5 for i in range(10)}),
        "json schema": dict(guide=("json", json.dumps(SMALL))),
    }
    batches = {}
    for name, kw in cases.items():
        seqs = []
        for r in range(rows):
            seq = Sequence(f"{name}-{r}", history[r][:256], SamplingParams(
                max_tokens=1000, temperature=0.8, **kw))
            seq.token_ids += doc_ids[:8] if "guide" in kw else history[r][256:]
            seqs.append(seq)
        batches[name] = seqs
        procs.apply(torch.randn(rows, vocab), seqs)  # builds the vocabulary, compiles
    times = {name: [] for name in cases}
    sampler = []
    for _ in range(rounds):
        logits = torch.randn(rows, vocab) * 5
        for name, seqs in batches.items():
            a = time.perf_counter()
            procs.apply(logits, seqs)
            times[name].append(time.perf_counter() - a)
        params = [s.params for s in batches["none"]]
        a = time.perf_counter()
        sample(logits, params, [None] * rows)
        sampler.append(time.perf_counter() - a)
    base = statistics.median(sampler)
    print(f"\nsampler alone (16 rows, temperature 0.8): {ms(base)}\n")
    print("| every row uses | stage | stage / sampler |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {ms(statistics.median(t))} | {statistics.median(t) / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = default_model_dir()
    cfg = ModelConfig.from_dir(model)
    print(f"model {model.name}, vocabulary {cfg.vocab_size}, load {os.getloadavg()[0]:.1f}\n")
    libraries(model, cfg, Tokenizer(model))
    stage(model, cfg, args.rounds)
    print(f"\nload at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
