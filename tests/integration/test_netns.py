"""Several hosts on one machine: router, prefill and two decode nodes each in a network
namespace of their own, joined by veth pairs to a bridge in a "switch" namespace. Cutting
a decode node's link mid-stream must move its requests to the other decode node with no
token lost or repeated. Everything here (namespaces, links, addresses, processes) is made
by the test and removed by it; no traffic leaves these namespaces."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="needs root and iproute2 to make network namespaces")

NET = "10.231.7"   # the test hosts' own subnet, inside the namespaces only
HOSTS = {"r": 1, "p": 2, "d0": 3, "d1": 4}


def sh(*args):
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    tag = f"pd{os.getpid() % 100000}"
    ns = {h: f"{tag}-{h}" for h in HOSTS}
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
            sh("ip", "netns", "exec", n, "ip", "addr", "add", f"{NET}.{HOSTS[h]}/24", "dev",
               host_end)
            sh("ip", "netns", "exec", n, "ip", "link", "set", host_end, "up")
            sh("ip", "netns", "exec", n, "ip", "link", "set", "lo", "up")
        yield ns, switch, tag
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def in_ns(ns, *cmd, log=None):
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd],
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True)


CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    import httpx
    URL, MODEL, PROMPTS, N = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    async def one(client, prompt, i):
        text = ""
        async with client.stream("POST", URL + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": N, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]}
                text += chunk["choices"][0]["text"]
                if len(text) > 0 and i == 0:
                    print("STREAMING", flush=True)
        return {"text": text}
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            out = await asyncio.gather(*(one(client, p, i) for i, p in enumerate(PROMPTS)))
        print("RESULT " + json.dumps(out), flush=True)
    asyncio.run(main())
""")


def test_cutting_a_decode_link_mid_stream_fails_over(hosts, tiny_model, tmp_path):
    ns, switch, tag = hosts
    model = tiny_model("llama")
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    want = [o.text for o in LLM(model=model).generate(
        prompts, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))]
    py = [sys.executable, "-m", "pdserve.cli"]
    hb = ["--heartbeat-interval", "0.3"]
    router = f"tcp://{NET}.1:5556"
    procs = []
    try:
        procs.append(in_ns(ns["r"], *py, "router", "--model", str(model), "--host", f"{NET}.1",
                           "--http-port", "8000", "--control", router, "--ingress", "none",
                           "--insecure", *hb, log=open(tmp_path / "router.log", "w")))
        procs.append(in_ns(ns["p"], *py, "prefill", "--router", router, "--model", str(model),
                           "--node-id", "p", "--threads", "1", *hb,
                           log=open(tmp_path / "p.log", "w")))
        for d in ("d0", "d1"):
            procs.append(in_ns(ns[d], *py, "decode", "--router", router, "--model", str(model),
                               "--node-id", d, "--kv-bind", f"tcp://{NET}.{HOSTS[d]}:5600",
                               "--insecure", "--threads", "1", *hb,
                               log=open(tmp_path / f"{d}.log", "w")))
        deadline = time.monotonic() + 120
        while True:  # the router's /health, asked from inside its namespace, and both
            # decode nodes joined (health needs one: d0 may still be starting)
            ok = subprocess.run(["ip", "netns", "exec", ns["r"], sys.executable, "-c",
                                 f"import httpx,sys; sys.exit(httpx.get('http://{NET}.1:8000/"
                                 "health').status_code != 200)"], capture_output=True)
            joined = open(tmp_path / "router.log").read()
            if ok.returncode == 0 and all(f"node {d} joined" in joined for d in ("d0", "d1")):
                break
            assert time.monotonic() < deadline, open(tmp_path / "router.log").read()
            time.sleep(0.5)
        client = in_ns(ns["r"], sys.executable, "-c", CLIENT, f"http://{NET}.1:8000",
                       model.name, json.dumps(prompts), "150")
        procs.append(client)
        assert client.stdout.readline().strip() == "STREAMING"
        # Cut decode node d0's cable at the switch.
        sh("ip", "netns", "exec", switch, "ip", "link", "set", f"{tag}d0s", "down")
        out, _ = client.communicate(timeout=180)
        result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
        assert [r.get("text") for r in result] == want, result
        log = open(tmp_path / "router.log").read()
        assert "d0 missed" in log and "moves to other nodes" in log
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
