"""``pdserve launch`` for end-to-end tests: the benchmarks' launcher (free loopback ports,
the whole process group stopped on exit) with the tests' defaults."""
from __future__ import annotations

import contextlib

from pdserve.bench.cluster import Cluster, free_port, processes  # noqa: F401 (the tests' API)
from pdserve.bench.cluster import handed_config as child_config  # noqa: F401 (as above)
from pdserve.bench.cluster import launched as launch_cluster

# tests/conftest.py pins every launch to float32, the dtype whose greedy tokens equal
# transformers'. A module whose checks hold whatever the arithmetic (a stream against the
# same server's answer, a schema, an error's shape) passes these flags instead and serves
# what a user's `pdserve launch` serves: on a CPU with AVX512-BF16, bfloat16 with the GGUF
# file's 4-bit weights as stored and pdserve's native kernels: test_tool_calls.py alone
# took 39.9 s against 100.2 in float32 on the 2-core dev machine.
USERS_DTYPE = ("--dtype", "auto")


@contextlib.contextmanager
def launched(model_dir, prefill: int = 1, decode: int = 1, *extra: str, log_dir=None,
             heartbeat: float = 0.5):
    """Yields a Cluster of ``prefill`` + ``decode`` nodes on ``model_dir``, logging at info
    (tests read the log), one torch thread per node."""
    with launch_cluster("--model", str(model_dir), "--prefill", str(prefill), "--decode",
                        str(decode), "--heartbeat-interval", str(heartbeat), "--threads", "1",
                        *extra, ready_timeout_s=180.0, log_dir=log_dir and str(log_dir),
                        log_level="info") as cluster:
        yield cluster


def q4_1_cluster_logs(tiny_model, tmp_path, *extra: str) -> str:
    """Launches 1P1D (``extra``: more flags) on the tiny Llama written as a Q4_1 GGUF file,
    asserts that a greedy completion of 8 tokens comes back through it, and returns the
    launcher's and the nodes' logs, once everything has stopped."""
    import httpx

    from tests.gguf_files import write_gguf

    model = write_gguf(tiny_model("llama"), tmp_path / "tiny-q4_1.gguf", "Q4_1")
    logs = tmp_path / "logs"
    logs.mkdir()
    with launched(model, 1, 1, *extra, log_dir=logs) as cluster:
        r = httpx.post(cluster.http_url + "/v1/completions", timeout=60, json={
            "model": "tiny-q4_1", "prompt": "The quick brown fox", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    return "\n".join(p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file())


def node_pids(pgid: int) -> dict[str, int]:
    """PID of each node pdserve launch started (its process group ``pgid``), by node id."""
    return {name: pid for name, pid in processes(pgid).items() if name != "router"}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sim_test_profile(path, name: str, peak_flops: float, memory_bandwidth: float):
    """Writes to ``path`` a simulation profile of Llama 3 8B's shape on a made-up slow
    accelerator (steps long beside this machine's own overhead), no EOS; returns ``path``."""
    import json

    from pdserve.sim.profile import PROFILE_DIR

    p = json.loads((PROFILE_DIR / "h100-llama3-8b.json").read_text())
    p["name"] = name
    p["accelerator"] = {"name": name, "peak_flops": peak_flops,
                        "memory_bandwidth": memory_bandwidth, "memory_bytes": 40e9}
    p["eos"] = {"kind": "never"}
    path.write_text(json.dumps(p))
    return path
