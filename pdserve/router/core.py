"""The router's core as the front ends see it: a thin asyncio shell over the dispatch
state machine (dispatch/) and the control socket (control.py).

    core = RouterCore(config)            # reads config.json + tokenizer of config.model
    await core.start()                   # binds the control socket, starts its loops
    core.check(req)                      # RequestError(BAD_REQUEST, message, param)
    stream = core.submit(req)            # never waits on a socket
    stream = core.resume(owner, id, n, c)  # a queue stream whose router died, resumed here
    async for event in stream: ...       # StreamEvent; the last one is terminal
    stream.cancel()                      # the client went away: abort on the nodes
    core.health()                        # (ok, reason): loops alive, nodes enough
    core.ready()                         # (ok, reason): health, and the prefix index in

Everything runs on one asyncio loop (the core is not thread-safe). A request's states,
failover and the rules for node messages are dispatch's. The way is one way: the core
registers each request's ``RequestStream`` in ``streams`` and hands what dispatch returns
to control; control sends the messages and pushes the client events into the streams;
the front ends read the streams. Nothing calls back into the core.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from pdserve.common import protocol as P
from pdserve.common.metrics import RouterMetrics
from pdserve.model.config import ModelConfig
from pdserve.model.identity import model_identity_hash, model_name
from pdserve.model.tokenizer import Tokenizer
from pdserve.router import streams as S
from pdserve.router.config import RouterConfig
from pdserve.router.control import Control
from pdserve.router.dispatch.dispatch import Dispatch
from pdserve.router.dispatch.node_messages import CONTROL_IN  # noqa: F401 (part of this API)
from pdserve.router.dispatch.policies import CacheAware
from pdserve.router.dispatch.registry import Registry
from pdserve.router.guide_check import GuideChecker
from pdserve.router.kv_index import KVIndexFeed
from pdserve.router.limits import PromptBound, check_request
from pdserve.router.tokenizing import TokenizerPool
from pdserve.sim.profile import load_profile, scaled_head_dim, sim_identity

log = logging.getLogger(__name__)


def sim_expectation(profile_name: str, kv_scale: float
                    ) -> tuple[P.ModelIdentity, tuple[int, int, int]]:
    """The identity and KV shape (layers, kv heads, head dim) that simulated nodes of a
    profile announce (engine/sim_runner.py makes them from the same functions)."""
    p = load_profile(profile_name)
    name, config_hash = sim_identity(p, kv_scale)
    return (P.ModelIdentity(name=name, config_hash=config_hash),
            (p.model.num_layers, p.model.num_kv_heads, scaled_head_dim(p, kv_scale)))


class RouterCore:
    def __init__(self, config: RouterConfig):
        from pdserve.model.default_model import default_model_dir

        self.config = config
        model_dir = Path(config.model) if config.model else default_model_dir()
        self.model_config = cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        if model_dir.is_file():  # a GGUF file, read: its parsed metadata can go
            from pdserve.model import gguf
            gguf.release_readers()
        self.model_name = config.served_model_name or model_name(model_dir)
        self.max_model_len = cfg.max_model_len
        self.prompt_bound = PromptBound(config, cfg.max_model_len,
                                        self.tokenizer.longest_token_chars())
        identity = P.ModelIdentity(name=model_name(model_dir),
                                   config_hash=model_identity_hash(model_dir))
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if config.sim_profile:  # simulated nodes: the profile's model, --model's tokenizer
            identity, shape = sim_expectation(config.sim_profile, config.sim_kv_bytes_scale)
        self.registry = Registry(identity, *shape, config.heartbeat_interval_s,
                                 config.liveness)
        self.metrics = RouterMetrics(self.model_name, error_codes=S.HTTP_STATUS)
        self.dispatch = Dispatch(self.registry, config.policy, self.metrics, config,
                                 cfg.vocab_size, cfg.eos_token_ids, cfg.max_model_len,
                                 self.tokenizer)
        self.policy = self.dispatch.policy
        self.streams: dict[str, S.RequestStream] = {}   # by the client's request id
        self.control = Control(config, self.registry, self.dispatch, self.metrics,
                               self.streams)
        self.index_feed = None   # cache_aware: its index comes from the nodes' KV events
        if isinstance(self.policy, CacheAware):
            self.index_feed = KVIndexFeed(self.policy.index, self.registry, self.control,
                                          self.metrics)
            self.control.index_feed = self.index_feed
        self.metrics.watch(lambda: len(self.dispatch.requests), lambda: [
            (n.role, n.state) for n in list(self.registry.nodes.values())])
        self.tokenizing = TokenizerPool(config.tokenizer_threads, config.max_tokenizing)
        self.guides = GuideChecker()   # structured output checked off the event loop
        self._tasks: list[asyncio.Task] = []

    # The dispatch's and control's state, where callers (tests, /health) read it.
    @property
    def flights(self):
        return self.dispatch.flights

    @property
    def requests(self):
        return self.dispatch.requests

    @property
    def loop_ticks(self) -> dict[str, int]:
        return self.control.loop_ticks

    @property
    def incarnation(self) -> str:
        return self.control.incarnation

    # -- front-end API ------------------------------------------------------------------------
    def check(self, req: S.GenerationRequest) -> None:
        """RequestError(BAD_REQUEST) naming the field, for what this model and config refuse."""
        check_request(req, self.model_config.vocab_size, self.max_model_len, self.config)

    def submit(self, req: S.GenerationRequest) -> S.RequestStream:
        try:
            return self._submit(req)
        except S.RequestError as exc:  # refused: counted, then answered by the front-end
            self.refused(exc)
            raise

    def refused(self, exc: S.RequestError) -> None:
        """Counts a refusal once, whichever front end or check made it (the one place
        pdserve_request_errors_total learns of requests that never became a flight)."""
        if not exc.counted:
            exc.counted = True
            self.metrics.refused(exc.code)

    def _submit(self, req: S.GenerationRequest) -> S.RequestStream:
        self.check(req)
        ok, reason = self.health()
        if not ok:
            # A clock that has not ticked while its loops live means this loop is busy
            # (a flood): that is load, to retry, not a cluster without nodes.
            stalled = reason.startswith("the router's clock")
            raise S.RequestError(S.OVERLOADED if stalled else S.NO_NODES,
                                 f"{reason}; retry after 1 s" if stalled else reason)
        req_id, out = self.dispatch.submit(req, time.monotonic())
        stream = S.RequestStream(req_id, list(req.prompt_token_ids))
        stream._cancel = self.cancel
        self.streams[req_id] = stream
        self.control.apply(out)
        return stream

    def resume(self, owner: str, client_id: str, held: int,
               chars: int | None) -> S.RequestStream:
        """The stream of a producer whose router died (docs/queue-protocol.md), found on the
        decode node that keeps it: its events are the tokens after the ``held`` the
        producer has, then its one terminal event (or an error saying why not). Never waits;
        RequestError when there is no decode node to ask. (Not refused on a busy clock as a
        submit is: the stream exists, and the producer may not be able to retry it.)"""
        req_id = self.dispatch.resumes.start(owner, client_id, held, chars, time.monotonic())
        stream = S.RequestStream(req_id, [])
        stream._cancel = self.cancel
        self.streams[req_id] = stream
        self.control.apply(self.dispatch.take())
        return stream

    def cancel(self, req_id: str) -> None:
        self.control.apply(self.dispatch.cancel(req_id, time.monotonic()))

    def health(self) -> tuple[bool, str]:
        dead = [t.get_name() for t in self._tasks if t.done()]
        if dead:
            return False, f"the router's loop(s) {', '.join(dead)} stopped; see its log"
        if self._tasks and time.monotonic() - self.control.last_tick > 2.0:
            return False, (f"the router's clock has not ticked for "
                           f"{time.monotonic() - self.control.last_tick:.1f} s")
        return self.registry.health()

    def ready(self) -> tuple[bool, str]:
        """Whether a load balancer should send this router requests (/health): healthy,
        and with cache_aware its prefix index holds every node's dump (or the node missed
        its deadline: prefix_index.py). Requests that come anyway are served (submit asks
        ``health``): an index still filling only costs cache hits."""
        ok, reason = self.health()
        if not ok or self.index_feed is None:
            return ok, reason
        ready, why = self.index_feed.readiness()
        return ready, f"{reason}; {why}" if why else reason

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.control.open()
        self._tasks = [asyncio.create_task(self.control.receive_loop(), name="receive"),
                       asyncio.create_task(self.control.tick_loop(), name="tick")]
        if self.index_feed is not None:
            self._tasks.append(asyncio.create_task(self.index_feed.run(), name="kv-events"))
        log.info("router control socket on %s, model %s", self.config.control, self.model_name)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.tokenizing.close()
        self.guides.close()
        self.control.apply(self.dispatch.fail_all(S.NO_NODES, "the router is shutting down"))
        self.control.close()
        if self.index_feed is not None:
            self.index_feed.close()
