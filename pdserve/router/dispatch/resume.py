"""Streams that outlive their router: a producer whose router died resumes here.

Held by dispatch.Dispatch, pure as it is (no sockets, no clock). The decode node keeps
each resumable stream (node/streams.py); this router finds it by asking every decode
node (``Resume``), since the producer's id is its own and says nothing of where its
stream runs, and a lookup is rare next to the requests it would burden with a node name
in their ids. The one that holds it answers with the stream (``Resumed``) and sends its
later tokens here. The request becomes a Flight of this router's, DECODING on that node,
whose text state is rebuilt from the client's prompt and sampling and the tokens the
producer holds; it gets the rest as any stream does, and exactly one terminal event.

    req_id = resumes.start(owner, client_id, held, chars, now)  # Resume to every decode node
    resumes.reply(node_id, Resumed, now)   # found: the flight; not anywhere: an error event
    resumes.tick(now)                      # lookups nobody answered in RESUME_TIMEOUT_S
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.model.text import RequestOutputState
from pdserve.router import streams as S
from pdserve.router.dispatch.flight import Flight, State

log = logging.getLogger(__name__)

RESUME_TIMEOUT_S = 5.0   # how long the decode nodes have to answer a lookup
MAX_LOOKUPS = 10_000     # lookups waiting for answers at once


@dataclass
class Lookup:
    req_id: str                # this router's id for the resumed request (its stream's)
    owner: str
    client_id: str
    held: int
    chars: int | None
    deadline: float
    asked: set[str] = field(default_factory=set)   # decode nodes yet to answer
    refusal: tuple[str, str] | None = None          # a node's (code, reason) other than
    #                                                 "not here"


def stream_origin(flight: Flight) -> P.StreamOrigin | None:
    """What the decode node keeps of a resumable request (None: not resumable). A request
    that asked for logprobs is not: its first token's came from the prefill node."""
    params = flight.out.params
    if flight.origin is None or params.logprobs is not None \
            or params.prompt_logprobs is not None:
        return None
    return P.StreamOrigin(owner=flight.origin[0], client_id=flight.origin[1],
                          num_prompt=len(flight.prompt), sampling=params)


class Resumes:
    def __init__(self, dispatch):
        self.d = dispatch                      # dispatch.Dispatch: its verbs and tables
        self.pending: dict[str, Lookup] = {}   # by req_id

    def start(self, owner: str, client_id: str, held: int, chars: int | None,
              now: float) -> str:
        """Asks every decode node (draining ones too: they still stream) for the stream;
        the id of the request its events will carry. RequestError when none can be asked."""
        nodes = [n.node_id for n in self.d.registry.nodes.values() if n.role == "decode"]
        if not nodes:
            raise S.RequestError(S.NO_NODES, "no decode node to resume the stream on")
        if len(self.pending) >= MAX_LOOKUPS:
            raise S.RequestError(S.OVERLOADED, f"{MAX_LOOKUPS} resumes in progress: retry")
        req_id = next(self.d._ids)
        self.pending[req_id] = Lookup(req_id, owner, client_id, held, chars,
                                      now + RESUME_TIMEOUT_S, set(nodes))
        for node_id in nodes:
            self.d.send(node_id, P.Resume(req_id=req_id, owner=owner, client_id=client_id,
                                          held=held))
        return req_id

    def cancel(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def reply(self, node_id: str, msg: P.Resumed, now: float) -> None:
        lookup = self.pending.get(msg.req_id)
        if lookup is None or node_id not in lookup.asked:
            if msg.ok:  # handed to us for a lookup that ended (timed out): not ours to end
                self.d.send(node_id, P.Release(req_ids=[msg.wire_id],
                                               reason="its resume had timed out"))
            return
        if msg.ok:
            del self.pending[msg.req_id]
            self._adopt(lookup, node_id, msg, now)
            return
        if msg.code != E.STREAM_NOT_FOUND:
            lookup.refusal = (msg.code, msg.reason)
        self._not_there(lookup, node_id)

    def node_gone(self, node_id: str) -> None:
        """A decode node left or died: whatever stream it held went with it, so a lookup
        need not wait for its answer (nor time out on it)."""
        for lookup in [k for k in self.pending.values() if node_id in k.asked]:
            self._not_there(lookup, node_id)

    def _not_there(self, lookup: Lookup, node_id: str) -> None:
        lookup.asked.discard(node_id)
        if not lookup.asked:
            self._fail(lookup, *(lookup.refusal or (E.STREAM_NOT_FOUND, (
                f"no decode node holds stream {lookup.client_id!r} of this producer: it "
                "ended longer ago than its nodes keep streams (--stream-keep), or never "
                "reached a decode node, or was submitted by another producer identity"))))

    def tick(self, now: float) -> None:
        for lookup in [k for k in self.pending.values() if now > k.deadline]:
            self._fail(lookup, S.TIMEOUT, f"decode node(s) {', '.join(sorted(lookup.asked))} "
                       f"did not answer the resume within {RESUME_TIMEOUT_S:g} s")

    def _fail(self, lookup: Lookup, code: str, message: str) -> None:
        self.pending.pop(lookup.req_id, None)
        log.info("resume of %s refused (%s): %s", lookup.client_id, code, message)
        self.d._emit(lookup, S.StreamEvent([], "", error=S.RequestError(code, message)))

    def _adopt(self, lookup: Lookup, node_id: str, msg: P.Resumed, now: float) -> None:
        """The stream is ours: its text state rebuilt from what the producer holds, and the
        rest delivered (with its end, if it has ended)."""
        d, prompt, tokens = self.d, list(msg.prompt_token_ids), list(msg.token_ids)
        if msg.sampling is None or any(not 0 <= t < d.node_messages.vocab_size
                                       for t in prompt + tokens):
            d.send(node_id, P.Abort(req_ids=[msg.wire_id], reason="a malformed resume"))
            self._fail(lookup, S.NODE_ERROR, f"decode node {node_id} answered the resume "
                       "without sampling or with token ids outside the vocabulary")
            return
        out = RequestOutputState(d.tokenizer, prompt, msg.sampling, d.eos_token_ids,
                                 d.max_model_len)
        out.add(tokens[:lookup.held])  # what the producer has: only the rest is new to it
        if lookup.chars is not None:
            if lookup.chars > len(out.text):  # the producer's mistake: its stream stays
                d.send(node_id, P.Release(req_ids=[msg.wire_id], reason="a refused resume"))
                self._fail(lookup, S.BAD_REQUEST, f"the producer says it holds {lookup.chars} "
                           f"characters of text; its {lookup.held} tokens make "
                           f"{len(out.text)} (the stream stays for a resume that says so)")
                return
            out.num_emitted_chars = lookup.chars
        timeout = msg.timeout_s or d.config.request_timeout_s
        flight = Flight(lookup.req_id, msg.wire_id, prompt, msg.sampling.for_nodes(), out,
                        deadline=now + timeout, created=now, state=State.DECODING,
                        decode_node=node_id, wire_prompt=list(prompt),
                        origin=(lookup.owner, lookup.client_id))
        d.flights[msg.wire_id] = d.requests[lookup.req_id] = flight
        d.placement.place(node_id, msg.wire_id)
        d.metrics.submitted(lookup.req_id)
        log.info("stream %s resumed on decode node %s from token %d of %d", lookup.client_id,
                 node_id, lookup.held, len(tokens))
        d.deliver(flight, tokens[lookup.held:], msg.finish_reason)
