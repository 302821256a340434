"""`--dtype auto`, the default: bfloat16 on a CPU that computes it natively (AVX512-BF16 or
AMX-BF16), or for a file whose int4 projections stay int4 where the native kernels run (AVX2
with FMA and F16C, and a C compiler); float32 elsewhere, said in each node's start-up log.
The expectation is read from /proc/cpuinfo here, not from pdserve."""
import os
import shutil
import subprocess
import sys

import pytest

from pdserve import LLM
from tests.cluster import q4_1_cluster_logs

pytest.importorskip("tests.gguf_files")


def expected_dtype(int4_file: bool = False) -> str:
    with open("/proc/cpuinfo") as f:
        flags = set(next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), []))
    native = {"avx2", "fma", "f16c"} <= flags and shutil.which("cc") is not None \
        and os.environ.get("PDSERVE_NATIVE_KERNELS", "1") != "0"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags or (int4_file and native) \
        else "float32"


def test_launch_with_defaults_serves_this_cpus_dtype(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_DTYPE", raising=False)  # conftest pins float32
    text = q4_1_cluster_logs(tiny_model, tmp_path)
    want = expected_dtype(int4_file=True)
    assert text.count(f"dtype auto: {want} (") == 2, text[-3000:]
    # bfloat16 keeps the file's 4-bit projections (--quantization auto); float32 does not
    assert text.count("kept as int4") == (2 if want == "bfloat16" else 0), text[-3000:]


def test_llm_defaults_to_auto_and_an_explicit_dtype_wins(tiny_model):
    model = tiny_model("llama")
    assert str(LLM(model=model).engine.dtype) == f"torch.{expected_dtype()}"
    assert str(LLM(model=model, dtype="float32").engine.dtype) == "torch.float32"


def test_a_bad_pdserve_dtype_is_a_clear_error(tiny_model):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--model",
                          str(tiny_model("llama")), "--prompt", "Hi", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PDSERVE_DTYPE": "float64"})
    assert out.returncode == 2, out.stderr
    assert "float64" in out.stderr and "auto" in out.stderr, out.stderr
