"""Colocated node: one engine prefills and decodes, behind the same router.

A request's way here::

    PrefillBatch --> scheduler.waiting --> (chunked) prefill steps --> first token:
      FirstTokens to the router --> one TokenBatch per step --> finished/aborted:
      blocks freed
"""
from __future__ import annotations

import time

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.node.config import NodeConfig
from pdserve.node.decode import DecodeJob, DecodeNode
from pdserve.node.io import InboxItem


class ColocatedNode(DecodeNode):
    """Prefills and decodes with one engine, behind the same router: the baseline that
    disaggregation is measured against, and what a user with one GPU runs. It takes
    PrefillBatch messages (no reservation, no KV transfer) and reports first tokens and
    later tokens exactly as a prefill + decode pair would."""
    role = "colocated"

    def handle(self, item: InboxItem) -> None:
        if not isinstance(item.msg, P.PrefillBatch):
            super().handle(item)
            return
        for req in item.msg.requests:
            self._take(req)

    def _take(self, req: P.PrefillRequest) -> None:
        if self.refuse_when_draining(req.req_id):
            return
        if self.park_for_guide(req.req_id, req.sampling, lambda: self._take(req),
                               lambda why: self.error_to_router(req.req_id, E.BAD_GUIDE,
                                                                why)):
            return
        seq = self.admit(req, known=req.req_id in self.jobs)
        if seq is None:
            return
        self.jobs[req.req_id] = DecodeJob(seq, transfer=None,
                                          deadline=time.monotonic() + req.timeout_s)
        self.engine.add(seq)


def run_colocated(config: NodeConfig) -> int:
    return ColocatedNode(config).run()
