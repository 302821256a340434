"""One engine step, written once: schedule -> forward and sampling -> outputs.

The offline ``LLM`` and every node role (prefill, decode, colocated) run this same
``Engine.step``; a role adds what it must through the step's hooks and reads its
outputs, and never runs the scheduler or the model itself. A request's way::

    add / add_request --> scheduler.waiting --> (chunks of) prefill
      --> last chunk: on_layer_group as each layer group's KV is final; first token
          sampled (StepOutput.first)
      --> scheduler.running --> one token per step --> finished: blocks freed
    add_prefilled: the prompt's KV arrived from a prefill node, with its first token
      --> scheduler.running --> one token per step --> ...
    detach: out of scheduling, the blocks handed to the owner (a prefill node keeps
      them until the decode node has the KV), who gives them back with free_detached
    can_reserve / reserve: blocks for a prompt whose KV will arrive (a decode node), its
      cached prefix linked; then add_prefilled once it has, or release
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdserve.common import errors as E
from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.logprobs import prompt_of
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.engine.types import Logprobs
from pdserve.engine.worker import Worker
from pdserve.model.text import RequestOutputState
from pdserve.model.tokenizer import Tokenizer


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int]
    new_text: str                            # "" when the engine does not detokenize
    finish_reason: str | None
    logprobs: Logprobs | None = None         # of new_token_ids, when asked
    prompt_logprobs: Logprobs | None = None  # with the first token, when asked
    first: bool = False   # the first token of a prompt this engine prefilled (not one whose
                          # KV arrived from elsewhere): what time to first token waits for


# on_layer_group(prompts, start, end): layers [start, end) of these prompts' KV are final.
LayerGroupHook = Callable[[list[Sequence], int, int], None]
BatchHook = Callable[[ScheduledBatch], None]


def layer_groups(num_layers: int, layers_per_group: int) -> list[tuple[int, int]]:
    """[start, end) of each group of ``layers_per_group`` consecutive layers."""
    return [(s, min(s + layers_per_group, num_layers))
            for s in range(0, num_layers, layers_per_group)]


class Engine(Worker):
    def __init__(self, config: EngineConfig, *, kv_storage=None, detokenize: bool = True):
        """``detokenize``: text and stop strings in the outputs (the offline ``LLM``); a
        node leaves them to the router, which holds the tokenizer. ``kv_storage``: see
        ModelRunner (where the CPU KV cache lives)."""
        super().__init__(config, kv_storage)
        self.tokenizer = Tokenizer(self.model_dir) if detokenize else None
        # Where on_layer_group fires; one group (the whole model) unless the owner splits it.
        self.layer_groups = [(0, self.model_config.num_hidden_layers)]
        self._requests: dict[str, tuple[Sequence, RequestOutputState]] = {}
        # Requests a step ended because they cannot go on (their grammar failed, or the KV
        # pool stopped growing short of them): (error code, why); the owner takes them
        # (take_rejected) and fails each.
        self.rejected: dict[str, tuple[str, str]] = {}
        self._pool_blocks = self.allocator.num_blocks
        self.release_load_memory()

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Sequence:
        """Checks a request (ValueError saying why it cannot be served) and queues it."""
        self.check_request(prompt_token_ids, params)
        seq = Sequence(req_id, prompt_token_ids, params)
        self.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queues a checked sequence whose prompt is prefilled here."""
        self._register(seq)
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence, first_token: int) -> None:
        """Admits a sequence whose prompt's KV is already in its blocks (computed by a
        prefill node, which sampled ``first_token`` and has delivered it): it decodes on."""
        self._register(seq)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.token_ids.append(first_token)
        self._requests[seq.seq_id][1].add([first_token])  # counts toward max_tokens
        self.scheduler.add_running(seq)

    def _register(self, seq: Sequence) -> None:
        if seq.seq_id in self._requests:
            raise ValueError(f"request id {seq.seq_id!r} is already in flight")
        state = RequestOutputState(self.tokenizer, seq.prompt_token_ids, seq.params,
                                   self.model_config.eos_token_ids, self.max_model_len)
        self._requests[seq.seq_id] = (seq, state)

    def take_rejected(self) -> dict[str, tuple[str, str]]:
        rejected, self.rejected = self.rejected, {}
        return rejected

    def finish(self, req_id: str, reason: str = "abort") -> bool:
        """Ends a request wherever it is and frees its blocks; False if it is not here."""
        entry = self._requests.pop(req_id, None)
        if entry is None:
            return False
        self.scheduler.finish(entry[0], reason)
        return True

    def detach(self, req_id: str) -> list[int]:
        """Takes a running request out of the engine but keeps its blocks, which the
        caller now owns and gives back with ``free_detached``."""
        seq, _ = self._requests.pop(req_id)
        return self.scheduler.detach(seq)

    def free_detached(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)

    # -- reservations: prompts whose KV is computed elsewhere ---------------------------
    def can_reserve(self, seq: Sequence) -> bool:
        """Whether the blocks of seq's whole prompt can be reserved now (its cached prefix
        linked, the rest allocated); changes nothing."""
        return self.scheduler.can_reserve(seq)

    def num_blocks_to_reserve(self, seq: Sequence) -> int:
        """The new blocks reserving seq takes: those of its prompt not cached here."""
        return self.scheduler.num_blocks_to_reserve(seq)

    def reserve(self, seq: Sequence) -> int:
        """Reserves seq's prompt blocks (``can_reserve`` first; ValueError if they cannot
        be had) and returns how many are its cached prefix, whose KV need not travel.
        The sequence is the caller's until ``add_prefilled`` or ``release``."""
        return self.scheduler.reserve(seq)

    def release(self, seq: Sequence) -> None:
        """Frees the blocks of a reserved sequence that never joined the engine."""
        self.scheduler.release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------
    def step(self, on_batch: BatchHook | None = None,
             on_layer_group: LayerGroupHook | None = None) -> list[StepOutput]:
        """Schedules, runs and samples one batch; returns an output per sampled token.
        Finished requests are ended (blocks freed) before it returns.

        ``on_batch(batch)`` fires once the batch is scheduled, before the forward.
        ``on_layer_group(prompts, start, end)`` fires for each group of ``layer_groups``,
        in order, as the forward finishes its layers, in a step running the last chunk of
        prompts prefilled here (``prompts``: those sequences; their KV for those layers is
        final). It fires before sampling: the prompts' first tokens come in the outputs."""
        if self.allocator.num_blocks < self._pool_blocks:
            self._reject_unfit()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if on_batch is not None:
            on_batch(batch)
        on_layer = None
        if on_layer_group is not None:
            prompts = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)
                       and seq.prefill_here and seq.num_output_tokens == 0]
            if prompts:
                on_layer = self._layer_callback(prompts, on_layer_group)
        sampled = self.runner.execute(batch, on_layer)
        self.scheduler.postprocess(batch, sampled)
        failed = self.runner.logits_processors.failed
        outputs = []
        for seq, token in zip(batch.seqs, sampled):
            if seq.seq_id in failed:  # its grammar failed: it ends here, its token unsent
                self.finish(seq.seq_id, "error")
                self.rejected[seq.seq_id] = (E.BAD_GUIDE, failed.pop(seq.seq_id))
                continue
            if token is None:
                continue  # a prompt chunk short of its end, or a preempted sequence's recompute
            delta = self._requests[seq.seq_id][1].add([token])
            first = seq.prefill_here and seq.num_output_tokens == 1
            outputs.append(StepOutput(seq.seq_id, delta.token_ids, delta.text,
                                      delta.finish_reason, seq.logprobs,
                                      prompt_of(seq) if first else None, first))
            if delta.finish_reason is not None:
                self.scheduler.finish(seq, delta.finish_reason)
                del self._requests[seq.seq_id]
        return outputs

    def _reject_unfit(self) -> None:
        """The KV pool stopped growing (its memory could not be had: engine/block_allocator.py)
        short of what add_request checked: a request whose longest length no longer fits
        would wait (or be preempted) forever. Each is ended and rejected, with why."""
        self._pool_blocks = blocks = self.allocator.num_blocks
        for req_id, (seq, _) in list(self._requests.items()):
            longest = self.longest(len(seq.prompt_token_ids), seq.params)
            if self.scheduler.blocks_for(longest) > blocks:
                self.finish(req_id, "error")
                self.rejected[req_id] = (E.NO_CAPACITY, (
                    f"needs up to {longest} tokens of KV cache, but the cache stopped growing "
                    f"at {blocks * self.block_size} (its memory could not be had)"))

    def _layer_callback(self, prompts: list[Sequence],
                        hook: LayerGroupHook) -> Callable[[int], None]:
        """The runner's per-layer callback: the hook at the last layer of each group."""
        ends = {end - 1: (start, end) for start, end in self.layer_groups}

        def on_layer(layer: int) -> None:
            group = ends.get(layer)
            if group is not None:
                hook(prompts, *group)
        return on_layer
