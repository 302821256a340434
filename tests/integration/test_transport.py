"""Socket tests on loopback: real ZeroMQ sockets, real frames, real peers."""
import asyncio
import ctypes
import gc
import select
import time

import pytest
import torch
import zmq
import zmq.asyncio

from pdserve.common import codec
from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common import transport as T
from pdserve.common.curve_guard import curve_guard

LOCAL = "tcp://127.0.0.1:*"
MiB = 1024 * 1024


def big_chunk(nbytes=8 * MiB, req_id="r1"):
    """A one-layer KVChunk whose k0/v0 total `nbytes` of float32."""
    lay = P.KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float32", block_size=16)
    num_blocks = nbytes // 2 // (16 * 8 * 128 * 4)
    shape = (num_blocks, 16, 8, 128)  # [num_blocks, block_size, kv_heads, head_dim]
    tensors = {"k0": torch.randn(shape), "v0": torch.randn(shape)}
    return P.KVChunk(model=P.ModelIdentity(name="m", config_hash="h"), kv_layout=lay,
                     layer_start=0, layer_end=1, last=True, tensors=tensors,
                     parts=[P.KVPart(req_id=req_id, num_tokens=num_blocks * 16, first_token=1)])


def same_tensors(a, b):
    return a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


@pytest.fixture
def make():
    """make(kind, **kw) -> socket on one shared context; all closed at teardown."""
    ctx = zmq.Context()
    sockets = []

    def _make(kind, **kw):
        sock = T.make_socket(ctx, kind, **kw)
        sockets.append(sock)
        return sock

    yield _make
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def poll_in(sock, timeout_ms=5000):
    return sock.poll(timeout_ms, zmq.POLLIN) == zmq.POLLIN


def pair(make, **router_kw):
    router = make(zmq.ROUTER, bind=LOCAL, **router_kw)
    dealer = make(zmq.DEALER, connect=T.endpoint_of(router), identity="node-a")
    return router, dealer


def test_dealer_router_dealer_round_trip_with_8mib_tensor(make):
    router = make(zmq.ROUTER, bind=LOCAL)
    a = make(zmq.DEALER, connect=T.endpoint_of(router), identity="a")
    b = make(zmq.DEALER, connect=T.endpoint_of(router), identity="b")
    T.send_message(b, P.Heartbeat(node_id="b"))  # b makes itself known to the router
    assert T.recv_routed(router, (P.Heartbeat,)) == (b"b", P.Heartbeat(node_id="b"))

    sent = big_chunk()
    T.send_message(a, sent)
    peer, msg = T.recv_routed(router, (P.KVChunk,))
    assert peer == b"a" and msg == sent and same_tensors(msg, sent)
    T.send_routed(router, b"b", msg)  # forwarded straight from the received frames
    got = T.recv_message(b, (P.KVChunk,))
    assert got == sent and same_tensors(got, sent)


def test_receive_is_zero_copy(make):
    router, dealer = pair(make)
    T.send_message(dealer, big_chunk())
    frames = router.recv_multipart(copy=False)
    msg = codec.decode(frames[1:])
    for frame, tensor in zip(frames[2:], msg.tensors.values()):
        buf = frame.buffer
        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert start <= tensor.data_ptr() < start + buf.nbytes


def test_zero_copy_send_keeps_buffer_alive_and_tracks(make):
    router, dealer = pair(make)
    sent = big_chunk()
    expected = {k: t.clone() for k, t in sent.tensors.items()}
    tracker = T.send_message(dealer, sent, track=True)
    del sent  # ZeroMQ still holds the tensors until it has sent them
    gc.collect()
    assert isinstance(tracker, zmq.MessageTracker)
    _, got = T.recv_routed(router, (P.KVChunk,))
    assert all(torch.equal(got.tensors[k], t) for k, t in expected.items())
    tracker.wait(5)
    assert tracker.done
    small = T.send_message(dealer, P.Heartbeat(node_id="a"), track=True)
    assert small.done  # every frame was copied: nothing to wait for


def test_router_send_to_unknown_peer_raises(make):
    router, _ = pair(make)
    with pytest.raises(T.SendError) as info:
        T.send_routed(router, b"nobody", P.Drain(reason="x"))
    assert info.value.peer == b"nobody" and info.value.reason == "unreachable"


def test_router_send_to_full_peer_raises(make):
    router = make(zmq.ROUTER, bind=LOCAL, sndhwm=1)
    dealer = make(zmq.DEALER, connect=T.endpoint_of(router), identity="slow", rcvhwm=1)
    T.send_message(dealer, P.Heartbeat(node_id="slow"))
    T.recv_routed(router)
    msg = big_chunk(1 * MiB)
    with pytest.raises(T.SendError) as info:
        for _ in range(2000):  # the dealer never reads: kernel buffers, then the HWM, fill up
            T.send_routed(router, b"slow", msg)
    assert info.value.reason == "full"


def test_malformed_input_on_router_is_answerable(make):
    router, dealer = pair(make)
    dealer.send_multipart([b"not msgpack \xc1"])
    with pytest.raises(P.ProtocolError) as info:
        T.recv_routed(router)
    assert info.value.peer == b"node-a"
    T.send_routed(router, info.value.peer, info.value.to_message())
    reply = T.recv_message(dealer, (P.Error,))
    assert reply.code == E.BAD_MESSAGE
    T.send_message(dealer, P.Bye(node_id="node-a", reason="done"))  # the router still serves
    with pytest.raises(P.ProtocolError, match="unexpected message type Bye"):
        T.recv_routed(router, (P.Hello,))


@pytest.mark.parametrize("msg, code, words", [
    # a type this socket does not take (the router's control socket takes no KV)
    (big_chunk(MiB), E.UNEXPECTED_TYPE, "unexpected message type KVChunk on this socket"),
    # a count past 2^63 - 1 (msgpack carries up to 2^64 - 1)
    (P.Heartbeat(node_id="node-a", stats=P.NodeStats(
        num_free_blocks=2**64 - 1, num_total_blocks=1, num_running=0, num_waiting=0,
        queued_prompt_tokens=0)), E.BAD_MESSAGE,
     "Heartbeat.stats.num_free_blocks: expected `int` <= 9223372036854775807"),
    # a wrong type deep inside a list
    (P.TokenBatch(items=[P.TokenItem(req_id="r", token_ids=[1]),
                         P.TokenItem(req_id="s", token_ids=[2, "3"])]), E.BAD_MESSAGE,
     "TokenBatch.items[1].token_ids[1]: expected `int`, got `str`"),
    # a list longer than the schema allows
    (P.Abort(req_ids=["r"] * (P.MAX_ITEMS + 1), reason="x"), E.BAD_MESSAGE,
     f"Abort.req_ids: expected `array` of length <= {P.MAX_ITEMS}"),
], ids=["wrong-type-on-socket", "huge-int", "wrong-type", "huge-count"])
def test_out_of_contract_messages_are_answered_naming_the_field(make, msg, code, words):
    """Over real sockets: the control ROUTER (one typed decoder for the types it takes)
    refuses each, the sender gets an Error saying what was wrong, the socket serves on."""
    router, dealer = pair(make)
    expected = (P.Hello, P.Heartbeat, P.TokenBatch, P.Abort, P.Bye)
    T.send_message(dealer, msg)
    assert poll_in(router)
    with pytest.raises(P.ProtocolError) as info:
        T.recv_routed(router, expected)
    assert info.value.peer == b"node-a" and info.value.code == code
    T.send_routed(router, info.value.peer, info.value.to_message())
    reply = T.recv_message(dealer, (P.Error,))
    assert reply.code == code and words in reply.message, reply
    T.send_message(dealer, P.Bye(node_id="node-a", reason="done"))
    assert T.recv_routed(router, expected) == (b"node-a", P.Bye(node_id="node-a", reason="done"))


def test_max_msg_size_drops_oversized_frames(make):
    router, dealer = pair(make, max_msg_size=1 * MiB)
    T.send_message(dealer, big_chunk(4 * MiB))  # 2 MiB frames: the router drops the peer
    assert not poll_in(router, 300)
    T.send_message(dealer, P.Heartbeat(node_id="node-a"))  # after reconnecting, small ones pass
    assert poll_in(router, 5000)
    assert T.recv_routed(router) == (b"node-a", P.Heartbeat(node_id="node-a"))


def test_make_socket_options_and_errors(make):
    sock = make(zmq.DEALER, sndhwm=7, rcvhwm=9, linger_ms=5, max_msg_size=123,
                heartbeat_ivl_ms=100, sndtimeo_ms=50)
    assert [sock.getsockopt(o) for o in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER, zmq.MAXMSGSIZE,
                                         zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.SNDTIMEO)] \
        == [7, 9, 5, 123, 100, 300, 50]
    with pytest.raises(T.SendError, match="full"):  # no peer: the timed send gives up
        T.send_message(sock, P.Drain(reason="x"))
    with pytest.raises(ValueError, match="ROUTER sockets only"):
        make(zmq.DEALER, router_mandatory=True)
    router = make(zmq.ROUTER, bind=LOCAL)
    with pytest.raises(zmq.ZMQError, match="bind 'tcp://127.0.0.1:"):
        make(zmq.ROUTER, bind=T.endpoint_of(router))  # port taken


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_round_trip(make):
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    router = make(zmq.ROUTER, bind=LOCAL, curve=T.CurveConfig.server(
        server_secret, server_public, allowed_client_keys=[client_public]))
    dealer = make(zmq.DEALER, connect=T.endpoint_of(router), identity="c",
                  curve=T.CurveConfig.client(client_secret, client_public, server_public))
    T.send_message(dealer, P.Heartbeat(node_id="c"))
    assert poll_in(router)
    assert T.recv_routed(router) == (b"c", P.Heartbeat(node_id="c"))
    # The allow-list is enforced (ZAP): a key not on it gets nothing through.
    other_public, other_secret = zmq.curve_keypair()
    stranger = make(zmq.DEALER, connect=T.endpoint_of(router), identity="s",
                    curve=T.CurveConfig.client(other_secret, other_public, server_public))
    T.send_message(stranger, P.Heartbeat(node_id="s"))
    assert not poll_in(router, 500)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_guard_idles_and_exits_once_its_sockets_are_gone():
    """A process whose CURVE client sockets have closed keeps its context's guard thread; the
    thread must sleep, not spin (a spinning one slowed torch in the same process tenfold),
    and exit when the context terminates."""
    ctx = zmq.Context()
    server_public, _ = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    sock = T.make_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:9",
                         curve=T.CurveConfig.client(client_secret, client_public, server_public))
    guard = curve_guard(ctx)
    sock.close(linger=0)
    time.sleep(0.3)  # the guard sees MONITOR_STOPPED and has nothing left to poll
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.3  # a spinning guard burns about a whole second
    assert guard.is_alive()
    ctx.term()
    guard.join(5)
    assert not guard.is_alive()


def test_asyncio_twins():
    async def main():
        ctx = zmq.asyncio.Context()
        router = T.make_socket(ctx, zmq.ROUTER, bind=LOCAL)
        dealer = T.make_socket(ctx, zmq.DEALER, connect=T.endpoint_of(router), identity="n")
        try:
            await T.async_send_message(dealer, P.Heartbeat(node_id="n"))
            peer, msg = await asyncio.wait_for(T.async_recv_routed(router, (P.Heartbeat,)), 5)
            assert (peer, msg) == (b"n", P.Heartbeat(node_id="n"))

            sent = big_chunk()
            tracker = await T.async_send_routed(router, peer, sent, track=True)
            got = await asyncio.wait_for(T.async_recv_message(dealer, (P.KVChunk,)), 5)
            assert got == sent and same_tensors(got, sent)
            assert tracker.wait(5) is None and tracker.done

            with pytest.raises(T.SendError, match="unreachable"):
                await T.async_send_routed(router, b"nobody", P.Drain(reason="x"))
            await T.async_send_message(dealer, P.Drain(reason="x"))
            with pytest.raises(P.ProtocolError) as info:
                await asyncio.wait_for(T.async_recv_routed(router, (P.Hello,)), 5)
            assert info.value.code == E.UNEXPECTED_TYPE and info.value.peer == b"n"
        finally:
            router.close(linger=0)
            dealer.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_plain_twin_drains_in_order_and_a_plain_send_loses_no_wake_up():
    """A burst arrives whole and in order through PlainTwin.received. Then the lost wake-up
    that ZeroMQ's edge-triggered notification allows: a message arrives while the loop is
    busy, and a plain send on the same socket takes in its notification (the socket's FD
    is no longer readable) before the loop looks. After ``rearm`` the waiting receive
    still gets it; without rearm nothing would wake it (checked while writing this)."""
    async def main():
        ctx = zmq.Context()
        router = T.make_socket(ctx, zmq.ROUTER, bind=LOCAL)
        twin = T.PlainTwin(router)
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, b"p")
        peer.connect(T.endpoint_of(router))
        inbox = twin.received()
        waiting = None
        try:
            for i in range(500):
                peer.send(b"%d" % i)
            got = [(await asyncio.wait_for(inbox.__anext__(), 5))[1] for _ in range(500)]
            assert got == [b"%d" % i for i in range(500)]
            waiting = asyncio.ensure_future(inbox.__anext__())
            await asyncio.sleep(0.2)            # the receive waits on the socket's FD
            peer.send(b"late")
            time.sleep(0.5)                     # the loop busy: the FD signals, unread
            twin.send_routed(b"p", P.Drain(reason="x"))   # takes the signal in
            fd = router.getsockopt(zmq.FD)
            assert select.select([fd], [], [], 0)[0] == [], "the hazard did not occur"
            twin.rearm()
            done, _ = await asyncio.wait({waiting}, timeout=5)
            assert done and waiting.result()[1] == b"late"
            assert peer.poll(5000) and peer.recv_multipart()  # the plain send arrived
        finally:
            if waiting is not None and not waiting.done():
                waiting.cancel()
                await asyncio.wait({waiting})
            await inbox.aclose()
            twin.close()
            router.close(linger=0)
            peer.close(linger=0)
            ctx.term()

    asyncio.run(main())
