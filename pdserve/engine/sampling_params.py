"""Sampling parameters, checked where the user hands them in."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", "must be a number in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def to_spec(params: SamplingParams):
    """The wire form (stop strings stay with the router, which owns the text)."""
    from pdserve.common.protocol import SamplingSpec

    return SamplingSpec(max_tokens=params.max_tokens, temperature=float(params.temperature),
                        top_p=float(params.top_p), top_k=params.top_k, seed=params.seed,
                        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)


def from_spec(spec) -> SamplingParams:
    """Raises ValueError when a peer sent values a user could not have."""
    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                          top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos)
