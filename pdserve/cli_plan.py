"""``pdserve plan``: what a simulation profile predicts, from the same roofline the
simulated nodes sleep (sim/roofline.py), so that a run can be held against it.

    pdserve plan --sim-profile h100-llama3-8b --show --prompt-len 1024 --batch 32 \\
        --context 2048 --json
    {"prefill_s": 0.0302, "decode_step_s": 0.0108}

No torch. The advisor (--workload, --slo-ttft, --slo-itl: a recommended P:D ratio from
simulation runs) is not built yet (issue 32).
"""
from __future__ import annotations

import json

import click

from pdserve.engine.config import EngineConfig


@click.command("plan")
@click.option("--sim-profile", required=True, metavar="NAME|FILE",
              help="A shipped profile's name or a profile file (docs/simulation.md).")
@click.option("--show", is_flag=True,
              help="Print the profile's predictions for one shape of work.")
@click.option("--prompt-len", type=click.IntRange(1), default=1024, show_default=True,
              help="Prompt tokens of the prefill predicted.")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True,
              help="Decode rows of the decode step predicted.")
@click.option("--context", type=click.IntRange(1), default=1024, show_default=True,
              help="Tokens of KV each decode row reads (its new one included).")
@click.option("--max-num-batched-tokens", type=click.IntRange(1),
              default=EngineConfig.max_num_batched_tokens, show_default=True,
              help="The nodes' chunk size: a longer prompt is prefilled in chunks.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def plan_cmd(sim_profile, show, prompt_len, batch, context, max_num_batched_tokens,
             as_json) -> None:
    """Predictions of a simulation profile (--show); the P:D advisor is not built yet."""
    from pdserve.sim import roofline as R
    from pdserve.sim.profile import load_profile

    if not show:
        raise click.UsageError("only --show is built: the advisor (--workload, --slo-ttft, "
                               "--slo-itl) is not yet")
    try:
        p = load_profile(sim_profile)
        capacity = R.kv_capacity_tokens(p)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sim-profile") from exc
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
