"""Where the benchmark sends requests: the OpenAI HTTP API (SSE) or the queue ingress.

Each ``send`` returns a RequestRecord stamped with ``time.perf_counter()``:
sent, each content chunk (a non-empty text delta on HTTP, a ``tokens``
message on the ingress), complete. A failure is a record with ``error`` set,
never an exception: one bad request must not stop a benchmark.
"""
from __future__ import annotations

import time

import orjson

from pdserve.bench.datasets import SampleRequest, is_messages
from pdserve.bench.metrics import RequestRecord

NO_CHUNK = "never received a content chunk (no TTFT): counted as failed"


def _fail(rec: RequestRecord, error: str) -> RequestRecord:
    rec.end, rec.success, rec.error = time.perf_counter(), False, error or "failed"
    return rec


class OpenAIBackend:
    """Streams /v1/completions or /v1/chat/completions with usage in the last chunk.

    On aiohttp: against a stand-in that answers at once it spends 0.2-0.26 ms of CPU per
    streamed request on the 2-core dev machine, against 1.3-2.3 ms for httpx, whose
    ceiling there (430-790 requests/s) sat below what the router serves
    (benchmarks/http_client.py)."""

    def __init__(self, base_url: str, endpoint: str, model: str, sampling: dict,
                 max_connections: int | None = None, api_key: str | None = None):
        self.chat = endpoint.rstrip("/").endswith("chat/completions")
        self.url = base_url.rstrip("/") + endpoint
        self.model = model
        self.sampling = sampling  # temperature, top_p, top_k, ignore_eos: as given
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._session = None  # made inside the running loop, which it belongs to

    def payload(self, req: SampleRequest) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                **self.sampling}
        messages = is_messages(req.prompt)
        if self.chat:
            if not isinstance(req.prompt, str) and not messages:
                raise ValueError("chat takes text prompts, not token ids")
            body["messages"] = req.prompt if messages else \
                [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        elif messages:
            raise ValueError("/v1/completions takes a text or token-id prompt, not messages")
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        return body

    def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self._max_connections or 0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=60.0),
                read_bufsize=READ_BUFSIZE)
        return self._session

    async def send(self, req: SampleRequest) -> RequestRecord:
        body = orjson.dumps(self.payload(req))
        rec = RequestRecord(prompt_len=req.prompt_len, start=time.perf_counter())
        text = []
        try:
            async with self._client().post(self.url, data=body, headers=_JSON) as resp:
                if resp.status != 200:
                    detail = (await resp.read()).decode(errors="replace")
                    return _fail(rec, f"HTTP {resp.status}: {detail[:500]}")
                async for line in resp.content:  # one SSE line at a time
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        return _fail(rec, orjson.dumps(chunk["error"]).decode()[:500])
                    if chunk.get("usage"):
                        rec.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    choices = chunk.get("choices") or []
                    if choices:
                        c = choices[0]
                        delta = (c.get("delta") or {}).get("content") if self.chat \
                            else c.get("text")
                        if delta:
                            rec.chunk_times.append(now)
                            text.append(delta)
        except Exception as e:  # connection refused, reset, bad JSON...
            return _fail(rec, f"{type(e).__name__}: {e}")
        return _finished(rec, text)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


_JSON = {"Content-Type": "application/json"}
# aiohttp refuses an SSE line over twice its read buffer (64 KiB by default): one chunk
# carrying the tokens of a long stall, or long logprobs, can be longer.
READ_BUFSIZE = 4 << 20


def _finished(rec: RequestRecord, text: list[str]) -> RequestRecord:
    """Closes a record whose stream ended: a success if any content chunk came."""
    rec.end = time.perf_counter()
    rec.generated_text = "".join(text)
    rec.success = bool(rec.chunk_times)
    rec.error = "" if rec.success else NO_CHUNK
    return rec


class IngressBackend:
    """Submits over one DEALER (pdserve.client.AsyncQueueClient); ids as prompts go out
    as ``prompt_token_ids``, text as ``prompt``."""

    def __init__(self, address: str, sampling: dict):
        self.address = address
        self.sampling = sampling
        self._client = None

    async def send(self, req: SampleRequest) -> RequestRecord:
        from pdserve.client import AsyncQueueClient, Done, QueueError

        if self._client is None:  # made inside the running loop, which it belongs to
            self._client = AsyncQueueClient(self.address)
        prompt = {"prompt": req.prompt} if isinstance(req.prompt, str) \
            else {"prompt_token_ids": req.prompt}
        if is_messages(req.prompt):
            raise ValueError("the ingress takes a text or token-id prompt, not messages")
        rec = RequestRecord(prompt_len=req.prompt_len, start=time.perf_counter(),
                            chunk_tokens=[], output_ids=[])
        text = []
        try:
            rid = await self._client.submit(**prompt, max_tokens=req.output_len,
                                            **self.sampling)
            async for ev in self._client.stream(rid):
                now = time.perf_counter()
                if isinstance(ev, Done):
                    rec.output_tokens = int(ev.usage.get("completion_tokens") or 0)
                elif ev.token_ids:
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(len(ev.token_ids))
                    rec.output_ids += ev.token_ids
                    text.append(ev.text)
        except QueueError as e:
            return _fail(rec, f"{e.code}: {e.message}")
        except Exception as e:
            return _fail(rec, f"{type(e).__name__}: {e}")
        return _finished(rec, text)

    async def aclose(self) -> None:
        if self._client is not None:
            self._client.close()


async def first_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id of GET /v1/models (what --model defaults to)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession(headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=30.0)) as client:
            async with client.get(url) as resp:
                resp.raise_for_status()
                data = orjson.loads(await resp.read()).get("data") or []
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise RuntimeError(f"cannot list the served models at {url} ({e}); is the server "
                           "running there? Or pass --model") from None
    if not data:
        raise RuntimeError(f"{url} lists no model; pass --model")
    return data[0]["id"]
