"""The fork server ``pdserve launch`` starts simulated nodes from (``python -m
pdserve.forkserver REPLY_FD``; launch's side and the protocol: forked_nodes.py).

    1. import what a simulated node runs, with OpenBLAS on one thread: no thread, ZeroMQ
       context or socket exists here, so forking is safe (checked before each fork)
    2. move every object to the garbage collector's permanent generation: a collection
       in a node would otherwise write to each inherited object's header, copying its page
    3. per request line on stdin fork a node; answer its PID on REPLY_FD
    4. at stdin's end, exit (launch, the subreaper, inherits the nodes)

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
import signal
import sys

from pdserve.common.config_io import ENV
from pdserve.forked_nodes import PR_SET_NAME, prctl

PRELOAD = ("torch", "zmq", "pdserve.cli", "pdserve.node.prefill", "pdserve.node.decode",
           "pdserve.node.colocated", "pdserve.engine.sim_runner")


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
    prctl(PR_SET_NAME, name.encode()[:15])
    import pdserve.cli

    sys.argv = [pdserve.cli.__file__, role, "--config-env"]
    return pdserve.cli.main(sys.argv[1:], prog_name="pdserve")


def _show_in_proc(text: str) -> None:
    """Writes ``text`` over the room the server's $PDSERVE_CONFIG held in the environment
    block the kernel shows as /proc/PID/environ (the one made at exec; os.environ is a
    copy). Trailing spaces keep it the same length: JSON ignores them."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
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
