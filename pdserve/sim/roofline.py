"""Step times of a simulated accelerator, from a profile's roofline (pure arithmetic).

With the model spread over ``tp`` devices (FLOP/s and bandwidth add up, TP communication
is not modelled) and ``b`` bytes per weight and KV element::

    prefill chunk  = FLOPs / (tp * peak * compute_eff) + bytes / (tp * bw * bandwidth_eff)
    decode step    = bytes / (tp * bw * bandwidth_eff) + step_overhead_s

where bytes = the weights read once per step (every layer and the LM head; the embedding
is a lookup) + the KV the step's attention reads. A step that mixes prefill chunks and
decode rows (a colocated node) pays the chunks' FLOPs, the weights once, every row's KV
and the overhead. Decode rows' FLOPs are not counted: at decode batch sizes the weights'
bytes, not the FLOPs, set the time (the roofline's memory-bound side).

FLOPs of a chunk of n new tokens after c tokens already in the KV cache, s of its rows
sampled (1 for a prompt's last chunk, else 0)::

    2 * n * layer_params * L + 2 * s * vocab * hidden
    + 4 * L * heads * head_dim * n * (c + (n + 1) / 2)     (causal QK^T and PV)
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.sim.profile import DTYPE_BYTES, Profile


def layer_params(p: Profile) -> int:
    """Weights of one decoder layer: q, k, v, o projections and the gated MLP (norms,
    a few thousand weights, are left out)."""
    m = p.model
    q = m.hidden_size * m.num_heads * m.head_dim
    kv = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
    o = m.num_heads * m.head_dim * m.hidden_size
    return q + kv + o + 3 * m.hidden_size * m.intermediate_size


def num_params(p: Profile) -> int:
    """Every weight held: the layers, the embedding and (unless tied) the LM head."""
    m = p.model
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * layer_params(p) + embeddings


def weight_bytes_read(p: Profile) -> int:
    """Bytes of weights one step reads: every layer and the LM head."""
    m = p.model
    return (m.num_layers * layer_params(p) + m.vocab_size * m.hidden_size) * \
        DTYPE_BYTES[m.dtype]


def kv_bytes_per_token(p: Profile) -> int:
    m = p.model
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * DTYPE_BYTES[m.dtype]


def kv_capacity_tokens(p: Profile) -> int:
    """Tokens of KV the node's devices hold beside the weights; ValueError when the
    weights alone do not fit."""
    usable = p.tensor_parallel * p.accelerator.memory_bytes * p.roofline.memory_utilization
    weights = num_params(p) * DTYPE_BYTES[p.model.dtype]
    if weights >= usable:
        raise ValueError(f"sim profile {p.name}: {weights / 1e9:.1f} GB of weights do not fit "
                         f"in {usable / 1e9:.1f} GB ({p.tensor_parallel} x "
                         f"{p.accelerator.name} at memory_utilization "
                         f"{p.roofline.memory_utilization})")
    return int((usable - weights) // kv_bytes_per_token(p))


def chunk_flops(p: Profile, num_new: int, num_cached: int, sampled: bool) -> float:
    m = p.model
    linear = 2.0 * num_new * layer_params(p) * m.num_layers
    head = 2.0 * m.vocab_size * m.hidden_size if sampled else 0.0
    attention = 4.0 * m.num_layers * m.num_heads * m.head_dim * num_new * (
        num_cached + (num_new + 1) / 2)
    return linear + head + attention


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk of a step: ``num_new`` tokens after ``num_cached`` in the cache."""
    num_new: int
    num_cached: int = 0
    sampled: bool = True


def step_seconds(p: Profile, chunks: list[Chunk], decode_contexts: list[int]) -> float:
    """The time of one step running ``chunks`` and one decode row per entry of
    ``decode_contexts`` (the tokens whose KV that row's attention reads, its new one
    included). 0 for an empty step."""
    if not chunks and not decode_contexts:
        return 0.0
    tp, acc, r = p.tensor_parallel, p.accelerator, p.roofline
    flops = sum(chunk_flops(p, c.num_new, c.num_cached, c.sampled) for c in chunks)
    kv_tokens = sum(c.num_cached for c in chunks) + sum(decode_contexts)
    nbytes = weight_bytes_read(p) + kv_tokens * kv_bytes_per_token(p)
    seconds = flops / (tp * acc.peak_flops * r.compute_efficiency) + \
        nbytes / (tp * acc.memory_bandwidth * r.bandwidth_efficiency)
    return seconds + (r.step_overhead_s if decode_contexts else 0.0)


def prefill_seconds(p: Profile, prompt_len: int, chunk_tokens: int | None = None) -> float:
    """A whole prompt's prefill, alone on the node, in chunks of at most chunk_tokens."""
    chunk_tokens = chunk_tokens or prompt_len
    total, done = 0.0, 0
    while done < prompt_len:
        n = min(chunk_tokens, prompt_len - done)
        total += step_seconds(p, [Chunk(n, done, done + n == prompt_len)], [])
        done += n
    return total


def decode_step_seconds(p: Profile, batch: int, context: int) -> float:
    """One decode step of ``batch`` rows, each reading ``context`` tokens of KV."""
    return step_seconds(p, [], [context] * batch)
