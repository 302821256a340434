"""``pdserve bench``: the serving benchmark, with ``vllm bench serve``'s flag names.

Flags keep vLLM's names and defaults so that users' scripts carry over; what
pdserve adds is ``--ingress`` (the ZeroMQ queue ingress instead of HTTP),
``--plot`` and an optional file name after ``--save-result``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from datetime import datetime
from pathlib import Path

import click

AUTO = "\0auto"  # --save-result given without a file name
CHAT_ENDPOINT = "/v1/chat/completions"
# Defaults of the multi-turn flags, applied in _multi_turn_spec: the flags default to None so
# that one given with another dataset is an error, not silently ignored.
MULTI_TURN_DEFAULTS = {"multi_turn_turns": 4, "multi_turn_system_len": 512,
                       "multi_turn_user_len": 128, "multi_turn_shared_system": 1}


def _percentile_args(percentile_metrics: str, metric_percentiles: str):
    from pdserve.bench import metrics

    names = tuple(n.strip() for n in percentile_metrics.split(",") if n.strip())
    bad = [n for n in names if n not in metrics.METRICS]
    if bad or not names:
        raise click.BadParameter(f"{','.join(bad) or 'nothing'}: choose from "
                                 f"{','.join(metrics.METRICS)}", param_hint="--percentile-metrics")
    try:
        ps = [float(p) for p in metric_percentiles.split(",") if p.strip()]
    except ValueError:
        ps = []
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise click.BadParameter(f"{metric_percentiles!r}: comma-separated numbers in (0, 100], "
                                 "e.g. 50,90,99", param_hint="--metric-percentiles")
    return names, ps


def _backend_kind(backend, endpoint, ingress) -> str:
    kind = backend or ("ingress" if ingress else
                       "openai-chat" if endpoint.rstrip("/").endswith("chat/completions")
                       else "openai")
    kind = "openai" if kind == "vllm" else kind
    if kind == "ingress" and not ingress:
        raise click.UsageError("--backend ingress needs --ingress tcp://HOST:PORT")
    if kind != "ingress" and ingress:
        raise click.UsageError(f"--ingress and --backend {backend} exclude each other")
    chat = endpoint.rstrip("/").endswith("chat/completions")
    if kind == "openai-chat" and not chat:
        raise click.UsageError(f"--backend openai-chat needs --endpoint {CHAT_ENDPOINT}")
    if kind == "openai" and chat:
        raise click.UsageError("--backend openai takes /v1/completions; for chat use "
                               "--backend openai-chat or leave --backend out")
    return kind


def _tokenizer_dir(tokenizer, model, served: str | None) -> Path:
    """--tokenizer, else --model when it is a checkpoint folder or .gguf file, else the
    bundled default model when that is what is served (or nothing says otherwise)."""
    from pdserve.model.default_model import default_model_dir
    from pdserve.model.loader import model_name

    if tokenizer:
        return Path(tokenizer)
    if model and Path(model).exists():
        return Path(model)
    if served is None or served == model_name(default_model_dir()):
        return default_model_dir()
    raise click.UsageError(f"which tokenizer does model {served!r} use? Pass --tokenizer "
                           "CHECKPOINT_DIR (a folder with tokenizer.json)")


async def _run(o: dict) -> dict:
    # Here, not at the top: `pdserve` loads this module for every command, and numpy with it.
    from pdserve.bench import datasets, metrics, report, runner
    from pdserve.model.loader import model_name

    kind = _backend_kind(o["backend"], o["endpoint"], o["ingress"])
    base_url = o["base_url"] or f"http://{o['host']}:{o['port']}"
    model = o["model"]
    served = o["served_model_name"] or (model_name(model) if model and Path(model).exists()
                                        else model)
    if kind != "ingress" and served is None:
        served = await backends_mod().first_model(base_url, o["api_key"])
        click.echo(f"Model not given; the server's first model: {served}")
    tok_dir = _tokenizer_dir(o["tokenizer"], model, served)
    try:
        tok = datasets.load_tokenizer(tok_dir)
    except Exception as e:  # no tokenizer.json, not a folder...
        raise click.UsageError(f"cannot load a tokenizer from {tok_dir}: {e}") from None
    chat = kind == "openai-chat"
    reqs, convs = _workload(o, tok, chat)
    probe = reqs[0] if reqs else datasets.random_requests(  # not a conversation's: no hit
        tok, 1, convs[0].user_tokens[0], convs[0].output_lens[0], seed=o["seed"] + 1,
        as_text=chat)[0]

    sampling = {"temperature": o["temperature"], "ignore_eos": o["ignore_eos"]}
    sampling.update({k: o[k] for k in ("top_p", "top_k") if o[k] is not None})
    b = backends_mod()
    backend = b.IngressBackend(o["ingress"], sampling) if kind == "ingress" else \
        b.OpenAIBackend(base_url, o["endpoint"], served, sampling, o["max_concurrency"],
                        o["api_key"])
    try:
        if o["ready_check_timeout_sec"]:
            await _ready_check(backend, probe, o["ready_check_timeout_sec"],
                               o["ingress"] if kind == "ingress" else base_url)
        if o["num_warmups"]:
            click.echo(f"Warming up with {o['num_warmups']} requests...")
            await runner.run_requests(backend, [probe] * o["num_warmups"],
                                      max_concurrency=o["max_concurrency"], progress=False)
        click.echo("Starting main benchmark run...")
        click.echo(f"Traffic request rate: {o['request_rate']}")
        dist = "Poisson process" if o["burstiness"] == 1.0 else "Gamma distribution"
        click.echo(f"Burstiness factor: {o['burstiness']} ({dist})")
        click.echo(f"Maximum request concurrency: {o['max_concurrency']}")
        pace = (o["request_rate"], o["burstiness"], o["max_concurrency"], o["seed"])
        if convs:
            records, turns, duration = await runner.run_conversations(
                backend, convs, lambda text: tok.encode(text, add_special_tokens=False),
                *pace, progress=not o["disable_tqdm"])
        else:
            records, duration = await runner.run_requests(backend, reqs, *pace,
                                                          progress=not o["disable_tqdm"])
    finally:
        await backend.aclose()

    m = metrics.compute_metrics(records, duration, o["percentiles"], o["goodput_slo"] or None)
    failed = [r.error for r in records if not r.success]
    if failed:
        click.echo(f"Failed requests ({len(failed)}; the first 10):")
        for i, err in enumerate(failed[:10]):
            click.echo(f"Error {i}: {err}")
    for line in report.format_report(m, o["metric_names"], o["max_concurrency"],
                                     o["request_rate"]):
        click.echo(line)
    info = dict(date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend=kind,
                label=o["label"] or kind, model_id=served, tokenizer_id=str(tok_dir),
                endpoint=o["ingress"] if kind == "ingress" else base_url + o["endpoint"],
                dataset_name=o["dataset_name"], num_prompts=o["num_prompts"],
                request_rate=o["request_rate"] if not math.isinf(o["request_rate"]) else "inf",
                burstiness=o["burstiness"], max_concurrency=o["max_concurrency"],
                goodput=o["goodput_slo"] or None)
    if convs:  # which conversation and turn each request was, in the result's order
        info.update(multi_turn=dataclasses.asdict(o["multi_turn"]),
                    conversation_index=[c for c, _ in turns], turn_index=[t for _, t in turns])
    info.update(o["metadata"])
    return dict(metrics=m, records=records,
                result=report.result_dict(m, records, o["metric_names"], **info))


def _workload(o: dict, tok, chat: bool):
    """(requests, []) for random and sharegpt; ([], conversations) for multi-turn."""
    from pdserve.bench import datasets, multi_turn

    output_len = o["output_len"] or o["random_output_len"]
    if o["dataset_name"] == "multi-turn":
        convs = multi_turn.conversations(tok, o["num_prompts"], o["multi_turn"], o["seed"],
                                         chat)
        click.echo(f"{len(convs)} conversations of up to {o['multi_turn'].turns} turns; the "
                   f"longest prompt can reach {o['multi_turn'].longest_prompt()} tokens")
        return [], convs
    if o["dataset_name"] == "random":
        return datasets.random_requests(
            tok, o["num_prompts"], o["input_len"] or o["random_input_len"], output_len,
            o["random_range_ratio"], o["random_prefix_len"], o["seed"], as_text=chat), []
    if not o["dataset_path"]:
        raise click.UsageError("--dataset-name sharegpt needs --dataset-path FILE.json")
    return datasets.sharegpt_requests(o["dataset_path"], tok, o["num_prompts"],
                                      o["output_len"] or o["sharegpt_output_len"],
                                      o["seed"], chat=chat), []


def _multi_turn_spec(o: dict):
    """The multi-turn flags, checked; None for another dataset (which takes none)."""
    from pdserve.bench.multi_turn import MultiTurnSpec

    given = [f"--{k.replace('_', '-')}" for k in MULTI_TURN_DEFAULTS if o[k] is not None]
    if o["dataset_name"] != "multi-turn":
        if given:
            raise click.UsageError(f"{', '.join(given)}: only with --dataset-name multi-turn")
        return None
    if o["input_len"]:
        raise click.UsageError("--input-len sets random prompts; multi-turn user messages "
                               "take --multi-turn-user-len")
    v = {k: d if o[k] is None else o[k] for k, d in MULTI_TURN_DEFAULTS.items()}
    spec = MultiTurnSpec(v["multi_turn_turns"], v["multi_turn_system_len"],
                         v["multi_turn_user_len"], o["output_len"] or o["random_output_len"],
                         v["multi_turn_shared_system"], o["random_range_ratio"])
    try:
        spec.check()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return spec


async def _ready_check(backend, req, timeout_s: float, where: str) -> None:
    """One request first, so that a wrong address or model fails in seconds, not after
    the whole run (a ZeroMQ connect to nobody never fails by itself)."""
    click.echo("Starting initial single prompt test run...")
    try:
        rec = await asyncio.wait_for(backend.send(req), timeout_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"no answer from {where} in {timeout_s:g} s: is the server "
                           "running there? (--ready-check-timeout-sec 0 skips this check)"
                           ) from None
    if not rec.success:
        raise RuntimeError(f"the initial test request failed: {rec.error}")
    click.echo("Initial test run completed.")


def backends_mod():
    from pdserve.bench import backends  # aiohttp and zmq load only when a run starts
    return backends


def _result_path(o: dict, result: dict) -> Path:
    name = o["save_result"] if o["save_result"] not in (None, AUTO) else o["result_filename"]
    if not name:
        conc = f"-concurrency{o['max_concurrency']}" if o["max_concurrency"] else ""
        model = str(result["model_id"] or "ingress").split("/")[-1]
        name = f"{result['label']}-{o['request_rate']}qps{conc}-{model}-{result['date']}.json"
    return Path(o["result_dir"] or ".") / name


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--backend", type=click.Choice(["openai", "openai-chat", "vllm", "ingress"]),
              default=None, help="[default: from --endpoint / --ingress]")
@click.option("--base-url", default=None, help="Server URL [default: http://HOST:PORT].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--endpoint", type=click.Choice(["/v1/completions", CHAT_ENDPOINT]),
              default="/v1/completions", show_default=True)
@click.option("--ingress", default=None,
              help="Benchmark the ZeroMQ queue ingress at this address (tcp://HOST:PORT) "
                   "instead of HTTP.")
@click.option("--api-key", default=lambda: os.environ.get("OPENAI_API_KEY"),
              help="Bearer key for the HTTP API [default: $OPENAI_API_KEY].")
@click.option("--model", default=None, help="Served model name, or a checkpoint folder "
              "(its name is sent, its tokenizer used) [default: the first of /v1/models].")
@click.option("--served-model-name", default=None, help="Name to send if not --model's.")
@click.option("--tokenizer", default=None, help="Checkpoint folder whose tokenizer builds the "
              "prompts [default: --model's folder, else the bundled default model's].")
@click.option("--dataset-name", type=click.Choice(["random", "sharegpt", "multi-turn"]),
              default="random", show_default=True,
              help="multi-turn: chat conversations whose turns resend the history (the "
              "prompt before, the server's answer, a new user message), each turn sent once "
              "the one before is answered; --num-prompts counts turns, --request-rate and "
              "--max-concurrency pace turns. Token ids on /v1/completions and the ingress, "
              "messages on chat.")
@click.option("--dataset-path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="ShareGPT JSON file.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=None,
              help="Overrides --random-input-len.")
@click.option("--output-len", type=click.IntRange(min=1), default=None,
              help="Overrides --random-output-len / --sharegpt-output-len.")
@click.option("--random-input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--random-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True, help="Lengths uniform in [L*(1-r), L*(1+r)].")
@click.option("--random-prefix-len", type=click.IntRange(min=0), default=0, show_default=True,
              help="Random tokens shared by every prompt, before its own input-len.")
@click.option("--multi-turn-turns", type=int, default=None,
              help=f"Turns per conversation [default: "
              f"{MULTI_TURN_DEFAULTS['multi_turn_turns']}].")
@click.option("--multi-turn-system-len", type=int, default=None,
              help=f"Tokens of the system prompt that starts each conversation (0: none) "
              f"[default: {MULTI_TURN_DEFAULTS['multi_turn_system_len']}].")
@click.option("--multi-turn-user-len", type=int, default=None,
              help=f"Tokens of each turn's new user message, with --random-range-ratio "
              f"[default: {MULTI_TURN_DEFAULTS['multi_turn_user_len']}]; answers are "
              "--random-output-len (--output-len) long.")
@click.option("--multi-turn-shared-system", type=int, default=None,
              help="Conversations that share one system prompt (1: each its own) "
              f"[default: {MULTI_TURN_DEFAULTS['multi_turn_shared_system']}].")
@click.option("--sharegpt-output-len", type=click.IntRange(min=1), default=None,
              help="Output length for every ShareGPT prompt [default: its reply's].")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Most requests in flight at once [default: no limit].")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), default=math.inf,
              show_default=True, help="Requests/s (inf: all at once).")
@click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Gamma shape of the gaps: 1 is Poisson, <1 burstier.")
@click.option("--ignore-eos", is_flag=True, default=False)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None)
@click.option("--top-k", type=click.IntRange(min=-1), default=None)
@click.option("--goodput", multiple=True, metavar="KEY:MS ...",
              help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:10000.")
@click.option("--percentile-metrics", default="ttft,tpot,itl", show_default=True,
              help="Of ttft,tpot,itl,e2el.")
@click.option("--metric-percentiles", default="99", show_default=True, help="E.g. 50,90,99.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--num-warmups", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--ready-check-timeout-sec", type=click.FloatRange(min=0), default=60.0,
              show_default=True, help="Send one request first and wait this long for it; "
              "0 skips the check.")
@click.option("--disable-tqdm", is_flag=True, default=False, help="No progress bar.")
@click.option("--save-result", is_flag=False, flag_value=AUTO, default=None, metavar="[FILE]",
              help="Save the result as JSON [default name: LABEL-RATEqps-MODEL-DATE.json].")
@click.option("--result-dir", default=None, help="Folder for the saved result.")
@click.option("--result-filename", default=None, help="File name of the saved result.")
@click.option("--label", default=None, help="Label of the result [default: the backend].")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Saved with the result.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Draw TTFT and ITL distributions to this PNG (needs matplotlib).")
@click.argument("rest", nargs=-1, metavar="")
def bench_cmd(rest, **o) -> None:
    """Benchmark a running server: requests/s, TTFT, TPOT, ITL, as vllm bench serve."""
    from pdserve.bench import metrics, report
    # vLLM's --goodput and --metadata take several values (`--goodput ttft:1 tpot:2`);
    # click gives an option one, and leaves the others here.
    more_goodput = [a for a in rest if ":" in a and "=" not in a and o["goodput"]]
    more_meta = [a for a in rest if "=" in a and o["metadata"]]
    for extra in rest:
        if extra not in more_goodput and extra not in more_meta:
            raise click.UsageError(f"unexpected argument {extra!r}")
    try:
        o["goodput_slo"] = metrics.parse_goodput([*o["goodput"], *more_goodput])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--goodput") from None
    o["metric_names"], o["percentiles"] = _percentile_args(o["percentile_metrics"],
                                                           o["metric_percentiles"])
    meta = {}
    for item in [*o["metadata"], *more_meta]:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--metadata")
        meta[key] = value
    o["metadata"] = meta
    o["multi_turn"] = _multi_turn_spec(o)
    if o["plot"]:
        try:
            report.require_matplotlib()  # fail now, not after the run
        except RuntimeError as e:
            raise click.UsageError(str(e)) from None
    try:
        out = asyncio.run(_run(o))
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    if o["save_result"] is not None or o["result_filename"]:
        path = report.save_result(_result_path(o, out["result"]), out["result"])
        click.echo(f"Saved the result to {path}")
    if o["plot"]:
        report.plot(o["plot"], out["records"], title=f"{out['result']['label']} "
                    f"({out['result']['model_id'] or 'ingress'})")
        click.echo(f"Plotted TTFT and ITL to {o['plot']}")
