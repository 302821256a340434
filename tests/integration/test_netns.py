"""Several hosts on one machine: router, prefill and two decode nodes each in a network
namespace of their own, joined by veth pairs to a bridge in a "switch" namespace. Cutting
a decode node's link mid-stream must move its requests to the other decode node with no
token lost or repeated. Everything here (namespaces, links, addresses, processes) is made
by the test and removed by it; no traffic leaves these namespaces."""
import contextlib
import json
import re
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams
from tests.fleet import fleet, healthy, wait_for
from tests.netns import Inside, in_ns, needs_netns, network, sh

pytestmark = needs_netns

NET = "10.231.7"   # the test hosts' own subnet, inside the namespaces only
HOSTS = {"r": 1, "p": 2, "d0": 3, "d1": 4}


@pytest.fixture
def hosts():
    with network(NET, HOSTS) as net:
        yield net


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
    ns, switch = hosts.ns, hosts.switch
    model = tiny_model("llama")
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    want = [o.text for o in LLM(dtype="float32", model=model).generate(
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
        sh("ip", "netns", "exec", switch, "ip", "link", "set", hosts.cable("d0"), "down")
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


FLEET_NET = "10.231.8"  # etcd's host, the routers' host, the nodes' host
FLEET_HOSTS = {"etcd": 1, "routers": 2, "nodes": 3}
NODE_TTL_S = 2  # the nodes' --discovery-ttl: the cut outlasts it


def stream_until(router, model: str, prompt: list[int], max_tokens: int,
                 stop: threading.Event) -> list[dict]:
    """Streams ``prompt`` through ``router`` again and again until ``stop``: for each
    request, the text streamed and every finish reason seen (a user's view)."""
    out = []
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            text, finishes = "", []
            with client.stream("POST", router.http_url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        finishes.append(f"error: {chunk['error']}")
                        continue
                    text += chunk["choices"][0]["text"]
                    if chunk["choices"][0].get("finish_reason"):
                        finishes.append(chunk["choices"][0]["finish_reason"])
            out.append({"text": text, "finishes": finishes})
    return out


def test_nodes_cut_off_from_etcd_serve_on(tiny_model, tmp_path):
    """The nodes' host loses etcd (etcd's packets to it vanish, as in a partition) longer
    than the nodes' lease, while streams flow through both routers: their records leave
    etcd, yet no router drops a node that still heartbeats; every request completes once
    with an unfaulted run's tokens; and once etcd is reachable the nodes register again
    (new leases, later epochs)."""
    model = tiny_model("llama")
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    n = 40
    want = [o.text for o in LLM(dtype="float32", model=model).generate(
        prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(network(FLEET_NET, FLEET_HOSTS))
        inside = stack.enter_context(Inside(net.ns["routers"], threads=len(prompts) + 1))
        f = stack.enter_context(fleet(tmp_path, model, net.addr["etcd"], net.ns["etcd"],
                                      inside))
        on_routers = dict(host=net.addr["routers"], ns=net.ns["routers"])
        routers = [f.router(name, **on_routers) for name in ("router-a", "router-b")]
        ttl = ("--discovery-ttl", str(NODE_TTL_S))
        nodes = [f.node("prefill", "prefill-0", *ttl, ns=net.ns["nodes"]),
                 f.node("decode", "decode-0", *ttl, "--insecure", "--kv-bind",
                        f"tcp://{net.addr['nodes']}:5600", ns=net.ns["nodes"])]
        for r in routers:
            wait_for(lambda r=r: inside.call(healthy, r), 120, f"{r.name} not healthy",
                     r, *nodes)
            for node in nodes:
                wait_for(lambda r=r, node=node: f"node {node.name} joined" in r.log(), 60,
                         f"{node.name} never joined {r.name}", r, node)
        wait_for(lambda: len(f.records("nodes")) == 2, 30, "the nodes never registered",
                 *nodes)
        epochs = {k: e for k, (_rec, e) in f.records("nodes").items()}
        since = {p.name: len(p.log()) for p in (*routers, *nodes)}  # (a start may be slow)
        stop = threading.Event()
        flows = [inside.submit(stream_until, routers[i % 2], model.name, p, n, stop)
                 for i, p in enumerate(prompts)]
        time.sleep(1.0)  # streams are under way through both routers
        cut = ("ip", "netns", "exec", net.ns["etcd"], "ip", "route", "add", "blackhole",
               f"{net.addr['nodes']}/32")
        sh(*cut)
        try:
            wait_for(lambda: not f.records("nodes"), 4 * NODE_TTL_S + 5,
                     "the cut nodes' records outlived their leases", *routers, *nodes)
            for r in routers:  # each router saw the records go, and kept the nodes
                wait_for(lambda r=r: r.log().count("left etcd but still heartbeats") >= 2,
                         10, f"{r.name} did not see the records go", r)
            time.sleep(1.0)  # streams go on meanwhile
        finally:
            sh(*(a if a != "add" else "del" for a in cut))
        wait_for(lambda: len(f.records("nodes")) == 2, 30, "the nodes did not register again",
                 *nodes)
        again = {k: e for k, (_rec, e) in f.records("nodes").items()}
        assert again.keys() == epochs.keys() and all(again[k] > epochs[k] for k in again)
        stop.set()
        results = [flow.result(timeout=120) for flow in flows]
        for i, got in enumerate(results):
            assert got, f"prompt {i} never completed"
            for one in got:
                assert one == {"text": want[i], "finishes": ["length"]}, (i, one, want[i])
        print("requests completed during the test:", sum(len(g) for g in results))
        for r in routers:
            log = r.log()[since[r.name]:]
            assert not re.search(r"missed|left etcd \(|restarted|moves to other", log), log
        for node in nodes:
            log = node.log()[since[node.name]:]
            assert "registering again" in log and "left the cluster" not in log, log[-3000:]
