"""Control-plane messages (router <-> nodes) and the nested types they carry."""
from typing import Annotated, Optional

from msgspec import Meta

from pdserve.common.config import ROLES
from pdserve.common.errors import BAD_MESSAGE
from pdserve.common.protocol.base import (
    MAX_HOST_ID,
    MAX_LOGPROBS,
    Count,
    Id,
    Int64,
    Message,
    Nested,
    NestedMap,
    ProtocolError,
    Text,
    TokenIds,
    _message,
    list_of,
)
from pdserve.common.sampling import SamplingParams

# ---------------------------------------------------------------- nested types

class KVLayout(NestedMap, kw_only=True):
    """Shape of a node's paged KV cache; prefill and decode must match exactly."""
    num_layers: Count
    num_kv_heads: Count
    head_dim: Count
    dtype: Id  # a key of DTYPES
    block_size: Count


class ModelIdentity(NestedMap, kw_only=True):
    """Which model a node serves; config_hash covers config.json + weight file names/sizes."""
    name: Text
    config_hash: Id


class NodeStats(Nested, kw_only=True):
    """A node's load, sent as data so the router can decide from it."""
    num_free_blocks: Count
    num_total_blocks: Count
    num_running: Count
    num_waiting: Count
    queued_prompt_tokens: Count
    # The number of the last KV-event batch the node published (-1: none, or no events):
    # a router whose index is behind it for a heartbeat lost some (a gap at the tail).
    kv_events_seq: Int64 = -1


class Logprobs(Nested, kw_only=True):
    """Logprobs of consecutive tokens of one request under the model's raw distribution
    (log_softmax of the unprocessed logits): for token i its own logprob, and the ids and
    logprobs of the k most likely tokens at its position, most likely first."""
    token_logprobs: list_of(float)
    top_ids: list_of(list_of(Int64, MAX_LOGPROBS))
    top_logprobs: list_of(list_of(float, MAX_LOGPROBS))


class PrefillRequest(Nested, kw_only=True):
    """One request of a PrefillBatch, with where its KV must go."""
    req_id: Id
    prompt_token_ids: TokenIds
    sampling: SamplingParams  # without stop strings (SamplingParams.for_nodes)
    decode_node_id: Id
    kv_address: Text
    timeout_s: float
    skip_blocks: Count = 0  # leading KV blocks the decode node holds already: not sent
    decode_host_id: Id = ""  # the decode node's Hello.host_id: equal to ours, KV goes via shm



class FirstToken(Nested, kw_only=True):
    """The first sampled token of one request (its TTFT)."""
    req_id: Id
    token_id: Int64
    finish_reason: Optional[Id] = None
    logprobs: Optional[Logprobs] = None          # of token_id, when the request asked
    prompt_logprobs: Optional[Logprobs] = None   # of prompt tokens 1.., when it asked


class TokenItem(Nested, kw_only=True):
    """New tokens of one request from one decode step."""
    req_id: Id
    token_ids: TokenIds
    finish_reason: Optional[Id] = None
    logprobs: Optional[Logprobs] = None  # of token_ids, when the request asked


# ---------------------------------------------------------------- messages

def peer_identity(node_id: str, incarnation: str) -> bytes:
    """A node's socket identity on the control and KV sockets. The incarnation makes it
    unguessable: with ROUTER_HANDOVER off an identity belongs to the first connection
    that claims it, and a stranger must not be able to claim a node's before it connects."""
    return f"{node_id}/{incarnation}".encode() if incarnation else node_id.encode()


@_message
class Hello(Message, tag="hello", kw_only=True):
    """node -> router: join the cluster (first message on the control socket)."""
    node_id: Id
    role: Id  # one of ROLES
    protocol_version: Int64
    model: ModelIdentity
    kv_layout: KVLayout
    capacity: NodeStats
    kv_address: Optional[Text] = None  # decode nodes: where prefill nodes connect
    pid: Count
    compute: Id = "model"  # "none": a benchmark node that skips the forward (fixed tokens)
    # Random per process start: the same id again after a silence is a resync (the router
    # stalled), a new one a restart (its work is gone).
    incarnation: Id = ""
    # Boot id + /dev/shm identity ("" unknown): nodes with equal ids share memory.
    host_id: Annotated[str, Meta(max_length=MAX_HOST_ID)] = ""
    # Where the node publishes its KV-cache events (vLLM's format, common/kv_events.py);
    # None: it publishes none (prefix caching off, or turned off).
    kv_events: Optional[Text] = None

    def _validate(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(BAD_MESSAGE, f"Hello.role: {self.role!r} is not one of {ROLES}")
        if len(self.host_id) > MAX_HOST_ID:
            raise ProtocolError(BAD_MESSAGE, f"Hello.host_id: {len(self.host_id)} characters, "
                                f"at most {MAX_HOST_ID}")


@_message
class Welcome(Message, tag="welcome", kw_only=True):
    """router -> node: answer to Hello; heartbeat every interval, dead after `liveness` misses."""
    accepted: bool
    reason: Text
    heartbeat_interval_s: float
    liveness: Count
    router_incarnation: Id = ""  # a node welcomed again by the same router keeps its work
    code: Id = ""  # why not accepted, when a node can act on it (errors.NAME_TAKEN)


@_message
class Heartbeat(Message, tag="heartbeat", kw_only=True):
    """both ways: I am alive (any message counts as one too); nodes attach stats."""
    node_id: Id
    stats: Optional[NodeStats] = None


@_message
class PrefillBatch(Message, tag="prefill_batch", kw_only=True):
    """router -> prefill: requests to prefill in one forward."""
    requests: list_of(PrefillRequest)


@_message
class FirstTokens(Message, tag="first_tokens", kw_only=True):
    """prefill -> router: first token of each prefilled request."""
    items: list_of(FirstToken)


class ReserveRequest(Nested, kw_only=True):
    """Hold KV blocks for one request for lease_s seconds (an item of Reserve)."""
    req_id: Id
    prompt_token_ids: TokenIds
    sampling: SamplingParams  # without stop strings (SamplingParams.for_nodes)
    prefill_node_id: Id
    # The named prefill node's Hello.incarnation: its KV socket identity is
    # peer_identity(prefill_node_id, prefill_incarnation), and only that sender's KV is taken.
    prefill_incarnation: Id = ""
    lease_s: float
    timeout_s: float = 0.0  # the request's time left; the node ends it past that (0: none)
    origin: Optional["StreamOrigin"] = None  # a resumable stream's (queue ingress) origin


class ReserveResult(Nested, kw_only=True):
    """Whether one request's blocks were reserved, and how many; of those, how many leading
    ones the decode node had cached (their KV need not be sent). An item of ReserveReply."""
    req_id: Id
    ok: bool
    reason: Text
    num_blocks: Count
    cached_blocks: Count = 0


@_message
class Reserve(Message, tag="reserve", kw_only=True):
    """router -> decode: the reservations of one router turn for this node."""
    items: list_of(ReserveRequest)


@_message
class ReserveReply(Message, tag="reserve_reply", kw_only=True):
    """decode -> router: the outcome of each reservation of one Reserve."""
    items: list_of(ReserveResult)


@_message
class TokenBatch(Message, tag="token_batch", kw_only=True):
    """decode -> router: the tokens of one decode step, all requests together."""
    items: list_of(TokenItem)


@_message
class Abort(Message, tag="abort", kw_only=True):
    """router -> node: forget these requests (client gone, deadline, failover)."""
    req_ids: list_of(Id)
    reason: Text


@_message
class Drain(Message, tag="drain", kw_only=True):
    """router -> node: take no new work; node -> router: I am draining."""
    reason: Text


@_message
class Bye(Message, tag="bye", kw_only=True):
    """node -> router: leaving the cluster on purpose."""
    node_id: Id
    reason: Text


# ------------------------------------------- streams that outlive their router (issue 31)
# Their own block: docs/queue-protocol.md "Resuming a stream" and docs/protocol.md.

class StreamOrigin(Nested, kw_only=True):
    """Whose a stream is and what a router needs to rebuild its text, carried by a
    ReserveRequest so that the decode node can hand the stream to another router: the
    producer (its ingress identity, hex) and the producer's id for the request, the
    client's own sampling (stop strings and max_tokens as asked, not an attempt's), and
    how many leading tokens of the attempt's prompt are the client's prompt (the rest
    were generated by earlier attempts)."""
    owner: Id
    client_id: Id
    num_prompt: Count
    sampling: SamplingParams


@_message
class Resume(Message, tag="resume", kw_only=True):
    """router -> every decode node: which of you holds this producer's stream? The one
    that does hands it over to the asking router (Resumed ok); ``req_id`` names the lookup,
    ``held`` is how many tokens the producer says it holds."""
    req_id: Id
    owner: Id
    client_id: Id
    held: Count = 0


@_message
class Release(Message, tag="release", kw_only=True):
    """router -> decode node: streams a Resume handed to this router that it will not serve
    (the producer's resume was refused, or came too late): orphans again, kept for
    another resume within the node's bound, where an Abort would end them."""
    req_ids: list_of(Id)
    reason: Text


@_message
class Resumed(Message, tag="resumed", kw_only=True):
    """decode -> the router that sent Resume: not here / refused (ok false, reason), or the
    stream, whose tokens go to that router from now on: the client's prompt and sampling,
    every token made so far (earlier attempts' included), its end if it has ended, the
    wire id it decodes under and the time left before the node's deadline for it."""
    req_id: Id
    ok: bool
    reason: Text = ""
    code: Id = ""
    wire_id: Id = ""
    prompt_token_ids: TokenIds = []
    sampling: Optional[SamplingParams] = None
    token_ids: TokenIds = []
    finish_reason: Optional[Id] = None
    timeout_s: float = 0.0
