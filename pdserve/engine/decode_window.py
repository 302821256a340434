"""Decode windows: the running batch's context kept contiguous across CPU decode steps.

The torch decode attention reads a sequence's context from its pages, which lie
anywhere in the cache, so each layer of each step used to copy every sequence's whole
context out of its pages before calling SDPA: on SmolLM2 at batch 16 that gather was
about a tenth of the step. transformers keeps one contiguous cache per batch instead
(and copies it whole every step to append a token).

A window is one layer's K and V as one float32 ``[B, 2, num_kv_heads, cap, head_dim]``
(kernels.DecodeWindow), [b, 0, h] and [b, 1, h] holding sequence b's context, head-major
as SDPA reads it. While the batch stays the same (the same sequences in the same order,
each one token further), a step writes just the new token of each sequence into its row,
the K and V the layer has just stored in its cache slot. When the batch changes, the step
refills the windows from the pages, once per layer: what the gather did every step. The
windows cost memory, a second copy of the batch's context padded to the longest one, in
float32 (twice a bfloat16 cache's bytes: SDPA computes in float32 anyway, and converting
the window every layer of every step cost more than the attention); past ``budget_bytes``
the step gathers as before.

Only CPU decode steps that call SDPA use them: float32 ones, and bfloat16/float16 ones
where the native decode attention does not run (it reads the pages itself, as the GPU's
Triton kernel does; ModelRunner then builds no windows). The
pages stay the source of truth: a step appends only when its batch holds the same
sequence objects in the same order, each one token further (or the same step again)
on the same pages under the window's positions, after a forward that completed;
anything else refills.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pdserve.kernels import DecodeWindow, WindowFill
from pdserve.kernels.attention_decode import page_list
from pdserve.model.attention import AttentionMetadata

WINDOW_DTYPE = torch.float32  # whatever the cache's: kernels.DecodeWindow

# Positions a window holds past the longest context when it is (re)built, at most: it is
# refilled when the longest context outgrows it, so every HEADROOM steps in a steady batch.
# Short contexts get a quarter of their length (at least a block), so that a batch that
# changes every step does not copy much more than the gather did.
HEADROOM = 64


def window_default_bytes(kv_cache_bytes: int, dtype: torch.dtype) -> int:
    """--decode-window-memory-gb's default: windows of half the KV cache's positions. They
    hold WINDOW_DTYPE, so that is half the cache's bytes for a float32 cache and all of a
    bfloat16 one's."""
    return kv_cache_bytes // 2 * WINDOW_DTYPE.itemsize // dtype.itemsize


class DecodeWindows:
    """Every layer's window, and the proof of what they hold. ``plan`` puts them in a
    step's metadata; ``commit`` records the step once its forward is complete; any
    other forward, or a failed one, calls ``forget``."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 budget_bytes: int):
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        k = kv_caches[0][0]
        self._token_shape = tuple(k.shape[2:])  # (num_kv_heads, head_dim)
        # bytes of one position of one row, K and V of every layer, in float32
        self.position_bytes = 2 * len(kv_caches) * k[0, 0].numel() * WINDOW_DTYPE.itemsize
        self._storage: list[torch.Tensor] = []  # flat, one per layer
        self._views: tuple[tuple[int, int], list[torch.Tensor]] | None = None  # (rows, cap)
        self._held: tuple | None = None     # (seqs, lens, cap, block tables) they hold
        self._pending: tuple | None = None  # the same, once this step's forward completes
        self.refills = 0
        self.appends = 0

    def plan(self, meta: AttentionMetadata, seqs: tuple) -> AttentionMetadata:
        """``meta`` with the step's windows, or ``meta`` itself when they do not apply (not a
        CPU decode step, or over the budget). ``seqs``: the batch's sequence objects, in
        order; they identify the rows (kept referenced, so no object can take another's
        place)."""
        gather = meta.decode_gather
        self._pending = None
        if gather is None or not seqs:
            self.forget()
            return meta
        lens = meta.seq_lens.numpy().astype(np.int64)  # counting the new token
        tables = meta.block_tables.numpy()
        rows = len(lens)
        held = self._held
        if (held is not None and gather.max_len <= held[2] and len(held[0]) == rows
                and all(a is b for a, b in zip(seqs, held[0]))
                and bool(((lens == held[1]) | (lens == held[1] + 1)).all())
                and self._same_pages(held[3], held[1], tables)):
            # Same batch, each sequence one token further (or the same step again), on the
            # same pages: the rows hold positions < lens - 1, so only the newest token of
            # each is written.
            cap, heads = held[2], 2 * self._token_shape[0]
            # row (b, j) of the [B * 2 KVH * cap, D] window takes position lens[b] - 1
            at = (np.arange(rows * heads).reshape(rows, heads) * cap + (lens - 1)[:, None])
            fill = WindowFill(rows=torch.from_numpy(at.reshape(-1)))
            self.appends += 1
        else:
            headroom = min(HEADROOM, max(self.block_size, gather.max_len // 4))
            cap = -(-(gather.max_len + headroom) // self.block_size) * self.block_size
            if rows * cap * self.position_bytes > self.budget_bytes:
                self.forget()
                self._free()  # give the memory back; gather as before
                return meta
            fill = WindowFill(pages=page_list(meta.block_tables, meta.seq_lens,
                                              self.block_size, cap // self.block_size))
            self.refills += 1
        self._pending = (tuple(seqs), lens, cap, tables)
        return replace(meta, decode_windows=self._windows(rows, cap, fill))

    def commit(self) -> None:
        """The planned step's forward ran through every layer: its windows are current."""
        if self._pending is not None:
            self._held, self._pending = self._pending, None

    def forget(self) -> None:
        self._held = self._pending = None

    def _same_pages(self, held_tables: np.ndarray, held_lens: np.ndarray,
                    tables: np.ndarray) -> bool:
        """Whether every row's pages under the positions its window holds are the same.
        They can change under a sequence that stays in the batch: preempted and readmitted
        in one schedule, it may take its prefix from the cache, in another request's
        blocks (same tokens, K/V computed another way, so not the same bits)."""
        need = -(-held_lens // self.block_size)  # blocks under positions < held_lens
        width = int(need.max())
        if width > held_tables.shape[1] or width > tables.shape[1]:
            return False
        same = held_tables[:, :width] == tables[:, :width]
        return bool((same | (np.arange(width)[None, :] >= need[:, None])).all())

    def _free(self) -> None:
        self._storage, self._views = [], None

    def _windows(self, rows: int, cap: int, fill: WindowFill) -> tuple[DecodeWindow, ...]:
        numel = rows * cap * 2 * int(np.prod(self._token_shape))
        if not self._storage or self._storage[0].numel() < numel:
            # (Only on a refill: an append keeps rows and cap, so its windows fit.)
            self._free()  # the old windows before taking the new ones
            self._storage = [k.new_empty(numel, dtype=WINDOW_DTYPE) for k, _ in self.kv_caches]
        if self._views is None or self._views[0] != (rows, cap):
            # Kept while rows and cap stay: 30 layers' views are 60 operations a step
            heads, head_dim = self._token_shape
            shape = (rows, 2, heads, cap, head_dim)
            self._views = (rows, cap), [kv[:numel].view(shape) for kv in self._storage]
        return tuple(DecodeWindow(kv, fill) for kv in self._views[1])
