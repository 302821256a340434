"""``--compute simulated``: a runner that sleeps a profile's roofline instead of running a
model, with the interface of ModelRunner (what the Engine and the KV senders and receiver
use: ``execute``, ``kv_caches``, ``num_blocks``).

- Time: each step's predicted seconds (sim/roofline.py) are slept on a clock. A step
  that goes on with sequences of the last one starts at the last one's end, so the Python
  work between steps is absorbed as long as it is shorter than the step. A
  prefill step fires ``on_layer`` at each layer's share of the step, so KV ships layer
  group by layer group as it would from a GPU.
- KV: real pages of the profile's layout, its head_dim scaled by ``--sim-kv-bytes-scale``
  (sim/profile.py: scaled_head_dim), in memory the OS maps only once a page is written
  (engine/host_memory.py: lazy_buffer).
  Nothing writes them but KV arriving from a prefill node: their bytes are whatever the
  memory held, and still checksummed and acknowledged like real KV.
- Tokens: a seeded stream from the token space of the --model checkpoint (the router's
  tokenizer), never its EOS ids, until the request's output length, drawn from the
  profile's EOS distribution, is reached; then its first EOS id. The stream and the length
  are functions of the profile's seed, the prompt's ids, the request's seed and the
  position only: a prefill node and the decode node taking the request over continue the
  same stream without telling each other anything.
"""
from __future__ import annotations

import logging
import math
import os
import random
import struct
import time
from dataclasses import dataclass
from typing import Callable

import torch
import xxhash

from pdserve.engine.host_memory import SparseStorage, lazy_buffer
from pdserve.engine.model_runner import kv_storage_of, kv_tensor_bytes, kv_views
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.sim import roofline as R
from pdserve.sim.profile import DTYPE_BYTES, Profile, scaled_head_dim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimModelConfig:
    """What a simulated engine knows of its model (the fields of ModelConfig it reads):
    the token space of the checkpoint the router tokenizes with, capped at the profile
    model's context; the KV shape of the profile's model, head_dim scaled."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    torch_dtype: str


def sim_model_config(token_space, profile: Profile, kv_scale: float) -> SimModelConfig:
    """``token_space``: (vocabulary size, EOS ids, context), model/config.py's
    read_token_space."""
    vocab, eos, context = token_space
    m = profile.model
    return SimModelConfig(vocab_size=int(vocab), eos_token_ids=tuple(eos),
                          max_model_len=min(int(context), m.max_model_len),
                          num_hidden_layers=m.num_layers, num_key_value_heads=m.num_kv_heads,
                          head_dim=scaled_head_dim(profile, kv_scale), torch_dtype=m.dtype)


def sim_num_blocks(profile: Profile, block_size: int) -> int:
    """The profile's KV capacity (from the devices' memory, at the real KV size) in blocks."""
    return max(1, R.kv_capacity_tokens(profile) // block_size)


class SimRunner:
    compute = "simulated"
    decode_windows = None

    def __init__(self, profile: Profile, model_config, num_blocks: int, block_size: int,
                 dtype: torch.dtype,
                 kv_storage: Callable[[int], torch.Tensor | SparseStorage | None] | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        """``model_config``: sim_model_config's. ``sleep`` and ``clock``: for tests."""
        self.profile = profile
        self.block_size, self.num_blocks = block_size, num_blocks
        self.device, self.dtype = torch.device("cpu"), dtype
        self.logits_processors = None  # set by the Worker; a token stream has no logits
        self.sleep, self.clock = sleep, clock
        self.busy_until = 0.0          # the end of the last step on the clock
        self._last_ids: set[str] = set()  # the sequences of the last step
        self.num_steps, self.slept_s = 0, 0.0
        cfg = model_config
        layers = cfg.num_hidden_layers
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        nbytes = 2 * layers * kv_tensor_bytes(shape, dtype)
        storage, self.kv_reserve = kv_storage_of(
            kv_storage(nbytes) if kv_storage is not None else None, layers, shape, dtype)
        self._memory = None
        if storage is None:
            phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if nbytes > phys // 2:
                log.warning("the simulated KV cache spans %.1f GiB, more than half this "
                            "machine's memory: it is fine while few blocks are in use; lower "
                            "--sim-kv-bytes-scale for load", nbytes / 2**30)
            self._memory, storage = lazy_buffer(nbytes)   # the mapping lives as long as we do
        self.kv_caches = kv_views(storage, layers, shape, dtype)
        self.num_layers = layers
        eos = tuple(cfg.eos_token_ids)
        self.eos_token = eos[0] if eos else None
        # Stream tokens from the middle half of the vocabulary: special tokens (empty text
        # once detokenized) sit at its ends.
        self.stream = [t for t in range(cfg.vocab_size // 4, 3 * cfg.vocab_size // 4)
                       if t not in eos]

    # -- time -------------------------------------------------------------------------------
    def predict(self, batch: ScheduledBatch) -> float:
        chunks, contexts = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            cached = seq.num_computed_tokens
            if n == 1 and cached >= seq.num_prompt_tokens:   # a decode row
                contexts.append(cached + 1)
            else:
                chunks.append(R.Chunk(n, cached, batch.samples(i)))
        return R.step_seconds(self.profile, chunks, contexts)

    def _sleep_until(self, t: float) -> None:
        wait = t - self.clock()
        if wait > 0:
            self.sleep(wait)
            self.slept_s += wait

    def execute(self, batch: ScheduledBatch,
                on_layer: Callable[[int], None] | None = None) -> list[int | None]:
        """Sleeps the batch's predicted time; returns each sequence's token (None for a
        prefill chunk short of its prompt's end), like ModelRunner.execute."""
        seconds = self.predict(batch)
        now = self.clock()
        ids = {seq.seq_id for seq in batch.seqs}
        # A batch going on from the last step starts where that step ended: a GPU engine
        # prepares the next step while the last one runs, so the Python time in between
        # (shorter than the step) is hidden. A batch after idle time starts now.
        continuing = not ids.isdisjoint(self._last_ids) and now - self.busy_until < seconds
        start = self.busy_until if continuing else now
        self.busy_until = start + seconds
        self._last_ids = ids
        self.num_steps += 1
        if on_layer is not None:
            for layer in range(self.num_layers):
                self._sleep_until(start + seconds * (layer + 1) / self.num_layers)
                on_layer(layer)
        self._sleep_until(self.busy_until)
        return [self.token(seq) if batch.samples(i) else None
                for i, seq in enumerate(batch.seqs)]

    # -- tokens -----------------------------------------------------------------------------
    def _key(self, seq) -> int:
        key = getattr(seq, "sim_key", None)
        if key is None:
            h = xxhash.xxh64(struct.pack("<q", self.profile.seed))
            h.update(struct.pack(f"<{seq.num_prompt_tokens}q",
                                 *seq.token_ids[:seq.num_prompt_tokens]))
            h.update(struct.pack("<q", -1 if seq.params.seed is None else seq.params.seed))
            key = seq.sim_key = h.intdigest()
            seq.sim_length = output_length(self.profile, random.Random(key))
        return key

    def token(self, seq) -> int:
        """The token at seq's next output position."""
        key = self._key(seq)
        n = seq.num_output_tokens          # outputs before this one
        p = seq.params
        if self.eos_token is not None and not p.ignore_eos and \
                n + 1 >= max(seq.sim_length, p.min_tokens + 1):
            return self.eos_token
        h = xxhash.xxh64_intdigest(struct.pack("<qQ", n, key))
        return self.stream[h % len(self.stream)]


def output_length(profile: Profile, rng: random.Random) -> float:
    """A request's output length (EOS included) from the profile's distribution; inf: none."""
    e = profile.eos
    if e.kind == "fixed":
        return e.tokens
    if e.kind == "uniform":
        return rng.randint(e.min_tokens, e.max_tokens)
    if e.kind == "never":
        return math.inf
    if e.mean_tokens <= 1:
        return 1
    u = 1.0 - rng.random()   # in (0, 1]: the geometric's inverse CDF, lengths from 1
    return 1 + math.floor(math.log(u) / math.log(1 - 1 / e.mean_tokens))


def sim_dtype(profile: Profile) -> torch.dtype:
    assert profile.model.dtype in DTYPE_BYTES
    return getattr(torch, profile.model.dtype)
