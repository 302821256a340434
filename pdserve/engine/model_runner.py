"""Owns everything on the device: the model, the KV cache, the forward and sampling.

Shared by prefill and decode nodes and by the offline ``LLM``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from pdserve import kernels
from pdserve.engine import logprobs
from pdserve.engine.decode_window import DecodeWindows
from pdserve.engine.host_memory import SparseStorage, lazy_buffer
from pdserve.engine.inputs import ModelInputs, build_model_inputs, decode_slots
from pdserve.engine.sampler import make_generator, sample
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.kernels import native
from pdserve.model.cpu_linear import bound_onednn_caches, resolve_cpu_linear
from pdserve.model.llama import LlamaForCausalLM


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over every layer, for a ModelConfig."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def kv_tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def kv_views(storage: torch.Tensor, num_layers: int, shape: tuple[int, ...],
             dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV cache over one uint8 buffer: layer l's K at byte offset (2l) * T, its V at
    (2l + 1) * T, T the bytes of one [num_blocks, block_size, kv_heads, head_dim] tensor."""
    size = kv_tensor_bytes(shape, dtype)
    return [tuple(storage[i * size:(i + 1) * size].view(dtype).view(shape)
                  for i in (2 * layer, 2 * layer + 1))
            for layer in range(num_layers)]


def kv_storage_of(storage: torch.Tensor | SparseStorage | None, num_layers: int,
                  shape: tuple[int, ...], dtype: torch.dtype
                  ) -> tuple[torch.Tensor | None, Callable[[int, int], None] | None]:
    """(the bytes, ``reserve_blocks(start, stop)``) of what a ``kv_storage`` callback gave:
    reserve_blocks backs blocks [start, stop) of every layer's K and V (kv_views' layout) in
    a SparseStorage, raising its OSError; None for storage that is all backed."""
    if not isinstance(storage, SparseStorage):
        return storage, None
    size, block = kv_tensor_bytes(shape, dtype), kv_tensor_bytes(shape[1:], dtype)

    def reserve_blocks(start: int, stop: int) -> None:
        for i in range(2 * num_layers):
            storage.reserve(i * size + start * block, (stop - start) * block)

    return storage.data, reserve_blocks


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype, compute: str = "model",
                 kv_storage: Callable[[int], torch.Tensor | SparseStorage | None] | None = None,
                 decode_window_bytes: int = 0, cpu_linear: str = "auto"):
        """``kv_storage(nbytes)``: where the CPU KV cache lives (a uint8 tensor of nbytes,
        zero-filled, or a SparseStorage: a prefill node's shared-memory segment, backed as
        the block allocator hands out blocks through ``kv_reserve``), or None for its own
        memory.
        ``decode_window_bytes``: the most the CPU decode windows may take
        (engine/decode_window.py); 0 turns them off. ``cpu_linear``: EngineConfig's."""
        cfg = model.config
        model.fuse_projections()
        self.linear = resolve_cpu_linear(cpu_linear, torch.device(device), dtype)
        if self.linear == "onednn":
            bound_onednn_caches()  # before the first reorder: oneDNN reads the caps then
            model.use_onednn()
        self.model = model
        self.compute = compute
        # compute="none": the token every sampled sequence gets, never an EOS. From the middle
        # of the vocabulary: special tokens (empty text once detokenized) sit at its ends.
        self.fixed_token = next(t for t in range(cfg.vocab_size // 2, cfg.vocab_size)
                                if t not in cfg.eos_token_ids)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        self.logits_processors = None  # engine/logits_processors.py, set by the Worker
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # One K and one V tensor per layer: [num_blocks, block_size, num_kv_heads, head_dim]
        nbytes = 2 * cfg.num_hidden_layers * kv_tensor_bytes(shape, dtype)
        storage, self.kv_reserve = kv_storage_of(
            kv_storage(nbytes) if kv_storage is not None and self.device.type == "cpu"
            else None, cfg.num_hidden_layers, shape, dtype)
        self._kv_memory = None
        if storage is None and self.device.type == "cpu":
            # Zeros the OS maps only as blocks are written: a node's RSS holds the KV it
            # uses, not the whole --kv-cache-memory-gb (the mapping lives as long as we do).
            self._kv_memory, storage = lazy_buffer(nbytes, reserve=True)
        if storage is not None:
            self.kv_caches = kv_views(storage, cfg.num_hidden_layers, shape, dtype)
        else:
            self.kv_caches = [
                (torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device))
                for _ in range(cfg.num_hidden_layers)
            ]
        # On the CPU, bfloat16 and float16 caches: decode attention in C over the pages,
        # which leaves the windows nothing to do (kernels/native/decode_attention.py)
        self.native_decode_why_not = (
            kernels.native_decode_why_not(dtype, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.head_dim, self.device)
            if self.device.type == "cpu" else "not on the CPU")
        self.native_decode = self.native_decode_why_not is None
        self.native_prefill_why_not = (
            kernels.native_prefill_why_not(dtype, cfg.num_attention_heads,
                                           cfg.num_key_value_heads, cfg.head_dim, self.device)
            if self.device.type == "cpu" else "not on the CPU")
        if self.native_decode and compute == "model":
            native.library()  # built (or its failure raised) now, not in the first step
        self.decode_windows = (DecodeWindows(self.kv_caches, block_size, decode_window_bytes)
                               if self.device.type == "cpu" and decode_window_bytes > 0
                               and not self.native_decode else None)

    def describe_decode_attention(self) -> str:
        """Which decode attention runs, for the start-up log."""
        if self.device.type != "cpu":
            return "Triton paged kernel" if self.device.type == "cuda" else "torch reference"
        if self.native_decode:
            return "native C kernel over the KV pages"
        how = "float32 decode windows" if self.decode_windows is not None else "gathered pages"
        return f"torch SDPA over {how} (native kernel not used: {self.native_decode_why_not})"

    def describe_prefill_attention(self) -> str:
        """Which prefill attention runs on the CPU, for the start-up log."""
        if self.device.type != "cpu":
            return "Triton kernel" if self.device.type == "cuda" else "torch reference"
        if self.native_prefill_why_not is None:
            return f"native C flash kernel ({native.isa()})"
        return f"torch SDPA (native kernel not used: {self.native_prefill_why_not})"

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        chunks, starts, tables, mask = [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            chunks.append(seq.token_ids[start:start + n])
            starts.append(start)
            tables.append(seq.block_table)
            mask.append(batch.samples(i))
        inputs = build_model_inputs(chunks, starts, tables, mask, self.block_size, self.device,
                                    native_decode=self.native_decode)
        return replace(inputs, seqs=tuple(batch.seqs))

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One forward; returns the float32 logits [S, vocab] of the sampled rows."""
        return self.model.compute_logits(self._hidden(inputs, on_layer)[inputs.logits_indices])

    def _hidden(self, inputs: ModelInputs, on_layer: Callable[[int], None] | None
                ) -> torch.Tensor:
        """The hidden states [T, H] of every fed token."""
        windows = self.decode_windows
        if windows is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches,
                              on_layer)
        meta = windows.plan(inputs.meta, inputs.seqs)
        try:
            hidden = self.model(inputs.input_ids, inputs.positions, meta, self.kv_caches,
                                on_layer)
        except BaseException:
            windows.forget()  # some layers may have taken the step's token, others not
            raise
        windows.commit()
        return hidden

    def _decode_greedy(self, batch: ScheduledBatch) -> list[int] | None:
        """The tokens of a batch of decoding sequences that only sample greedily from logits
        nothing else reads (no logprobs, no logits processing), from the model's native
        step, which looks the tokens up and picks them itself
        (LlamaForCausalLM.decode_greedy); None where that does not apply."""
        seqs = batch.seqs
        if self.decode_windows is not None or not self.native_decode or not seqs:
            return None
        for i, (seq, n) in enumerate(zip(seqs, batch.num_new_tokens)):
            p = seq.params
            if n != 1 or not seq.num_computed_tokens or not batch.samples(i) or not p.greedy \
                    or p.logprobs is not None or p.processes_logits or seq.wants_prompt_logprobs:
                return None
        positions = [seq.num_computed_tokens for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        got = self.model.decode_greedy([seq.token_ids[p] for seq, p in zip(seqs, positions)],
                                       positions, tables,
                                       decode_slots(positions, tables, self.block_size),
                                       self.kv_caches)
        if got is None:
            return None
        hidden, tokens = got
        if tokens is None:  # a NaN logit, or no Q8_0 head: the logits the usual way
            with torch.inference_mode():
                tokens = sample(self.model.compute_logits(hidden), [s.params for s in seqs],
                                [None] * len(seqs))
        return tokens

    def execute(self, batch: ScheduledBatch,
                on_layer: Callable[[int], None] | None = None) -> list[int | None]:
        """Runs the batch; returns the sampled token of each sequence (None for a
        prefill chunk that does not reach the end of its prompt yet)."""
        if self.compute == "none":
            if on_layer is not None:  # the KV (zeros) still ships, layer group by group
                for layer in range(len(self.kv_caches)):
                    on_layer(layer)
            return [self.fixed_token if batch.samples(i) else None for i in range(len(batch))]
        if on_layer is None:
            # (outside inference mode: the native step makes no tensor autograd could
            # track, and entering the mode is Python of its own, every step)
            tokens = self._decode_greedy(batch)
            if tokens is not None:
                return tokens
        return self._forward(batch, on_layer)

    @torch.inference_mode()
    def _forward(self, batch: ScheduledBatch,
                 on_layer: Callable[[int], None] | None) -> list[int | None]:
        """execute's way through the model's forward, the logits and the sampler."""
        inputs = self.prepare(batch)
        hidden = self._hidden(inputs, on_layer)                            # [T, H]
        if any(seq.wants_prompt_logprobs for seq in batch.seqs):
            logprobs.record_prompt(self.model, hidden, batch)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])   # [S, V]
        out: list[int | None] = [None] * len(batch)
        if inputs.sample_rows:
            seqs = [batch.seqs[i] for i in inputs.sample_rows]
            for seq in seqs:
                if seq.generator is None and seq.params.seed is not None:
                    seq.generator = make_generator(seq.params, self.device,
                                                   self.model.config.vocab_size,
                                                   seq.num_output_tokens)
            raw = logprobs.raw_rows(logits, [s.params.logprobs for s in seqs])
            if self.logits_processors is not None:
                logits = self.logits_processors.apply(logits, seqs)
            tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            logprobs.record_sampled(raw, seqs, tokens)
            for row, token in zip(inputs.sample_rows, tokens):
                out[row] = token
        return out

