"""The fork server ``pdserve launch`` starts simulated nodes from, and launch's side of it.

A simulated node loads no weights, yet ``import torch`` is ~160 MiB of private memory a
process: 10 GiB for a 64-node fleet. Forked from one process that has imported torch and
the node modules, the nodes share those pages copy-on-write (benchmarks/RESULTS.md,
"Simulated nodes forked").

The server (``python -m pdserve.forkserver REPLY_FD``, started by launch):

    1. import what a simulated node runs, with OpenBLAS on one thread: no thread, ZeroMQ
       context or socket exists here, so forking is safe (checked before each fork)
    2. move every object to the garbage collector's permanent generation: a collection
       in a node would otherwise write to each inherited object's header, copying its page
    3. per JSON line on stdin, {"name", "role", "config"} (the text of $PDSERVE_CONFIG):
       fork a node; answer {"name", "pid"} (or {"name", "error"}) on REPLY_FD
    4. at stdin's end, exit. launch is the nodes' subreaper: they become its children,
       which it waits for, signals and reports as it does the processes it starts itself.

A forked node then becomes what ``python -m pdserve.cli ROLE --config-env`` would be:
default signal handlers, /dev/null on stdin, Python's ``random`` (and numpy's) reseeded,
its config in $PDSERVE_CONFIG and in /proc/PID/environ (tests and benchmarks find nodes
there; a forked process shows its parent's, so the server's holds room the node overwrites),
its node id as its process name (ps, top). Nodes share the server's str hash seed.
"""
from __future__ import annotations

import ctypes
import gc
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
PRELOAD = ("torch", "zmq", "pdserve.cli", "pdserve.node.prefill", "pdserve.node.decode",
           "pdserve.node.colocated", "pdserve.engine.sim_runner")


# --- launch's side -----------------------------------------------------------------------

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
        _prctl(PR_SET_CHILD_SUBREAPER, 1)   # orphaned descendants (the nodes) come to us
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


def _prctl(option: int, arg) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


# --- the server -------------------------------------------------------------------------

def serve(reply_fd: int) -> tuple[str, str, str] | None:
    """Steps 1-4 above. Returns None in the server; in a forked node, its (name, role,
    config text), to run outside every frame of the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # launch stops us; Ctrl-C is for nodes
    for module in PRELOAD:
        __import__(module)
    gc.collect()
    gc.freeze()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            _check_one_thread()
            pid = os.fork()
        except (OSError, RuntimeError) as exc:
            _reply(reply_fd, {"name": request["name"], "error": str(exc)})
            continue
        if pid == 0:
            os.close(reply_fd)
            return request["name"], request["role"], request["config"]
        _reply(reply_fd, {"name": request["name"], "pid": pid})
    return None


def _reply(fd: int, reply: dict) -> None:
    os.write(fd, json.dumps(reply).encode() + b"\n")   # a line < PIPE_BUF: one write


def _check_one_thread() -> None:
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:   # a thread's locks (and the thread itself) would not survive a fork
        raise RuntimeError(f"the fork server has {threads} threads; a fork needs one")


def become_node(name: str, role: str, text: str) -> int:
    """In a forked child: the process ``pdserve ROLE --config-env`` would be."""
    import random

    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    os.environ[ENV] = text
    _show_in_proc(text)
    _prctl(PR_SET_NAME, name.encode()[:15])
    from pdserve.cli import main

    return main([role, "--config-env"], prog_name="pdserve")


def _show_in_proc(text: str) -> None:
    """Writes ``text`` over the room the server's $PDSERVE_CONFIG held in the environment
    block the kernel shows as /proc/PID/environ (the one made at exec; os.environ is a
    copy). Trailing spaces keep it the same length: JSON ignores them."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])   # env_start, env_end (stat fields 50, 51)
    block = ctypes.string_at(start, end - start)
    key = ENV.encode() + b"="
    if block.startswith(key):
        at = len(key)
    elif (at := block.find(b"\0" + key)) >= 0:
        at += 1 + len(key)
    else:
        return
    room = block.index(b"\0", at) - at
    data = text.encode()
    if len(data) <= room:
        ctypes.memmove(start + at, data.ljust(room), room)


def main() -> int:
    child = serve(int(sys.argv[1]))
    return 0 if child is None else become_node(*child)


if __name__ == "__main__":
    sys.exit(main())
