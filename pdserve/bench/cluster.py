"""``pdserve launch`` on free loopback ports, for the benchmark scripts and the tests.

The launcher runs in its own session so that everything it started can be
stopped as one process group, even if the launcher itself is stuck.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from pdserve.common.config import ROLES
from pdserve.common.config_io import ENV as CONFIG_ENV
from pdserve.common.sockets import free_port


@dataclass
class Cluster:
    proc: subprocess.Popen  # the launcher; its process group holds every process it started
    http_url: str
    ingress: str
    control: str
    log_path: str
    args: tuple[str, ...]
    kept_log: str | None = None  # the log as it ended, once its temporary file is gone

    def log(self) -> str:
        if self.kept_log is not None:
            return self.kept_log
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def ready_log(self, timeout_s: float = 30.0) -> str:
        """The log once ``pdserve launch`` has printed its ready table. /health answers a
        moment before the launcher sees every node registered and prints it, so a test that
        reads the table right after its first request must wait for it here."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log()
            if "Ctrl-C stops everything" in log:
                return log
            time.sleep(0.1)
        raise TimeoutError("pdserve launch printed no ready table:\n" + self.log()[-3000:])

    def metrics_urls(self, timeout_s: float = 30.0) -> dict[str, str]:
        """The /metrics URL of each process ("router", "prefill-0", ...), from the table
        ``pdserve launch`` prints once it is ready."""
        return {name: url for url, name in
                re.findall(r"(http://\S+/metrics)\s+\((\S+)\)", self.ready_log(timeout_s))}

    def wait_nodes(self, n: int, timeout_s: float = 600.0) -> None:
        """Until ``n`` nodes are registered with the router (its pdserve_nodes gauge):
        launch is ready once one node of each role is, and a big fleet on a loaded machine
        takes a while longer for the rest."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = metric_totals(self.http_url + "/metrics", ("pdserve_nodes",))
            if got["pdserve_nodes"] >= n:
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"{got['pdserve_nodes']:g} of {n} nodes registered; "
                                   f"the log, {self.log_path}:\n" + self.log()[-3000:])
            time.sleep(0.5)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by each process of the cluster, by role."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(self.proc.pid)],
                             capture_output=True, text=True).stdout
        tick = os.sysconf("SC_CLK_TCK")
        cpu: dict[str, float] = {}
        for line in out.splitlines():
            pid, _, cmd = line.strip().partition(" ")
            words = cmd.split()
            role = next((w for w in words if w in ("router", *ROLES, "launch")), None)
            with contextlib.suppress(OSError, IndexError):
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                cpu[role or pid] = cpu.get(role or pid, 0.0) + \
                    (int(fields[11]) + int(fields[12])) / tick
        return cpu


def metric_totals(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each named sample (a histogram's ``_sum`` or ``_count``, a counter) at ``url``,
    summed over its label sets; 0.0 for one not there."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = dict.fromkeys(names, 0.0)
    for name, value in re.findall(r"^(\w+)(?:{[^}]*})? (\S+)$", text, re.M):
        if name in out:
            out[name] += float(value)
    return out


def handed_config(pid: int) -> dict | None:
    """The config ``pdserve launch`` handed child ``pid`` ({"log_level", "config"}), read
    from its environment; None for a process that has none (or is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    raw = env.get(CONFIG_ENV.encode())
    return None if raw is None else json.loads(raw)


def processes(pgid: int) -> dict[str, int]:
    """PID of each process of a launched cluster (process group ``pgid``) by name
    ("router", "prefill-0", ...), from the config launch handed it."""
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True,
                         text=True).stdout.split()
    found = {}
    for pid in map(int, out):
        with contextlib.suppress(OSError):
            if b"router" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"):
                found["router"] = pid
                continue
        cfg = handed_config(pid)
        if cfg is not None and cfg["config"].get("node_id"):
            found[cfg["config"]["node_id"]] = pid
    return found


def memory_mib(pid: int) -> dict[str, float]:
    """A process's memory in MiB: "rss" (VmRSS), "pss" and "uss" (smaps_rollup: RSS counts
    the libraries' pages that every process shares again, PSS a share of them, USS none)."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1]) / 1024
    roll = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            roll[parts[0][:-1]] = int(parts[1])
    out["pss"] = roll.get("Pss", 0) / 1024
    out["uss"] = (roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0)) / 1024
    return out


@contextlib.contextmanager
def started(cmd: list[str], health_url: str, log_path: str, name: str,
            env: dict[str, str] | None = None, ready_timeout_s: float = 600.0):
    """Yields the Popen of ``cmd`` (its own session, its output appended to ``log_path``)
    once ``health_url`` answers 200; stops it and, by process group, everything it
    started, on success and failure."""
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def tail() -> str:
        with open(log_path, errors="replace") as f:
            return f.read()[-4000:]
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log, "
                                   f"{log_path}:\n" + tail())
            try:
                with urllib.request.urlopen(health_url, timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy in {ready_timeout_s} s; its log, "
                                   f"{log_path}:\n" + tail())
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever outlived the leader's clean-up
        proc.wait()


@contextlib.contextmanager
def launched(*args: str, ready_timeout_s: float = 600.0, log_dir: str | None = None,
             log_level: str = "warning"):
    """Yields a Cluster started with ``pdserve launch ARGS`` (ports are chosen here); stops
    the launcher and, by process group, everything it started, on success and failure.
    Its log is a temporary file, removed when the cluster stops cleanly (``Cluster.log()``
    still answers) and kept after an error (the errors raised here name it); in ``log_dir``
    it is always kept."""
    http, control, ingress = free_port(), free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", prefix="pdserve-launch-", suffix=".log",
                                     dir=log_dir, delete=False) as log:
        pass
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--http-port", str(http),
           "--control", f"tcp://127.0.0.1:{control}", "--ingress",
           f"tcp://127.0.0.1:{ingress}", "--log-level", log_level, *args]
    url = f"http://127.0.0.1:{http}"
    with started(cmd, url + "/health", log.name, f"pdserve launch {' '.join(args)}",
                 ready_timeout_s=ready_timeout_s) as proc:
        cluster = Cluster(proc, url, f"tcp://127.0.0.1:{ingress}",
                          f"tcp://127.0.0.1:{control}", log.name, tuple(args))
        yield cluster
    if log_dir is None:  # (not reached after an error: the file stays for its reader)
        cluster.kept_log = cluster.log()
        os.unlink(log.name)


def machine() -> str:
    """A one-line description of this machine, for the printed figures."""
    import platform

    from pdserve.common.cpuinfo import describe

    cpu = describe()
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = "no torch"
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {tv}; "
            f"load average {load} (1/5/15 min)")
