"""The "Serving Benchmark Result" block in vLLM's layout, the saved JSON, the plot.

The layout and the JSON keys follow ``vllm bench serve`` so that scripts that
parse one parse the other. The JSON also carries every request's times
(``start_times``, ``ttfts``, ``itls``, ``latencies``; seconds from the
benchmark's start), from which metrics.records_from_result rebuilds the
records and so any figure of the report.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from pdserve.bench.metrics import Metrics, RequestRecord

WIDTH = 50
HEADERS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}


def _row(label: str, value, fmt: str = "") -> str:
    return f"{label:<40} {format(value, fmt):<10}"


def p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_report(m: Metrics, percentile_metrics=("ttft", "tpot", "itl"),
                  max_concurrency: int | None = None, request_rate: float = math.inf,
                  title: str = " Serving Benchmark Result ") -> list[str]:
    lines = [f"{title:=^{WIDTH}}",
             _row("Successful requests:", m.completed),
             _row("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [_row("Benchmark duration (s):", m.duration, ".2f"),
              _row("Total input tokens:", m.total_input),
              _row("Total generated tokens:", m.total_output),
              _row("Request throughput (req/s):", m.request_throughput, ".2f")]
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [_row("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              _row("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
              _row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")]
    for key in ("ttft", "tpot", "itl", "e2el"):
        if key not in percentile_metrics:
            continue
        name, header = HEADERS[key]
        s = m.stats[key]
        lines += [f"{header:-^{WIDTH}}",
                  _row(f"Mean {name} (ms):", s.mean, ".2f"),
                  _row(f"Median {name} (ms):", s.median, ".2f")]
        lines += [_row(f"P{p_word(p)} {name} (ms):", v, ".2f") for p, v in s.percentiles]
    lines.append("=" * WIDTH)
    return lines


def result_dict(m: Metrics, records: list[RequestRecord], percentile_metrics, **info) -> dict:
    """The saved result: ``info`` (run settings), totals, per-request data, statistics."""
    result = dict(info)
    result.update(
        duration=m.duration, completed=m.completed, failed=m.failed,
        total_input_tokens=m.total_input, total_output_tokens=m.total_output,
        request_throughput=m.request_throughput, request_goodput=m.request_goodput,
        output_throughput=m.output_throughput, total_token_throughput=m.total_token_throughput,
        max_output_tokens_per_s=m.max_output_tokens_per_s,
        max_concurrent_requests=m.max_concurrent_requests,
        input_lens=[r.prompt_len for r in records], output_lens=m.output_lens,
        ttfts=[r.ttft for r in records], itls=[r.itl for r in records],
        latencies=[r.latency for r in records], start_times=[r.start for r in records],
        chunk_tokens=[r.chunk_tokens for r in records],
        generated_texts=[r.generated_text for r in records],
        errors=[r.error for r in records])
    for key in ("ttft", "tpot", "itl", "e2el"):
        if key not in percentile_metrics:
            continue
        s = m.stats[key]
        result[f"mean_{key}_ms"] = s.mean
        result[f"median_{key}_ms"] = s.median
        result[f"std_{key}_ms"] = s.std
        for p, v in s.percentiles:
            result[f"p{p_word(p)}_{key}_ms"] = v
    return result


PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
               "chunk_tokens", "generated_texts", "errors")


def merge_results(results: list[dict], percentiles=(99.0,),
                  percentile_metrics=("ttft", "tpot", "itl", "e2el")) -> dict:
    """One result from saved results of runs made side by side (one client per router):
    their requests together, the longest run's duration, every figure computed again;
    settings from the first, ``num_prompts`` summed. Each run's times stay relative to
    its own start (clients started within moments of each other)."""
    from pdserve.bench.metrics import compute_metrics, records_from_result

    merged = {k: [x for r in results for x in (r.get(k) or [None] * len(r["errors"]))]
              for k in PER_REQUEST}
    records = records_from_result(merged)
    duration = max(r["duration"] for r in results)
    m = compute_metrics(records, duration, percentiles)
    info = {k: v for k, v in results[0].items() if k not in PER_REQUEST and
            not isinstance(v, list) and not k.endswith("_ms")}
    info["num_prompts"] = sum(r.get("num_prompts") or 0 for r in results)
    out = result_dict(m, records, percentile_metrics, **info)
    if all("conversation_index" in r for r in results):  # numbered apart, run after run
        base, convs = 0, []
        for r in results:
            convs += [base + c for c in r["conversation_index"]]
            base += max(r["conversation_index"], default=-1) + 1
        out.update(conversation_index=convs,
                   turn_index=[t for r in results for t in r["turn_index"]])
    return out


def save_result(path: str | Path, result: dict) -> Path:
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def require_matplotlib():
    """pyplot with a file-only backend; a clear error if matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib, which is not installed: "
                           "pip install matplotlib (or leave out --plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(path: str | Path, records: list[RequestRecord], title: str = "") -> Path:
    """Histograms of TTFT and ITL (ms), with median and p99 marked, to a PNG."""
    import numpy as np

    plt = require_matplotlib()
    ok = [r for r in records if r.success]
    series = {"TTFT": [r.ttft * 1000 for r in ok],
              "ITL": [g * 1000 for r in ok for g in r.itl]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, values) in zip(axes, series.items()):
        if values:
            ax.hist(values, bins=min(60, max(10, len(values) // 5)), color="#4878a8")
            for q, style in ((50, "--"), (99, ":")):
                v = float(np.percentile(values, q))
                ax.axvline(v, color="black", linestyle=style, label=f"p{q} {v:.1f} ms")
            ax.legend()
        ax.set_title(f"{name} ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
