"""One engine: scheduler + model runner + output processing, stepped by its owner.

A request's way: ``add_request`` → scheduler.waiting → (chunks of) prefill →
scheduler.running → one token per ``step`` → finished, blocks freed.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.protocol import Logprobs
from pdserve.engine.config import EngineConfig
from pdserve.engine.logprobs import prompt_of
from pdserve.engine.output import RequestOutputState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.worker import Worker
from pdserve.model.tokenizer import Tokenizer


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    logprobs: Logprobs | None = None         # of new_token_ids, when asked
    prompt_logprobs: Logprobs | None = None  # on the first output, when asked


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.worker = Worker(config)
        self.model_dir = self.worker.model_dir
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.runner = self.worker.runner
        self.allocator = self.worker.allocator
        self.scheduler = self.worker.scheduler
        self.check_request = self.worker.check_request
        self.tokenizer = Tokenizer(self.model_dir)
        self._requests: dict[str, tuple[Sequence, RequestOutputState]] = {}

    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in flight")
        self.check_request(prompt_token_ids, params)
        seq = Sequence(req_id, prompt_token_ids, params)
        state = RequestOutputState(self.tokenizer, prompt_token_ids, params,
                                   self.model_config.eos_token_ids, self.max_model_len)
        self._requests[req_id] = (seq, state)
        self.scheduler.add(seq)

    def abort(self, req_id: str) -> bool:
        entry = self._requests.pop(req_id, None)
        if entry is None:
            return False
        self.scheduler.finish(entry[0], "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        sampled = self.runner.execute(batch)
        self.scheduler.postprocess(batch, sampled)
        outputs = []
        for seq, token in zip(batch.seqs, sampled):
            if token is None:
                continue
            state = self._requests[seq.seq_id][1]
            delta = state.add([token])
            if delta.finish_reason is not None:
                self.scheduler.finish(seq, delta.finish_reason)
                del self._requests[seq.seq_id]
            first = len(state.token_ids) == len(delta.token_ids)
            outputs.append(StepOutput(seq.seq_id, delta.token_ids, delta.text,
                                      delta.finish_reason, seq.logprobs,
                                      prompt_of(seq) if first else None))
        return outputs
