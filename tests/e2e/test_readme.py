"""The README's "From another terminal" section, run as written against `make serve`'s
cluster: each ```bash and ```python block in a fresh shell in a folder that holds `.venv`
(as a checkout does), with nothing of this process's PATH; each ```text block after one
is what it must print (numbers aside: counters and times vary)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### From another terminal"


def blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, expected output or None) of each runnable block in the section."""
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    section = text[start:text.index("\n### ", start + len(SECTION))]
    found = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    out = []
    for i, (lang, code) in enumerate(found):
        if lang in ("bash", "python"):
            nxt = found[i + 1] if i + 1 < len(found) else None
            out.append((lang, code, nxt[1] if nxt and nxt[0] == "text" else None))
    return out


def numbers_aside(line: str) -> str:
    return re.sub(r"\d+(?:\.\d+)?(?:e-?\d+)?", "N", line.rstrip())


def test_readme_runs_as_written(tmp_path):
    from pdserve.model.default_model import bundled_model

    if bundled_model()[0] is None:
        pytest.skip("the README's examples are about the bundled model")
    assert len(blocks()) >= 5
    venv = Path(sys.prefix)
    (tmp_path / ".venv").symlink_to(venv)
    ports = {"8000": free_port(), "5557": free_port(), "5556": free_port()}
    args = (f"--http-port {ports['8000']} --control tcp://127.0.0.1:{ports['5556']} "
            f"--ingress tcp://127.0.0.1:{ports['5557']}")
    # a user's terminal: neither make's nor pytest's variables, nor conftest's float32 pin
    # (the README's outputs are what `make serve`'s default dtype prints)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MAKELEVEL", "VIRTUAL_ENV", "TRITON_INTERPRET",
                        "PDSERVE_DTYPE")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"   # a new terminal: no venv on it
    make = subprocess.Popen(["make", "-s", "-o", f"{venv}/.installed", "serve", f"VENV={venv}",
                             f"ARGS={args}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert make.poll() is None, "make serve exited"
            try:
                if httpx.get(f"http://127.0.0.1:{ports['8000']}/health",
                             timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "make serve not healthy in 300 s"
            time.sleep(0.5)
        for lang, code, expected in blocks():
            for port, ours in ports.items():
                code = code.replace(f"127.0.0.1:{port}", f"127.0.0.1:{ours}")
            if "--ingress" not in code:
                code = code.replace("pdserve submit ", f"pdserve submit --ingress "
                                    f"tcp://127.0.0.1:{ports['5557']} ")
            script = code if lang == "bash" else f"python - <<'PY'\n{code}PY\n"
            run = subprocess.run(["bash", "-c", "source .venv/bin/activate\n" + script],
                                 cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=120)
            assert run.returncode == 0, (code, run.stdout, run.stderr)
            if expected:
                got = [numbers_aside(line) for line in run.stdout.splitlines()]
                for line in expected.splitlines():
                    assert numbers_aside(line) in got, (code, line, run.stdout)
    finally:
        make.send_signal(signal.SIGINT)
        try:
            make.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
