"""Turns a scheduled batch into the flat tensors of one forward, vectorised.

Per-sequence work is a slice copy; nothing loops over tokens in Python. This
is where per-token overhead hides in serving engines, so it is kept to a few
numpy operations whatever the mix of prefill chunks and decode tokens; a small
decode batch (one token a sequence) takes a shorter path of list comprehensions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve import kernels
from pdserve.model.attention import DECODE, MIXED, PREFILL, AttentionMetadata

# Decode batches up to this size take the short path (_decode_inputs): per-call cost rules
# there; larger ones take numpy's vectorised one.
SHORT_DECODE_MAX = 8


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor       # int64 [T]
    positions: torch.Tensor       # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S]: rows of the hidden states that are sampled
    sample_rows: list[int]        # which sequences of the batch those S rows belong to
    seqs: tuple = ()              # the batch's Sequence objects (the runner's decode windows)


def build_model_inputs(token_chunks: list[list[int]], start_positions: list[int],
                       block_tables: list[list[int]], sample_mask: list[bool],
                       block_size: int, device: torch.device | str = "cpu",
                       native_decode: bool = False) -> ModelInputs:
    """Inputs for B sequences: sequence i feeds ``token_chunks[i]`` at positions
    ``start_positions[i]...``, its KV pages are ``block_tables[i]``, and
    ``sample_mask[i]`` says whether its last token is sampled. ``native_decode``: a CPU
    decode step runs the native decode attention (AttentionMetadata.decode_native), which
    needs no gather."""
    how = _decode_inputs if 0 < len(start_positions) <= SHORT_DECODE_MAX and \
        all(start_positions) and all(len(c) == 1 for c in token_chunks) else _batch_inputs
    return how(token_chunks, start_positions, block_tables, sample_mask, block_size, device,
               native_decode)


def _batch_inputs(token_chunks: list[list[int]], start_positions: list[int],
                  block_tables: list[list[int]], sample_mask: list[bool], block_size: int,
                  device: torch.device | str, native_decode: bool) -> ModelInputs:
    """build_model_inputs of any batch: prefill chunks, decode tokens, or both."""
    num_seqs = len(token_chunks)
    q_lens = np.fromiter((len(c) for c in token_chunks), dtype=np.int64, count=num_seqs)
    starts = np.asarray(start_positions, dtype=np.int64)
    seq_lens = starts + q_lens
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])

    if total == num_seqs:  # one token each: skip the concatenation
        input_ids = np.fromiter((c[0] for c in token_chunks), dtype=np.int64, count=num_seqs)
    else:
        input_ids = np.concatenate([np.asarray(c, dtype=np.int64) for c in token_chunks])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)                 # [T]
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)

    max_blocks = max((len(b) for b in block_tables), default=0) or 1
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)             # [B, max_blocks]
    for i, blocks in enumerate(block_tables):
        tables[i, :len(blocks)] = blocks
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size                                          # [T]

    if total == num_seqs and bool(starts.all()):
        kind = DECODE
    elif not starts.any():
        kind = PREFILL
    else:
        kind = MIXED
    sample_rows = [i for i, s in enumerate(sample_mask) if s]
    logits_indices = cu[1:][sample_rows] - 1

    def t(a, dtype):
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    meta = _metadata(kind, t(cu, torch.int32), t(seq_lens, torch.int32), t(slots, torch.int64),
                     t(tables, torch.int32), block_size, native_decode)
    return ModelInputs(t(input_ids, torch.int64), t(positions, torch.int64), meta,
                       t(logits_indices, torch.int64), sample_rows)


def _decode_inputs(token_chunks: list[list[int]], start_positions: list[int],
                   block_tables: list[list[int]], sample_mask: list[bool], block_size: int,
                   device: torch.device | str, native_decode: bool) -> ModelInputs:
    """build_model_inputs of a small decode step (one token a sequence, each after its
    context): the same tensors from a few list comprehensions. At batch 1 the general
    path's dozen numpy operations, cold in the cache after a forward, took 0.18-0.20 ms
    of a 5.7 ms step in the engine, this 0.09-0.10 (RESULTS.md, "Batch-1 TPOT through
    launch: where the rest goes")."""
    num_seqs = len(token_chunks)
    max_blocks = max(len(b) for b in block_tables) or 1
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)             # [B, max_blocks]
    for i, blocks in enumerate(block_tables):
        tables[i, :len(blocks)] = blocks
    slots = decode_slots(start_positions, block_tables, block_size)       # [B]
    sample_rows = [i for i, s in enumerate(sample_mask) if s]

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    meta = _metadata(DECODE, t(list(range(num_seqs + 1)), torch.int32),
                     t([p + 1 for p in start_positions], torch.int32), t(slots, torch.int64),
                     torch.from_numpy(tables).to(device=device), block_size, native_decode)
    return ModelInputs(t([c[0] for c in token_chunks], torch.int64),
                       t(start_positions, torch.int64), meta, t(sample_rows, torch.int64),
                       sample_rows)


def decode_slots(positions: list[int], block_tables: list[list[int]], block_size: int
                 ) -> list[int]:
    """The KV cache slot of each sequence's token at ``positions[i]`` (its page, through its
    block table, and the offset in it)."""
    return [table[p // block_size] * block_size + p % block_size
            for table, p in zip(block_tables, positions)]


def _metadata(kind: str, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
              slot_mapping: torch.Tensor, block_tables: torch.Tensor, block_size: int,
              native_decode: bool) -> AttentionMetadata:
    """The step's AttentionMetadata (both paths'): which decode attention a CPU decode step
    runs, and the page list the torch one needs, decided here once."""
    decode_on_cpu = kind == DECODE and seq_lens.device.type == "cpu"
    native = decode_on_cpu and native_decode
    return AttentionMetadata(
        kind=kind,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        all_slots=True,  # every token is fed into a block of its table
        decode_native=native,
        decode_gather=(kernels.decode_gather(block_tables, seq_lens, block_size)
                       if decode_on_cpu and not native else None),
    )
