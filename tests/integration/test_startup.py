"""`pdserve submit` and the queue client start without loading torch (or numpy): a producer
that sends a prompt should not pay for the model's stack."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "transformers")


@pytest.mark.parametrize("code", [
    "import pdserve.client",
    "from pdserve.cli import main; main(['submit', '--help'], standalone_mode=False)",
])
def test_no_heavy_import(code):
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# The router never touches a tensor: it must not pay torch's (or triton's) import time and
# memory, on import or at run time.
ROUTER_HEAVY = ("torch", "triton", "transformers")


@pytest.mark.parametrize("code", [
    "import pdserve.router.main",
    "import pdserve.router.http.api, pdserve.router.ingress",
    "from pdserve.cli import main; main(['router', '--help'], standalone_mode=False)",
])
def test_the_router_imports_no_torch(code):
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {ROUTER_HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_serving_router_has_no_torch_mapped(tiny_model):
    """A real cluster (pdserve launch, --compute none nodes) after it served a chat request:
    the router process has neither libtorch nor triton in its memory map."""
    import json
    import urllib.request

    from tests.cluster import launched

    with launched(tiny_model(), 1, 1, "--compute", "none") as cluster:
        body = json.dumps({"model": "llama-0", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hello"}]}).encode()
        req = urllib.request.Request(cluster.http_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        ps = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(cluster.proc.pid)],
                            capture_output=True, text=True).stdout
        (pid,) = [line.split()[0] for line in ps.splitlines()
                  if "pdserve.cli router" in line]
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps and "triton" not in maps
        # (the nodes do load torch: the check would see it if it were there)
        (node,) = [line.split()[0] for line in ps.splitlines() if "pdserve.cli prefill" in line]
        with open(f"/proc/{node}/maps") as f:
            assert "libtorch" in f.read()


def test_a_taken_http_port_is_a_clear_error_and_no_ready_line(tiny_model):
    """`pdserve router` on an HTTP port another process holds: exit status 1, the port named
    in the error, and no "router ready" line before it (that line means every bind held)."""
    import socket

    from tests.cluster import free_port

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "router", "--model", str(tiny_model()),
             "--http-port", str(port), "--control", f"tcp://127.0.0.1:{free_port()}",
             "--ingress", f"tcp://127.0.0.1:{free_port()}"],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "router ready" not in out.stderr, out.stderr
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
