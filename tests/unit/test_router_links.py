"""A node's links to several routers (node/routers.py): whose request is whose, where a
reply goes, and the turn in which the routers' sockets are read. Real zmq sockets (never
connected: nothing here sends), real protocol messages."""
from __future__ import annotations

import time

import pytest
import zmq

from pdserve.common import protocol as P
from pdserve.common.sampling import SamplingParams
from pdserve.node.routers import Orphaned, RouterLinks

A, B = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


@pytest.fixture
def links():
    ctx = zmq.Context()
    links = RouterLinks([A, B])
    for endpoint in links.added():
        links.open(endpoint, ctx.socket(zmq.DEALER), 0.0)
    yield links
    for sock in links.by_sock:
        sock.close(0)
    ctx.term()


def reserve(*req_ids):
    return P.Reserve(items=[P.ReserveRequest(
        req_id=r, prompt_token_ids=[1, 2], sampling=SamplingParams(), prefill_node_id="p",
        lease_s=5.0) for r in req_ids])


def test_a_reply_goes_to_the_router_that_gave_the_request(links):
    links.took(links.links[A], reserve("a1", "a2"))
    links.took(links.links[B], reserve("b1"))
    batch = P.TokenBatch(items=[P.TokenItem(req_id=r, token_ids=[7]) for r in
                                ("a1", "b1", "a2")])
    out = {link.endpoint: [i.req_id for i in msg.items] for link, msg in links.route(batch)}
    assert out == {A: ["a1", "a2"], B: ["b1"]}
    error = P.Error(req_id="b1", code="internal", message="x")
    assert [link.endpoint for link, _ in links.route(error)] == [B]


def test_a_message_about_the_node_goes_to_every_router(links):
    beat = P.Heartbeat(node_id="n", stats=None)
    assert sorted(link.endpoint for link, _ in links.route(beat)) == [A, B]
    assert sorted(link.endpoint for link, _ in links.route(P.Drain(reason="bye"))) == [A, B]


def test_a_finished_or_aborted_request_is_forgotten(links):
    links.took(links.links[A], reserve("a1", "a2"))
    links.route(P.TokenBatch(items=[P.TokenItem(req_id="a1", token_ids=[7],
                                                finish_reason="length")]))
    links.took(links.links[A], P.Abort(req_ids=["a2"], reason="client gone"))
    assert links.owner == {} and links.links[A].owned == set()


def test_the_routers_sockets_are_read_in_turn(links):
    firsts = [links.in_turn()[0].endpoint for _ in range(4)]
    assert firsts == [B, A, B, A]  # each router first every other round


def test_a_router_gone_from_etcd_keeps_its_link_while_it_talks(links):
    for link in links.links.values():
        link.welcome = P.Welcome(accepted=True, reason="", heartbeat_interval_s=1.0,
                                 liveness=3)
    links.took(links.links[B], reserve("b1"))
    links.set_wanted([A])
    links.links[B].last_message = time.monotonic()   # B still heartbeats
    assert links.removed(1.0) == [] and links.stale()
    links.links[B].last_message = time.monotonic() - 10  # B silent past 3 intervals
    gone = links.removed(1.0)
    assert [link.endpoint for link in gone] == [B] and gone[0].owned == {"b1"}
    assert list(links.links) == [A]
    told = links.orphan(gone[0], "its router left the cluster")  # (sync() tells the loop)
    assert told == P.Abort(req_ids=["b1"], reason="its router left the cluster")
    assert "b1" not in links.owner
    gone[0].sock.close(0)  # the caller's to close (NodeIO does)


def test_a_decode_nodes_stream_outlives_its_router_and_moves_to_the_one_resuming(links):
    """A decode node's requests whose router went are orphans (their messages go nowhere,
    no router may abort them); a Resumed moves one to the router that asked, in order."""
    links.keeps_streams = True
    links.took(links.links[A], reserve("a1", "a2"))
    told = links.orphan(links.links[A], "router restarted")
    assert told == Orphaned(["a1", "a2"], "router restarted")
    items = P.TokenBatch(items=[P.TokenItem(req_id="a1", token_ids=[7])])
    assert links.route(items) == []  # nobody reads them now
    assert links.took(links.links[B], P.Abort(req_ids=["a1"], reason="x")) is None
    links.took(links.links[B], P.Resume(req_id="look-1", owner="p", client_id="c"))
    found = P.Resumed(req_id="look-1", ok=True, wire_id="a1")
    assert [link.endpoint for link, _ in links.route(found)] == [B]
    assert [link.endpoint for link, _ in links.route(items)] == [B]
    assert links.took(links.links[A], P.Abort(req_ids=["a1"], reason="late")) is None
    mine = P.Abort(req_ids=["a1"], reason="done")
    assert links.took(links.links[B], mine) == mine and "a1" not in links.owner


def test_a_stream_resumed_while_its_router_serves_it_moves_and_that_router_is_told(links):
    links.keeps_streams = True
    links.took(links.links[A], reserve("a1"))
    links.took(links.links[B], P.Resume(req_id="look-1", owner="p", client_id="c"))
    out = links.route(P.Resumed(req_id="look-1", ok=True, wire_id="a1"))
    assert [(link.endpoint, type(msg).__name__) for link, msg in out] == [
        (B, "Resumed"), (A, "Error")]
    assert out[1][1].req_id == "a1" and out[1][1].code == "stream_moved"
    assert links.owner["a1"] == B and links.links[A].owned == set()
    items = P.TokenBatch(items=[P.TokenItem(req_id="a1", token_ids=[7])])
    assert [link.endpoint for link, _ in links.route(items)] == [B]


def test_a_released_stream_is_an_orphan_again_and_only_its_owner_releases_it(links):
    links.keeps_streams = True
    links.took(links.links[A], reserve("a1"))
    links.orphan(links.links[A], "router restarted")
    links.took(links.links[B], P.Resume(req_id="look-1", owner="p", client_id="c"))
    links.route(P.Resumed(req_id="look-1", ok=True, wire_id="a1"))
    assert links.took(links.links[A], P.Release(req_ids=["a1"], reason="x")) is None
    assert links.owner["a1"] == B
    back = links.took(links.links[B], P.Release(req_ids=["a1", "b9"], reason="refused"))
    assert back == P.Release(req_ids=["a1"], reason="refused")
    assert links.owner["a1"] == "" and links.links[B].owned == set()
    items = P.TokenBatch(items=[P.TokenItem(req_id="a1", token_ids=[7])])
    assert links.route(items) == []  # nobody's until the next resume
