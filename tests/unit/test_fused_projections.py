"""Fused projections (model/llama.py): q/k/v and gate/up are fused after loading. On the
CPU that must not change a bit of the output, since greedy decoding is compared with
transformers token for token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.model.llama import LM_HEAD_CPU_BLOCK, MLP, LlamaForCausalLM


@pytest.mark.parametrize("rows,bias", [(1, False), (16, False), (64, True)])
def test_fused_gate_up_gives_the_same_bits_on_the_cpu(rows, bias):
    torch.manual_seed(0)
    mlp = MLP(SimpleNamespace(hidden_size=96, intermediate_size=256, mlp_bias=bias))
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        separate = mlp(x)
        mlp.fuse()
        assert mlp.gate_up_proj is not None and not hasattr(mlp, "gate_proj")
        assert torch.equal(mlp(x), separate)


@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_the_cpu_lm_head_in_vocabulary_blocks_gives_the_one_gemm_bits(rows):
    # A vocabulary that is not a multiple of the block, so the last block is short.
    vocab = 3 * LM_HEAD_CPU_BLOCK + 123
    torch.manual_seed(0)
    model = SimpleNamespace(lm_head=torch.nn.Linear(96, vocab, bias=False))
    hidden = torch.randn(rows, 96)
    with torch.inference_mode():
        logits = LlamaForCausalLM.compute_logits(model, hidden)
        assert logits.shape == (rows, vocab) and logits.dtype == torch.float32
        assert torch.equal(logits, torch.nn.functional.linear(hidden, model.lm_head.weight))
