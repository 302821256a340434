"""Decode node: reserves blocks, receives KV into its pages, decodes in continuous batches.

A request's way here::

    Reserve (all of a router turn's) --> engine.reserve: blocks allocated, cached prefix
      linked (or refused with the reason), lease started; one ReserveReply for them all
      --> KVChunk... (several requests each) checked (model, layout, checksum) and
          copied into those blocks
      --> last chunk: first token appended, sequence joins the running batch, KVAck (one
          per chunk, for all its requests)
      --> one TokenBatch per step to the router --> finished/aborted: blocks freed
    A lease that runs out before the KV has arrived frees the blocks and tells the router.

A stream whose Reserve named its origin (a queue producer's) outlives its router: when
the router goes, it decodes on as an orphan; a ``Resume`` from any router for its
(producer, id) hands it over with every token made so far; it is kept for
--stream-keep seconds after its end, or after its router went (node/streams.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.node.base import Node, wire_logprobs
from pdserve.node.config import NodeConfig
from pdserve.node.io import InboxItem
from pdserve.node.kv import InboundTransfer, KVReceiver, KVTransferError, TransferState
from pdserve.node.kv.receiver import Reply
from pdserve.node.routers import Orphaned
from pdserve.node.streams import StreamKeeper

log = logging.getLogger(__name__)

MAX_WAITING_RESUMES = 8  # Resumes of one stream waiting for its KV; past it: answered now


@dataclass
class DecodeJob:
    seq: Sequence
    transfer: InboundTransfer | None     # None: prefilled here (a colocated node)
    lease_s: float = 0.0
    lease_deadline: float = 0.0
    deadline: float = float("inf")       # the request's own: past it the job ends here
    sender: str = ""                     # the one prefill node whose KV is taken ("": any)
    sender_peer: bytes = b""             # and its KV socket identity (P.peer_identity)
    origin: P.StreamOrigin | None = None  # a resumable stream's (node/streams.py)

    @property
    def placed(self) -> bool:
        """The sequence is the scheduler's (KV arrived, or prefilled locally)."""
        return self.transfer is None or self.transfer.state is TransferState.SUCCESS


class DecodeNode(Node):
    role = "decode"

    def __init__(self, config: NodeConfig, kv_reply: Reply | None = None):
        """``kv_reply``: how KVAcks reach the senders (default: the node's KV socket)."""
        super().__init__(config)
        self.receiver = KVReceiver(self.identity, self.layout, self.engine.runner.kv_caches,
                                   reply=kv_reply or self.io.send_kv_reply)
        self.jobs: dict[str, DecodeJob] = {}
        self.kept = StreamKeeper(config.stream_keep_s)
        self._waiting: dict[str, list[P.Resume]] = {}  # resumes waiting for their KV
        self._senders_pruned = 0.0
        self._step_started, self._batch_size = 0.0, 0  # of the step running, for its metric

    def handle(self, item: InboxItem) -> None:
        msg = item.msg
        if isinstance(msg, P.Reserve):  # one reply for all the router's turn reserved here
            items = [self._reserve(r) for r in msg.items if not self._park(r)]
            if items:
                self.io.send_control(P.ReserveReply(items=items))
        elif isinstance(msg, P.KVChunk):
            self._place(item.peer, msg)
        elif isinstance(msg, P.Abort):
            for req_id in msg.req_ids:
                self.unpark(req_id)
                self.drop(req_id, "abort")
        elif isinstance(msg, Orphaned):
            self._orphaned(msg)
        elif isinstance(msg, P.Resume):
            self._answer(msg)
        elif isinstance(msg, P.Release):  # (only what that router owned: RouterLinks)
            now = time.monotonic()
            for req_id in msg.req_ids:  # a running stream is an orphan again; an ended
                if req_id in self.jobs:  # one stays kept as it was
                    self.kept.orphaned(req_id, now)
            log.info("%d resumed streams handed back (%s): kept %g s for another resume",
                     len(msg.req_ids), msg.reason, self.kept.keep_s)
        elif isinstance(msg, P.Error):
            log.warning("error from %s: %s %s", item.channel, msg.code, msg.message)
        elif isinstance(msg, P.Drain):
            log.info("asked to drain: %s", msg.reason)

    def _park(self, msg: P.ReserveRequest) -> bool:
        """The reservation waits for its guide to compile (its reply comes alone, then)."""
        def reply(result: P.ReserveResult) -> None:
            self.io.send_control(P.ReserveReply(items=[result]))

        return self.park_for_guide(
            msg.req_id, msg.sampling, lambda: reply(self._reserve(msg)),
            lambda why: reply(P.ReserveResult(req_id=msg.req_id, ok=False, num_blocks=0,
                                              reason=f"{E.BAD_MESSAGE}: {why}")))

    def _reserve(self, msg: P.ReserveRequest) -> P.ReserveResult:
        def refuse(reason: str) -> P.ReserveResult:
            log.info("reservation for %s refused: %s", msg.req_id, reason)
            return P.ReserveResult(req_id=msg.req_id, ok=False, reason=reason, num_blocks=0)

        if msg.req_id in self.jobs:
            return refuse(f"{E.BAD_MESSAGE}: request id {msg.req_id!r} is already here")
        if self.draining:
            return refuse(f"{E.NO_CAPACITY}: node {self.node_id} is draining")
        try:
            params = self.request_params(msg.req_id, msg.prompt_token_ids, msg.sampling)
        except ValueError as exc:
            return refuse(f"{E.BAD_MESSAGE}: {exc}")
        seq = Sequence(msg.req_id, msg.prompt_token_ids, params, prefill_here=False)
        if not self.engine.can_reserve(seq):
            stats = self.engine.stats()
            return refuse(f"{E.NO_CAPACITY}: needs {self.engine.num_blocks_to_reserve(seq)} "
                          f"KV blocks, {stats.num_free_blocks} of {stats.num_total_blocks} free")
        # The sender is told by its whole socket identity, incarnation included: a stranger
        # who took the bare node id on this socket first is not the node.
        peer = P.peer_identity(msg.prefill_node_id, msg.prefill_incarnation) \
            if msg.prefill_node_id else b""
        cached = self.engine.reserve(seq)  # the cached blocks' KV need not cross the wire
        transfer = InboundTransfer(msg.req_id, torch.tensor(seq.block_table[cached:],
                                                            dtype=torch.int64),
                                   len(msg.prompt_token_ids), first_block=cached)
        now = time.monotonic()
        self.jobs[msg.req_id] = DecodeJob(seq, transfer, msg.lease_s, now + msg.lease_s,
                                          now + msg.timeout_s if msg.timeout_s else float("inf"),
                                          sender=msg.prefill_node_id, sender_peer=peer,
                                          origin=msg.origin)
        if msg.origin is not None:
            self.kept.started(msg.req_id, msg.origin)
        if peer:
            self.io.expected_kv_peers |= {peer}
        return P.ReserveResult(req_id=msg.req_id, ok=True, reason="",
                               num_blocks=len(seq.block_table), cached_blocks=cached)

    def _place(self, peer: bytes, chunk: P.KVChunk) -> None:
        """Places each part whose reservation is here and names this sender; answers for
        each part that is settled (placed whole, or refused) in one KVAck."""
        results, transfers = [], {}
        for i, part in enumerate(chunk.parts):
            job = self.jobs.get(part.req_id)
            if job is None or job.transfer is None or job.transfer.state not in (
                    TransferState.BOOTSTRAPPING, TransferState.TRANSFERRING):
                results.append(P.KVResult(req_id=part.req_id, ok=False, reason=(
                    f"no reservation here for {part.req_id!r} (expired, aborted or never "
                    "made)")))
            elif job.sender_peer and peer != job.sender_peer:  # refused; the reservation stands
                log.warning("KV for %s from %r refused: the reservation names prefill node %s",
                            part.req_id, peer, job.sender)
                results.append(P.KVResult(req_id=part.req_id, ok=False, reason=(
                    f"{E.BAD_MESSAGE}: KV for {part.req_id!r} is taken only from prefill node "
                    f"{job.sender!r}, the one its reservation names")))
            else:
                transfers[i] = job.transfer
        failed = {i: exc for i in transfers
                  if (exc := self._check_first_token(chunk, chunk.parts[i])) is not None}
        failed |= self.receiver.place(chunk, {i: t for i, t in transfers.items()
                                              if i not in failed})
        for i, exc in failed.items():
            req_id = chunk.parts[i].req_id
            transfers[i].state = TransferState.FAILED
            self.drop(req_id, "error")
            results.append(P.KVResult(req_id=req_id, ok=False, reason=f"{exc.code}: {exc.message}"))
            self.error_to_router(req_id, exc.code, exc.message)
        for i, transfer in transfers.items():
            if i not in failed and transfer.state is TransferState.SUCCESS:
                part, job = chunk.parts[i], self.jobs[chunk.parts[i].req_id]
                self.engine.add_prefilled(job.seq, part.first_token)  # the router has it
                self._answer_waiting(part.req_id)
                results.append(P.KVResult(req_id=part.req_id, ok=True))
        if results:
            self.receiver.ack(peer, results)

    def _check_first_token(self, chunk: P.KVChunk, part: P.KVPart) -> KVTransferError | None:
        vocab = self.engine.model_config.vocab_size
        if chunk.last and (part.first_token is None or not 0 <= part.first_token < vocab):
            return KVTransferError(E.BAD_MESSAGE, f"the last KV chunk of {part.req_id!r} "
                                   f"carries first_token={part.first_token!r}, not a token id "
                                   f"in [0, {vocab})")
        return None

    # -- streams that outlive their router ------------------------------------------------
    def _orphaned(self, msg: Orphaned) -> None:
        """Their router is gone: a resumable stream decodes on (for a resume, within the
        bound); one that nobody could resume ends now."""
        now = time.monotonic()
        for req_id in msg.req_ids:
            job = self.jobs.get(req_id)
            if job is not None and job.origin is not None:
                self.kept.orphaned(req_id, now)  # (KV still coming: the lease bounds it)
            else:
                self.unpark(req_id)
                self.drop(req_id, "abort")
        log.info("%d requests lost their router (%s): their streams are kept %g s for a "
                 "resume", len(msg.req_ids), msg.reason, self.kept.keep_s)

    def _answer(self, msg: P.Resume) -> None:
        """A Resume for a stream whose KV is still arriving waits for it (its first token
        may have reached the client already): answered once placed, or, if the request
        ends first, as not found (drop); the router's own timeout bounds the wait."""
        job = self.jobs.get(self.kept.find(msg.owner, msg.client_id))
        if job is not None and job.origin is not None and not job.placed:
            waiting = self._waiting.setdefault(job.seq.seq_id, [])
            if len(waiting) < MAX_WAITING_RESUMES:
                waiting.append(msg)
                return
        self.io.send_control(self._resume(msg))

    def _answer_waiting(self, req_id: str) -> None:
        for msg in self._waiting.pop(req_id, ()):
            self.io.send_control(self._resume(msg))

    def _resume(self, msg: P.Resume) -> P.Resumed:
        """The stream of (owner, client id), handed to the router that asks: every token it
        has made, and its end if it has ended; or why not."""
        def refuse(code: str, reason: str) -> P.Resumed:
            return P.Resumed(req_id=msg.req_id, ok=False, code=code, reason=reason)

        wire_id = self.kept.find(msg.owner, msg.client_id)
        job, ended = self.jobs.get(wire_id), self.kept.ended.get(wire_id)
        if ended is not None:
            origin, tokens, reason, left = ended.origin, ended.tokens, ended.finish_reason, 0.0
        elif job is not None and job.placed:
            origin, tokens, reason = job.origin, job.seq.token_ids, None
            left = job.deadline - time.monotonic() if job.deadline < float("inf") else 0.0
        else:
            return refuse(E.STREAM_NOT_FOUND, f"decode node {self.node_id} holds no stream "
                          f"{msg.client_id!r} of this producer")
        made = len(tokens) - origin.num_prompt
        if msg.held > made:
            return refuse(E.BAD_REQUEST, f"the producer says it holds {msg.held} tokens of "
                          f"{msg.client_id!r}; the stream has made {made}")
        self.kept.adopted(wire_id)
        log.info("stream %s (%s) resumed from token %d of %d%s", msg.client_id, wire_id,
                 msg.held, made, f", ended ({reason})" if reason else "")
        return P.Resumed(req_id=msg.req_id, ok=True, wire_id=wire_id,
                         prompt_token_ids=list(tokens[:origin.num_prompt]),
                         sampling=origin.sampling, token_ids=list(tokens[origin.num_prompt:]),
                         finish_reason=reason, timeout_s=max(0.0, left))

    def drop(self, req_id: str, reason: str) -> None:
        self.kept.forget(req_id)
        job = self.jobs.pop(req_id, None)
        self._answer_waiting(req_id)  # (not found, now)
        if job is None:
            return
        if job.placed:
            self.engine.finish(req_id, reason)
        else:  # still reserved: the sequence never joined the engine
            self.engine.release(job.seq)

    def step(self) -> None:
        self._batch_size = 0
        outputs = self.engine.step(on_batch=self._scheduled)
        if self._batch_size:  # nothing could be scheduled: no step ran
            self.metrics.step(self._batch_size, time.monotonic() - self._step_started)
        firsts, items = [], []
        for out in outputs:
            if out.first:  # prefilled here (a colocated node): time to first token
                firsts.append(P.FirstToken(req_id=out.req_id, token_id=out.new_token_ids[0],
                                           finish_reason=out.finish_reason,
                                           logprobs=wire_logprobs(out.logprobs),
                                           prompt_logprobs=wire_logprobs(out.prompt_logprobs)))
            else:
                items.append(P.TokenItem(req_id=out.req_id, token_ids=out.new_token_ids,
                                         finish_reason=out.finish_reason,
                                         logprobs=wire_logprobs(out.logprobs)))
            if out.finish_reason is not None:
                job = self.jobs.pop(out.req_id)  # the engine has freed its blocks
                if job.origin is not None:
                    self.kept.finished(out.req_id, job.origin, job.seq.token_ids,
                                       out.finish_reason, time.monotonic())
        self.send_first_tokens(firsts)  # time to first token
        if items:
            self.io.send_control(P.TokenBatch(items=items))

    def _scheduled(self, batch: ScheduledBatch) -> None:
        """The step metric times from here (the batch scheduled) to its outputs."""
        self._step_started = time.monotonic()
        self._batch_size = len(batch)

    def release(self) -> None:
        self.receiver.close()

    def expire(self) -> None:
        now = time.monotonic()
        self.receiver.tick(now)
        if now >= self._senders_pruned + 1.0:  # KV budgets: who may still send KV here
            self._senders_pruned = now
            self.io.expected_kv_peers = frozenset(
                j.sender_peer for j in self.jobs.values() if j.sender_peer and not j.placed)
        for job in [j for j in self.jobs.values() if now > j.deadline]:
            # Its Abort may have been lost: it must not run on to max_tokens.
            self.drop(job.seq.seq_id, "error")
            self.error_to_router(job.seq.seq_id, E.TIMEOUT, "the request passed its deadline "
                                 "on the decode node")
        for req_id in self.kept.expired(now):
            log.info("stream %s freed: no router resumed it within %g s of its router "
                     "going", req_id, self.kept.keep_s)
            self.drop(req_id, "abort")
        late = [j for j in self.jobs.values() if not j.placed and now > j.lease_deadline]
        for job in late:
            req_id = job.seq.seq_id
            self.drop(req_id, "error")
            self.error_to_router(req_id, E.LEASE_EXPIRED, (
                f"reservation of {len(job.transfer.block_ids)} KV blocks expired after "
                f"{job.lease_s:g} s without the KV arriving"))


def run_decode(config: NodeConfig) -> int:
    return DecodeNode(config).run()
