"""Prefill node: batch prefill, first token to the router at once, KV to the decode node.

A request's way here::

    PrefillBatch --> scheduler.waiting --> (chunked) prefill steps
      --> last chunk's forward: layer groups' KV sent as each group finishes, one message
          per decode node for all the requests of the step bound for it
      --> first token sampled: FirstTokens to router, last KV chunk (with the tokens)
      --> TRANSFERRING until the decode node's KVAck (or the deadline) --> blocks freed
The KV goes by the first of the node's senders (node/kv/) that reaches the decode node.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.engine.engine import layer_groups
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.node.base import Node, wire_logprobs, wire_stats
from pdserve.node.config import NodeConfig
from pdserve.node.io import KV_OUT, InboxItem
from pdserve.node.kv import KVSender, Outgoing, TransferState, default_senders

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    req: P.PrefillRequest
    seq: Sequence
    state: TransferState = TransferState.BOOTSTRAPPING  # of its KV's transfer
    blocks: list[int] | None = None      # TRANSFERRING: owned here until acknowledged
    deadline: float = 0.0                # for the decode node's acknowledgement


MAX_PATHS_LOGGED = 4096  # decode nodes whose KV path was logged; then the log starts over


class PrefillNode(Node):
    role = "prefill"

    def __init__(self, config: NodeConfig, kv_senders: list[KVSender] | None = None):
        """``kv_senders``: the ways KV leaves, most preferred first (default: /dev/shm
        when on, then TCP, both through the node's KV sockets). Simulated nodes take TCP,
        as KV goes between GPU hosts: a segment needs /dev/shm room for the simulated GPU's
        whole KV capacity, and backs every block the pool hands out."""
        shm = config.kv_shm and config.engine.compute != "simulated"
        self.kv_senders = kv_senders if kv_senders is not None else default_senders(
            lambda address, chunk: self.io.send_kv(address, chunk), shm=shm,
            checksums=config.kv_checksums)
        super().__init__(config)
        for sender in self.kv_senders:
            sender.attach(self.identity, self.layout, self.engine.runner.kv_caches,
                          self.host_id)
        self.jobs: dict[str, PrefillJob] = {}
        self.groups = layer_groups(self.layout.num_layers, config.kv_layers_per_chunk)
        self.engine.layer_groups = self.groups  # where the step hands out KV to ship
        self._paths_logged: set[tuple[str, str]] = set()

    def kv_storage(self, nbytes: int):
        """Where a sender needs the KV cache (shm: in a /dev/shm segment, so same-host
        decode nodes copy from it); None: the process's own memory."""
        for sender in self.kv_senders:
            storage = sender.storage(nbytes)
            if storage is not None:
                return storage
        return None

    def release(self) -> None:
        for sender in self.kv_senders:
            sender.close()

    def _sender_for(self, req: P.PrefillRequest) -> KVSender:
        """The first sender that reaches the request's decode node; the way chosen is
        logged once per decode node (not per request)."""
        sender = next((s for s in self.kv_senders if s.reaches(req)), None)
        if sender is None:  # a node built without TCP (which reaches every node)
            raise RuntimeError(f"no KV sender of {[s.path for s in self.kv_senders]} "
                               f"reaches decode node {req.decode_node_id}")
        if (req.kv_address, sender.path) not in self._paths_logged:
            if len(self._paths_logged) >= MAX_PATHS_LOGGED:
                self._paths_logged.clear()
            self._paths_logged.add((req.kv_address, sender.path))
            log.info("KV to decode node %s (%s) goes %s", req.decode_node_id, req.kv_address,
                     sender.describe(req))
        return sender

    def handle(self, item: InboxItem) -> None:
        msg = item.msg
        if isinstance(msg, P.PrefillBatch):
            for req in msg.requests:
                self._admit(req)
        elif isinstance(msg, P.Abort):
            for req_id in msg.req_ids:
                self.unpark(req_id)
                self.drop(req_id)
        elif isinstance(msg, P.KVAck):
            for result in msg.results:
                job = self.jobs.get(result.req_id)
                if job is None or job.state is not TransferState.TRANSFERRING \
                        or job.req.kv_address != item.peer:
                    continue  # not this decode node's to settle (or not all sent yet)
                job.state = TransferState.SUCCESS if result.ok else TransferState.FAILED
                self.metrics.kv_acked(result.req_id, result.ok)
                self.drop(result.req_id)
                if not result.ok:  # the decode node told the router why
                    log.warning("decode node refused KV of %s: %s", result.req_id,
                                result.reason)
        elif isinstance(msg, P.Error):
            if item.channel == KV_OUT and msg.req_id in self.jobs:
                self.jobs[msg.req_id].state = TransferState.FAILED
                self.metrics.kv_failed(msg.req_id)
                self.drop(msg.req_id)
                self.error_to_router(msg.req_id, msg.code,
                                     f"KV transfer to {item.peer} failed: {msg.message}")
            else:
                log.warning("error from %s: %s %s", item.channel, msg.code, msg.message)
        elif isinstance(msg, P.Drain):
            log.info("asked to drain: %s", msg.reason)

    def _admit(self, req: P.PrefillRequest) -> None:
        if self.refuse_when_draining(req.req_id):
            return
        if self.park_for_guide(req.req_id, req.sampling, lambda: self._admit(req),
                               lambda why: self.error_to_router(req.req_id, E.BAD_GUIDE,
                                                                why)):
            return
        most = (len(req.prompt_token_ids) - 1) // self.layout.block_size
        if not 0 <= req.skip_blocks <= most:
            self.error_to_router(req.req_id, E.BAD_MESSAGE, (
                f"skip_blocks={req.skip_blocks} for a prompt of {len(req.prompt_token_ids)} "
                f"tokens: at most {most} leading blocks can be cached on the decode node"))
            return
        seq = self.admit(req, known=req.req_id in self.jobs)
        if seq is not None:
            self.jobs[req.req_id] = PrefillJob(req, seq)
            self.engine.add(seq)

    def drop(self, req_id: str, reason: str = "abort") -> None:
        self.metrics.forget(req_id)
        job = self.jobs.pop(req_id, None)
        if job is None:
            return
        if job.blocks is not None:  # detached from the engine: the blocks are ours
            self.engine.free_detached(job.blocks)
        else:
            self.engine.finish(req_id, "abort")

    def stats(self) -> P.NodeStats:
        sched = self.engine.scheduler
        queued = sum(s.num_tokens - s.num_computed_tokens
                     for s in (*sched.waiting, *sched.running))
        return wire_stats(self.engine.stats(queued_prompt_tokens=queued), self.events_seq())

    def step(self) -> None:
        outputs = self.engine.step(on_batch=self._scheduled, on_layer_group=self._ship_group)
        firsts, shipping = [], {}
        for out in outputs:  # each the first token of a prompt whose last chunk just ran
            token = out.new_token_ids[0]
            self.metrics.first_token(out.req_id)
            firsts.append(P.FirstToken(req_id=out.req_id, token_id=token,
                                       finish_reason=out.finish_reason,
                                       logprobs=wire_logprobs(out.logprobs),
                                       prompt_logprobs=wire_logprobs(out.prompt_logprobs)))
            if out.finish_reason is None:
                shipping[out.req_id] = token
            else:
                self.drop(out.req_id)  # finished at its first token: no decode needed
        self.send_first_tokens(firsts)  # time to first token
        self._send_kv([self.jobs[r].seq for r in shipping], *self.groups[-1], last=True,
                      first_tokens=shipping)
        deadline_from = time.monotonic()
        for req_id in shipping:  # the blocks stay allocated until the decode node's KVAck
            job = self.jobs[req_id]
            job.blocks = self.engine.detach(req_id)
            job.state = TransferState.TRANSFERRING
            job.deadline = deadline_from + job.req.timeout_s

    def _scheduled(self, batch: ScheduledBatch) -> None:
        self.metrics.step([s.seq_id for s in batch.seqs])

    def _ship_group(self, prompts: list[Sequence], start: int, end: int) -> None:
        """KV of a layer group, sent as soon as the forward has it. Not the last group's:
        that leaves after sampling, carrying the first tokens."""
        if (start, end) != self.groups[-1]:
            self._send_kv(prompts, start, end, last=False)

    def _send_kv(self, seqs: list[Sequence], start: int, end: int, *, last: bool,
                 first_tokens: dict[str, int] | None = None) -> None:
        """Layers [start, end) of these requests' KV: one message per decode node. Only
        the blocks the decode node does not hold travel."""
        by_address: dict[str, list[Outgoing]] = {}
        for seq in seqs:
            req = self.jobs[seq.seq_id].req
            by_address.setdefault(req.kv_address, []).append(Outgoing(
                seq.seq_id, seq.block_table[req.skip_blocks:], seq.num_prompt_tokens,
                req.skip_blocks, first_tokens[seq.seq_id] if last else None))
        for address, outgoing in by_address.items():
            sender = self._sender_for(self.jobs[outgoing[0].req_id].req)
            for at in range(0, len(outgoing), P.MAX_KV_PARTS):
                parts = outgoing[at:at + P.MAX_KV_PARTS]
                nbytes = sender.send(address, parts, start, end, last)
                self.metrics.kv_sent([p.req_id for p in parts], nbytes, sender.path)
                if last:
                    self.metrics.kv_blocks(sum(len(p.block_ids) for p in parts),
                                           sum(p.first_block for p in parts))

    def expire(self) -> None:
        now = time.monotonic()
        late = [j for j in self.jobs.values()
                if j.state is TransferState.TRANSFERRING and now > j.deadline]
        for job in late:
            job.state = TransferState.FAILED
            self.metrics.kv_failed(job.req.req_id)
            self.drop(job.req.req_id)
            self.error_to_router(job.req.req_id, E.TIMEOUT, (
                f"decode node {job.req.decode_node_id} at {job.req.kv_address} did not "
                f"acknowledge the KV within {job.req.timeout_s:g} s"))


def run_prefill(config: NodeConfig) -> int:
    return PrefillNode(config).run()
