"""The queue-ingress messages (docs/queue-protocol.md) as msgspec Structs, used by both
ends: the router's ingress (router/ingress.py) and the clients (pdserve/client.py).

Like the whole protocol package it imports no torch (the client must not). The
wire form is the public contract's: one MessagePack map per frame with a ``"type"`` key,
no version field. Producers' messages refuse unknown keys, so a misspelt field never
passes silently; answers may grow keys, and the client ignores those it does not know.
Types and the limits that are the wire's own (string and list lengths, 64-bit integers,
seed in [0, 2^63)) are checked here while decoding; what a value means against the model
(max_tokens within the context, top_k within the vocabulary, ...) is SamplingParams' and
the router's to check.
"""
from __future__ import annotations

from typing import Annotated, Optional, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType

MAX_ID_CHARS = 1024   # a producer's request id
MAX_ITEMS = 1 << 20   # entries of a list (prompt tokens, stop strings, ...)
_Int64 = Annotated[int, Meta(ge=-2**63, le=2**63 - 1)]
_Ids = Annotated[list[_Int64], Meta(max_length=MAX_ITEMS)]
_Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
_Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]


class Submit(msgspec.Struct, tag="submit", tag_field="type", kw_only=True,
             omit_defaults=True, forbid_unknown_fields=True):
    """producer -> router: a request. UNSET fields are left out of the map; the router
    then uses SamplingParams' defaults. max_tokens is required, and exactly one of prompt
    / prompt_token_ids, which the router says in words when they are missing."""
    id: _Id
    prompt: Union[str, UnsetType] = UNSET
    prompt_token_ids: Union[_Ids, UnsetType] = UNSET
    max_tokens: Union[Annotated[int, Meta(ge=1, le=2**63 - 1)], UnsetType] = UNSET
    temperature: Union[float, UnsetType] = UNSET
    top_p: Union[float, UnsetType] = UNSET
    top_k: Union[_Int64, UnsetType] = UNSET
    seed: Union[Optional[_Seed], UnsetType] = UNSET
    stop: Union[str, Annotated[list[str], Meta(max_length=MAX_ITEMS)], UnsetType] = UNSET
    stop_token_ids: Union[_Ids, UnsetType] = UNSET
    ignore_eos: Union[bool, UnsetType] = UNSET
    logprobs: Union[Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]], UnsetType] = UNSET


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    """producer -> router: end this request now (done / finish_reason "abort"). Other keys
    are ignored, as they always were."""
    id: _Id


# How each field of Submit is described when a value does not fit (the error message
# says "field 'X' must be <this>, got ..."); derived from the types above.
FIELD_TYPES = {
    "type": "'submit' or 'cancel'", "id": "a non-empty string of at most 1024 characters",
    "prompt": "a string", "prompt_token_ids": "a list of integers",
    "max_tokens": "an integer >= 1", "temperature": "a number", "top_p": "a number",
    "top_k": "an integer", "seed": "an integer in [0, 2^63) or nil",
    "stop": "a string or a list of strings", "stop_token_ids": "a list of integers",
    "ignore_eos": "a boolean", "logprobs": "a non-negative integer or nil",
}
assert set(FIELD_TYPES) == {"type", *Submit.__struct_fields__}


class TokenLogprobs(msgspec.Struct, omit_defaults=True):
    """The logprobs of a Tokens answer's tokens: one each, and k alternatives each."""
    token_logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class Tokens(msgspec.Struct, tag="tokens", tag_field="type", omit_defaults=True):
    """router -> producer: new tokens of a request and the stable text they add."""
    id: str
    token_ids: list[int]
    text: str
    logprobs: Optional[TokenLogprobs] = None  # when the submit asked for logprobs


class Done(msgspec.Struct, tag="done", tag_field="type"):
    """router -> producer: the request's end; usage = {prompt_tokens, completion_tokens}."""
    id: str
    finish_reason: str
    usage: dict[str, int]


class Error(msgspec.Struct, tag="error", tag_field="type"):
    """router -> producer: the request's end, failed (id is nil when none was readable)."""
    id: Optional[str]
    code: str
    message: str


ENCODER = msgspec.msgpack.Encoder()
PRODUCER_DECODER = msgspec.msgpack.Decoder(Union[Submit, Cancel])   # the ingress reads
ANSWER_DECODER = msgspec.msgpack.Decoder(Union[Tokens, Done, Error])  # clients read
