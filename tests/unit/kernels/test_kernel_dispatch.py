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
        "decode_gather", "gather_kv", "paged_decode_attention", "paged_prefill_attention",
        "prefill_attention", "quant_linear", "rms_norm", "rotary_tables", "rotate_",
        "scatter_kv", "store_kv"])
