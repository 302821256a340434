"""oneDNN linear layers (model/cpu_linear.py): what the CPU serving path computes its
projections and LM head with, against F.linear, and how the engine picks them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve import LLM
from pdserve.model.cpu_linear import (
    CACHE_ENV,
    MAX_ROWS,
    OneDNNLinear,
    onednn_available,
    onednn_runs,
    resolve_cpu_linear,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_runs(torch.bfloat16),
    reason="this CPU has no AVX512-BW/VL/DQ or AVX-NE-CONVERT: oneDNN cannot reorder bfloat16")
CPU = torch.device("cpu")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 2, 16, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_is_f_linear_to_float32_rounding(rows, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=bias)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        got, want = OneDNNLinear(linear)(x), linear(x)
    assert got.shape == want.shape == (rows, 1536) and got.dtype == torch.float32
    # Float32 sums of 576 products in another order: a few ulps of the largest terms.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_in_bfloat16_onednn_linear_gives_f_linears_bits(rows):
    # F.linear already runs bfloat16 through oneDNN; the reordered weight changes no bit.
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(OneDNNLinear(linear)(x), linear(x))


@needs_onednn
def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    # What a request gets must not depend on what else runs in its step (from 2 rows up;
    # one row takes another kernel, as with MKL's GEMV).
    torch.manual_seed(0)
    for n_in, n_out in ((576, 960), (1536, 576)):
        layer = OneDNNLinear(torch.nn.Linear(n_in, n_out, bias=False))
        x = torch.randn(256, n_in)
        with torch.inference_mode():
            whole = layer(x)
            for lo, hi in ((0, 2), (3, 19), (100, 164)):
                assert torch.equal(layer(x[lo:hi].contiguous()), whole[lo:hi])


@needs_onednn
def test_past_max_rows_a_row_still_does_not_depend_on_the_batch():
    # Longer inputs go in pieces of MAX_ROWS, never a piece of one row.
    torch.manual_seed(0)
    layer = OneDNNLinear(torch.nn.Linear(576, 960, bias=True))
    for n in (MAX_ROWS + 1, 2 * MAX_ROWS + 37):
        x = torch.randn(n, 576)
        with torch.inference_mode():
            whole = layer(x)
            assert whole.shape == (n, 960)
            for lo, hi in ((0, 2), (MAX_ROWS - 3, MAX_ROWS + 1), (n - 2, n), (0, n - 1)):
                assert torch.equal(layer(x[lo:hi].contiguous()), whole[lo:hi]), (n, lo, hi)


ROW_COUNTS = """
import torch
from pdserve.model.cpu_linear import OneDNNLinear, bound_onednn_caches
bound_onednn_caches()
torch.set_num_threads(1)
shapes = ((576, 1536), (1536, 576), (576, 576))
layers = [OneDNNLinear(torch.nn.Linear(a, b, bias=False)) for a, b in shapes]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10
before = rss()
with torch.inference_mode():
    for rows in range(1, 300):
        for layer in layers:
            layer(torch.randn(rows, layer.in_features))
print(rss() - before)
"""


@needs_onednn
def test_a_new_row_count_in_every_batch_keeps_no_unbounded_memory():
    """oneDNN's caches keep buffers per row count: 3 projections at 299 row counts grew a
    process by 541 MiB with their default 1,024 entries (2-core AMD EPYC, 2026-12-05),
    41-53 MiB with the engine's caps (32 entries each)."""
    env = {k: v for k, v in os.environ.items()
           if k not in CACHE_ENV and k != "DNNL_PRIMITIVE_CACHE_CAPACITY"}
    run = subprocess.run([sys.executable, "-c", ROW_COUNTS], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) < 200, f"grew {run.stdout.strip()} MiB"


def test_auto_takes_onednn_for_float32_and_bfloat16_on_the_cpu():
    want = "onednn" if onednn_available() else "torch"
    assert resolve_cpu_linear("auto", CPU, torch.float32) == want
    # bfloat16 as far as this CPU can reorder it (an AVX2-only one cannot): both ways run
    want = "onednn" if onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() \
        else "torch"
    assert resolve_cpu_linear("auto", CPU, torch.bfloat16) == want
    assert resolve_cpu_linear("auto", CPU, torch.float16) == "torch"
    assert resolve_cpu_linear("auto", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_cpu_linear("torch", CPU, torch.float32) == "torch"


def test_asking_for_onednn_where_it_cannot_run_says_why():
    with pytest.raises(ValueError, match="bfloat16 models on the CPU, not float16 on cpu"):
        resolve_cpu_linear("onednn", CPU, torch.float16)
    if onednn_available() and not onednn_runs(torch.bfloat16):
        with pytest.raises(ValueError, match="bfloat16 needs a CPU with AVX512-BW"):
            resolve_cpu_linear("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_linear must be 'auto', 'onednn' or 'torch'"):
        resolve_cpu_linear("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        LLM(cpu_linear="fast")


@needs_onednn
def test_the_engine_runs_every_projection_and_the_lm_head_through_onednn(tiny_model):
    llm = LLM(dtype="float32", model=tiny_model("qwen2"))  # q/k/v biases, tied embeddings
    model = llm.engine.model
    assert model.config.tie_word_embeddings
    assert llm.engine.runner.linear == "onednn"
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, OneDNNLinear)
        assert isinstance(layer.self_attn.o_proj, OneDNNLinear)
        assert isinstance(layer.mlp.gate_up_proj, OneDNNLinear)
        assert isinstance(layer.mlp.down_proj, OneDNNLinear)
    assert isinstance(model.lm_head, OneDNNLinear)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    # The tied LM head's reordered copy is the embedding's weight, which stays dense for
    # the token lookup.
    hidden = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            model.compute_logits(hidden),
            torch.nn.functional.linear(hidden, model.model.embed_tokens.weight),
            rtol=1e-5, atol=1e-5)
    plain = LLM(dtype="float32", model=tiny_model("qwen2"), cpu_linear="torch").engine.model
    assert isinstance(plain.lm_head, torch.nn.Linear)
    assert isinstance(plain.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
