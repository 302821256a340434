"""KV bytes per second from a prefill process's pages into a decode process's pages.

A Llama-3-8B-shaped cache (32 layers, 8 KV heads, head dim 128, bfloat16:
128 KiB per token) at 2,048 tokens (256 MiB), over TCP on loopback. In the
same run, on the same transport: a bare pyzmq PUSH/PULL of the same bytes in
8 MiB frames, and an in-process memcpy. Ours uses the nodes' own code:
the tcp and shm backends' chunks (gather blocks + checksum) on the sender, ``KVReceiver.place``
(checks + checksum + scatter into pages) on the receiver, acknowledged at the end.
The same-host rows keep the sender's pages in a /dev/shm segment, as a prefill
node does: the messages carry offsets and the receiver copies the pages from
the segment (compare them with memcpy). Every process sets malloc as the nodes do
(``tune_malloc``). Each row also reports the CPU seconds that all threads of both
processes spent per GiB moved: where the baseline already keeps the cores busy, the
baseline's CPU per GiB over ours bounds the ratio this machine can show.

    python benchmarks/kv_transfer.py [--tokens 2048] [--repeats 5] [--rounds 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time
from typing import NamedTuple

import torch
import zmq

from pdserve.common import codec
from pdserve.common import protocol as P
from pdserve.common.transport import make_socket, recv_message, recv_routed, send_message
from pdserve.engine.engine import layer_groups
from pdserve.engine.host_memory import tune_malloc
from pdserve.engine.model_runner import kv_tensor_bytes, kv_views
from pdserve.node.kv import InboundTransfer, KVReceiver, Outgoing
from pdserve.node.kv.pages import pool_bytes
from pdserve.node.kv.segment import Segment
from pdserve.node.kv.shm import shm_chunk
from pdserve.node.kv.tcp import frames_chunk

LAYOUT = P.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                    block_size=16)
MODEL = P.ModelIdentity(name="llama-3-8b-shaped", config_hash="bench")
FRAME = 8 * 2**20


class Run(NamedTuple):
    times: list[float]  # wall seconds of each timed repeat
    cpu: float          # CPU seconds of every thread of both processes over those repeats


def make_caches(num_blocks: int, fill: bool, segment: bool = False):
    """The KV cache; with segment=True in a /dev/shm segment as a prefill node's is
    (returns the segment too)."""
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if segment:
        seg = Segment.create(2 * LAYOUT.num_layers * kv_tensor_bytes(shape, torch.bfloat16))
        caches = kv_views(seg.data, LAYOUT.num_layers, shape, torch.bfloat16)
        for k, v in caches:
            k.copy_(torch.randn(shape))
            v.copy_(torch.randn(shape))
        return caches, seg
    make = (lambda: torch.randn(shape).to(torch.bfloat16)) if fill else \
        (lambda: torch.zeros(shape, dtype=torch.bfloat16))
    return [(make(), make()) for _ in range(LAYOUT.num_layers)]


def block_ids(num_tokens: int, num_blocks: int, seed: int, scattered: bool) -> torch.Tensor:
    """Scattered: blocks in random order (a long-running node). Contiguous: one run, as a
    fresh allocator hands them out (then the sender ships the pages without a gather and
    the receiver places them with one slice copy per layer)."""
    n = -(-num_tokens // LAYOUT.block_size)
    if not scattered:
        return torch.arange(seed, seed + n)
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n]


def ours_receiver(address_q, args, scattered: bool):
    tune_malloc()
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", rcvhwm=0)
    address_q.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    caches = make_caches(args.num_blocks, fill=False)
    receiver = KVReceiver(MODEL, LAYOUT, caches)
    ids = block_ids(args.tokens, args.num_blocks, seed=1, scattered=scattered)
    for i in range(args.repeats):
        if i == 1:  # the first run warms up, as on the sender's side
            cpu0 = time.process_time()
        transfer = InboundTransfer("r", ids, args.tokens)
        while True:
            peer, chunk = recv_routed(sock, (P.KVChunk,))
            failed = receiver.place(chunk, {0: transfer})
            assert not failed, failed
            if chunk.last:
                break
        ack = P.KVAck(results=[P.KVResult(req_id="r", ok=True)])
        sock.send_multipart([peer, *codec.encode(ack)])
    address_q.put(time.process_time() - cpu0)
    receiver.close()
    sock.close()
    ctx.term()


def bare_receiver(address_q, args):
    tune_malloc()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    done = ctx.socket(zmq.PUSH)
    done.bind("tcp://127.0.0.1:*")
    address_q.put((pull.getsockopt_string(zmq.LAST_ENDPOINT),
                   done.getsockopt_string(zmq.LAST_ENDPOINT)))
    nframes = args.tokens * 128 * 1024 // FRAME
    for i in range(args.repeats):
        if i == 1:
            cpu0 = time.process_time()
        for _ in range(nframes):
            pull.recv(copy=False)
        done.send(b"ok")
    address_q.put(time.process_time() - cpu0)
    pull.close(0)
    done.close(0)
    ctx.term()


def run_ours(args, checksums: bool, scattered: bool, shm: bool = False) -> list[float]:
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=ours_receiver, args=(q, args, scattered))
    proc.start()
    address = q.get(timeout=60)
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=address, sndhwm=0)
    caches, segment = make_caches(args.num_blocks, fill=True, segment=True) if shm else \
        (make_caches(args.num_blocks, fill=True), None)
    ids = block_ids(args.tokens, args.num_blocks, seed=0, scattered=scattered)
    groups = layer_groups(LAYOUT.num_layers, args.layers_per_chunk)
    views = pool_bytes(caches)  # as a prefill node makes them, once
    times = []
    try:
        for i in range(args.repeats):
            if i == 1:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            for start, end in groups:
                last = end == LAYOUT.num_layers
                part = Outgoing("r", ids.tolist(), args.tokens, first_token=1 if last else None)
                if segment is None:
                    msg = frames_chunk(MODEL, LAYOUT, caches, [part], start, end,
                                       checksums=checksums, last=last, views=views)
                else:
                    msg = shm_chunk(MODEL, LAYOUT, caches, [part], start, end,
                                    checksums=checksums, last=last, segment=segment, views=views)
                send_message(sock, msg)
            ack = recv_message(sock, (P.KVAck,))
            assert ack.results[0].ok
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0 + q.get(timeout=60)
    finally:
        sock.close(0)
        ctx.term()
        proc.join(timeout=30)
        if segment is not None:
            segment.close()
    return Run(times[1:], cpu)  # the first run warms the page cache and sockets


def run_bare(args) -> list[float]:
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=bare_receiver, args=(q, args))
    proc.start()
    push_addr, done_addr = q.get(timeout=60)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(push_addr)
    done = ctx.socket(zmq.PULL)
    done.connect(done_addr)
    buf = torch.randn(FRAME // 4).numpy()  # 8 MiB
    nframes = args.tokens * 128 * 1024 // FRAME
    times = []
    for i in range(args.repeats):
        if i == 1:
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(nframes):
            push.send(buf, copy=False)
        done.recv()
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0 + q.get(timeout=60)
    push.close(0)
    done.close(0)
    ctx.term()
    proc.join(timeout=30)
    return Run(times[1:], cpu)


def run_memcpy(args) -> list[float]:
    nbytes = args.tokens * 128 * 1024
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for i in range(args.repeats):
        if i == 1:
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return Run(times[1:], time.process_time() - cpu0)


def variants(paths: str) -> list[tuple[str, str, dict]]:
    """(name, baseline, run_ours kwargs) of each of our rows."""
    out = []
    if paths != "shm":
        out += [(f"pdserve pages->pages, {'scattered' if sc else 'contiguous'} blocks, "
                 f"{'checksum' if ck else 'no check'}", "bare", dict(checksums=ck, scattered=sc))
                for sc in (True, False) for ck in (True, False)]
    if paths != "tcp":
        out += [(f"same host, /dev/shm, {'scattered' if sc else 'contiguous'} blocks, "
                 "checksum", "memcpy", dict(checksums=True, scattered=sc, shm=True))
                for sc in (True, False)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3,
                    help="every row is measured once per round, rounds interleave the rows "
                         "(a load that drifts hits all of them); ratios are per round, then "
                         "the median")
    ap.add_argument("--layers-per-chunk", type=int, default=4)
    ap.add_argument("--paths", choices=("all", "tcp", "shm"), default="all",
                    help="which of ours to run (memcpy and bare pyzmq always run)")
    args = ap.parse_args()
    tune_malloc()  # every process here mallocs as the nodes do (engine/host_memory.py)
    args.num_blocks = 2 * -(-args.tokens // LAYOUT.block_size)
    nbytes = args.tokens * 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2

    def gbps(run: Run) -> float:
        return nbytes / statistics.median(run.times) / 1e9

    def cpu_per_gib(run: Run) -> float:
        return run.cpu / (len(run.times) * nbytes / 2**30)

    rows = variants(args.paths)
    figures: dict[str, list[float]] = {"memcpy": [], "bare": []}
    cpu: dict[str, list[float]] = {"memcpy": [], "bare": []}
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        base = {"memcpy": run_memcpy(args), "bare": run_bare(args)}
        for key, run in base.items():
            figures[key].append(gbps(run))
            cpu[key].append(cpu_per_gib(run))
        for name, against, kw in rows:
            run = run_ours(args, **kw)
            figures.setdefault(name, []).append(gbps(run))
            cpu.setdefault(name, []).append(cpu_per_gib(run))
            ratios[name].append(gbps(run) / gbps(base[against]))
        loads.append(os.getloadavg()[0])
    med = statistics.median
    print(f"KV of {args.tokens} tokens, {nbytes / 2**20:.0f} MiB (32 layers x 8 kv heads x 128, "
          f"bf16), TCP loopback, {platform.machine()}, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds, load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'memcpy (one process)':54s}: {med(figures['memcpy']):6.2f} GB/s  "
          f"CPU {med(cpu['memcpy']):.3f} s/GiB")
    print(f"{'bare pyzmq PUSH/PULL, 8 MiB frames':54s}: {med(figures['bare']):6.2f} GB/s  "
          f"CPU {med(cpu['bare']):.3f} s/GiB")
    for name, against, _ in rows:
        each = " ".join(f"{r:.2f}" for r in ratios[name])
        print(f"{name:54s}: {med(figures[name]):6.2f} GB/s  ratio to {against} "
              f"{med(ratios[name]):.2f} (rounds: {each})  CPU {med(cpu[name]):.3f} s/GiB, "
              f"{against}'s / ours {med(cpu[against]) / med(cpu[name]):.2f}")
    print("CPU: seconds of every thread of both processes (libzmq's I/O threads and torch's "
          "included) per GiB moved. Where the baseline keeps every core busy, 'its / ours' is "
          "the most the ratio can reach on this machine.")
    print(f"goals: ratio to bare >= 0.8 over TCP, to memcpy >= 0.6 through /dev/shm "
          f"(checksums on, the default); {os.cpu_count()} cores here")


if __name__ == "__main__":
    main()
