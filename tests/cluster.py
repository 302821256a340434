"""``pdserve launch`` for end-to-end tests: the benchmarks' launcher (free loopback ports,
the whole process group stopped on exit) with the tests' defaults."""
from __future__ import annotations

import contextlib

from pdserve.bench.cluster import Cluster, free_port  # noqa: F401 (the tests' API)
from pdserve.bench.cluster import launched as launch_cluster


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


def child_config(pid: int) -> dict | None:
    """The config ``pdserve launch`` handed child ``pid`` ({"log_level", "config"}), read
    from its environment; None for a process that has none."""
    import json

    from pdserve.common.config_io import ENV

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    raw = env.get(ENV.encode())
    return None if raw is None else json.loads(raw)
