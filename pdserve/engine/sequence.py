"""A request's state inside one engine (pure Python)."""
from __future__ import annotations

import enum
import time

from pdserve.common.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, prefill_here: bool = True):
        """``prefill_here``: this engine computes the prompt's KV and samples its first
        token; False on a decode node, where both arrive from a prefill node."""
        self.seq_id = seq_id
        self.prefill_here = prefill_here
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache hashes of its first full blocks
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.generator = None          # torch.Generator for seeded sampling, set by the runner
        # Logprobs (types.Logprobs), set by the runner when params ask: the last sampled
        # token's, and the prompt's, gathered while prefilling (so only where it is).
        self.logprobs = None
        self.prompt_logprobs = None
        self.scores_prompt = prefill_here and params.prompt_logprobs is not None
        self.guide_state = None        # structured output's matcher (engine/grammar.py)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_scored(self) -> int:
        return len(self.prompt_logprobs.token_logprobs) if self.prompt_logprobs else 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt tokens (1..) remain whose logprobs are still to be computed."""
        return self.scores_prompt and self.num_prompt_scored < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
