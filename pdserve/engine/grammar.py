"""Structured output through llguidance: a guide (kind, spec) becomes a grammar, a grammar
plus the model's vocabulary a token mask per step.

Why llguidance (xgrammar and outlines-core were measured beside it, SmolLM2's 49152-token
vocabulary on the 2-core dev machine): it has no dependencies (one abi3 wheel; xgrammar
requires torch, transformers and triton), compiles a grammar lazily in about a millisecond
(outlines-core builds a whole-vocabulary index up front: 36 ms for a 4-field schema, and it
grows with the schema), takes JSON schema, regex and Lark context-free grammars (outlines-core
only regular languages), says which schema keyword it does not support, and computes a mask in
tens of microseconds, far below one forward. Numbers: benchmarks/RESULTS.md.

The guides themselves (kinds, grammars, the check at the edge): common/guides.py.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pdserve.common.guides import to_grammar

CACHE_SIZE = 256               # compiled guides kept per node, at most ...
CACHE_MAX_BYTES = 512 * 2**20  # ... and about this much memory in them
# What a compiled guide holds, estimated from its spec (llguidance does not say): a
# 1,000-property schema (27 KB) took 3.8 MB of RSS on a 1,024-token vocabulary, a
# 10,000-property one about 25 MB on SmolLM2's 49,152. 256 of those were 6 GB per node.
COST_PER_SPEC_BYTE = 160
COST_BASE_BYTES = 64 * 1024
# Threads that compile guides off the compute loop (llguidance releases the GIL while it
# compiles: the loop steps on). Two, so one slow guide does not hold up every other.
COMPILE_WORKERS = 2


def guide_cost(guide: tuple[str, str]) -> int:
    """The bytes a compiled guide is reckoned to hold in the cache."""
    return COST_BASE_BYTES + COST_PER_SPEC_BYTE * len(guide[1])


class GrammarBackend:
    """One node's structured-output machinery: the vocabulary (built once, from the model's
    tokenizer) and a cache of compiled guides. Built on first use: a node no request asks
    for structured output pays nothing."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        from llguidance import LLTokenizer

        from pdserve.model.gguf import release_readers
        from pdserve.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_path)
        # llguidance reads the byte spelling of every token (byte-level BPE or SentencePiece
        # byte fallback) from the tokenizers JSON, GGUF-built tokenizers included.
        self.tokenizer = LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size,
                                     eos_token=list(eos_token_ids))
        # A GGUF file's tokenizer was read through its parsed reader, cached again since the
        # engine released it after loading (Worker.release_load_memory).
        release_readers()
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_bytes = 0          # guide_cost of what _cache holds
        self._lock = threading.Lock()
        self._compiling: dict[tuple[str, str], Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def compiled(self, guide: tuple[str, str]) -> bool:
        with self._lock:
            return guide in self._cache

    def compile_soon(self, guide: tuple[str, str]) -> Future:
        """The guide compiled into the cache on a worker thread; the Future's exception
        (a ValueError for a guide llguidance refuses) says why not. One compile per
        distinct guide, however many requests wait for it."""
        with self._lock:
            future = self._compiling.get(guide)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(COMPILE_WORKERS,
                                                    thread_name_prefix="guide-compile")
                future = self._compiling[guide] = self._pool.submit(self._compile, guide)
                future.add_done_callback(self._cancelled)
        return future

    def _cancelled(self, future: Future) -> None:
        """A compile cancelled before it started is forgotten (the next asks anew)."""
        if future.cancelled():
            with self._lock:
                for guide in [g for g, f in self._compiling.items() if f is future]:
                    del self._compiling[guide]

    def _compile(self, guide: tuple[str, str]) -> None:
        try:
            self.matcher(guide)
        finally:
            with self._lock:
                self._compiling.pop(guide, None)

    def matcher(self, guide: tuple[str, str]):
        """A fresh matcher at the start of the guide; ValueError saying why there is none."""
        from llguidance import LLMatcher

        with self._lock:
            compiled = self._cache.get(guide)
            if compiled is not None:
                self._cache.move_to_end(guide)
                return compiled.deep_copy()
        compiled = LLMatcher(self.tokenizer, to_grammar(*guide), log_level=0)
        if compiled.is_error():
            raise ValueError(f"structured output {guide[0]}: {compiled.get_error()}")
        with self._lock:
            if guide not in self._cache:
                self._cache[guide] = compiled
                self._cache_bytes += guide_cost(guide)
            # The newest stays even alone over the budget: its request is using it.
            while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE
                                            or self._cache_bytes > CACHE_MAX_BYTES):
                old, _ = self._cache.popitem(last=False)
                self._cache_bytes -= guide_cost(old)
        return compiled.deep_copy()


class GuideState:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_consumed = 0

    def catch_up(self, output_ids: list[int]) -> None:
        """Consumes the output tokens it has not seen: the tokens of earlier attempts (after
        a move to another node) and the one sampled last step."""
        new = output_ids[self.num_consumed:]
        if new and not self.matcher.consume_tokens(new):
            raise RuntimeError(f"structured output: tokens {new} break the grammar "
                               f"({self.matcher.get_error()})")
        self.num_consumed = len(output_ids)


def allowed_mask(states: list[GuideState], stop_ids: list[list[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """[R, V] bool: the tokens each row's grammar allows next. A row's stop tokens (EOS,
    its stop_token_ids) are allowed exactly when its grammar accepts the output so far."""
    words = (vocab_size + 31) // 32
    bits = torch.zeros((len(states), words), dtype=torch.int32)          # [R, W]
    for row, state in enumerate(states):
        state.matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), words * 4)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(states), -1)  # [R, W*32]
    allowed = allowed[:, :vocab_size]
    for row, state in enumerate(states):
        allowed[row, stop_ids[row]] = state.matcher.is_accepting()
    return allowed.to(device, non_blocking=True)
