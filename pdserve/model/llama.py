"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) over flat, packed tokens.

Module and parameter names mirror Hugging Face's so that a checkpoint's
state dict loads without renaming. Tokens of all sequences in a step are
packed into one flat batch ``[T]``; the attention metadata says where each
sequence starts and where its KV lives.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from pdserve import kernels
from pdserve.kernels.native import decode_ops, decode_step
from pdserve.model.attention import AttentionMetadata, PagedAttention
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_linear import OneDNNLinear
from pdserve.model.q8_head import Q8Embedding, Q8Head
from pdserve.model.quant import Int4Linear, kernels_used
from pdserve.model.rope import cos_sin_cache

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

LM_HEAD_CPU_BLOCK = 1024  # vocabulary rows per GEMM of the LM head on the CPU


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # The model owns every residual it passes (a layer's output, or the embedding's):
        # the sum may go into it rather than into a new tensor. It built x and residual
        # itself: no argument checks (kernels' docstring).
        return kernels.rms_norm(x, self.weight, self.eps, residual=residual,
                                add_in_place=True, check=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # Qwen2 puts biases on q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = bias and cfg.model_type != "qwen2"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer)
        self.qkv_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        """One [q; k; v] projection instead of three (fewer, larger GEMMs; same bits on the
        CPU: each output column is the same dot product). Done after loading."""
        if self.qkv_proj is None:
            self.qkv_proj = _fused_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, positions, cos_sin, meta: AttentionMetadata, kv_cache: KVCache | None,
                rope: kernels.RotaryTables | None = None):
        """``rope``: the step's rotary tables (torch path), else ``apply_rotary`` per layer."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and rope is not None:
            qkv = self.qkv_proj(x).view(t, -1, d)                     # [T, H + 2 KVH, D]
            # q's and k's heads lie side by side: one rotation for both, in place, so that
            # k stays beside v (a decode window appends both in one copy)
            kernels.rotate_(qkv[:, :h + kvh], rope)
            q, kv = qkv[:, :h], qkv[:, h:]                            # [T, H, D], [T, 2 KVH, D]
            k, v = kv[:, :kvh], kv[:, kvh:]                           # [T, KVH, D] each
        else:
            kv = None
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).view(t, -1, d).split([h, kvh, kvh], dim=1)
            else:
                q = self.q_proj(x).view(t, h, d)                      # [T, H, D]
                k = self.k_proj(x).view(t, kvh, d)                    # [T, KVH, D]
                v = self.v_proj(x).view(t, kvh, d)                    # [T, KVH, D]
            if rope is not None:
                q, k = kernels.rotate_(q, rope), kernels.rotate_(k, rope)
            else:
                q, k = kernels.apply_rotary(q, k, positions, cos_sin)
        out = self.attn(q, k, v, meta, kv_cache, kv)                  # [T, H, D]
        return self.o_proj(out.reshape(t, h * d))


def _fused_linear(*parts: nn.Linear | Int4Linear) -> nn.Linear | Int4Linear:
    """One Linear whose output is the parts' outputs side by side. int4 parts stay int4
    when all are (packed for the kernel here); among float parts they are dequantized."""
    if all(isinstance(p, Int4Linear) for p in parts):
        return Int4Linear.cat(list(parts))
    dtype = next(p.weight.dtype for p in parts if isinstance(p, nn.Linear))
    parts = tuple(_as_linear(p, dtype) if isinstance(p, Int4Linear) else p for p in parts)
    w = parts[0].weight
    fused = nn.Linear(w.shape[1], sum(p.out_features for p in parts),
                      bias=parts[0].bias is not None, device="meta", dtype=w.dtype)
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def _as_linear(q: Int4Linear, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device="meta")
    lin.weight = nn.Parameter(q.dequantized().to(dtype), requires_grad=False)
    if q.bias is not None:
        lin.bias = nn.Parameter(q.bias.to(dtype), requires_grad=False)
    return lin


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        """One [gate; up] projection instead of two, as Attention.fuse."""
        if self.gate_up_proj is None:
            self.gate_up_proj = _fused_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        elif x.device.type == "cpu" and isinstance(self.gate_up_proj, nn.Linear):
            # Two GEMMs over the fused weight's halves (row views: no copy), same bits.
            # On the CPU one [2I, H] GEMM ran 5-10 % slower than two [I, H] ones at
            # 16-64 rows (MKL, SmolLM2's shapes), and silu then read a strided half.
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
            i = w.shape[0] // 2
            gate = nn.functional.linear(x, w[:i], None if b is None else b[:i])
            up = nn.functional.linear(x, w[i:], None if b is None else b[i:])
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if decode_ops.runs(gate) and up.stride(1) == 1:
            # bfloat16 on the CPU: silu and the product in one native call, the same bits
            return self.down_proj(decode_ops.silu_mul(gate, up))
        # gate is this call's own (a new tensor or a half of one): silu goes into it, and
        # the product too where gate is a whole tensor (same bits as silu(gate) * up). A
        # strided half takes the product into a new tensor: the int4 GEMM needs its input
        # contiguous (a bfloat16 + int4 node failed on it).
        act = nn.functional.silu(gate, inplace=True)
        return self.down_proj(act.mul_(up) if act.is_contiguous() else act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, cos_sin, meta, kv_cache, rope=None):
        # The residual add is fused into the norms: same adds, same order as HF.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, meta, kv_cache, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cos_sin: torch.Tensor | None = None  # [max_pos, D] float32, set by init_rope
        # a decode step's layers in one native call, where every projection is native int4
        # (set by fuse_projections; None: layer by layer)
        self.native_step: decode_step.DecodeStep | None = None

    def init_rope(self, device: torch.device | str) -> None:
        cfg = self.config
        self.cos_sin = cos_sin_cache(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)

    def fuse_projections(self) -> None:
        """Fuses q/k/v and gate/up in every layer, after the weights are loaded: the
        state dict keeps Hugging Face's names until then. int4 weights are packed for
        their kernel here, once fused."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        device = self.model.norm.weight.device
        int4 = [m.pack(device) for m in self.modules() if isinstance(m, Int4Linear)]
        if int4:
            log.info("%s", kernels_used(int4))
            self.native_step, why = self._native_step()
            log.info("decode step: %s", "every layer in one native call" if why is None
                     else f"layer by layer ({why})")

    def _native_step(self) -> tuple[decode_step.DecodeStep | None, str | None]:
        """The native decode step over this model's weights, or None and why not."""
        cfg, layers = self.config, []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, Int4Linear) and m.backend == "native" and m.bias is None
                       for m in projections):
                return None, "not every projection is a bias-free int4 one on the native kernel"
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype is not torch.bfloat16 or not w.is_contiguous() for w in norms):
                return None, "the norms are not bfloat16"
            # detached: the step holds the tensors whose memory it reads, whatever becomes
            # of the parameters (fuse_projections builds it; it does not follow them)
            layers.append(decode_step.LayerWeights(*(m.packed for m in projections),
                                                   *(w.detach() for w in norms)))
        shape = decode_step.Shape(cfg.hidden_size, cfg.num_attention_heads,
                                  cfg.num_key_value_heads, cfg.head_dim,
                                  cfg.intermediate_size, cfg.rms_norm_eps)
        why = decode_step.why_not(shape)
        final = self.model.norm.weight
        if why is not None or final.dtype is not torch.bfloat16 or not final.is_contiguous():
            return None, why or "the final norm is not bfloat16"
        picks, lookup = self._picks_and_lookup(shape)
        return decode_step.DecodeStep(layers, final.detach(), shape, picks, lookup), None

    def _picks_and_lookup(self, shape: decode_step.Shape
                          ) -> tuple[decode_step.Head | None, decode_step.Lookup | None]:
        """The native step's Q8_0 head (greedy picks) and its lookup (token ids), each None
        where this model's tables do not fit them (the start-up log says why)."""
        head, embed = self.lm_head, self.model.embed_tokens
        picks = decode_step.Head(head.table.packed, head.out_features) \
            if isinstance(head, Q8Head) else None
        why_head = decode_step.head_why_not(picks, shape) if picks is not None \
            else "the LM head is not Q8_0"
        if isinstance(embed, Q8Embedding):
            table = embed.packed if embed.dtype is torch.bfloat16 else None
        else:
            table = embed.weight.detach()
        lookup = decode_step.Lookup(table, embed.num_embeddings, self.cos_sin) \
            if table is not None and self.cos_sin is not None else None
        why_lookup = decode_step.lookup_why_not(lookup, shape) if lookup is not None \
            else "no bfloat16 embedding or rotary cache"
        if why_head is not None or why_lookup is not None:
            log.info("decode step: greedy batches %s", "; ".join(
                f"{what} ({why})" for what, why in
                (("form the logits", why_head), ("come as tensors", why_lookup)) if why))
        return (picks if why_head is None else None,
                lookup if why_lookup is None else None)

    def streamed_weights(self) -> list[torch.Tensor]:
        """The packed weights a decode step reads whole, in the order it reads them: each
        layer's int4 projections (with torch's kernel, their scales and zeros too), then the
        Q8_0 tables (the embedding, and an LM head of its own). Dense weights are not
        listed: nn.Linear's and oneDNN's reordered copies stay where they are."""
        out = []
        for layer in self.model.layers:
            for m in layer.modules():
                if isinstance(m, Int4Linear) and m.packed is not None:
                    out += [t for t in (m.packed, m.scales_and_zeros) if t is not None]
        embed, head = self.model.embed_tokens, getattr(self.lm_head, "table", None)
        out += [t.packed for t in (embed, head if head is not embed else None)
                if isinstance(t, Q8Embedding)]
        return out

    def place_streamed_weights(self, place: Callable[[list[torch.Tensor]], str]) -> str:
        """Hands ``streamed_weights()`` to ``place``, which may move their memory (keeping
        each tensor object: engine/host_memory.py's into_huge_pages), then has the native
        step take their addresses again. Returns what ``place`` says."""
        said = place(self.streamed_weights())
        if self.native_step is not None:
            self.native_step.rebind()
        return said

    def use_onednn(self) -> None:
        """Every projection and the LM head through oneDNN with reordered weights
        (model/cpu_linear.py), after ``fuse_projections``. A tied LM head keeps the
        embedding as it is beside its reordered copy."""
        def onednn(m):  # an int4 projection (model/quant.py) keeps its kernel
            return OneDNNLinear(m) if isinstance(m, nn.Linear) else m

        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = onednn(attn.qkv_proj), onednn(attn.o_proj)
            mlp.gate_up_proj = onednn(mlp.gate_up_proj)
            mlp.down_proj = onednn(mlp.down_proj)
        self.lm_head = onednn(self.lm_head)

    def tie_weights(self) -> None:
        """A tied head is the embedding: its weight, or a Q8_0 embedding's bytes."""
        if not self.config.tie_word_embeddings:
            return
        embed = self.model.embed_tokens
        if isinstance(embed, Q8Embedding):
            self.lm_head = Q8Head(embed)
        else:
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[KVCache] | None,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden].

        ``on_layer(i)`` runs once layer i's K/V are in the cache: a prefill node
        starts shipping them while the later layers compute."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = kernels.rotary_tables(positions, self.cos_sin, x.dtype)  # once, every layer's
        if self.native_step is not None and meta.decode_native and on_layer is None \
                and kv_caches is not None and rope is not None \
                and x.dtype is torch.bfloat16 and x.is_contiguous():
            return self.native_step(x, rope.cos, rope.sin, meta.block_tables, meta.seq_lens,
                                    meta.slot_mapping, kv_caches)
        residual = None
        for i, layer in enumerate(self.model.layers):
            cache = kv_caches[i] if kv_caches is not None else None
            x, residual = layer(x, residual, positions, self.cos_sin, meta, cache, rope)
            if on_layer is not None:
                on_layer(i)
        x, _ = self.model.norm(x, residual)
        return x

    def decode_greedy(self, ids: list[int], positions: list[int], tables: list[list[int]],
                      slots: list[int], kv_caches: list[KVCache]
                      ) -> tuple[torch.Tensor, list[int] | None] | None:
        """A decode step of one token a sequence (its id, position, block table and cache
        slot) on the native step, which looks the tokens up itself and, with the Q8_0 head
        it was built with, picks each row's greedy token: the first index of its largest
        logit in ``compute_logits``. Returns the final hidden states [B, hidden] and the
        tokens (None where a logit is NaN, or the step has no head: the caller computes
        the logits), or None where the native step cannot run this model."""
        step = self.native_step
        embed = self.model.embed_tokens
        table = embed.packed if isinstance(embed, Q8Embedding) else embed.weight
        if step is None or step.lookup is None or step.lookup.cos_sin is not self.cos_sin \
                or step.lookup.embedding.data_ptr() != table.data_ptr() \
                or step.lookup.embedding.shape[0] != table.shape[0]:
            return None  # (the tables it was built with are no longer the model's)
        # the head it was built with, still the model's (read by address)
        pick = step.head is not None and isinstance(self.lm_head, Q8Head) \
            and self.lm_head.table.packed is step.head.packed
        return step.decode(ids, positions, tables, slots, kv_caches, pick)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] in float32 (sampling precision)."""
        head = self.lm_head
        if not isinstance(head, nn.Linear) or hidden.device.type != "cpu" \
                or hidden.shape[0] < 2 or head.bias is not None \
                or head.weight.shape[0] < 2 * LM_HEAD_CPU_BLOCK:
            return head(hidden).float()
        weight = head.weight
        # Through F.linear (cpu_linear "torch"), the LM head is the one GEMM whose weight
        # (vocab x hidden: 113 MB for SmolLM2) and output are far larger than the caches.
        # MKL runs it 15-30 % faster at 2-256 rows in blocks of 1,024 vocabulary rows
        # written into one output, and each logit is the same dot product, so the bits are
        # those of the one-call GEMM (tests/unit/test_fused_projections.py). One row takes
        # MKL's GEMV, as fast whole.
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype)  # [N, V]
        for lo in range(0, weight.shape[0], LM_HEAD_CPU_BLOCK):
            hi = lo + LM_HEAD_CPU_BLOCK
            torch.mm(hidden, weight[lo:hi].t(), out=out[:, lo:hi])
        return out.float()
