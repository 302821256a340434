"""launch's side of the fork server (forkserver.py): simulated nodes forked from one
process that has imported torch share its pages copy-on-write.

A simulated node loads no weights, yet ``import torch`` is ~160 MiB of private memory a
process: 10 GiB for a 64-node fleet. Forked, a node keeps ~20-25 MiB private
(benchmarks/RESULTS.md, "Simulated nodes forked").

    1. ``ForkServer()``: launch becomes its descendants' subreaper and starts the server,
       which imports while launch starts the routers
    2. ``fork(nodes)``: one JSON line per node on the server's stdin, {"name", "role",
       "config"} (the text of $PDSERVE_CONFIG); one answer per node on the reply pipe,
       {"name", "pid"} or {"name", "error"}; then stdin's end, and the server exits
    3. the server gone, its nodes are launch's children: ``ForkedNode`` waits for,
       signals and reports each as launch does a ``subprocess.Popen``
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

from pdserve.common.config_io import ENV

# Room in the server's environment for a node's config to show in /proc/PID/environ: a
# node's config is ~1 KiB; a longer one works, only /proc then shows the placeholder.
ENV_ROOM = 16384
PLACEHOLDER = '{"log_level": null, "config": {}}'   # no node id: no tool mistakes it for one
PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 15, 36


class ForkedNode:
    """A node the fork server started, once launch is its parent: what launch uses of a
    ``subprocess.Popen`` (poll, wait, terminate, kill, returncode, pid)."""

    def __init__(self, pid: int, name: str):
        self.pid, self.name, self.returncode = pid, name, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)   # not reaped yet: the PID is still this node's

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """launch's handle: start the server (it imports while launch starts the routers), then
    ``fork`` every node at once."""

    def __init__(self):
        prctl(PR_SET_CHILD_SUBREAPER, 1)   # orphaned descendants (the nodes) come to us
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1",  # else a BLAS thread at import
               ENV: PLACEHOLDER.ljust(ENV_ROOM)}
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.forkserver",
                                      str(write_fd)], stdin=subprocess.PIPE, env=env,
                                     pass_fds=(write_fd,))
        os.close(write_fd)
        self.replies = read_fd

    def fork(self, nodes: list[tuple[str, str, str]],
             timeout_s: float) -> dict[str, ForkedNode]:
        """Forks each (name, role, config text); returns every node by name once the server
        has exited (they are launch's children then). One it could not start (an error,
        the server dying or silent for ``timeout_s``) is returned as exited with 1, its
        reason on stderr: launch reports it and stops the others, as for any node."""
        try:
            for name, role, text in nodes:
                self.proc.stdin.write(json.dumps({"name": name, "role": role,
                                                  "config": text}).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass   # it died: the replies' end says so
        started, buf, deadline = {}, b"", time.monotonic() + timeout_s
        while len(started) < len(nodes):
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self.replies], [], [], wait)[0]:
                why = f"no answer in {timeout_s:g} s"
                break
            data = os.read(self.replies, 65536)
            if not data:
                why = "it exited"
                break
            *lines, buf = (buf + data).split(b"\n")
            for reply in map(json.loads, lines):
                node = started[reply["name"]] = ForkedNode(reply.get("pid", 0), reply["name"])
                if "error" in reply:
                    node.returncode = 1
                    print(f"pdserve launch: {node.name}: the fork server could not start it: "
                          f"{reply['error']}", file=sys.stderr)
        for name, _, _ in nodes:
            if name not in started:
                started[name] = node = ForkedNode(0, name)
                node.returncode = 1
                print(f"pdserve launch: {name}: not started by the fork server ({why})",
                      file=sys.stderr)
        self.close()
        return started

    def close(self) -> None:
        """Waits for the server to exit (at once, once it has answered), else kills it."""
        if self.replies is None:
            return
        os.close(self.replies)
        self.replies = None
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prctl(option: int, arg) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")
