"""A prefill node's KV sockets to decode nodes (pdserve/node/kv_out.py), real ZeroMQ sockets
that connect to loopback ports nobody listens on (a connect does not wait for a peer): one
socket per decode node, reused; past MAX_KV_OUT open the least recently used closes, and
one unused for KV_OUT_IDLE_S closes at the next sweep."""
import zmq

from pdserve.node import kv_out
from pdserve.node.kv_out import KVOut


def test_sockets_are_reused_capped_and_closed_when_idle(monkeypatch):
    monkeypatch.setattr(kv_out, "MAX_KV_OUT", 2)
    ctx, poller, socks = zmq.Context(), zmq.Poller(), []
    out = KVOut(ctx, poller, socks, identity=b"prefill-0")
    try:
        a, b, c = (f"tcp://127.0.0.1:{port}" for port in (1, 2, 3))
        first = out.socket(a)
        assert out.socket(a) is first  # one socket per decode node
        out.socket(b)
        out.socket(a)  # a used last: b is now the least recently used
        out.socket(c)
        assert set(out.by_address) == {a, c}
        assert len(socks) == 2 and len(poller.sockets) == 2
        assert first.closed is False and out.by_address[a] is first
        monkeypatch.setattr(kv_out, "KV_OUT_IDLE_S", -1.0)  # every socket counts as idle
        out.close_idle()
        assert out.by_address == {} and socks == [] and poller.sockets == []
        assert first.closed
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
