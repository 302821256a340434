"""The serving report's numbers, computed from per-request timestamps only.

Pure (numpy, no I/O) so that every figure can be checked by hand. Definitions
are vLLM's (``vllm bench serve``), so numbers compare across the two tools:

- TTFT: from sending the request to its first content chunk.
- TPOT: ``(latency - TTFT) / (output_tokens - 1)``, only for requests with
  more than one output token.
- ITL: every gap between consecutive content chunks, pooled over requests.
- E2EL: from sending to the response being complete.
- Peak output throughput: the most output tokens seen in one 1-second bin,
  bins counted from the first request's start.
- Peak concurrent requests: the most requests in flight at once, each in
  flight over ``[start, start + latency)``.
- Goodput: completed requests per second that met every given SLO (ms);
  a request with one output token counts TPOT 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds on one clock."""
    prompt_len: int
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    chunk_tokens: list[int] | None = None  # tokens per chunk; None: one each (SSE text)
    output_tokens: int = 0                 # the server's count (usage); 0: count the chunks
    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_ids: list[int] | None = None    # the answer's ids, where the backend sends them

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency(self) -> float:
        return self.end - self.start if self.success else 0.0

    @property
    def num_output_tokens(self) -> int:
        if self.output_tokens:
            return self.output_tokens
        return sum(self.chunk_tokens) if self.chunk_tokens is not None else len(self.chunk_times)


@dataclass
class Stat:
    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value)


@dataclass
class Metrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    request_goodput: float | None  # None: no --goodput given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]         # per request, 0 for a failed one
    stats: dict[str, Stat]         # "ttft", "tpot", "itl", "e2el"; values in ms


def stat_ms(values_s: list[float], percentiles) -> Stat:
    """Mean, median, std and percentiles in ms; all 0 for no values (as vLLM prints)."""
    v = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    return Stat(float(np.mean(v)), float(np.median(v)), float(np.std(v)),
                [(float(p), float(np.percentile(v, p))) for p in percentiles])


def peak_output_tokens_per_s(records: list[RequestRecord]) -> float:
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start for r in ok)
    bins: dict[int, int] = {}
    for r in ok:
        counts = r.chunk_tokens if r.chunk_tokens is not None else [1] * len(r.chunk_times)
        for t, n in zip(r.chunk_times, counts):
            b = int(t - t0)
            bins[b] = bins.get(b, 0) + n
    return float(max(bins.values(), default=0))


def peak_concurrency(records: list[RequestRecord]) -> int:
    events = []
    for r in records:
        if r.success:
            events += [(r.start, 1), (r.end, -1)]
    events.sort()  # at equal times -1 sorts first: the intervals are half-open
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def parse_goodput(pairs) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (also comma- or space-joined) -> {"ttft": 500.0, ...} ms."""
    slo: dict[str, float] = {}
    for item in pairs:
        for pair in item.replace(",", " ").split():
            name, sep, value = pair.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = None
            if not sep or ms is None:
                raise ValueError(f"goodput {pair!r}: expected KEY:MILLISECONDS, e.g. ttft:500")
            if name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"goodput {pair!r}: KEY must be ttft, tpot or e2el")
            if ms < 0:
                raise ValueError(f"goodput {pair!r}: the value must be >= 0 ms")
            slo[name] = ms
    return slo


def compute_metrics(records: list[RequestRecord], duration: float,
                    percentiles=(99.0,), goodput: dict[str, float] | None = None) -> Metrics:
    ttfts, tpots, itls, e2els, output_lens = [], [], [], [], []
    total_input = good = 0
    for r in records:
        if not r.success:
            output_lens.append(0)
            continue
        n = r.num_output_tokens
        output_lens.append(n)
        total_input += r.prompt_len
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        ttfts.append(r.ttft)
        itls += r.itl
        e2els.append(r.latency)
        if goodput and all(goodput[k] / 1000.0 >= v for k, v in
                           (("ttft", r.ttft), ("tpot", tpot), ("e2el", r.latency))
                           if k in goodput):
            good += 1
    completed = len(e2els)
    total_output = sum(output_lens)
    return Metrics(
        completed=completed, failed=len(records) - completed, total_input=total_input,
        total_output=total_output, duration=duration,
        request_throughput=completed / duration,
        request_goodput=good / duration if goodput else None,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_output_tokens_per_s(records),
        max_concurrent_requests=peak_concurrency(records), output_lens=output_lens,
        stats={"ttft": stat_ms(ttfts, percentiles), "tpot": stat_ms(tpots, percentiles),
               "itl": stat_ms(itls, percentiles), "e2el": stat_ms(e2els, percentiles)})


def goodput(result: dict, slo_ttft_s: float, slo_itl_s: float) -> float:
    """Requests per second of a saved result (report.result_dict) that completed with a TTFT
    of at most ``slo_ttft_s`` and the 99th percentile of their own inter-token gaps at most
    ``slo_itl_s`` (a request with one chunk meets the ITL SLO): the SLO of the fleet
    benchmarks and of ``pdserve plan``'s advisor. Per request, unlike ``--goodput``'s
    TPOT, so that one long stall inside a stream counts against the request it hit."""
    good = 0
    for ttft, itl, err in zip(result["ttfts"], result["itls"], result["errors"]):
        if err or ttft is None or ttft > slo_ttft_s:
            continue
        if not itl or float(np.percentile(itl, 99)) <= slo_itl_s:
            good += 1
    return good / result["duration"] if result["duration"] > 0 else 0.0


def records_from_result(result: dict) -> list[RequestRecord]:
    """Rebuilds the records of a saved result (report.result_dict), to recompute any figure."""
    records = []
    chunk_tokens = result.get("chunk_tokens") or [None] * len(result["start_times"])
    for i, start in enumerate(result["start_times"]):
        ok = not result["errors"][i]
        times = []
        if ok:
            t = start + result["ttfts"][i]
            times = [t]
            for gap in result["itls"][i]:
                t += gap
                times.append(t)
        records.append(RequestRecord(
            prompt_len=result["input_lens"][i], start=start,
            end=start + result["latencies"][i], chunk_times=times,
            chunk_tokens=chunk_tokens[i], output_tokens=result["output_lens"][i],
            success=ok, error=result["errors"][i],
            generated_text=result["generated_texts"][i]))
    return records
