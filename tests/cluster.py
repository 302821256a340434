"""Runs ``pdserve launch`` as a child process on free loopback ports, for end-to-end tests."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    proc: subprocess.Popen
    http_url: str
    ingress: str
    control: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def wait_healthy(url: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve launch exited with {proc.returncode}:\n"
                               + open(log_path, errors="replace").read()[-4000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"cluster not healthy after {timeout_s} s:\n"
                       + open(log_path, errors="replace").read()[-4000:])


@contextlib.contextmanager
def launched(model_dir, prefill: int = 1, decode: int = 1, *extra: str, log_dir=None,
             heartbeat: float = 0.5):
    """Yields a Cluster; stops the launcher (and so every child) on exit, even on failure."""
    http, control, ingress = free_port(), free_port(), free_port()
    log_path = os.path.join(log_dir or "/tmp", f"pdserve-launch-{http}.log")
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--model", str(model_dir),
           "--prefill", str(prefill), "--decode", str(decode), "--http-port", str(http),
           "--control", f"tcp://127.0.0.1:{control}", "--ingress",
           f"tcp://127.0.0.1:{ingress}", "--heartbeat-interval", str(heartbeat),
           "--threads", "1", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    cluster = Cluster(proc, f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{ingress}",
                      f"tcp://127.0.0.1:{control}", log_path)
    try:
        wait_healthy(cluster.http_url, proc, log_path)
        yield cluster
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # Whatever survived the launcher's own clean-up dies with its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
