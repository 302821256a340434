"""free_port picks under the kernel's ephemeral range, where no outgoing connection or
port-0 bind can take a port between the pick and its process binding it."""
import socket
import subprocess
import sys

from pdserve.common.sockets import free_port


def ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_are_under_the_ephemeral_range_bindable_and_never_repeated():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < ephemeral_low() for p in ports), sorted(ports)[-5:]
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_processes_seeded_alike_pick_different_ports():
    """Two test processes that both call random.seed(0) (a test or a benchmark may) must not
    pick the same ports in the same order."""
    code = ("import random; random.seed(0); from pdserve.common.sockets import free_port; "
            "print([free_port() for _ in range(20)])")
    a, b = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60).stdout for _ in range(2))
    assert a != b
