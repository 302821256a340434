"""Backend choice and the errors that say why Triton can't run."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import _dispatch


def _norm(backend):
    return kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, backend=backend)


def test_default_backend_on_cpu_is_torch():
    assert _dispatch.pick_backend(None, torch.device("cpu")) == "torch"
    assert _dispatch.pick_backend("torch", torch.device("cpu")) == "torch"


def test_default_backend_on_cuda(monkeypatch):
    monkeypatch.setattr(_dispatch, "INTERPRET_AT_IMPORT", False)
    assert _dispatch.pick_backend(None, torch.device("cuda")) == "triton"
    monkeypatch.setattr(_dispatch, "INTERPRET_AT_IMPORT", True)  # kernels are interpreted
    assert _dispatch.pick_backend(None, torch.device("cuda")) == "torch"


def test_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"backend must be None, 'torch' or 'triton', got 'cuda'"):
        _norm("cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"backend='triton' on CPU tensors needs "
                                           r"TRITON_INTERPRET=1 \(no CUDA device\)"):
        _norm("triton")


def test_triton_missing_says_so(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton", None)
    monkeypatch.setattr(_dispatch, "TRITON_INSTALLED", False)
    with pytest.raises(RuntimeError, match="needs the triton package, which is not installed"):
        _norm("triton")
    assert _dispatch.pick_backend(None, torch.device("cuda")) == "torch"


def test_import_without_triton():
    # sys.modules[name] = None makes "import triton" raise ImportError, as on macOS.
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, pdserve.kernels as k\n"
        "x = torch.randn(2, 8)\n"
        "assert k.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)\n"
        "try:\n"
        "    k.rms_norm(x, torch.ones(8), 1e-6, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "triton package, which is not installed" in result.stdout


def test_public_names():
    assert sorted(kernels.__all__) == sorted([
        "DecodeGather", "DecodeWindow", "RotaryTables", "WindowFill", "apply_rotary",
        "decode_gather", "gather_kv", "native_decode_why_not", "native_prefill_why_not",
        "paged_decode_attention",
        "paged_prefill_attention", "prefill_attention", "quant_linear", "rms_norm",
        "rotary_tables", "rotate_", "scatter_kv", "store_kv"])


def test_check_false_is_the_same_call_without_the_argument_checks(monkeypatch):
    """The model's per-layer calls pass check=False (the package docstring): the same
    results, and no check_* helper called."""
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(3, 16, generator=gen) for _ in range(3))
    k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    q = torch.randn(2, 4, 8, generator=gen)
    tables, lens = torch.tensor([[1, 0], [2, 0]], dtype=torch.int32), torch.tensor([3, 4])
    slots = torch.tensor([4 + 2, 8 + 3])

    def run(check):
        k_cache = torch.randn(3, 4, 2, 8, generator=torch.Generator().manual_seed(1))
        v_cache = torch.randn(3, 4, 2, 8, generator=torch.Generator().manual_seed(2))
        kernels.store_kv(k, v, k_cache, v_cache, slots, check=check)
        return (kernels.rms_norm(x, w[0], 1e-6, check=check),
                kernels.rms_norm(x, w[0], 1e-6, residual=res.clone(), check=check),
                k_cache, v_cache,
                kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                               check=check))

    checked = run(True)
    for module in ("norm", "kv_cache", "attention_decode"):
        mod = sys.modules[f"pdserve.kernels.{module}"]
        for name in dir(mod):
            if name.startswith("check_"):
                monkeypatch.setattr(mod, name, None)  # calling one would raise TypeError
    for a, b in zip(checked, run(False)):
        assert all(map(torch.equal, a, b)) if isinstance(a, tuple) else torch.equal(a, b)
