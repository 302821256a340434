"""The queue-ingress messages (docs/queue-protocol.md) as msgspec Structs, used by both
ends: the router's ingress (router/ingress.py) and the clients (pdserve/client.py).

Like the whole protocol package it imports no torch (the client must not). The
wire form is the public contract's: one MessagePack map per frame with a ``"type"`` key,
no version field. Producers' messages refuse unknown keys, so a misspelt field never
passes silently; answers may grow keys, and the client ignores those it does not know.
Every field's type and limits are checked here while decoding: the sampling fields take
theirs from SamplingParams (common/sampling.py), so the queue refuses exactly what the
sampling type refuses, and says so naming the field; what a value means against the model
(max_tokens within the context, top_k within the vocabulary, ...) is the router's to check.
"""
from __future__ import annotations

from typing import Annotated, Optional, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType

from pdserve.common.limits import MAX_ID_CHARS, MAX_INT, TokenIds, allowed
from pdserve.common.sampling import FIELD_TYPES as SAMPLING_TYPES

_Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]


def _sampling(name: str):
    """A Submit field that is SamplingParams' field ``name``, or left out (UNSET)."""
    return Union[SAMPLING_TYPES[name], UnsetType]


class Submit(msgspec.Struct, tag="submit", tag_field="type", kw_only=True,
             omit_defaults=True, forbid_unknown_fields=True):
    """producer -> router: a request. UNSET fields are left out of the map; the router
    then uses SamplingParams' defaults. max_tokens is required, and exactly one of prompt
    / prompt_token_ids, which the router says in words when they are missing. The keys
    are the public contract's; their types and limits are SamplingParams'."""
    id: _Id
    prompt: Union[str, UnsetType] = UNSET
    prompt_token_ids: Union[TokenIds, UnsetType] = UNSET
    max_tokens: _sampling("max_tokens") = UNSET
    temperature: _sampling("temperature") = UNSET
    top_p: _sampling("top_p") = UNSET
    top_k: _sampling("top_k") = UNSET
    seed: _sampling("seed") = UNSET
    stop: Union[str, SAMPLING_TYPES["stop"], UnsetType] = UNSET  # one string, or a list
    stop_token_ids: _sampling("stop_token_ids") = UNSET
    ignore_eos: _sampling("ignore_eos") = UNSET
    logprobs: _sampling("logprobs") = UNSET


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    """producer -> router: end this request now (done / finish_reason "abort"). Other keys
    are ignored, as they always were."""
    id: _Id


class Resume(msgspec.Struct, tag="resume", tag_field="type", kw_only=True,
             forbid_unknown_fields=True):
    """producer -> any router: go on with my request ``id``, whose router was lost; I hold
    its first ``tokens`` token ids and ``chars`` characters of its text (so the text goes
    on exactly where it stopped, stop strings and split characters included; left out:
    the text of those tokens as this router decodes it). The producer is told by its
    socket identity, which must be the one it submitted with (docs/queue-protocol.md)."""
    id: _Id
    tokens: Annotated[int, Meta(ge=0, lt=MAX_INT)]
    chars: Union[Annotated[int, Meta(ge=0)], UnsetType] = UNSET


# How each field of Submit is described when a value does not fit (the error message
# says "field 'X' must be <this>, got ..."); derived from the types above.
FIELD_TYPES = {"type": "'submit', 'cancel' or 'resume'", **allowed(Submit, none="nil"),
               "tokens": "an integer in [0, 2^31)", "chars": "a non-negative integer"}
SAMPLING_FIELDS = tuple(f for f in Submit.__struct_fields__ if f in SAMPLING_TYPES)


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
PRODUCER_DECODER = msgspec.msgpack.Decoder(Union[Submit, Cancel, Resume])  # the ingress reads
ANSWER_DECODER = msgspec.msgpack.Decoder(Union[Tokens, Done, Error])  # clients read
