"""A whole bfloat16 decode step in one native call (decode_step.c): every layer of a
Llama-family model whose projections are all native int4 (model/quant.py's Int4Linear).

The per-layer path makes about 150 kernel calls and 265 tensor views a batch-1 step of
SmolLM2-135M, each costing about what its kernel does; this is one call, with the same
arithmetic in the same order: the hidden states are the same bits. The model builds a
``DecodeStep`` once its weights are packed (model/llama.py) and calls it on decode steps
that run the native decode attention.
"""
from __future__ import annotations

import ctypes
import functools
import operator
from typing import NamedTuple

import torch

from pdserve.kernels.native import decode_attention, function

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class LayerWeights(NamedTuple):
    """One layer's tensors as the kernel reads them: the int4 projections packed for
    int4_gemm.c (q, k and v side by side; gate then up), the norms' weights bfloat16."""
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


class Shape(NamedTuple):
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in
                ("qkv", "o", "gate_up", "down", "ln1", "ln2", "k_cache", "v_cache")]


class _Model(ctypes.Structure):
    _fields_ = [("L", _I), ("hidden", _I), ("H", _I), ("KVH", _I), ("D", _I), ("I", _I),
                ("block_size", _I), ("eps", _F), ("scale", _F)]


class _Lookup(ctypes.Structure):
    _fields_ = [("ids", _P), ("positions", _P), ("emb_q8", _P), ("emb", _P), ("vocab", _L),
                ("cos_sin", _P), ("max_pos", _L)]


class _Inputs:
    """``DecodeStep.decode``'s ctypes inputs for one batch size, made once and filled in
    place each step: made anew, they were half of the wrapper's 55 us a batch-1 step, its
    memory cold after the weights streamed through the caches (RESULTS.md). ``width``: the
    block tables' row stride, room for ``width`` blocks a sequence."""

    def __init__(self, rows: int, width: int, lookup: Lookup):
        self.rows, self.width = rows, width
        self.tables = (ctypes.c_int32 * (rows * width))()
        self.ids, self.positions = (_L * rows)(), (_L * rows)()
        self.lens, self.slots = (ctypes.c_int32 * rows)(), (_L * rows)()
        self.tokens = (_L * rows)()
        emb = lookup.embedding
        q8 = emb.dtype is torch.uint8
        self.lookup = _Lookup(ctypes.addressof(self.ids), ctypes.addressof(self.positions),
                              emb.data_ptr() if q8 else None, None if q8 else emb.data_ptr(),
                              lookup.vocab, lookup.cos_sin.data_ptr(), lookup.cos_sin.shape[0])
        self.lookup_at = ctypes.addressof(self.lookup)


@functools.cache  # declaring the signature costs more than the call's arguments
def _fn():
    return function("pd_decode_step",
                    [_P, _P, _I, _P, _P, _P, _P, _P, _P, _L, _P, _P, _P, _I, _P, _P])


def why_not(shape: Shape) -> str | None:
    """None if the kernel takes a model of this shape, else why not (one phrase)."""
    why = decode_attention.why_not(torch.bfloat16, shape.num_heads, shape.num_kv_heads,
                                   shape.head_dim)
    if why is not None:
        return why
    for name, size in (("hidden size", shape.hidden), ("intermediate size", shape.intermediate),
                       ("heads x head_dim", shape.num_heads * shape.head_dim)):
        if size % 32:
            return f"{name} {size} is not a multiple of 32"
    return None


class Head(NamedTuple):
    """A Q8_0 LM head packed for q8_gemm.c ([ceil(vocab / 16), hidden / 32, 544] uint8)."""
    packed: torch.Tensor
    vocab: int


class Lookup(NamedTuple):
    """What ``DecodeStep.decode`` looks a step's tokens up in: the embedding, Q8_0 packed
    for q8_gemm.c (uint8, model/q8_head.py's) or bfloat16 [vocab, hidden], and the rotary
    cache (model/rope.py's float32 [max_position, head_dim]: cos, then sin)."""
    embedding: torch.Tensor
    vocab: int
    cos_sin: torch.Tensor


def lookup_why_not(lookup: Lookup, shape: Shape) -> str | None:
    """None if the step can look its tokens up in these tables, else why not."""
    emb, cs = lookup.embedding, lookup.cos_sin
    q8 = emb.dtype is torch.uint8
    rows = -(-lookup.vocab // 16) if q8 else lookup.vocab
    if not emb.is_cpu or not emb.is_contiguous() or lookup.vocab <= 0 \
            or tuple(emb.shape) != ((rows, shape.hidden // 32, 544) if q8
                                    else (rows, shape.hidden)) \
            or not (q8 or emb.dtype is torch.bfloat16):
        return (f"the embedding is not Q8_0-packed or bfloat16 [{lookup.vocab}, "
                f"{shape.hidden}] on the CPU: {emb.dtype} {list(emb.shape)}")
    if not cs.is_cpu or cs.dtype is not torch.float32 or not cs.is_contiguous() \
            or cs.dim() != 2 or cs.shape[1] != shape.head_dim:
        return f"the rotary cache is not float32 [positions, {shape.head_dim}] on the CPU"
    return None


def head_why_not(head: Head, shape: Shape) -> str | None:
    """None if the step can pick greedy tokens from this head, else why not."""
    if not head.packed.is_cpu or head.packed.dtype is not torch.uint8 \
            or not head.packed.is_contiguous() or head.vocab <= 0 \
            or tuple(head.packed.shape) != (-(-head.vocab // 16), shape.hidden // 32, 544):
        return (f"the LM head is not Q8_0-packed [{head.vocab}, {shape.hidden}] on the CPU: "
                f"{list(head.packed.shape)}")
    return None


class DecodeStep:
    """The layers' forward of a decode step (one token a sequence, every one with cached
    context), the final norm included, and with a Q8_0 head the greedy pick of every row.
    Holds the weights' tensors (their memory is read by address); the KV caches are bound
    on the first call and whenever they change."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, shape: Shape,
                 head: Head | None = None, lookup: Lookup | None = None):
        why = why_not(shape) or (lookup_why_not(lookup, shape) if lookup else None) \
            or (head_why_not(head, shape) if head else None)
        if why is not None:
            raise ValueError(f"native decode step: {why}")
        self.lookup = lookup
        self.layers, self.final_norm, self.shape, self.head = layers, final_norm, shape, head
        self._bound: tuple | None = None     # (the KV pairs bound, their _Layer array)
        self._out: torch.Tensor | None = None  # decode's hidden states, the last batch's size
        self._inputs: _Inputs | None = None    # decode's, the last batch's size
        self._model = _Model(len(layers), shape.hidden, shape.num_heads, shape.num_kv_heads,
                             shape.head_dim, shape.intermediate, 0, shape.eps,
                             shape.head_dim ** -0.5)

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        # the runner allocates its caches once: the same pairs as last step (by identity,
        # a few us; every address cost more than the rest of this wrapper). The bound pairs
        # are held, so the addresses in the array cannot outlive their tensors.
        bound = self._bound
        if bound is not None and len(bound[0]) == len(kv_caches) \
                and all(map(operator.is_, bound[0], kv_caches)):
            return bound[1]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        pairs = tuple(kv_caches)
        shape = self.shape
        block_size = pairs[0][0].shape[1]
        for k, v in pairs:
            if k.dtype is not torch.bfloat16 or v.dtype is not torch.bfloat16 \
                    or not (k.is_contiguous() and v.is_contiguous()) or k.dim() != 4 \
                    or k.shape != v.shape or k.shape[1] != block_size \
                    or tuple(k.shape[2:]) != (shape.num_kv_heads, shape.head_dim):
                raise ValueError(
                    "native decode step: the KV caches must be contiguous bfloat16 "
                    f"[blocks, {block_size}, {shape.num_kv_heads}, {shape.head_dim}], K and "
                    f"V alike, got {str(k.dtype).removeprefix('torch.')} {list(k.shape)}")
        array = (_Layer * len(self.layers))()
        for entry, w, (k, v) in zip(array, self.layers, pairs):
            entry.qkv, entry.o = w.qkv.data_ptr(), w.o.data_ptr()
            entry.gate_up, entry.down = w.gate_up.data_ptr(), w.down.data_ptr()
            entry.ln1 = w.input_norm.data_ptr()
            entry.ln2 = w.post_attention_norm.data_ptr()
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        self._model.block_size = block_size
        self._bound = (pairs, array)
        return array

    def rebind(self) -> None:
        """The weights' memory moved (their tensors are the same objects): the next call
        takes every address again."""
        self._bound = None
        self._inputs = None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [B, hidden] bfloat16 contiguous, the embeddings; cos, sin: the
        step's RotaryTables' ([B, 1, D] bfloat16, contiguous); block_tables int32 [B, n],
        seq_lens int32 [B], slots int64 [B], as the step's AttentionMetadata holds them.
        Returns the final norm's output [B, hidden]."""
        return self.run(x, cos, sin, block_tables, seq_lens, slots, kv_caches, False)[0]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pick: bool
            ) -> tuple[torch.Tensor, list[int] | None]:
        """``__call__``'s output and, when ``pick`` and the step has a head, every row's
        greedy token: the first index of its largest logit, as torch's max over the head's
        logits (Q8Head) gives. None instead where it has no head, or a row's logits hold a
        NaN: the caller then computes the logits from the output."""
        rows, d = x.shape[0], self.shape.head_dim
        if x.dtype is not torch.bfloat16 or not x.is_contiguous() \
                or x.shape[1] != self.shape.hidden \
                or block_tables.dtype is not torch.int32 or seq_lens.dtype is not torch.int32 \
                or slots.dtype is not torch.int64 or block_tables.stride(1) != 1 \
                or block_tables.shape[0] != rows or seq_lens.shape != (rows,) \
                or slots.shape != (rows,) or seq_lens.stride(0) != 1 or slots.stride(0) != 1 \
                or cos.numel() != rows * d or sin.numel() != rows * d \
                or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"native decode step: x bfloat16 [B, {self.shape.hidden}], "
                             f"cos and sin [B, 1, {d}], block tables [B, n] and lengths [B] "
                             "int32, slots [B] int64, all contiguous")
        out = torch.empty(rows, self.shape.hidden, dtype=torch.bfloat16)
        return self._call(rows, self._bind(kv_caches), pick, out, x.data_ptr(), cos.data_ptr(),
                          sin.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                          seq_lens.data_ptr(), slots.data_ptr(), None)

    def decode(self, ids: list[int], positions: list[int], tables: list[list[int]],
               slots: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               pick: bool) -> tuple[torch.Tensor, list[int] | None]:
        """``run`` from the step's tokens as lists: each sequence's token id, its position
        (its cached length), its block table and the token's cache slot. The step looks up
        the embedding's rows and the rotary tables itself (``Lookup``): ``run``'s inputs
        are a dozen tensors whose making took 0.2 ms of a batch-1 step. The hidden states
        it returns are valid until the next ``decode`` (one buffer, made again when the
        batch size changes, not a tensor every step). Raises IndexError
        for an id or a position outside the lookup's tables, a block table too short for
        its position or naming a block the cache has not, a slot outside the cache."""
        lookup = self.lookup
        if lookup is None:
            raise ValueError("native decode step: built without a lookup")
        rows = len(ids)
        if not rows or not len(positions) == len(tables) == len(slots) == rows:
            raise ValueError(f"native decode step: {rows} ids, {len(positions)} positions, "
                             f"{len(tables)} tables, {len(slots)} slots")
        layers = self._bind(kv_caches)
        self._check(ids, positions, tables, slots)
        width = max(map(len, tables)) or 1
        inputs = self._inputs
        if inputs is None or inputs.rows != rows or inputs.width < width:
            # room for 16 more blocks a sequence: made again every 16 blocks at most
            inputs = self._inputs = _Inputs(rows, width + 16, lookup)
        flat, width = inputs.tables, inputs.width
        for i, table in enumerate(tables):  # (the kernel reads a table up to its position)
            flat[i * width:i * width + len(table)] = table
        inputs.ids[:], inputs.positions[:] = ids, positions
        inputs.lens[:] = [p + 1 for p in positions]
        inputs.slots[:] = slots
        out = self._out
        if out is None or out.shape[0] != rows:
            out = self._out = torch.empty(rows, self.shape.hidden, dtype=torch.bfloat16)
        return self._call(rows, layers, pick, out, None, None, None, flat, width, inputs.lens,
                          inputs.slots, inputs.lookup_at, tokens=inputs.tokens)

    def _check(self, ids: list[int], positions: list[int], tables: list[list[int]],
               slots: list[int]) -> None:
        """decode's tokens against the tables the kernel reads and the cache it writes
        (bound), each an IndexError: the kernel trusts them."""
        vocab, max_pos = self.lookup.vocab, self.lookup.cos_sin.shape[0]
        blocks, size = self._bound[0][0][0].shape[:2]
        if min(ids) < 0 or max(ids) >= vocab:
            raise IndexError(f"native decode step: a token id out of range (vocab {vocab})")
        if min(positions) < 0 or max(positions) >= max_pos:
            raise IndexError(f"native decode step: a position out of range ({max_pos} "
                             "positions)")
        if min(slots) < 0 or max(slots) >= blocks * size:
            raise IndexError(f"native decode step: a slot out of range ({blocks} blocks of "
                             f"{size})")
        for table, p in zip(tables, positions):
            used = table[:p // size + 1]
            if len(used) <= p // size or min(used) < 0 or max(used) >= blocks:
                raise IndexError(f"native decode step: a block table that does not hold "
                                 f"position {p} in a cache of {blocks} blocks of {size}")

    def _call(self, rows: int, layers, pick: bool, out: torch.Tensor, *inputs, tokens=None
              ) -> tuple[torch.Tensor, list[int] | None]:
        """pd_decode_step over the bound ``layers`` into ``out`` [B, hidden] bfloat16:
        ``inputs`` are its x, cos, sin, tables, table stride, lengths, slots and lookup;
        ``tokens``: int64 [rows] for the picks, else one is made"""
        x, cos, sin, tables, stride, lens, slots, lookup = inputs
        head = self.head if pick else None
        if head is None:
            tokens = None
        elif tokens is None:
            tokens = (ctypes.c_int64 * rows)()
        rc = _fn()(ctypes.addressof(layers), ctypes.addressof(self._model), rows, x,
                   self.final_norm.data_ptr(), out.data_ptr(), cos, sin, tables, stride, lens,
                   slots, head.packed.data_ptr() if head is not None else None,
                   head.vocab if head is not None else 0, tokens, lookup)
        if rc == -1:
            raise MemoryError("pd_decode_step: no memory for its buffers")
        if rc == -3:
            raise IndexError(f"pd_decode_step: a token id or a position out of range (vocab "
                             f"{self.lookup.vocab}, {self.lookup.cos_sin.shape[0]} positions)")
        if rc:
            raise ValueError(f"pd_decode_step: shapes it cannot take ({self.shape})")
        picked = list(tokens) if tokens is not None else None
        return out, picked if picked is None or min(picked) >= 0 else None
