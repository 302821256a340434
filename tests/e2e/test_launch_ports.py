"""`pdserve launch` places every port a firewall or Prometheus config names: each node's
/metrics from --node-metrics-port up, each decode node's KV socket from --decode-kv-port up
(--node-arg would give every node the same one, and the prefill node takes no --kv-bind)."""
from __future__ import annotations

import re
import socket

import httpx

from tests.cluster import launched


def free_run(n: int) -> int:
    """A port p with p .. p+n-1 free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            held = []
            for p in range(base, base + n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()


def test_per_node_metrics_and_decode_kv_ports(tiny_model):
    metrics, kv = free_run(3), free_run(2)
    with launched(tiny_model(), 1, 2, "--compute", "none", "--node-metrics-port", str(metrics),
                  "--decode-kv-port", str(kv)) as cluster:
        urls = cluster.metrics_urls()
        assert urls["prefill-0"] == f"http://127.0.0.1:{metrics}/metrics"
        assert urls["decode-0"] == f"http://127.0.0.1:{metrics + 1}/metrics"
        assert urls["decode-1"] == f"http://127.0.0.1:{metrics + 2}/metrics"
        for name in ("prefill-0", "decode-0", "decode-1"):
            assert httpx.get(urls[name], timeout=5).status_code == 200, name
        body = {"model": tiny_model().name, "prompt": "hello", "max_tokens": 4}
        for _ in range(2):  # round robin: both decode nodes get KV over their own ports
            resp = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
        log = cluster.log()
    for i in range(2):
        assert re.search(rf"decode-{i} .*KV socket tcp://127\.0\.0\.1:{kv + i}\b", log), log


def test_nodes_sharing_the_machine_share_its_cores(tiny_model):
    """Without --threads every node gets every core, its idle OpenMP threads sleeping
    (OMP_WAIT_POLICY=PASSIVE), a decode node's after a short spin (GOMP_SPINCOUNT); a
    user's own OMP_WAIT_POLICY, GOMP_SPINCOUNT and --threads stand."""
    import os

    from pdserve.bench.cluster import launched as launch_cluster
    from pdserve.launch import DECODE_SPIN_COUNT
    from tests.cluster import child_config, node_pids

    def nodes(cluster) -> dict[str, tuple[int, str | None, str | None]]:
        """node id -> (threads launch gave it, its OMP_WAIT_POLICY, its GOMP_SPINCOUNT)."""
        found = {}
        for node_id, pid in node_pids(cluster.proc.pid).items():
            env = {k.decode(): v.decode() for k, v in (
                v.split(b"=", 1) for v in
                open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)}
            found[node_id] = (child_config(pid)["config"]["engine"]["threads"],
                              env.get("OMP_WAIT_POLICY"), env.get("GOMP_SPINCOUNT"))
        return found

    model = str(tiny_model())
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        with launch_cluster("--model", model, "--prefill", "1", "--decode", "1",
                            ready_timeout_s=180) as cluster:
            cores = os.cpu_count()
            assert nodes(cluster) == {"prefill-0": (cores, "PASSIVE", None),
                                      "decode-0": (cores, "PASSIVE", DECODE_SPIN_COUNT)}
        os.environ.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="7")
        with launch_cluster("--model", model, "--prefill", "1", "--decode", "1",
                            "--threads", "1", ready_timeout_s=180) as cluster:
            assert nodes(cluster) == {"prefill-0": (1, "ACTIVE", "7"),
                                      "decode-0": (1, "ACTIVE", "7")}
    finally:
        for k in names:
            os.environ.pop(k, None)
        os.environ.update(saved)
