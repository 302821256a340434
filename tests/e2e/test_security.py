"""CurveZMQ keys and allow-lists, the HTTP API key: unit tests on loopback sockets, then a
cluster started by ``pdserve launch`` with both on, and a rogue node and producers."""
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import httpx
import pytest
import zmq
from click.testing import CliRunner

from pdserve.common import protocol as P
from pdserve.common import security as S
from pdserve.common import transport as T
from tests.cluster import launched

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
LOCAL = "tcp://127.0.0.1:*"
API_KEY = "sk-test-0123456789"


def poll_in(sock, timeout_ms=5000):
    return sock.poll(timeout_ms, zmq.POLLIN) == zmq.POLLIN


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return _generate(tmp_path_factory.mktemp("keys"))


def _generate(path):
    result = CliRunner().invoke(S.keys_group, ["generate", str(path), "--node", "prefill-2"])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def rogue(tmp_path_factory, keys):
    """Keys made elsewhere, plus the real router's public key: right server, unknown client."""
    path = _generate(tmp_path_factory.mktemp("rogue"))
    shutil.copyfile(keys / "router.key", path / "router.key")
    return path


# ------------------------------------------------------------------ key files

def test_generate_layout_modes_and_keeping_keys(keys):
    names = {p.relative_to(keys).as_posix() for p in keys.rglob("*") if p.is_file()}
    assert names == {f"{n}.{ext}" for n in ("router", "node", "client", "prefill-2")
                     for ext in ("key", "key_secret")} | {
        "allow/nodes/node.key", "allow/nodes/prefill-2.key", "allow/clients/client.key"}
    for secret in keys.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert S.load_public(keys, "node") == S.load_public(keys / "allow" / "nodes", "node")
    before = S.load_keypair(keys, "router")
    result = CliRunner().invoke(S.keys_group, ["generate", str(keys)])
    assert result.exit_code == 0 and "every key exists already" in result.output
    assert S.load_keypair(keys, "router") == before   # never replaced without --force


def test_missing_keys_are_clear_errors(tmp_path, keys):
    with pytest.raises(ValueError, match="nobody.key_secret is missing.*pdserve keys generate"):
        S.client_curve(keys, "nobody")
    shutil.copy(keys / "router.key_secret", tmp_path)
    with pytest.raises(ValueError, match="allow-list folder .*allow/clients is missing"):
        S.server_curve(tmp_path, S.INGRESS_DOMAIN)
    with pytest.raises(ValueError, match="plain file name"):
        S.generate_keys(tmp_path, nodes=["../x"])
    assert S.server_curve(None, S.CONTROL_DOMAIN) is None and S.node_curves(None, "decode") is None


def test_api_key_reaches_the_router_config_but_never_argv(monkeypatch):
    import click

    from pdserve import cli_config as cli
    from pdserve.common.config_io import ENV, child_env
    from pdserve.launch import _child

    @click.command()
    @cli.router_options
    def show(**kw):
        kw.pop("log_level")
        config = cli.router_config(kw)
        assert API_KEY not in repr(config)  # configs get logged
        assert API_KEY not in " ".join(_child("router"))  # argv: visible to every user
        handed = json.loads(child_env(config, "info")[ENV])["config"]["api_key"]
        click.echo(f"{config.api_key} {handed}")

    assert CliRunner().invoke(show, ["--api-key", API_KEY]).output.split() == [API_KEY] * 2
    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)
    assert CliRunner().invoke(show, []).output.split() == [API_KEY] * 2
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert CliRunner().invoke(show, []).output.split() == ["None", "None"]


def test_open_to_other_machines_without_keys_refuses_to_start_unless_insecure(keys, caplog):
    from pdserve.engine.config import EngineConfig
    from pdserve.node.config import NodeConfig
    from pdserve.router.config import RouterConfig

    caplog.set_level(logging.WARNING, logger="pdserve.common.security")
    S.check_router_security(RouterConfig())  # loopback: nothing to say
    assert caplog.text == ""
    exposed = dict(host="0.0.0.0", control="tcp://*:5556", ingress="tcp://*:5557")
    with pytest.raises(ValueError, match="refusing to start") as info:
        S.check_router_security(RouterConfig(**exposed))
    assert "control socket tcp://*:5556 is open to other machines without CURVE" in \
        str(info.value) and "ingress socket" in str(info.value) and "--api-key" in \
        str(info.value) and "--insecure" in str(info.value)
    S.check_router_security(RouterConfig(**exposed, insecure=True))  # starts, and says so
    assert caplog.text.count("INSECURE (--insecure)") == 3
    caplog.clear()
    S.check_router_security(RouterConfig(host="0.0.0.0", control="tcp://*:5556",
                                         curve_dir=str(keys), api_key="k"))
    assert caplog.text == ""
    # A decode node's KV socket off loopback: the same rule.
    decode = NodeConfig(role="decode", engine=EngineConfig(), kv_bind="tcp://*:5600")
    with pytest.raises(ValueError, match="KV socket tcp://\\*:5600"):
        S.refuse_insecure(S.node_exposures(decode), decode.insecure)
    assert S.node_exposures(NodeConfig(role="decode", engine=EngineConfig(),
                                       kv_bind="tcp://*:5600", curve_dir=str(keys))) == []
    assert S.node_exposures(NodeConfig(role="prefill", engine=EngineConfig())) == []
    # --insecure: the warning comes back every period.
    warnings = S.InsecureWarnings(["exposed"], period_s=0.05)
    caplog.clear()
    warnings.tick()
    assert "INSECURE" not in caplog.text
    time.sleep(0.06)
    warnings.tick()
    assert "INSECURE (--insecure): exposed" in caplog.text


# ------------------------------------------------------------------ ZAP on real sockets

def test_allow_list_per_socket_kind_and_refusals_logged(keys, rogue, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.common.security")
    ctx = zmq.Context()
    socks = []

    def make(kind, **kw):
        socks.append(T.make_socket(ctx, kind, **kw))
        return socks[-1]

    try:
        control = make(zmq.ROUTER, bind=LOCAL, curve=S.server_curve(keys, S.CONTROL_DOMAIN))
        ingress = make(zmq.ROUTER, bind=LOCAL, curve=S.server_curve(keys, S.INGRESS_DOMAIN))

        def reaches(server, name=None, key_dir=keys, expected=False):
            dealer = make(zmq.DEALER, connect=T.endpoint_of(server), identity=f"d{len(socks)}",
                          curve=S.client_curve(key_dir, name) if name else None,
                          sndtimeo_ms=2000)
            try:
                T.send_message(dealer, P.Heartbeat(node_id="x"))
            except T.SendError:  # refused before the send: the DEALER has no pipe left
                return False
            if not poll_in(server, 5000 if expected else 400):
                return False
            return T.recv_routed(server)[1] == P.Heartbeat(node_id="x")

        assert reaches(control, "node", expected=True)
        assert reaches(control, "prefill-2", expected=True)
        assert reaches(ingress, "client", expected=True)
        assert not reaches(control, "client")       # a producer's key never joins as a node
        assert not reaches(ingress, "node")         # and a node's key does not submit
        assert not reaches(control, "node", rogue)  # unknown key, right server key
        assert not reaches(ingress)                 # no keys at all
        wrong_server = make(zmq.DEALER, connect=T.endpoint_of(control), curve=T.CurveConfig.client(
            *reversed(S.load_keypair(keys, "node")), S.load_public(rogue, "node")))
        T.send_message(wrong_server, P.Heartbeat(node_id="x"))
        assert not poll_in(control, 400)
        time.sleep(0.3)  # the guard thread logs asynchronously
    finally:
        for s in socks:
            s.close(linger=0)
        started = time.monotonic()
        ctx.term()  # the guard thread lets go of its sockets: no hang
        assert time.monotonic() - started < 2
    text = caplog.text
    rogue_key = S.load_public(rogue, "node").decode()
    client_key = S.load_public(keys, "client").decode()
    assert f"refused client 127.0.0.1 on the control socket: public key {rogue_key}" in text
    assert f"on the control socket: public key {client_key} is not on its allow-list" in text
    assert "ingress socket" in text and "one side has no CURVE keys" in text
    assert "wrong server public key" in text


# ------------------------------------------------------------------ a whole cluster

@pytest.fixture(scope="module")
def cluster(tiny_model, keys, tmp_path_factory):
    model = tiny_model("llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_API_KEY", API_KEY)  # --api-key's variable; launch passes it down
        with launched(model, 1, 1, "--curve-dir", str(keys),
                      log_dir=tmp_path_factory.mktemp("logs")) as c:
            yield model, c


@pytest.fixture(scope="module")
def offline(cluster):
    from pdserve import LLM, SamplingParams

    llm = LLM(model=cluster[0])
    return llm.generate(["Secure sockets"], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True))[0].token_ids


def completion(cluster, headers=None):
    model, c = cluster
    return httpx.post(c.http_url + "/v1/completions", headers=headers, timeout=60, json={
        "model": os.path.basename(str(model)), "prompt": "Secure sockets", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True})


def test_cluster_serves_with_curve_and_api_key(cluster, keys, offline):
    c = cluster[1]
    ok = completion(cluster, {"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == len(offline)
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = completion(cluster, headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "authentication_error" and "API key" in err["message"]
    assert httpx.get(c.http_url + "/v1/models").status_code == 401
    assert httpx.get(c.http_url + "/health").status_code == 200   # open for probes
    assert httpx.get(c.http_url + "/metrics").status_code in (200, 404)  # never 401
    from pdserve.client import QueueClient
    with QueueClient(c.ingress, curve=S.client_curve(keys, "client")) as client:
        assert client.generate("Secure sockets", temperature=0, max_tokens=8, ignore_eos=True,
                               timeout_s=60).token_ids == offline


@pytest.mark.parametrize("who", ["no keys", "unknown key", "a node's key"])
def test_producer_without_the_right_key_gets_nothing(cluster, keys, rogue, who):
    from pdserve.client import QueueClient
    curve = {"no keys": None, "unknown key": S.client_curve(rogue, "client"),
             "a node's key": S.client_curve(keys, "node")}[who]
    # send_timeout_s: the cancel sent on timeout finds no connection to queue on
    with QueueClient(cluster[1].ingress, curve=curve, send_timeout_s=0.5) as client:
        with pytest.raises(TimeoutError):
            client.generate("Secure sockets", max_tokens=4, timeout_s=1.5)


def test_node_with_unknown_key_is_refused_and_logged(cluster, rogue, tmp_path):
    model, c = cluster
    log_path = tmp_path / "rogue.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "decode", "--model", str(model), "--router",
             c.control, "--node-id", "rogue-decode", "--curve-dir", str(rogue), "--threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        rogue_key = S.load_public(rogue, "node").decode()
        deadline = time.monotonic() + 60
        while rogue_key not in c.log() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        router_log = c.log()
        assert f"refused client 127.0.0.1 on the control socket: public key {rogue_key}" \
            in router_log
        time.sleep(1.0)  # well past a registration's round trip
        assert "rogue-decode" not in c.log()              # never joined, never said hello
        assert "registered" not in log_path.read_text()
        assert "the server refused this key" in log_path.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_node_name_is_bound_to_the_key_that_registered_it(cluster, keys):
    """With CURVE the identity is the key: a peer with an allowed key (prefill-2's) that
    says Hello as the live decode-0 (registered with the ``node`` key) is refused, and
    decode-0 keeps serving."""
    from pdserve.common import errors as E
    from tests.e2e.test_attack_first import claiming_hello

    ctx = zmq.Context()
    try:
        sock = T.make_socket(ctx, zmq.DEALER, connect=cluster[1].control,
                             curve=S.node_curves(keys, "decode", "prefill-2").control)
        T.send_message(sock, claiming_hello("decode-0"))
        assert poll_in(sock, 10_000), "no answer to the Hello"
        welcome = T.recv_message(sock, (P.Welcome,))
        sock.close(0)
    finally:
        ctx.term()
    assert not welcome.accepted and welcome.code == E.NAME_TAKEN, welcome
    assert "another CURVE key" in welcome.reason, welcome.reason
    assert completion(cluster, {"Authorization": f"Bearer {API_KEY}"}).status_code == 200
