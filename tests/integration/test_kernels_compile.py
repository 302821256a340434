"""`pdserve kernels compile`: every Triton kernel compiles for sm_80 and sm_90, no GPU needed.

The kernel tests run under TRITON_INTERPRET=1, which executes kernels as Python and
accepts what the GPU compiler refuses (tl.dot below 16, block shapes that are not
powers of two, shared memory over the chip's limit). Here the CLI compiles them for real
targets at the specializations each model's forward launches: the default model and the
test architectures (Qwen2 with q/k/v biases, Mistral's own head_dim), every dtype.
Compiling must run without the interpreter, hence a subprocess with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS_DIR = Path(__file__).resolve().parents[2] / "pdserve" / "kernels"
LINE = re.compile(r"^(\w+) (\S+) sm_(\d+) (ok|FAILED) shared=(\d+) regs=(\d+) spills=(\d+)$")


def compiler_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said aloud (it warns)
    return env


COMPILE = [sys.executable, "-m", "pdserve.cli", "kernels", "compile"]
ARCHS = {"default": None, "qwen2": "qwen2", "mistral": "mistral"}


def run_compile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMPILE, *args], capture_output=True, text=True, timeout=280,
                          env=compiler_env())


def defined_kernels() -> set[str]:
    """Every launched @triton.jit function in pdserve/kernels/ (the helpers they call
    are compiled inside them)."""
    names = set()
    for path in KERNELS_DIR.glob("*.py"):
        names |= set(re.findall(r"^    def (_\w+_kernel)\(", path.read_text(), re.M))
    return names


def model_config(tmp_path: Path, arch: str) -> str:
    from pdserve.model.make_model import build_config

    path = tmp_path / arch
    path.mkdir()
    (path / "config.json").write_text(json.dumps(build_config(arch, "tiny")))
    return str(path)


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """The compile command for each model, all started at once (each compiler is one
    thread: on 2 cores the three take about half the time one after another would); a
    test waits for its own. Their output goes to files (a full pipe would stall one)."""
    tmp = tmp_path_factory.mktemp("compile")
    runs = {}
    try:
        for name, arch in ARCHS.items():
            args = ["--arch", "80,90"] + (["--model", model_config(tmp, arch)] if arch else [])
            out, err = open(tmp / f"{name}.out", "w+"), open(tmp / f"{name}.err", "w+")
            runs[name] = (subprocess.Popen([*COMPILE, *args], stdout=out, stderr=err,
                                           text=True, env=compiler_env()), out, err)
        yield runs
    finally:
        for proc, out, err in runs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            out.close()
            err.close()


def finished(run, timeout_s: float) -> subprocess.CompletedProcess:
    proc, out, err = run
    proc.wait(timeout=timeout_s)
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_kernel_compiles_for_sm80_and_sm90(compiles, arch):
    out = finished(compiles[arch], timeout_s=280)
    lines = [line for line in out.stdout.splitlines() if not line.startswith("#")]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [LINE.match(line) for line in lines[:-1]]
    assert all(rows), [line for line, row in zip(lines, rows) if not row][:5]
    assert lines[-1] == f"{len(rows)} compiled, 0 failed"
    for sm in ("80", "90"):
        launched = {row[1] for row in rows if row[3] == sm}
        assert launched == defined_kernels(), f"sm_{sm}: compiled {launched}"
        keys = {row[2] for row in rows if row[3] == sm}
        assert {key.split(",")[0] for key in keys} == {"fp32", "bf16", "fp16"}
    assert all(0 < int(row[6]) <= 255 for row in rows)


def test_a_kernel_the_compiler_refuses_is_a_failed_line(tmp_path):
    # tl.dot refuses K = 4 (it needs 8, or 16 for bf16/fp16); the interpreter would run it.
    script = textwrap.dedent("""
        import torch, triton, triton.language as tl
        from pdserve import aot
        from pdserve.kernels._dispatch import Launch

        @triton.jit
        def _tiny_dot_kernel(x_ptr, B: tl.constexpr):
            offs = tl.arange(0, B)
            x = tl.load(x_ptr + offs[:, None] * B + offs[None, :])
            tl.store(x_ptr + offs[:, None] * B + offs[None, :], tl.dot(x, x))

        x = torch.empty(64, device="meta")
        bad = aot.compile_launch(Launch(_tiny_dot_kernel, (1,), (x,), {"B": 4}), "B=4", 90)
        good = aot.compile_launch(Launch(_tiny_dot_kernel, (1,), (x,), {"B": 16}), "B=16", 90)
        print(bad.line()); print(good.line())
    """)
    path = tmp_path / "tiny_dot.py"  # Triton reads a kernel's source from its file
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         timeout=120, env=compiler_env())
    assert out.returncode == 0, out.stderr[-4000:]
    bad, message, good = out.stdout.splitlines()[-3:]
    assert bad.startswith("_tiny_dot_kernel B=4 sm_90 FAILED")
    assert message.strip().startswith("CompilationError")
    assert good.startswith("_tiny_dot_kernel B=16 sm_90 ok")


def test_bad_arguments_are_refused_with_what_is_allowed():
    out = run_compile("--arch", "75")
    assert out.returncode == 2 and "--arch" in out.stderr and "80" in out.stderr
    interpreted = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "kernels", "compile"], capture_output=True,
        text=True, timeout=60, env={**compiler_env(), "TRITON_INTERPRET": "1"})
    assert interpreted.returncode == 2 and "TRITON_INTERPRET" in interpreted.stderr
