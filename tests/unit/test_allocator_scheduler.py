"""Pure-Python units: block allocator and scheduler (no model, no torch)."""
import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.engine.block_allocator import BlockAllocator, BlockAllocatorError
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus


def test_allocator_allocates_frees_and_refuses_double_free():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free_blocks == 1
    assert not alloc.can_allocate(2)
    with pytest.raises(BlockAllocatorError, match="cannot allocate 2 KV blocks: 1 of 4 free"):
        alloc.allocate(2)
    alloc.free(a[:1])
    with pytest.raises(BlockAllocatorError, match="freed twice"):
        alloc.free(a[:1])
    with pytest.raises(BlockAllocatorError, match="never allocated"):
        alloc.free([99])
    alloc.free(a[1:])
    assert alloc.num_free_blocks == 4 and alloc.usage() == 0


def test_blocks_freed_together_come_back_in_ascending_order():
    """A sequence's blocks are consecutive where the free list allows: its KV then moves
    as one run per tensor (node/kv/pages.paired_runs) instead of one copy per block."""
    alloc = BlockAllocator(6)
    a, b = alloc.allocate(3), alloc.allocate(3)
    assert (a, b) == ([0, 1, 2], [3, 4, 5])
    alloc.free(a)  # last block first: a prefix's tail is evicted before its head
    alloc.free(b)
    assert alloc.allocate(3) == [0, 1, 2] and alloc.allocate(3) == [3, 4, 5]


def seq(i, n, max_tokens=4):
    return Sequence(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def run_to_end(sched, steps=1000):
    """Drives the scheduler with a fake sampler that emits token 7, finishing at max_tokens."""
    seen = []
    for _ in range(steps):
        if not sched.has_unfinished():
            return seen
        batch = sched.schedule()
        assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        sampled = [7 if batch.samples(i) else None for i in range(len(batch))]
        seen.append(list(zip([s.seq_id for s in batch.seqs], batch.num_new_tokens)))
        sched.postprocess(batch, sampled)
        for s in list(batch.seqs):
            assert len(s.block_table) * sched.block_size >= s.num_computed_tokens
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_respects_budget_and_returns_all_blocks():
    alloc = BlockAllocator(64)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    seqs = [seq(i, n) for i, n in enumerate([25, 3, 9, 1])]
    for s in seqs:
        sched.add(s)
    steps = run_to_end(sched)
    # the 25-token prompt is cut into chunks of at most 10
    first = [n for step in steps for sid, n in step if sid == "0"]
    assert first[:3] == [10, 10, 5]
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 4 for s in seqs)
    assert alloc.num_free_blocks == 64


def test_preemption_when_blocks_run_out_recomputes_and_finishes():
    alloc = BlockAllocator(6)  # 24 token slots for three sequences that want 3*(8+8)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(i, 8, max_tokens=8) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert all(s.num_output_tokens == 8 for s in seqs)
    assert alloc.num_free_blocks == 6


def test_waiting_sequence_waits_for_blocks_and_max_num_seqs():
    alloc = BlockAllocator(3)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = seq("a", 4), seq("b", 4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == ["a"]
    assert b.status is SequenceStatus.WAITING


def test_finish_of_waiting_sequence_and_add_running():
    alloc = BlockAllocator(8)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    w = seq("w", 5)
    sched.add(w)
    sched.finish(w, "abort")
    assert not sched.has_unfinished() and w.finish_reason == "abort"
    # A sequence arriving with its KV already placed joins the running batch as a decode.
    r = seq("r", 5)
    r.block_table = alloc.allocate(2)
    r.num_computed_tokens = 5
    r.token_ids.append(9)
    sched.add_running(r)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] and batch.samples(0)


def test_siblings_of_one_prompt_share_its_prefill():
    """n choices of one prompt arrive together: the first computes the prompt, the others
    wait until its blocks are cached and compute only what no full block covers; a request
    with another prompt is not held back by them."""
    alloc = BlockAllocator(64, enable_caching=True)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=24)
    prompt = list(range(1, 21))                     # 20 tokens: 4 cacheable full blocks
    sibs = [Sequence(f"s{j}", prompt, SamplingParams(max_tokens=2)) for j in range(3)]
    for s in sibs[:2] + [seq("other", 3, max_tokens=2)] + sibs[2:]:
        sched.add(s)
    first = sched.schedule()
    assert [s.seq_id for s in first.seqs] == ["s0", "other"]
    assert [s.seq_id for s in sched.waiting] == ["s1", "s2"]  # their order kept
    sched.postprocess(first, [7 if first.samples(i) else None for i in range(len(first))])
    steps = [list(zip([s.seq_id for s in first.seqs], first.num_new_tokens))]
    steps += run_to_end(sched)
    computed = {}
    for step in steps:
        for sid, n in step:
            computed[sid] = computed.get(sid, 0) + n
    # s0: the prompt, then one decode step; s1, s2: the last 4 tokens, then one step.
    assert computed == {"s0": 21, "s1": 5, "s2": 5, "other": 4}
    assert sched.num_prefix_hit_tokens == 2 * 16
    assert alloc.num_free_blocks == 64
    # Without caching nothing is held back (there is no cache to wait for).
    alloc = BlockAllocator(64, enable_caching=False)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for j in range(3):
        sched.add(Sequence(f"t{j}", prompt, SamplingParams(max_tokens=2)))
    assert [n for n in sched.schedule().num_new_tokens] == [20, 20, 20]


class Backing:
    """A growing pool's memory as the allocator asks for it: the blocks [0, stop) it
    backed, each call, and OSError past ``room`` blocks (a /dev/shm that filled up)."""

    def __init__(self, room: int):
        self.room, self.calls = room, []

    def __call__(self, start: int, stop: int) -> None:
        self.calls.append((start, stop))
        if stop > self.room:
            raise OSError(28, "No space left on device")


def test_a_growing_pool_is_backed_as_blocks_are_first_handed_out():
    from pdserve.engine.block_allocator import RESERVE_STEP as STEP

    backing = Backing(room=1000)
    alloc = BlockAllocator(300, reserve=backing)
    # at start: the first block, then a step ahead
    assert backing.calls == [(0, 1), (1, 1 + STEP)] and alloc.num_backed == 1 + STEP
    a = alloc.allocate(STEP)  # within what is backed: nothing asked
    assert len(backing.calls) == 2
    alloc.free(a)  # freed blocks go to the back: never-used ones are taken first
    b = alloc.allocate(STEP + 10)
    assert b == list(range(STEP, 2 * STEP + 10))
    assert backing.calls[2:] == [(1 + STEP, 2 * STEP + 10), (2 * STEP + 10, 3 * STEP + 10)]
    alloc.free(b)
    alloc.allocate(alloc.num_free_blocks)  # all 300: backed to the end, not past it
    assert backing.calls[4:] == [(3 * STEP + 10, 300)] and alloc.num_backed == 300


def test_a_growing_pool_whose_memory_runs_out_stops_there_and_serves_on(caplog):
    from pdserve.engine.block_allocator import RESERVE_STEP

    room = 2 * RESERVE_STEP + 5
    alloc = BlockAllocator(1000, enable_caching=True, reserve=Backing(room))
    held = alloc.allocate(2 * RESERVE_STEP)
    assert alloc.can_allocate(5)  # the step ahead is refused, the five blocks asked are not
    assert alloc.num_backed == room and alloc.num_blocks == 1000
    more = alloc.allocate(5)
    assert more == list(range(2 * RESERVE_STEP, room))
    with caplog.at_level("ERROR"):
        assert not alloc.can_allocate(1)
    assert alloc.num_blocks == room and alloc.num_free_blocks == 0
    assert f"the KV pool stops at {room} blocks: the memory for {1000 - room} more " \
           "cannot be had" in caplog.text
    with pytest.raises(BlockAllocatorError, match=f"cannot allocate 1 KV blocks: 0 of {room}"):
        alloc.allocate(1)
    alloc.free(more)  # the blocks it has keep serving
    assert alloc.allocate(5) == more and alloc.usage() == 1.0
    alloc.free(held + more)
    assert alloc.num_free_blocks == room


def test_a_growing_pool_that_cannot_back_its_first_blocks_fails_at_start():
    with pytest.raises(BlockAllocatorError, match="cannot back any KV block: .*No space left"):
        BlockAllocator(100, reserve=Backing(room=0))
