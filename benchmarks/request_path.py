"""The way of one streamed chat request through the code: which pdserve files its
processes enter between the request leaving the client and its first token arriving.

    python benchmarks/request_path.py [--repo DIR] [--model DIR|FILE.gguf]

It starts ``pdserve launch`` (1 prefill, 1 decode) from ``--repo`` (default: this
checkout) with a profile hook in every process (a sitecustomize on PYTHONPATH, active
only under this script) that writes each change of the running pdserve file, per
thread, with a system-wide monotonic clock. It sends one streamed chat request, then
counts, over all processes and threads, the files entered inside that window (by room)
and the distinct calls from one file into another. The same count over an idle window
of the same length just before the request says how much of it is background
(heartbeats, the clock): it is not subtracted, only printed beside.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

HOOK = r'''
import os, sys, threading, time
_dir = os.environ.get("PDSERVE_TRACE_DIR")
if _dir:
    _out = open(os.path.join(_dir, f"trace-{os.getpid()}.txt"), "w", buffering=1 << 16)
    _last = {}

    def _hook(frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_filename
        i = name.rfind("/pdserve/")
        if i < 0 or "/site-packages/" in name:
            return
        tid = threading.get_ident()
        rel = name[i + 1:]
        if _last.get(tid) != rel:
            _last[tid] = rel
            _out.write(f"{time.monotonic_ns()} {tid} {rel}\n")

    sys.setprofile(_hook)
    threading.setprofile(_hook)
    import atexit
    atexit.register(_out.flush)
'''


def read_traces(folder: Path) -> list[tuple[int, str, str]]:
    events = []
    for path in folder.glob("trace-*.txt"):
        pid = path.stem.split("-")[1]
        for line in path.read_text().splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[0].isdigit():
                events.append((int(parts[0]), f"{pid}/{parts[1]}", parts[2]))
    return sorted(events)


def count(events, t0: int, t1: int) -> tuple[list[str], set[tuple[str, str]]]:
    """(the files entered in [t0, t1] in order of first entry, the distinct calls from one
    file into another on the same thread: how tangled the way is)."""
    files, edges, last = [], set(), {}
    for t, thread, name in events:
        if not t0 <= t <= t1:
            continue
        if name not in files:
            files.append(name)
        if thread in last and last[thread] != name:
            edges.add((last[thread], name))
        last[thread] = name
    return files, edges


def rooms(files: list[str]) -> str:
    by_room = defaultdict(int)
    for name in files:
        parts = name.split("/")
        by_room["/".join(parts[1:-1]) or parts[-1]] += 1
    return ", ".join(f"{room} {n}" for room, n in sorted(by_room.items()))


def first_token(url: str, model: str) -> tuple[int, int]:
    body = {"model": model, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    t0 = time.monotonic_ns()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                data = json.loads(line[6:])
                if data["choices"] and data["choices"][0]["delta"].get("content"):
                    return t0, time.monotonic_ns()
    raise RuntimeError("the stream ended without a token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--model", default=None)
    ap.add_argument("--http-port", type=int, default=18431)
    ap.add_argument("--list", action="store_true", help="print the files too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hook, traces = Path(tmp, "hook"), Path(tmp, "traces")
        hook.mkdir()
        traces.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        env = {**os.environ, "PYTHONPATH": f"{hook}:{args.repo}",
               "PDSERVE_TRACE_DIR": str(traces)}
        cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--http-port",
               str(args.http_port), "--ingress", "none", "--threads", "1"]
        cmd += ["--model", args.model] if args.model else []
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            for line in proc.stdout:
                if line.startswith("Ctrl-C"):
                    break
            url = f"http://127.0.0.1:{args.http_port}"
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            first_token(url, model)  # warm: first-use imports and caches are not the way
            time.sleep(3)
            t0, t1 = first_token(url, model)
            time.sleep(1)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        events = read_traces(traces)
    files, edges = count(events, t0, t1)
    idle_end = t0 - 2_000_000_000
    idle_files, idle_edges = count(events, idle_end - (t1 - t0), idle_end)
    print(f"repo {args.repo}: first token after {(t1 - t0) / 1e6:.1f} ms\n"
          f"  {len(files)} pdserve files entered ({rooms(files)}), {len(edges)} distinct "
          f"file-to-file calls\n  an idle window as long, 2 s before: {len(idle_files)} "
          f"files ({rooms(idle_files)}), {len(idle_edges)} calls")
    if args.list:
        print("\n".join(files))

if __name__ == "__main__":
    main()
