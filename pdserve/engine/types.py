"""Plain data the engine hands out about itself and its outputs.

No wire types: the engine serves the offline ``LLM`` as well as the nodes, and knows
nothing of the protocol. A node converts these at its edge (node/base.py) into the
protocol's Structs, which carry the wire's limits and encoding; the fields are the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelId:
    """Which model the engine runs; config_hash covers config.json + weight file names and
    sizes (two engines with equal ids compute the same KV)."""
    name: str
    config_hash: str


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of the engine's paged KV cache: one K and one V pool per layer, each
    [num_blocks, block_size, num_kv_heads, head_dim] of dtype (a torch dtype's name)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's load now."""
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int = 0


@dataclass(slots=True)
class Logprobs:
    """Logprobs of consecutive tokens of one request under the model's raw distribution
    (log_softmax of the unprocessed logits): for token i its own logprob, and the ids and
    logprobs of the k most likely tokens at its position, most likely first."""
    token_logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: "Logprobs") -> None:
        """Append ``other``'s entries (the next tokens' logprobs)."""
        self.token_logprobs.extend(other.token_logprobs)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)
