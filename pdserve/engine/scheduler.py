"""Continuous-batching scheduler with chunked prefill (pure Python, no torch).

Each step: running sequences first (decode tokens and the next chunk of
prompts being prefilled), oldest first; then waiting sequences are admitted
while the token budget, the sequence limit and free blocks allow. When a
running sequence needs a block and none is free, the newest running sequence
is preempted: its blocks are freed and it is recomputed later.

With prefix caching (the allocator's), a sequence admitted with nothing computed
first takes the cached blocks of its longest cached prefix and starts computing
after them; every block that fills with computed tokens is registered for reuse.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.common.block_hash import NO_PARENT, block_hashes, hash_block
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches its last token, so a token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_prefix_queried_tokens = 0   # tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0       # of those, found cached (not computed again)

    # -- membership ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admits a sequence whose KV is already in its blocks (arrived from a prefill node)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def detach(self, seq: Sequence) -> list[int]:
        """Takes a running sequence out of scheduling but keeps its blocks, which the
        caller now owns (a prefill node holds them until its KV is acknowledged)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        blocks, seq.block_table = seq.block_table, []
        seq.block_hashes = []
        return blocks

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence wherever it is and returns its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, batch):
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        claimed, held = None, []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.take_cached_prefix(seq)  # a waiting sequence has nothing computed
            if self.allocator.enable_caching and not seq.wants_prompt_logprobs:
                claimed = self._claimed() if claimed is None else claimed
                if self._next_block_hash(seq) in claimed:  # held, in its place in the queue
                    self.put_back_cached_prefix(seq, cached)
                    held.append(self.waiting.popleft())
                    continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            if not self.allocator.can_allocate(need):
                self.put_back_cached_prefix(seq, cached)
                break
            self.count_prefix_lookup(seq)
            seq.block_table.extend(self.allocator.allocate(need))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if claimed is not None:
                claimed.update(self._claims(seq))
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(held))
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Gets the blocks seq needs for n more tokens, preempting newer sequences if needed.
        False when seq itself had to be preempted."""
        need = self.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _claimed(self) -> set[int]:
        """Keys of the full blocks running sequences are still computing. A waiting sequence
        whose next block is one of them (a sibling choice of the same prompt, or another
        request sharing a prefix) waits until they are cached and then takes them from the
        cache: one prefill of the shared prefix, not one per request."""
        claimed: set[int] = set()
        for seq in self.running:
            claimed.update(self._claims(seq))
        return claimed

    def _claims(self, seq: Sequence) -> list[int]:
        if seq.num_computed_tokens >= seq.num_tokens - 1:   # not prefilling (or recomputing)
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if limit <= len(seq.block_hashes):
            return []
        return block_hashes(seq.token_ids, self.block_size, limit)[len(seq.block_hashes):]

    def _next_block_hash(self, seq: Sequence) -> int | None:
        """The key of the first block of seq not taken from the cache; None when the rest
        of seq is no full block it could take from it."""
        i = len(seq.block_table)
        if i >= (seq.num_tokens - 1) // self.block_size:
            return None
        return block_hashes(seq.token_ids, self.block_size, i + 1)[i]

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """The keys of the full blocks of seq a cached prefix may cover: all but its last
        token (the next token is sampled from its logits); none when nothing may be taken."""
        if seq.num_computed_tokens or seq.block_table or not self.allocator.enable_caching:
            return []
        if seq.wants_prompt_logprobs:  # cached positions have no logits to score them
            return []
        return block_hashes(seq.token_ids, self.block_size, (seq.num_tokens - 1) // self.block_size)

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Links the cached blocks of seq's longest cached prefix into its block table and
        counts them as computed; returns how many. At least one token is left to compute."""
        hashes = self._prefix_hashes(seq)
        if not hashes:
            return 0
        blocks = self.allocator.match_prefix(hashes, seq.token_ids, self.block_size)
        seq.block_table = blocks
        seq.block_hashes = hashes[:len(blocks)]
        seq.num_computed_tokens = len(blocks) * self.block_size
        return len(blocks)

    def put_back_cached_prefix(self, seq: Sequence, num_blocks: int) -> None:
        """Undoes ``take_cached_prefix`` (the rest of the sequence's blocks were not had)."""
        if num_blocks:
            self.allocator.free(seq.block_table)
            seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0

    def count_prefix_lookup(self, seq: Sequence) -> None:
        """Counts a lookup that ``take_cached_prefix`` made and that stands."""
        if self.allocator.enable_caching:
            self.num_prefix_queried_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += seq.num_computed_tokens

    # -- reservations: a prompt whose KV is computed elsewhere (a decode node's) --------
    def _reserve_cost(self, seq: Sequence) -> tuple[int, int]:
        """(new blocks reserving seq's prompt allocates, free blocks it uses up): its
        cached prefix is linked, not allocated, but cached blocks no one holds leave the
        free list too."""
        cached = self.allocator.cached_prefix(self._prefix_hashes(seq), seq.token_ids,
                                              self.block_size)
        need = self.blocks_for(seq.num_prompt_tokens) - len(cached)
        return need, need + self.allocator.num_unreferenced(cached)

    def can_reserve(self, seq: Sequence) -> bool:
        return self._reserve_cost(seq)[1] <= self.allocator.num_free_blocks

    def num_blocks_to_reserve(self, seq: Sequence) -> int:
        return self._reserve_cost(seq)[0]

    def reserve(self, seq: Sequence) -> int:
        """Links seq's cached prefix and allocates the rest of its prompt's blocks; returns
        how many were cached. ValueError (nothing changed) when they cannot be had."""
        cached = self.take_cached_prefix(seq)
        need = self.blocks_for(seq.num_prompt_tokens) - cached
        if not self.allocator.can_allocate(need):
            self.put_back_cached_prefix(seq, cached)
            raise ValueError(f"needs {need} KV blocks, {self.allocator.num_free_blocks} of "
                             f"{self.allocator.num_blocks} free")
        self.count_prefix_lookup(seq)
        seq.block_table.extend(self.allocator.allocate(need))
        return cached

    def release(self, seq: Sequence) -> None:
        """Frees a reserved sequence's blocks (it never joined the batch)."""
        self.allocator.free(seq.block_table)
        seq.block_table, seq.block_hashes = [], []

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offers each block that has just filled with computed tokens to the cache."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_PARENT
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            self.allocator.register(seq.block_table[i], h,
                                    parent if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> None:
        """Records a step's result: computed tokens advance, sampled tokens are appended."""
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            seq.num_computed_tokens += n
            if token is not None:
                seq.token_ids.append(token)
            if self.allocator.enable_caching:
                self._register_full_blocks(seq)
