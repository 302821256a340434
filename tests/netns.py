"""Several hosts on one machine: a network namespace per host, each joined by a veth pair
to a bridge in a "switch" namespace, on a subnet of their own. Everything (namespaces,
links, addresses) is made by the test and removed by it; no traffic leaves them.

``Inside(ns)`` runs calls on a thread that lives in a host's namespace (setns(2) moves
one thread only), so the test itself can speak to its hosts with tests/fleet.py's own
helpers (health, etcd records, HTTP requests) instead of a script started in there.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                 reason="needs root and iproute2 to make network namespaces")

CLONE_NEWNET = 0x40000000


def sh(*args) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@dataclass
class Network:
    subnet: str              # "10.231.7": host h is SUBNET.N
    ns: dict[str, str]       # host -> its namespace
    addr: dict[str, str]     # host -> its address
    switch: str              # the bridge's namespace
    tag: str                 # prefix of every name made (namespaces, links)

    def cable(self, host: str) -> str:
        """The switch end of a host's link (``ip link set ... down`` cuts the host off)."""
        return f"{self.tag}{host}s"


@contextlib.contextmanager
def network(subnet: str, hosts: dict[str, int]):
    """Namespaces for ``hosts`` (name -> last byte of its address) on one bridge."""
    tag = f"pd{os.getpid() % 100000}"
    ns = {h: f"{tag}-{h}" for h in hosts}
    switch = f"{tag}-sw"
    made = []
    try:
        sh("ip", "netns", "add", switch)
        made.append(switch)
        sh("ip", "netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", switch, "ip", "link", "set", "br0", "up")
        for h, n in ns.items():
            sh("ip", "netns", "add", n)
            made.append(n)
            host_end, switch_end = f"{tag}{h}h", f"{tag}{h}s"
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            sh("ip", "link", "set", host_end, "netns", n)
            sh("ip", "link", "set", switch_end, "netns", switch)
            sh("ip", "netns", "exec", switch, "ip", "link", "set", switch_end, "master", "br0")
            sh("ip", "netns", "exec", switch, "ip", "link", "set", switch_end, "up")
            sh("ip", "netns", "exec", n, "ip", "addr", "add", f"{subnet}.{hosts[h]}/24", "dev",
               host_end)
            sh("ip", "netns", "exec", n, "ip", "link", "set", host_end, "up")
            sh("ip", "netns", "exec", n, "ip", "link", "set", "lo", "up")
        yield Network(subnet, ns, {h: f"{subnet}.{i}" for h, i in hosts.items()}, switch, tag)
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def in_ns(ns: str, *cmd, log=None) -> subprocess.Popen:
    """``cmd`` in namespace ``ns`` (``ip netns exec`` execs it: the PID is the command's)."""
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd],
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True)


class Inside(ThreadPoolExecutor):
    """Threads in the namespace ``ns``: ``inside.call(f, *args)`` runs ``f`` on one of them
    and returns what it returns (sockets it opens are that namespace's)."""

    def __init__(self, ns: str, threads: int = 1):
        super().__init__(threads, thread_name_prefix=f"in-{ns}",
                         initializer=_enter, initargs=(ns,))

    def call(self, fn, *args, **kw):
        return self.submit(fn, *args, **kw).result()


def _enter(ns: str) -> None:
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)
