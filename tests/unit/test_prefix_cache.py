"""Automatic prefix caching: allocator and scheduler units (no torch), then the engine
against transformers with the cache hit."""

import msgspec
import pytest

from pdserve.common.block_hash import BlockRemoved, BlockStored, block_hashes
from pdserve.common.sampling import SamplingParams
from pdserve.engine.block_allocator import BlockAllocator, BlockAllocatorError
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence

BS = 4


def make_sched(num_blocks=16, caching=True, budget=64):
    alloc = BlockAllocator(num_blocks, enable_caching=caching)
    alloc.record_events()
    return Scheduler(alloc, BS, max_num_seqs=8, max_num_batched_tokens=budget)


def run(sched, seq, max_tokens=1):
    """Admits seq and steps until it has max_tokens outputs (fake sampler: token 7)."""
    sched.add(seq)
    first = None
    for _ in range(100):
        if seq.num_output_tokens >= max_tokens:
            break
        batch = sched.schedule()
        if first is None:
            first = dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens))
        sched.postprocess(batch, [7 if batch.samples(i) else None for i in range(len(batch))])
    assert seq.num_output_tokens >= max_tokens, "the scheduler never ran the sequence"
    return first[seq.seq_id]


def test_hash_chain_depends_on_every_earlier_token():
    a = block_hashes(list(range(12)), BS)
    b = block_hashes([99] + list(range(1, 12)), BS)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 changes every later key
    assert block_hashes(list(range(12)), BS) == a  # stable
    assert block_hashes(list(range(13)), BS, limit=2) == a[:2]


def test_second_prompt_with_shared_prefix_computes_only_its_suffix():
    sched = make_sched()
    a = Sequence("a", list(range(1, 19)), SamplingParams(max_tokens=1))  # 18 tokens: 4 full
    assert run(sched, a) == 18
    sched.finish(a, "length")
    assert sched.num_prefix_hit_tokens == 0 and sched.num_prefix_queried_tokens == 18
    b = Sequence("b", list(range(1, 15)) + [50, 51, 52], SamplingParams(max_tokens=1))
    # Shares 14 tokens = 3 full blocks with a: only the last 5 tokens are computed.
    assert run(sched, b) == 17 - 12
    assert sched.num_prefix_hit_tokens == 12
    assert sched.num_prefix_queried_tokens == 18 + 17


def test_full_hit_still_computes_the_last_token():
    sched = make_sched()
    prompt = list(range(1, 17))  # exactly 4 blocks
    a = Sequence("a", prompt, SamplingParams(max_tokens=1))
    run(sched, a)
    a_blocks = list(a.block_table)
    sched.finish(a, "length")
    b = Sequence("b", prompt, SamplingParams(max_tokens=1))
    assert run(sched, b) == 4  # 3 blocks reused, the 4th recomputed for its logits
    assert b.block_table[:3] == a_blocks[:3] and b.block_table[3] != a_blocks[3]


def test_a_cached_prefix_comes_back_in_prefix_order_whatever_its_block_ids():
    """A prefix's blocks keep their order (block i holds tokens i*bs..): allocation may hand
    blocks out in ascending order, a prefix match must not reorder them."""
    alloc = BlockAllocator(4, enable_caching=True)
    blocks = alloc.allocate(3)                  # [0, 1, 2]
    prefix = [blocks[2], blocks[0]]             # the prefix lies in blocks 2, then 0
    tokens = list(range(1, 9))
    alloc.register(prefix[0], 111, None, tokens[:4])
    alloc.register(prefix[1], 222, 111, tokens[4:])
    alloc.free(blocks)
    assert alloc.match_prefix([111, 222], tokens, 4) == prefix


def test_shared_blocks_freed_only_when_the_last_reference_goes():
    sched = make_sched(num_blocks=8)
    alloc = sched.allocator
    a = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=4))
    run(sched, a)
    b = Sequence("b", list(range(1, 10)), SamplingParams(max_tokens=4))
    run(sched, b)
    shared = set(a.block_table) & set(b.block_table)
    assert len(shared) == 2
    sched.finish(a, "length")
    with pytest.raises(BlockAllocatorError):
        alloc.allocate(alloc.num_free_blocks + 1)  # b still holds the shared blocks
    assert not shared & set(alloc.allocate(alloc.num_free_blocks))
    sched.finish(b, "length")


def test_cached_blocks_are_evicted_least_recently_freed_first_and_reported():
    sched = make_sched(num_blocks=6)
    alloc = sched.allocator
    a = Sequence("a", list(range(1, 14)), SamplingParams(max_tokens=1))  # 3 full blocks
    run(sched, a)
    sched.finish(a, "length")
    stored = [e for e in alloc.drain_events() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    assert alloc.num_free_blocks == 6 and alloc.num_cached_blocks == 3
    # Two never-used blocks and the 4th (partial) block go first, then the prefix's tail.
    taken = alloc.allocate(4)
    removed = alloc.drain_events()
    assert removed == [BlockRemoved(stored[2].block_hash)]
    alloc.free(taken)
    b = Sequence("b", list(range(1, 14)), SamplingParams(max_tokens=1))
    assert run(sched, b) == 13 - 8  # the head of the prefix survived


def test_reserve_links_the_cached_prefix_and_can_reserve_counts_its_free_blocks():
    """A decode node's verb pair: can_reserve changes nothing, and counts the cached blocks
    no one holds as taken (they leave the free list); reserve links them (their KV need not
    travel) and allocates the rest; release gives every block back, the cache kept."""
    sched = make_sched(num_blocks=8)
    a = Sequence("a", list(range(1, 18)), SamplingParams(max_tokens=1))  # 17 tokens: 4 full
    run(sched, a)
    sched.finish(a, "length")  # its 4 full blocks stay cached, unreferenced, in the free list
    free = sched.allocator.num_free_blocks
    assert free == 8
    b = Sequence("b", list(range(1, 13)) + [60] * 9, SamplingParams(max_tokens=1),
                 prefill_here=False)  # 21 tokens: 6 blocks, the first 3 cached
    assert sched.can_reserve(b) and sched.num_blocks_to_reserve(b) == 3
    assert sched.allocator.num_free_blocks == free and b.block_table == []  # nothing changed
    assert sched.reserve(b) == 3
    assert len(b.block_table) == 6 and sched.allocator.num_free_blocks == 8 - 6
    assert sched.num_prefix_hit_tokens == 12
    big = Sequence("big", list(range(1, 13)) + [70] * 16, SamplingParams(max_tokens=1),
                   prefill_here=False)  # 7 blocks, 3 of them b's (held): 4 new, 2 free
    assert not sched.can_reserve(big) and sched.num_blocks_to_reserve(big) == 4
    with pytest.raises(ValueError, match="needs 4 KV blocks, 2 of 8 free"):
        sched.reserve(big)
    assert big.block_table == [] and sched.allocator.num_free_blocks == 2
    sched.release(b)
    assert sched.allocator.num_free_blocks == 8 and sched.allocator.num_cached_blocks == 4


def test_caching_off_reuses_nothing():
    sched = make_sched(caching=False)
    for name in "ab":
        s = Sequence(name, list(range(1, 19)), SamplingParams(max_tokens=1))
        assert run(sched, s) == 18
        sched.finish(s, "length")
    assert sched.num_prefix_queried_tokens == 0 and sched.allocator.drain_events() == []


def test_preempted_sequence_reuses_its_own_blocks():
    sched = make_sched(num_blocks=6, budget=64)
    a = Sequence("a", list(range(1, 13)), SamplingParams(max_tokens=6))
    b = Sequence("b", list(range(100, 108)), SamplingParams(max_tokens=6))
    sched.add(a)
    sched.add(b)
    preempted = False
    for _ in range(200):
        batch = sched.schedule()
        if b.num_computed_tokens == 0 and b.num_output_tokens:
            preempted = True
        sched.postprocess(batch, [7 if batch.samples(i) else None for i in range(len(batch))])
        for s in list(batch.seqs):
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
        if not sched.has_unfinished():
            break
    assert preempted and not sched.has_unfinished()
    assert sched.num_prefix_hit_tokens > 0
    assert sched.allocator.num_free_blocks == 6


# -- the engine, token for token against transformers ---------------------------------------
def test_cache_hits_keep_greedy_output_equal_to_transformers(tiny_model):
    from pdserve import LLM
    from tests.unit.test_engine_vs_hf import NEW_TOKENS, hf_greedy, make_prompts

    model_dir = tiny_model("llama")
    llm = LLM(dtype="float32", model=model_dir, max_num_batched_tokens=32)
    sched = llm.engine.scheduler
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    prompts = make_prompts(llm.engine.model_config.vocab_size)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    hits = sched.num_prefix_hit_tokens
    # Turn two: each prompt again plus its answer plus 3 new tokens. The prompt's and
    # most of the answer's blocks come from the cache.
    turn2 = [p + out + [5, 6, 7] for p, out in zip(prompts, first)]
    second = [o.token_ids for o in llm.generate(turn2, params)]
    assert sched.num_prefix_hit_tokens - hits >= sum(
        (len(p) + len(o)) // 16 * 16 - 16 for p, o in zip(prompts, first))
    assert first + second == hf_greedy(model_dir, prompts + turn2)
    off = LLM(dtype="float32", model=model_dir, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    assert [o.token_ids for o in off.generate(turn2, params)] == second
    assert off.engine.scheduler.num_prefix_hit_tokens == 0


# -- through `pdserve launch`: both nodes skip what they have cached --------------------------


# -- the router's cache-aware policy (pure: a registry, no process) --------------------------
def make_registry(*roles_ids):
    from pdserve.common import protocol as P
    from pdserve.router.dispatch.registry import Registry

    model = P.ModelIdentity(name="m", config_hash="h")
    reg = Registry(model, 2, 2, 16, heartbeat_interval_s=1.0, liveness=3)
    for role, node_id in roles_ids:
        stats = P.NodeStats(num_free_blocks=64, num_total_blocks=64, num_running=0,
                            num_waiting=0, queued_prompt_tokens=0)
        hello = P.Hello(node_id=node_id, role=role, protocol_version=P.PROTOCOL_VERSION,
                        model=model, kv_layout=P.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16,
                                                  dtype="float32", block_size=16),
                        capacity=stats, pid=1, kv_events="tcp://127.0.0.1:2",
                        kv_address="tcp://127.0.0.1:1" if role == "decode" else None)
        assert reg.admit(hello, now=0.0)[0]
    return reg


def published(*events, seq_ts=0.0):
    """What a subscriber decodes of a batch the node published: the node's own encoder
    (common/kv_events.py), msgpack, then the router's decoder."""
    import msgpack

    from pdserve.common.kv_events import decode_batch, encode_events

    return decode_batch(msgpack.packb([seq_ts, encode_events(list(events), 16, "CPU"), 0]))


def stored(tokens, parent=None):
    """The allocator's BlockStored events of ``tokens``' full blocks (block size 16)."""
    hashes, out = block_hashes(tokens, 16), []
    for i, h in enumerate(hashes):
        block = tuple(tokens[16 * i:16 * i + 16])
        out.append(BlockStored(h, hashes[i - 1] if i else parent, block))
    return out


def synced(index, *node_ids, now=0.0):
    """Every node asked for its dump and answered it empty, as of batch 0."""
    assert {n for n, _ in index.due(now)} >= set(node_ids)
    for node_id in node_ids:
        assert index.dump(node_id, 0, [], now)


def test_cache_aware_follows_the_prefix_the_nodes_say_they_hold():
    from pdserve.router.dispatch.placement import Placement
    from pdserve.router.dispatch.policies import CacheAware

    reg = make_registry(("prefill", "p0"), ("prefill", "p1"))
    placement = Placement()
    policy = CacheAware(reg, placement)
    p0, p1 = reg.nodes["p0"], reg.nodes["p1"]
    synced(policy.index, "p0", "p1")
    shared = list(range(100, 164))                      # 4 blocks
    # What this router sent counts for nothing: only what a node says it stored.
    first = policy.pick("prefill", [p0, p1], shared + [1, 2])
    placement.queue(first.node_id, 66)
    other = p1 if first is p0 else p0
    assert policy.pick("prefill", [p0, p1], shared + [3]) is other
    # The busier node said it stored the prefix (another router's request, say): it wins.
    policy.index.batch(first.node_id, 1, published(*stored(shared)))
    assert policy.num_indexed_blocks(first.node_id) == 4
    assert policy.pick("prefill", [p0, p1], shared + [3, 4, 5]) is first
    # A new prefix goes to the least loaded.
    assert policy.pick("prefill", [p0, p1], list(range(500, 540))) is other
    # Too busy: past the slack, the least loaded wins even with the prefix elsewhere.
    placement.queue(first.node_id, CacheAware.PREFILL_SLACK_TOKENS + 1)
    assert policy.pick("prefill", [p0, p1], shared + [6]) is other
    # Evicted from its tail: only the head still matches.
    placement.queue(first.node_id, -CacheAware.PREFILL_SLACK_TOKENS - 1)
    hashes = block_hashes(shared, 16)
    policy.index.batch(first.node_id, 2, published(BlockRemoved(hashes[3]),
                                                   BlockRemoved(hashes[2])))
    assert policy.index.match(first.node_id, hashes) == 2


def test_cache_aware_forgets_departed_and_restarted_nodes():
    from pdserve.router.dispatch.policies import CacheAware

    reg = make_registry(("prefill", "p0"), ("prefill", "p1"))
    policy = CacheAware(reg)
    prompt = list(range(100, 164))
    hashes = block_hashes(prompt, 16)
    synced(policy.index, "p0", "p1")
    policy.index.batch("p0", 1, published(*stored(prompt)))
    assert policy.pick("prefill", list(reg.nodes.values()), prompt).node_id == "p0"
    reg.remove("p0")
    assert policy.num_indexed_blocks("p0") == 0
    # Back as a new process (a new Hello): nothing is known of it until its dump.
    policy.index.batch("p1", 1, published(*stored(prompt)))
    assert policy.num_indexed_blocks("p1") == 4
    assert reg.admit(msgspec.structs.replace(reg.nodes["p1"].hello, pid=2), now=0.0)[0]
    assert policy.num_indexed_blocks("p1") == 0
    assert policy.index.pending(1.0) == ["p1"]
    assert policy.index.due(1.0) == [("p1", "joined")]
    assert policy.index.dump("p1", 7, hashes[:2], 1.0)
    assert policy.index.match("p1", hashes) == 2 and policy.index.pending(1.0) == []


def test_prefix_index_gaps_ask_for_a_dump_and_what_came_meanwhile_is_kept():
    from pdserve.router.dispatch import prefix_index as X

    index = X.PrefixIndex(deadline_s=10.0)
    index.add("p0", events=True)
    index.add("quiet", events=False)   # publishes nothing: never asked, never pending
    a, b, c = (list(range(k * 100, k * 100 + 16)) for k in (1, 2, 3))
    ha, hb, hc = (block_hashes(t, 16)[0] for t in (a, b, c))
    # Joined: pending, asked once; batches before the dump are kept, not applied.
    assert index.pending(0.0) == ["p0"] and index.due(0.0) == [("p0", "joined")]
    assert index.due(1.0) == []                              # asked; not again so soon
    index.batch("p0", 5, published(*stored(b)))
    index.batch("p0", 6, published(*stored(c)))
    assert index.match("p0", [hb]) == 0 and index.degraded("p0")
    # The dump as of batch 5 (a and b); 6 goes on top of it, 5 is in the dump already.
    assert index.dump("p0", 5, [ha, hb], 1.0)
    assert [index.match("p0", [h]) for h in (ha, hb, hc)] == [1, 1, 1]
    assert not index.degraded("p0") and index.pending(1.0) == []
    assert not index.dump("p0", 6, [], 1.0)                  # nobody asked for that one
    # A skipped number: a gap; the next dump waits out the backoff after the last one.
    index.batch("p0", 8, published(BlockRemoved(ha)))
    assert index.degraded("p0") and index.match("p0", [ha]) == 1   # 8 waits for the dump
    assert index.due(1.1) == []
    assert index.due(1.0 + X.MIN_DUMP_INTERVAL_S) == [("p0", "gap")]
    assert index.dump("p0", 7, [ha, hb, hc], 2.0)
    assert index.match("p0", [ha]) == 0 and not index.degraded("p0")   # 8 applied on 7
    # Lost at the tail: the heartbeat said 9 was published; a heartbeat later, still not
    # here.
    index.heartbeat("p0", 9)
    assert not index.degraded("p0")
    index.heartbeat("p0", 9)
    assert index.degraded("p0") and index.nodes["p0"].want == "gap"
    assert index.num_dumps == {"joined": 1, "gap": 1}
    # A dump that never comes is asked again, and the deadline ends the wait.
    index.remove("p0")
    index.add("p1", events=True)
    assert index.due(20.0) == [("p1", "joined")] and index.pending(20.0) == ["p1"]
    assert index.due(20.0 + X.DUMP_RETRY_S) == [("p1", "joined")]
    assert index.pending(30.0) == [] and index.degraded("p1")


# -- failover with shared blocks ------------------------------------------------------------


def test_kv_after_the_cached_blocks_lands_after_them_and_a_wrong_start_is_refused():
    import torch

    from pdserve.common import codec
    from pdserve.common import protocol as P
    from pdserve.node.kv import InboundTransfer, KVReceiver, Outgoing, TransferState
    from pdserve.node.kv.tcp import frames_chunk
    from tests.integration.test_kv_transfer import LAYOUT, MODEL, caches

    def chunk_of(req_id, ids, first_block=0, last=True, end=LAYOUT.num_layers):
        return frames_chunk(MODEL, LAYOUT, src, [Outgoing(req_id, ids, num_tokens, first_block,
                                                          1 if last else None)],
                            0, end, checksums=True, last=last)

    src, dst = caches(fill=True), caches(fill=False)
    src_ids, dst_ids = list(range(4, 10)), [20, 21, 5, 6, 7, 30]   # 6 blocks, 2 cached
    num_tokens = 6 * LAYOUT.block_size - 1
    cached_before = [(k[dst_ids[:2]].clone(), v[dst_ids[:2]].clone()) for k, v in dst]
    transfer = InboundTransfer("r", torch.tensor(dst_ids[2:]), num_tokens, first_block=2)
    receiver = KVReceiver(MODEL, LAYOUT, dst)
    chunk = chunk_of("r", src_ids[2:], first_block=2)
    assert not receiver.place(codec.decode(codec.encode(chunk)), {0: transfer})
    assert transfer.state is TransferState.SUCCESS
    for (sk, sv), (dk, dv), (ck, cv) in zip(src, dst, cached_before):
        assert torch.equal(dk[dst_ids[2:]], sk[src_ids[2:]])
        assert torch.equal(dk[dst_ids[:2]], ck) and torch.equal(dv[dst_ids[:2]], cv)
    failed = receiver.place(chunk_of("q", src_ids), {0: InboundTransfer(
        "q", torch.tensor(dst_ids[2:]), num_tokens, first_block=2)})
    assert "starts at block 0; this decode node holds 2" in failed[0].message
    with pytest.raises(P.ProtocolError, match="leaves no block"):
        codec.encode(chunk_of("z", [], first_block=6, last=False, end=1))
