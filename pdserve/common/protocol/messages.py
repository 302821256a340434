"""Control-plane messages (router <-> nodes) and the nested types they carry."""
from dataclasses import field
from typing import Optional

from pdserve.common.config import ROLES
from pdserve.common.errors import BAD_MESSAGE
from pdserve.common.protocol.base import MAX_HOST_ID, Message, ProtocolError, _message, _struct

# ---------------------------------------------------------------- nested types

@_struct
class KVLayout:
    """Shape of a node's paged KV cache; prefill and decode must match exactly."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    block_size: int


@_struct
class ModelIdentity:
    """Which model a node serves; config_hash covers config.json + weight file names/sizes."""
    name: str
    config_hash: str


@_struct
class NodeStats:
    """A node's load, sent as data so the router can decide from it."""
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int


@_struct
class LogitBias:
    """A number added to one token's logit before sampling."""
    token_id: int
    bias: float


@_struct
class GuideSpec:
    """Structured output: kind (engine/grammar.py GUIDE_KINDS: json, json_object, regex,
    choice, grammar) and its spec (a JSON schema, a regex, a JSON array of choices, a Lark
    grammar); nodes compile it with the model's vocabulary, cached by (kind, spec)."""
    kind: str
    spec: str


@_struct
class SamplingSpec:
    """Sampling parameters as nodes see them (stop strings stay in the router)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int] = None
    stop_token_ids: list[int]
    ignore_eos: bool
    # Tokens this request already sampled in earlier attempts (failover): a seeded request's
    # random stream resumes at this index instead of starting over.
    seed_offset: int = 0
    # Logprobs to compute (None: none): of each sampled token with this many alternatives,
    # and of each prompt token (on the prefill node) with prompt_logprobs alternatives.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    # Logits processing (vLLM's meanings; engine/logits_processors.py). Output tokens of
    # earlier attempts are the last seed_offset tokens of the prompt sent.
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[LogitBias] = field(default_factory=list)
    guide: Optional[GuideSpec] = None


@_struct
class Logprobs:
    """Logprobs of consecutive tokens of one request under the model's raw distribution
    (log_softmax of the unprocessed logits): for token i its own logprob, and the ids and
    logprobs of the k most likely tokens at its position, most likely first."""
    token_logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@_struct
class PrefillRequest:
    """One request of a PrefillBatch, with where its KV must go."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    decode_node_id: str
    kv_address: str
    timeout_s: float
    skip_blocks: int = 0  # leading KV blocks the decode node holds already: not sent
    decode_host_id: str = ""  # the decode node's Hello.host_id: equal to ours, KV goes via shm



@_struct
class FirstToken:
    """The first sampled token of one request (its TTFT)."""
    req_id: str
    token_id: int
    finish_reason: Optional[str] = None
    logprobs: Optional[Logprobs] = None          # of token_id, when the request asked
    prompt_logprobs: Optional[Logprobs] = None   # of prompt tokens 1.., when it asked


@_struct
class TokenItem:
    """New tokens of one request from one decode step."""
    req_id: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[Logprobs] = None  # of token_ids, when the request asked


# ---------------------------------------------------------------- messages

@_message("hello")
class Hello(Message):
    """node -> router: join the cluster (first message on the control socket)."""
    node_id: str
    role: str  # one of ROLES
    protocol_version: int
    model: ModelIdentity
    kv_layout: KVLayout
    capacity: NodeStats
    kv_address: Optional[str] = None  # decode nodes: where prefill nodes connect
    pid: int
    compute: str = "model"  # "none": a benchmark node that skips the forward (fixed tokens)
    # Random per process start: the same id again after a silence is a resync (the router
    # stalled), a new one a restart (its work is gone).
    incarnation: str = ""
    # Boot id + /dev/shm identity ("" unknown): nodes with equal ids share memory.
    host_id: str = ""

    def _validate(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(BAD_MESSAGE, f"Hello.role: {self.role!r} is not one of {ROLES}")
        if len(self.host_id) > MAX_HOST_ID:
            raise ProtocolError(BAD_MESSAGE, f"Hello.host_id: {len(self.host_id)} characters, "
                                f"at most {MAX_HOST_ID}")


@_message("welcome")
class Welcome(Message):
    """router -> node: answer to Hello; heartbeat every interval, dead after `liveness` misses."""
    accepted: bool
    reason: str
    heartbeat_interval_s: float
    liveness: int
    router_incarnation: str = ""  # a node welcomed again by the same router keeps its work


@_message("heartbeat")
class Heartbeat(Message):
    """both ways: I am alive (any message counts as one too); nodes attach stats."""
    node_id: str
    stats: Optional[NodeStats] = None


@_message("prefill_batch")
class PrefillBatch(Message):
    """router -> prefill: requests to prefill in one forward."""
    requests: list[PrefillRequest]


@_message("first_tokens")
class FirstTokens(Message):
    """prefill -> router: first token of each prefilled request."""
    items: list[FirstToken]


@_message("reserve")
class Reserve(Message):
    """router -> decode: hold KV blocks for a request for lease_s seconds."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_node_id: str
    lease_s: float
    timeout_s: float = 0.0  # the request's time left; the node ends it past that (0: none)


@_message("reserve_reply")
class ReserveReply(Message):
    """decode -> router: whether the blocks were reserved, and how many; of those, how
    many leading ones the decode node had cached (their KV need not be sent)."""
    req_id: str
    ok: bool
    reason: str
    num_blocks: int
    cached_blocks: int = 0


@_message("token_batch")
class TokenBatch(Message):
    """decode -> router: the tokens of one decode step, all requests together."""
    items: list[TokenItem]


@_message("abort")
class Abort(Message):
    """router -> node: forget these requests (client gone, deadline, failover)."""
    req_ids: list[str]
    reason: str


@_message("drain")
class Drain(Message):
    """router -> node: take no new work; node -> router: I am draining."""
    reason: str


@_message("bye")
class Bye(Message):
    """node -> router: leaving the cluster on purpose."""
    node_id: str
    reason: str
