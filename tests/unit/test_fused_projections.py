"""Fused projections (model/llama.py): q/k/v and gate/up are fused after loading. On the
CPU that must not change a bit of the output, since greedy decoding is compared with
transformers token for token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.model.llama import MLP


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
