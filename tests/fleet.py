"""A cluster on etcd for end-to-end tests: etcd itself on free loopback ports with a
temporary data dir, routers and nodes started one by one with --discovery, each a
process of its own (so that a test can SIGKILL or SIGSTOP any one), every one stopped
by PID when the test ends, on success and failure. Any of them may run on a host of
tests/netns.py (``ns=``, ``host=``): the test then reaches them through ``inside``."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdserve.common import discovery as D
from pdserve.common.sockets import free_port


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    http_url: str = ""
    ingress: str = ""     # a router's queue ingress

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Fleet:
    tmp: Path
    model: str
    etcd_url: str = ""
    etcd: Proc | None = None
    procs: list[Proc] = field(default_factory=list)
    inside: object = None  # a tests.netns.Inside the test's calls run on; None: here

    def reach(self, fn, *args):
        """``fn(*args)`` where the fleet can be reached from (``inside``, or here)."""
        return self.inside.call(fn, *args) if self.inside is not None else fn(*args)

    def _spawn(self, name: str, cmd: list[str], ns: str | None = None, **kw) -> Proc:
        log_path = self.tmp / f"{name}.log"
        if ns is not None:  # (ip netns exec execs the command: the PID is the command's)
            cmd = ["ip", "netns", "exec", ns, *cmd]
        with open(log_path, "w") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc = Proc(name, popen, log_path, **kw)
        self.procs.append(proc)
        return proc

    def start_etcd(self, host: str = "127.0.0.1", ns: str | None = None) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"etcd://{host}:{client}"
        self.etcd = self._spawn("etcd", [
            shutil.which("etcd"), "--name", "test", "--data-dir", str(self.tmp / "etcd"),
            "--listen-client-urls", f"http://{host}:{client}",
            "--advertise-client-urls", f"http://{host}:{client}",
            "--listen-peer-urls", f"http://{host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", f"test=http://{host}:{peer}"], ns=ns)
        wait_for(lambda: self.reach(self._etcd_up), 30, "etcd did not start", self.etcd)

    def _etcd_up(self) -> bool:
        try:
            return httpx.get(D.gateway_url(self.etcd_url) + "/health", timeout=1).is_success
        except httpx.HTTPError:
            return False

    def router(self, name: str, *extra: str, host: str = "127.0.0.1",
               ns: str | None = None) -> Proc:
        http, ingress = free_port(), f"tcp://{host}:{free_port()}"
        where = ["--host", host, "--insecure"] if host != "127.0.0.1" else []
        return self._spawn(name, [
            sys.executable, "-m", "pdserve.cli", "router", "--log-level", "info",
            "--model", self.model, "--http-port", str(http),
            "--control", f"tcp://{host}:{free_port()}", *where,
            "--ingress", ingress, "--discovery", self.etcd_url,
            "--discovery-ttl", "3", "--heartbeat-interval", "0.5", *extra],
            ns=ns, http_url=f"http://{host}:{http}", ingress=ingress)

    def node(self, role: str, name: str, *extra: str, ns: str | None = None) -> Proc:
        return self._spawn(name, [
            sys.executable, "-m", "pdserve.cli", role, "--log-level", "info",
            "--model", self.model, "--node-id", name, "--discovery", self.etcd_url,
            "--discovery-ttl", "3", "--threads", "1", *extra], ns=ns)

    def records(self, kind: str) -> dict[str, tuple[dict, int]]:
        return self.reach(self._records, kind)

    def _records(self, kind: str) -> dict[str, tuple[dict, int]]:
        client = D.EtcdClient(self.etcd_url)
        try:
            return client.range(D.prefix("default", kind))[0]
        finally:
            client.close()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.popen.pid, signal.SIGCONT)  # one a test stopped
                os.kill(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()


def wait_for(check, timeout_s: float, what: str, *procs: Proc) -> None:
    """Polls ``check`` until it is true; fails with ``what`` and the logs of ``procs``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        for p in procs:
            assert p.popen.poll() is None, f"{p.name} exited:\n{p.log()[-3000:]}"
        if time.monotonic() > deadline:
            pytest.fail(what + "".join(f"\n--- {p.name}:\n{p.log()[-2000:]}" for p in procs))
        time.sleep(0.2)


def healthy(router: Proc) -> bool:
    try:
        return httpx.get(router.http_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def fleet(tmp: Path, model, etcd_host: str = "127.0.0.1", etcd_ns: str | None = None,
          inside=None):
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (make test installs it: .ci/install-etcd.sh)")
    f = Fleet(tmp, str(model), inside=inside)
    try:
        f.start_etcd(etcd_host, etcd_ns)
        yield f
    finally:
        f.stop_all()
