"""``pdserve plan``: what a simulation profile predicts, and which P:D ratio serves a
workload best on it.

    pdserve plan --sim-profile h100-llama3-8b --show --prompt-len 1024 --batch 32 \\
        --context 2048 --json
    {"prefill_s": 0.0302, "decode_step_s": 0.0108}

    pdserve plan --sim-profile h100-llama3-8b --workload random --request-rate 40 \\
        --prompt-len 2048 --output-len 128 --slo-ttft 500 --slo-itl 50 --nodes 4,8

``--show`` is the roofline the simulated nodes sleep (sim/roofline.py), so that a run can
be held against it; no torch. The advisor (``--workload``) runs simulated clusters of
every ratio of each node count and recommends one (sim/advisor.py).
"""
from __future__ import annotations

import json

import click

from pdserve.engine.config import EngineConfig


def _counts(ctx, param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        counts = sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected node counts such as 4 or 4,6,8") \
            from None
    if counts[0] < 2 or counts[-1] > 64:
        raise click.BadParameter(f"{value!r}: each count must be 2..64 (at least one "
                                 "prefill and one decode node)")
    return counts


@click.command("plan")
@click.option("--sim-profile", required=True, metavar="NAME|FILE",
              help="A shipped profile's name or a profile file (docs/simulation.md).")
@click.option("--show", is_flag=True,
              help="Print the profile's predictions for one shape of work.")
@click.option("--prompt-len", type=click.IntRange(1), default=1024, show_default=True,
              help="Prompt tokens: of the prefill predicted (--show), of each request "
                   "(--workload random), of each new user message (multi-turn).")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True,
              help="--show: decode rows of the decode step predicted.")
@click.option("--context", type=click.IntRange(1), default=1024, show_default=True,
              help="--show: tokens of KV each decode row reads (its new one included).")
@click.option("--max-num-batched-tokens", type=click.IntRange(1),
              default=EngineConfig.max_num_batched_tokens, show_default=True,
              help="The nodes' chunk size: a longer prompt is prefilled in chunks.")
@click.option("--workload", type=click.Choice(["random", "multi-turn"]), default=None,
              help="Advise a P:D ratio for this workload (pdserve bench's datasets).")
@click.option("--request-rate", type=click.FloatRange(0, min_open=True), default=None,
              help="Advisor: the offered load, requests/s (Poisson arrivals).")
@click.option("--slo-ttft", type=click.FloatRange(0, min_open=True), default=None,
              metavar="MS", help="Advisor: the time to first token a good request meets.")
@click.option("--slo-itl", type=click.FloatRange(0, min_open=True), default=None,
              metavar="MS", help="Advisor: the p99 of a good request's inter-token gaps.")
@click.option("--nodes", callback=_counts, default="4", show_default=True,
              metavar="N[,N...]", help="Advisor: node counts to try, every P:D split of each.")
@click.option("--target", type=click.FloatRange(0, 1, min_open=True), default=0.95,
              show_default=True,
              help="Advisor: the share of requests within the SLO that makes a node count "
                   "enough.")
@click.option("--num-prompts", type=click.IntRange(1), default=200, show_default=True,
              help="Advisor: requests of each trial.")
@click.option("--output-len", type=click.IntRange(1), default=64, show_default=True,
              help="Advisor: tokens answered per request (EOS ignored).")
@click.option("--prefix-len", type=click.IntRange(0), default=0, show_default=True,
              help="Advisor: random, tokens every prompt shares; multi-turn, the system "
                   "prompt's.")
@click.option("--turns", type=click.IntRange(1), default=4, show_default=True,
              help="Advisor: turns of each multi-turn conversation.")
@click.option("--policy", default=None, help="Advisor: the router's policy [launch's default].")
@click.option("--sim-kv-bytes-scale", default="0.0078125", show_default=True,
              help="Advisor: the simulated KV's bytes scale (docs/simulation.md).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def plan_cmd(sim_profile, show, prompt_len, batch, context, max_num_batched_tokens,
             workload, request_rate, slo_ttft, slo_itl, nodes, target, num_prompts,
             output_len, prefix_len, turns, policy, sim_kv_bytes_scale, seed,
             as_json) -> None:
    """Predictions of a simulation profile (--show), or the P:D ratio and node count that
    serve a workload best under an SLO (--workload), from simulation runs."""
    from pdserve.sim import roofline as R
    from pdserve.sim.profile import load_profile

    if show == (workload is not None):
        raise click.UsageError("give either --show (the profile's predictions) or "
                               "--workload (the P:D advisor)")
    try:
        p = load_profile(sim_profile)
        capacity = R.kv_capacity_tokens(p)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sim-profile") from exc
    if workload is not None:
        missing = [f for f, v in (("--request-rate", request_rate), ("--slo-ttft", slo_ttft),
                                  ("--slo-itl", slo_itl)) if v is None]
        if missing:
            raise click.UsageError(f"--workload needs {', '.join(missing)}")
        _advise(sim_profile, p, workload, request_rate, slo_ttft, slo_itl, nodes, target,
                num_prompts, prompt_len, output_len, prefix_len, turns, policy,
                sim_kv_bytes_scale, seed, max_num_batched_tokens, as_json)
        return
    prefill = R.prefill_seconds(p, prompt_len, max_num_batched_tokens)
    decode = R.decode_step_seconds(p, batch, context)
    if as_json:
        click.echo(json.dumps({"prefill_s": prefill, "decode_step_s": decode}))
        return
    click.echo(f"{p.name}: {p.tensor_parallel} x {p.accelerator.name}, {p.model.name} "
               f"({R.num_params(p) / 1e9:.2f} B weights, {p.model.dtype})\n"
               f"  prefill of {prompt_len} tokens (chunks of {max_num_batched_tokens}): "
               f"{prefill * 1e3:.3f} ms\n"
               f"  decode step, {batch} rows x {context} tokens of context: "
               f"{decode * 1e3:.3f} ms ({batch / decode:.0f} tokens/s)\n"
               f"  KV capacity: {capacity} tokens "
               f"({R.kv_bytes_per_token(p) / 1024:.0f} KiB per token)")


def _advise(profile_arg, profile, kind, rate, slo_ttft, slo_itl, counts, target,
            num_prompts, prompt_len, output_len, prefix_len, turns, policy, kv_scale, seed,
            chunk_tokens, as_json) -> None:
    from pdserve.sim import advisor as A

    wl = A.Workload(kind, num_prompts, prompt_len, output_len, prefix_len, turns, rate, seed)
    slo = A.Slo(slo_ttft / 1e3, slo_itl / 1e3)
    launch_args = ("--sim-kv-bytes-scale", kv_scale,
                   "--max-num-batched-tokens", str(chunk_tokens),
                   *(("--policy", policy) if policy else ()))
    trials = []
    for prefill, decode in A.ratios(counts):
        click.echo(f"pdserve plan: {prefill}P{decode}D ...", err=True)
        try:
            trials.append(A.run_trial(profile_arg, profile, prefill, decode, wl, slo,
                                      launch_args, chunk_tokens))
        except (RuntimeError, TimeoutError) as exc:   # the cluster or the bench failed
            raise click.ClickException(f"{prefill}P{decode}D: {exc}") from exc
        t = trials[-1]
        click.echo(f"pdserve plan: {prefill}P{decode}D goodput {t.goodput_req_s} req/s",
                   err=True)
    best, met = A.recommend(trials, target)
    if as_json:
        click.echo(json.dumps(A.report(trials, best, met, rate, target)))
        return
    click.echo(f"{kind} workload at {rate:g} req/s, {num_prompts} requests a trial; SLO "
               f"TTFT {slo_ttft:g} ms, p99 ITL {slo_itl:g} ms; {profile.name}\n"
               f"{'P:D':>6} {'goodput/s':>10} {'good':>6} {'p50 TTFT':>9} {'p99 TTFT':>9} "
               f"{'queue':>8} {'p99 ITL':>8} {'failed':>6}")
    for t in trials:
        mark = "  <- recommended" if t is best else ""
        click.echo(f"{t.prefill:>3}:{t.decode:<2} {t.goodput_req_s:>10.2f} "
                   f"{t.good_share:>6.0%} {t.p50_ttft_ms:>7.0f}ms {t.p99_ttft_ms:>7.0f}ms "
                   f"{t.queue_ms:>6.0f}ms {t.p99_itl_ms:>6.0f}ms {t.failed:>6}{mark}")
    if met:
        click.echo(f"recommended: {best.prefill} prefill and {best.decode} decode nodes, the "
                   f"fewest nodes tried that serve {target:.0%} of the requests within the SLO")
    else:
        click.echo(f"no node count tried serves {target:.0%} of the requests within the SLO: "
                   f"the most goodput was {best.prefill}P{best.decode}D's; try more nodes "
                   "(--nodes)")
