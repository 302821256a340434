"""A simulation profile of this machine's CPU serving a checkpoint, measured here: the real
engine's step times, fitted to the roofline the simulated nodes sleep (sim/roofline.py).

    python -m pdserve.sim.calibrate --threads 1 --out cpu.json
    pdserve launch --compute simulated --sim-profile cpu.json --sim-kv-bytes-scale 1

1. Build the Engine a node builds (the checkpoint, dtype, torch threads: give the count
   ``pdserve launch`` gives each node, cores / nodes), prefix caching off so that every
   prompt is computed.
2. Per prompt length: one request to warm up (oneDNN builds its primitives for each new
   row count), then ``repeats`` requests, each a prefill step and ``decode_steps`` decode
   steps at batch 1, every ``Engine.step`` timed whole (scheduler, forward, sampling and
   the step's Python): what a node's latency is made of at low load.
3. Fit the medians, relative error, coefficients >= 0::

       prefill(n) = FLOPs(n) * f + weight_bytes * b
       decode(c)  = (weight_bytes + c * kv_bytes_per_token) * b + step_overhead_s

   1/f and 1/b are the FLOP/s and bytes/s the engine reaches. A big GEMM and a big read
   measure the CPU's own (``peak_flops``, ``memory_bandwidth``); the efficiencies are the
   ratios (a fitted rate above the micro-benchmark's raises the peak, efficiency 1).
4. The profile: the checkpoint's own shape, dtype and tie_word_embeddings; memory_bytes
   such that its KV capacity is the real node's (--kv-cache-memory-gb, in blocks); the
   points measured and fitted in ``sources``.
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from pdserve.common import cpuinfo
from pdserve.sim import roofline as R
from pdserve.sim.profile import DTYPE_BYTES, profile_from_dict

DEFAULT_PROMPT_LENS = (16, 64, 128)
MAX_FIT_ERROR = 0.25   # measured here, the points are within ~2 % of the fit


@dataclass(frozen=True)
class StepTimes:
    """Median seconds of a step: a prefill by prompt length, a batch-1 decode step by
    context (the tokens of KV it reads, its own included)."""
    prefill: dict[int, float]
    decode: dict[int, float]


@dataclass(frozen=True)
class Fit:
    seconds_per_flop: float
    seconds_per_byte: float
    step_overhead_s: float


# -- measuring --------------------------------------------------------------------------------
def measure_steps(engine, prompt_lens=DEFAULT_PROMPT_LENS, decode_steps: int = 4,
                  repeats: int = 5) -> StepTimes:
    """Times ``engine``'s steps (an Engine with prefix caching off): per prompt length, one
    warm-up request, then ``repeats`` of a prefill and ``decode_steps`` decode steps. The
    decode steps after prompts of n tokens are one point, at their middle context."""
    from pdserve.common.sampling import SamplingParams

    params = SamplingParams(max_tokens=1 + decode_steps, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    prefill: dict[int, list[float]] = {}
    decode: dict[int, list[float]] = {}
    k = 0
    for n in prompt_lens:
        for rep in range(repeats + 1):
            k += 1   # distinct prompts, from the middle of the vocabulary (no special ids)
            ids = [vocab // 4 + (k * 7919 + i * 31) % (vocab // 2) for i in range(n)]
            engine.add_request(f"calibrate-{k}", ids, params)
            times = []
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            if rep == 0:
                continue   # warm-up
            prefill.setdefault(n, []).append(times[0])
            # decode step j reads n + 1 + j tokens: pooled at their middle context, the
            # roofline being linear in it
            decode.setdefault(n + 1 + (decode_steps - 1) // 2, []).extend(times[1:])
    return StepTimes({n: statistics.median(v) for n, v in prefill.items()},
                     {c: statistics.median(v) for c, v in decode.items()})


def hardware_peaks(dtype: str, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s of a 1024^3 GEMM in ``dtype``, bytes/s of summing a 256 MiB float32 tensor),
    the best of ``repeats``, on torch's current threads."""
    import torch

    a = torch.randn(1024, 1024).to(getattr(torch, dtype))
    b = torch.randn(1024, 1024).to(a.dtype)
    x = torch.ones(64 * 2**20)   # 256 MiB: far beyond the caches
    gemm, read = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        gemm.append(time.perf_counter() - start)
        start = time.perf_counter()
        x.sum()
        read.append(time.perf_counter() - start)
    return 2 * 1024**3 / min(gemm), x.numel() * 4 / min(read)


# -- fitting (pure arithmetic) ---------------------------------------------------------------
def _solve(rows: list[list[float]], ys: list[float], cols: list[int]) -> list[float] | None:
    """Least squares over the columns ``cols`` (the others 0), by the normal equations;
    None when they are singular."""
    k = len(cols)
    a = [[sum(r[i] * r[j] for r in rows) for j in cols] + [sum(r[i] * y for r, y in
                                                              zip(rows, ys))] for i in cols]
    for p in range(k):   # Gauss-Jordan with partial pivoting
        piv = max(range(p, k), key=lambda i: abs(a[i][p]))
        if abs(a[piv][p]) < 1e-300:
            return None
        a[p], a[piv] = a[piv], a[p]
        for i in range(k):
            if i != p:
                f = a[i][p] / a[p][p]
                a[i] = [x - f * y for x, y in zip(a[i], a[p])]
    out = [0.0] * len(rows[0])
    for p, i in enumerate(cols):
        out[i] = a[p][k] / a[p][p]
    return out


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """argmin ||rows x - ys|| over x >= 0, for a handful of columns: the best least-squares
    solution over every subset of free columns that comes out non-negative."""
    n = len(rows[0])
    best, best_err = [0.0] * n, sum(y * y for y in ys)
    for mask in range(1, 2 ** n):
        x = _solve(rows, ys, [i for i in range(n) if mask >> i & 1])
        if x is None or min(x) < 0:
            continue
        err = sum((sum(r_i * x_i for r_i, x_i in zip(r, x)) - y) ** 2
                  for r, y in zip(rows, ys))
        if err < best_err:
            best, best_err = x, err
    return best


def fit_roofline(profile, times: StepTimes) -> Fit:
    """The roofline's coefficients for ``profile``'s model that best fit ``times``, each
    point weighted by 1/its time (relative error); ValueError when the times do not
    fit a roofline (a rate fitted as infinite, or a point missed by over MAX_FIT_ERROR).
    """
    w = R.weight_bytes_read(profile)
    kv = R.kv_bytes_per_token(profile)
    rows, ys = [], []
    for n, t in sorted(times.prefill.items()):
        rows.append([R.chunk_flops(profile, n, 0, True) / t, w / t, 0.0])
        ys.append(1.0)
    for c, t in sorted(times.decode.items()):
        rows.append([0.0, (w + c * kv) / t, 1.0 / t])
        ys.append(1.0)
    x = nnls(rows, ys)
    worst = max(abs(sum(r_i * x_i for r_i, x_i in zip(r, x)) - 1) for r in rows)
    if x[0] <= 0 or x[1] <= 0 or worst > MAX_FIT_ERROR:
        raise ValueError(f"the step times measured do not fit the roofline (seconds per "
                         f"FLOP {x[0]:g}, per byte {x[1]:g}, a point missed by "
                         f"{worst:.0%}): prefill {times.prefill}, decode {times.decode}")
    return Fit(*x)


# -- the profile ------------------------------------------------------------------------------
def model_section(engine) -> dict:
    """The profile's ``model``: the engine's checkpoint's shape, dtype and embeddings."""
    from pdserve.model.identity import model_name

    cfg = engine.model_config
    return {"name": model_name(engine.model_dir), "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "max_model_len": engine.max_model_len,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "tie_word_embeddings": bool(cfg.tie_word_embeddings)}


def build_profile(name: str, accelerator: str, model: dict, times: StepTimes,
                  peaks: tuple[float, float], kv_cache_bytes: int,
                  sources: list[str] = ()) -> dict:
    """The profile dict (docs/simulation.md's file format) fitted to ``times``;
    ``peaks``: hardware_peaks'; ``kv_cache_bytes``: the real node's KV cache, in whole
    blocks (the simulated node gets as many)."""
    draft = {"name": name, "accelerator": {"name": accelerator, "peak_flops": 1.0,
                                           "memory_bandwidth": 1.0, "memory_bytes": 1.0},
             "model": model, "tensor_parallel": 1,
             "roofline": {"compute_efficiency": 1.0, "bandwidth_efficiency": 1.0,
                          "step_overhead_s": 0.0, "memory_utilization": 1.0}}
    p = profile_from_dict(draft, name)
    fit = fit_roofline(p, times)
    flops, bandwidth = 1 / fit.seconds_per_flop, 1 / fit.seconds_per_byte
    peak_flops, peak_bw = max(peaks[0], flops), max(peaks[1], bandwidth)
    weights = R.num_params(p) * DTYPE_BYTES[p.model.dtype]
    draft["accelerator"].update(peak_flops=peak_flops, memory_bandwidth=peak_bw,
                                memory_bytes=float(weights + kv_cache_bytes))
    draft["roofline"].update(compute_efficiency=flops / peak_flops,
                             bandwidth_efficiency=bandwidth / peak_bw,
                             step_overhead_s=fit.step_overhead_s)
    draft["eos"] = {"kind": "geometric", "mean_tokens": 256.0}
    p = profile_from_dict(draft, name)
    fitted = [f"prefill {n}: {t * 1e3:.1f} ms (fit {R.prefill_seconds(p, n) * 1e3:.1f})"
              for n, t in sorted(times.prefill.items())]
    fitted += [f"decode at context {c}: {t * 1e3:.1f} ms "
               f"(fit {R.decode_step_seconds(p, 1, c) * 1e3:.1f})"
               for c, t in sorted(times.decode.items())]
    draft["sources"] = [*sources,
                        "step times measured (medians) and fitted: " + "; ".join(fitted),
                        f"micro-benchmarks: {peaks[0] / 1e9:.1f} GFLOP/s (1024^3 GEMM), "
                        f"{peaks[1] / 1e9:.2f} GB/s (256 MiB read)",
                        "eos is not measured: the geometric default"]
    return draft


def calibrate(model: str | None = None, dtype: str = "float32", threads: int | None = None,
              prompt_lens=DEFAULT_PROMPT_LENS, decode_steps: int = 4, repeats: int = 5,
              kv_cache_memory_gb: float | None = None, name: str | None = None) -> dict:
    """A profile (a dict in docs/simulation.md's file format) of this CPU serving
    ``model`` (None: the bundled one) in ``dtype`` on ``threads`` torch threads (None:
    torch's choice), from the real engine's step times measured here. The simulated node's
    KV capacity is a real node's with --kv-cache-memory-gb (None: the default)."""
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.model_runner import kv_bytes_per_block

    config = EngineConfig(model=model, dtype=dtype, threads=threads,
                          enable_prefix_caching=False,
                          **({} if kv_cache_memory_gb is None
                             else {"kv_cache_memory_gb": kv_cache_memory_gb}))
    engine = Engine(config, detokenize=False)
    times = measure_steps(engine, prompt_lens, decode_steps, repeats)
    peaks = hardware_peaks(str(engine.dtype).removeprefix("torch."))
    kv_cache_bytes = engine.num_blocks * kv_bytes_per_block(engine.model_config,
                                                            config.block_size, engine.dtype)
    model_part = model_section(engine)
    threads = torch.get_num_threads()
    name = name or f"cpu-{model_part['name'].lower()}-{threads}t"
    today = datetime.date.today().isoformat()
    return build_profile(
        name, f"{cpuinfo.describe()}, {threads} torch thread(s)", model_part, times, peaks,
        kv_cache_bytes,
        [f"measured by pdserve.sim.calibrate on {today}: the real engine (torch "
         f"{torch.__version__}, {threads} thread(s), {model_part['dtype']}, cpu_linear "
         f"{engine.runner.linear}) serving {engine.model_dir}",
         f"KV capacity: a real node's {engine.num_blocks} blocks of {config.block_size} "
         f"tokens (memory_bytes = the weights + that cache, memory_utilization 1)"])


@click.command("calibrate")
@click.option("--model", default=None, metavar="PATH",
              help="Checkpoint folder or .gguf file (default: the bundled model).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "auto"]),
              default="float32", show_default=True, help="The weights' and the KV's dtype.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="torch threads: what each node gets (pdserve launch: cores / nodes).")
@click.option("--prompt-lens", default=",".join(map(str, DEFAULT_PROMPT_LENS)),
              show_default=True, help="Prompt lengths to time, comma-separated.")
@click.option("--decode-steps", type=click.IntRange(1), default=4, show_default=True,
              help="Decode steps timed after each prefill.")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True,
              help="Requests per prompt length (after one to warm up); medians are fitted.")
@click.option("--kv-cache-memory-gb", type=click.FloatRange(0, min_open=True), default=None,
              help="The real nodes' --kv-cache-memory-gb: the simulated KV capacity.")
@click.option("--name", default=None, help="The profile's name.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Where to write the profile (JSON); default: standard output.")
def main(model, dtype, threads, prompt_lens, decode_steps, repeats, kv_cache_memory_gb,
         name, out) -> None:
    """Measure this CPU serving a checkpoint and write a simulation profile of it."""
    try:
        lens = tuple(int(x) for x in prompt_lens.split(","))
        if len(lens) < 2 or min(lens) < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{prompt_lens!r}: two or more positive integers, "
                                 "comma-separated", param_hint="--prompt-lens") from None
    try:
        profile = calibrate(model, dtype, threads, lens, decode_steps, repeats,
                            kv_cache_memory_gb, name)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    text = json.dumps(profile, indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)
        click.echo(f"wrote {out}: " + profile["sources"][-3], err=True)


if __name__ == "__main__":
    main()
