"""A prefill node and a decode node in this process, on the tiny llama, their KV over the
fake backend (node/kv/fake.py): no sockets, no processes. The test plays the router: it
hands the nodes the control messages a router sends and reads what they send it back."""
import json
import queue

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.common import codec
from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.engine.config import EngineConfig
from pdserve.node.config import NodeConfig
from pdserve.node.decode import DecodeNode
from pdserve.node.io import CONTROL, InboxItem
from pdserve.node.kv import TransferState
from pdserve.node.kv.fake import FakeLink
from pdserve.node.prefill import PrefillNode

ADDRESS = "fake://d0"


class Cluster:
    """Prefill nodes p0, p1 and decode node d0 joined by one FakeLink."""

    def __init__(self, model, tamper=None):
        self.link = FakeLink(tamper)
        engine = EngineConfig(dtype="float32", model=str(model), num_kv_blocks=64,
                              max_num_batched_tokens=48)
        self.prefill = {}
        for node_id in ("p0", "p1"):
            node = PrefillNode(NodeConfig(role="prefill", engine=engine, node_id=node_id,
                                          kv_layers_per_chunk=1),
                               kv_senders=[self.link.sender(node_id)])
            self.link.connect(node_id, node.handle)
            self.prefill[node_id] = node
        self.decode = DecodeNode(NodeConfig(role="decode", engine=engine, node_id="d0"),
                                 kv_reply=self.link.reply(ADDRESS))
        self.link.connect(ADDRESS, self.decode.handle)
        self.to_router: list[P.Message] = []

    def nodes(self):
        return [*self.prefill.values(), self.decode]

    def collect(self) -> None:
        """What the nodes handed their (unstarted) I/O threads for the router."""
        for node in self.nodes():
            while True:
                try:
                    channel, _, msg = node.io._outbox.get_nowait()
                except queue.Empty:
                    break
                assert channel == CONTROL
                self.to_router.append(msg)

    def reserve(self, req_id, prompt, spec, prefill="p0") -> P.ReserveResult:
        self.decode.handle(InboxItem(CONTROL, None, P.Reserve(items=[P.ReserveRequest(
            req_id=req_id, prompt_token_ids=prompt, sampling=spec, prefill_node_id=prefill,
            lease_s=30.0)])))
        self.collect()
        (reply,) = [m for m in self.to_router if isinstance(m, P.ReserveReply)]
        self.to_router.remove(reply)
        return reply.items[0]

    def submit(self, requests: dict, prefill="p0", named="p0") -> dict:
        """Reserves each request on d0 (naming prefill node ``named``) and hands them to
        ``prefill`` in one batch; returns where their results will be filed."""
        results = {r: {"tokens": [], "finish": None, "error": None, "cached": 0}
                   for r in requests}
        batch = []
        for req_id, (prompt, spec) in requests.items():
            reply = self.reserve(req_id, prompt, spec, named)
            assert reply.ok, reply.reason
            results[req_id]["cached"] = reply.cached_blocks
            batch.append(P.PrefillRequest(
                req_id=req_id, prompt_token_ids=prompt, sampling=spec, decode_node_id="d0",
                kv_address=ADDRESS, timeout_s=30.0, skip_blocks=reply.cached_blocks))
        self.prefill[prefill].handle(InboxItem(CONTROL, None, P.PrefillBatch(requests=batch)))
        return results

    def settle(self, results: dict) -> dict:
        """Turns every node's loop (a step, then what the link carries) until each request
        has finished or failed, or nothing is left to do."""
        for _ in range(1000):
            moved = 0
            for node in self.nodes():
                if node.has_work():
                    node.step()
                    moved += 1
                moved += self.link.deliver()
            self.collect()
            for msg in self.to_router:
                self._file(msg, results)
            self.to_router.clear()
            if not moved or all(r["finish"] or r["error"] for r in results.values()):
                return results
        raise AssertionError(f"requests never finished: {results}")

    def run(self, requests: dict, **where) -> dict:
        return self.settle(self.submit(requests, **where))

    @staticmethod
    def _file(msg, results) -> None:
        if isinstance(msg, P.FirstTokens):
            for it in msg.items:
                results[it.req_id]["tokens"].append(it.token_id)
        elif isinstance(msg, P.TokenBatch):
            for it in msg.items:
                results[it.req_id]["tokens"].extend(it.token_ids)
                results[it.req_id]["finish"] = it.finish_reason
        elif isinstance(msg, P.Error) and msg.req_id in results:
            results[msg.req_id]["error"] = msg

    def assert_all_free(self) -> None:
        for node in self.nodes():
            stats = node.stats()
            assert stats.num_free_blocks == stats.num_total_blocks, node.node_id
            assert not node.jobs, node.node_id


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def want(model):
    """Greedy output of the offline LLM for each prompt."""
    llm = LLM(dtype="float32", model=model)
    return lambda prompts, n: [o.token_ids for o in llm.generate(prompts, greedy(n))]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompts_for(model, lengths, seed=0):
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_kv_over_the_fake_link_gives_the_offline_output_and_frees_every_block(model, want):
    """Prompts chunked (48-token steps) with one layer per KV message: each transfer goes
    BOOTSTRAPPING -> TRANSFERRING on both sides, the decode node's output is token for
    token the offline LLM's, and afterwards no block is held on either side."""
    c = Cluster(model)
    prompts = prompts_for(model, [1, 7, 16, 17, 40, 90])
    spec = greedy(12)
    assert c.reserve("early", prompts[4], spec).ok
    c.decode.drop("early", "abort")  # a reservation given back: its blocks are free again
    results = c.submit({f"r{i}": (p, spec) for i, p in enumerate(prompts)})
    p0 = c.prefill["p0"]
    assert {j.state for j in p0.jobs.values()} == {TransferState.BOOTSTRAPPING}
    assert {j.transfer.state for j in c.decode.jobs.values()} == {TransferState.BOOTSTRAPPING}
    for _ in range(10):  # the first step's prompts (48 tokens of them) are sent whole
        p0.step()
        if any(j.state is TransferState.TRANSFERRING for j in p0.jobs.values()):
            break
    assert c.link.deliver() > 0
    assert TransferState.SUCCESS in {j.transfer.state for j in c.decode.jobs.values()}
    got = c.settle(results)
    assert [got[f"r{i}"]["tokens"] for i in range(len(prompts))] == want(prompts, 12)
    assert all(r["finish"] == "length" and r["error"] is None for r in got.values())
    assert p0.metrics.kv_bytes.labels(**p0.metrics.labels, path="fake")._value.get() > 0
    c.assert_all_free()


def test_a_cached_prefix_stays_home_and_the_rest_lands_after_it(model, want):
    """A second prompt sharing 3 full blocks with the first: the decode node reserves them
    from its cache, only the later blocks travel, and the output is still exact."""
    c = Cluster(model)
    (first,) = prompts_for(model, [60], seed=3)
    second = first[:48] + prompts_for(model, [20], seed=4)[0]
    spec = greedy(8)
    got = c.run({"a": (first, spec)})
    got |= c.run({"b": (second, spec)})
    assert got["a"]["cached"] == 0 and got["b"]["cached"] == 3
    assert [got["a"]["tokens"], got["b"]["tokens"]] == want([first, second], 8)
    c.assert_all_free()


def test_a_frame_changed_on_the_wire_fails_that_request_on_both_sides(model):
    """The link flips a byte of the first layer's K frame: the decode node refuses the KV
    with checksum_mismatch and tells the router; the prefill node, acknowledged with the
    failure, frees its blocks; nothing is left reserved."""
    def tamper(msg, frames):
        if isinstance(msg, P.KVChunk) and msg.layer_start == 0:
            frames[1] = bytes([frames[1][0] ^ 0xFF]) + frames[1][1:]
        return frames

    c = Cluster(model, tamper)
    prompt = prompts_for(model, [30], seed=7)[0]
    got = c.run({"bad": (prompt, greedy(8))})
    err = got["bad"]["error"]
    assert err is not None and err.code == E.CHECKSUM_MISMATCH
    assert "KV frame k0 of 1 request(s) ('bad')" in err.message
    assert len(got["bad"]["tokens"]) == 1, "the first token, from the prefill node, only"
    c.assert_all_free()


def test_kv_from_a_prefill_node_the_reservation_does_not_name_is_refused(model, want):
    """p1 sends KV for a request reserved for p0: refused, and p1, told so, frees its
    blocks; the reservation stands, and the same request prefilled on p0 decodes exactly."""
    c = Cluster(model)
    prompt = prompts_for(model, [20], seed=9)[0]
    spec = greedy(6)
    got = c.run({"x": (prompt, spec)}, prefill="p1", named="p0")
    assert got["x"]["finish"] is None and got["x"]["error"] is None
    assert c.decode.jobs["x"].transfer.state is TransferState.BOOTSTRAPPING
    assert not c.prefill["p1"].jobs  # acknowledged with the refusal: its blocks are free
    results = {"x": {"tokens": [], "finish": None, "error": None}}
    c.prefill["p0"].handle(InboxItem(CONTROL, None, P.PrefillBatch(requests=[
        P.PrefillRequest(req_id="x", prompt_token_ids=prompt, sampling=spec,
                         decode_node_id="d0", kv_address=ADDRESS, timeout_s=30.0)])))
    got = c.settle(results)
    assert got["x"]["tokens"] == want([prompt], 6)[0] and got["x"]["finish"] == "length"
    c.assert_all_free()


def test_a_request_breaking_a_rule_across_fields_fails_alone(model, want):
    """A PrefillBatch as it comes off the wire (encoded, then decoded), one of whose
    requests asks for more min_tokens than max_tokens: that request fails with bad_message
    and the other one is served, token for token the offline output."""
    c = Cluster(model)
    good, bad = prompts_for(model, [20, 12], seed=11)
    assert c.reserve("good", good, greedy(6)).ok
    wrong = SamplingParams(max_tokens=4, min_tokens=9, temperature=0)  # built, not checked

    def request(req_id, prompt, sampling):
        return P.PrefillRequest(req_id=req_id, prompt_token_ids=prompt, sampling=sampling,
                                decode_node_id="d0", kv_address=ADDRESS, timeout_s=30.0)

    batch = P.PrefillBatch(requests=[request("bad", bad, wrong),
                                     request("good", good, greedy(6))])
    decoded = codec.decode([bytes(f) for f in codec.encode(batch)])
    c.prefill["p0"].handle(InboxItem(CONTROL, None, decoded))
    got = c.settle({r: {"tokens": [], "finish": None, "error": None} for r in ("bad", "good")})
    assert got["bad"]["error"].code == E.BAD_MESSAGE
    assert "min_tokens=9 is invalid" in got["bad"]["error"].message
    assert got["good"]["tokens"] == want([good], 6)[0] and got["good"]["finish"] == "length"
    c.assert_all_free()
