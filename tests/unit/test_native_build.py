"""pdserve.kernels.native's build: once per machine into the cache, reused by the next
process, refused with the reason where it cannot run, and a compiler's failure said in
full with the way out. Each case runs in a fresh interpreter (the build is cached per
process)."""
import os
import stat
import subprocess
import sys

import pytest

from pdserve.kernels import native

CHECK = """
import torch
from pdserve.kernels import native
from pdserve.model.quant import Int4Linear, kernels_used
print("why:", native.why_unavailable())
lin = Int4Linear(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1),
                 dtype=torch.bfloat16).pack()
print("backend:", lin.backend)
print(kernels_used([lin]))
from pdserve import kernels  # a bfloat16 op with a native version serves either way
x = torch.ones(2, 32, dtype=torch.bfloat16)
print("norm:", kernels.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6).sum().item())
"""


def run(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_off_by_the_environment_says_so_and_keeps_torchs_kernel(tmp_path):
    out = run({native.ENV: "0", "XDG_CACHE_HOME": str(tmp_path)})
    assert f"why: {native.ENV}=0" in out and "backend: torch" in out
    assert f"native kernels unavailable: {native.ENV}=0" in out
    assert not (tmp_path / "pdserve").exists()  # nothing built


@pytest.mark.skipif(not native.available(), reason=f"native: {native.why_unavailable()}")
def test_built_once_into_the_cache_and_reused(tmp_path):
    out = run({"XDG_CACHE_HOME": str(tmp_path)})
    assert "backend: native" in out and f"GEMM on {native.isa()}" in out
    built = list((tmp_path / "pdserve" / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("pdserve-native-")
    mtime = built[0].stat().st_mtime_ns
    assert "backend: native" in run({"XDG_CACHE_HOME": str(tmp_path)})
    assert list((tmp_path / "pdserve" / "native").iterdir()) == built
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not built again


@pytest.mark.skipif(not native.available(), reason=f"native: {native.why_unavailable()}")
def test_a_failing_compiler_is_reported_and_torchs_kernel_serves(tmp_path):
    """A `cc` that fails (a broken toolchain): the compiler's message and the switch are
    logged, torch's kernels serve (the int4 layer's and a norm's), and nothing half-built
    is left in the cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cc = bin_dir / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\n"
                  "echo 'fatal: no room for the build' >&2\nexit 3\n")
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    out = run({"XDG_CACHE_HOME": str(tmp_path / "cache"),
               "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert "backend: torch" in out and "norm: 64.0" in out
    assert "cc exit 3" in out and "no room for the build" in out and f"{native.ENV}=0" in out
    assert not any((tmp_path / "cache" / "pdserve" / "native").iterdir())
