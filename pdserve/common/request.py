"""Sampling parameters, checked where the user hands them in."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.guides import GUIDE_KINDS

MAX_INT = 2**31      # bound of counts and token ids (the model's own bounds are checked later)
MAX_SEED = 2**63     # seeds are signed 64-bit on every side
MAX_LOGPROBS = 20    # alternatives per token position (OpenAI's and vLLM's default limit)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    ``stop`` strings end the text just before the string; ``stop_token_ids`` and
    the model's EOS (unless ``ignore_eos``) end it after the token.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Set by the router on failover, not by users: tokens already sampled in earlier
    # attempts, so a seeded request's random stream resumes where it stopped.
    seed_offset: int = 0
    # Logprobs (vLLM's meaning; None: not computed): each sampled token's, with its
    # `logprobs` most likely alternatives; each prompt token's (the first has none), with
    # `prompt_logprobs` alternatives. Of the raw distribution, before any sampling setting.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logits processing (engine/logits_processors.py), with vLLM's meanings: no stop token
    # before min_tokens outputs; repetition_penalty over prompt + output tokens, presence /
    # frequency over output tokens; logit_bias {token id: bias} (clamped to [-100, 100]);
    # guide: (kind, spec) of structured output (engine/grammar.py), or None.
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    guide: tuple[str, str] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = {t: max(-100.0, min(100.0, float(b)))
                           if isinstance(b, (int, float)) and not isinstance(b, bool) else b
                           for t, b in (self.logit_bias or {}).items()}
        self.guide = tuple(self.guide) if self.guide is not None else None
        self.validate()

    def validate(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        def is_int(v, lo, hi):
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi

        if not is_int(self.max_tokens, 1, MAX_INT):
            bad("max_tokens", f"must be an integer in [1, {MAX_INT})")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", "must be a number in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be a number in (0, 1]")
        if not is_int(self.top_k, 0, MAX_INT):
            bad("top_k", f"must be an integer in [0, {MAX_INT}) (0 or -1 disables it)")
        if self.seed is not None and not is_int(self.seed, 0, MAX_SEED):
            bad("seed", "must be an integer in [0, 2^63) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(is_int(t, 0, MAX_INT) for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be a list of integers in [0, {MAX_INT})")
        if not is_int(self.seed_offset, 0, MAX_INT):
            bad("seed_offset", f"must be an integer in [0, {MAX_INT})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not is_int(getattr(self, name), 0,
                                                               MAX_LOGPROBS + 1):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        self._validate_processing(bad, is_int)

    def _validate_processing(self, bad, is_int) -> None:
        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        if not is_int(self.min_tokens, 0, self.max_tokens + 1):
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            bad("repetition_penalty", "must be a number in (0, 100] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not all(is_int(t, 0, MAX_INT) and number(b) for t, b in self.logit_bias.items()):
            bad("logit_bias", f"must map token ids in [0, {MAX_INT}) to numbers")
        if self.guide is not None and not (
                len(self.guide) == 2 and self.guide[0] in GUIDE_KINDS
                and isinstance(self.guide[1], str)):
            bad("guide", f"must be (kind, spec) with kind one of {GUIDE_KINDS}")
        if self.guide is not None and self.ignore_eos:
            bad("ignore_eos", "cannot be true with structured output: the output ends when "
                "the grammar is complete")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits processing stage has anything to do for this request."""
        return bool(self.min_tokens or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.guide)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def to_spec(params: SamplingParams):
    """The wire form (stop strings stay with the router, which owns the text)."""
    from pdserve.common.protocol import SamplingSpec

    return SamplingSpec(max_tokens=params.max_tokens, temperature=float(params.temperature),
                        top_p=float(params.top_p), top_k=params.top_k, seed=params.seed,
                        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                        seed_offset=params.seed_offset, logprobs=params.logprobs,
                        prompt_logprobs=params.prompt_logprobs, **_processing_to_spec(params))


def _processing_to_spec(params: SamplingParams) -> dict:
    from pdserve.common.protocol import GuideSpec, LogitBias

    return dict(min_tokens=params.min_tokens,
                repetition_penalty=float(params.repetition_penalty),
                presence_penalty=float(params.presence_penalty),
                frequency_penalty=float(params.frequency_penalty),
                logit_bias=[LogitBias(token_id=t, bias=float(b))
                            for t, b in params.logit_bias.items()],
                guide=GuideSpec(kind=params.guide[0], spec=params.guide[1])
                if params.guide else None)


def from_spec(spec) -> SamplingParams:
    """Raises ValueError when a peer sent values a user could not have."""
    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                          top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
                          seed_offset=spec.seed_offset, logprobs=spec.logprobs,
                          prompt_logprobs=spec.prompt_logprobs, min_tokens=spec.min_tokens,
                          repetition_penalty=spec.repetition_penalty,
                          presence_penalty=spec.presence_penalty,
                          frequency_penalty=spec.frequency_penalty,
                          logit_bias={b.token_id: b.bias for b in spec.logit_bias},
                          guide=(spec.guide.kind, spec.guide.spec) if spec.guide else None)
