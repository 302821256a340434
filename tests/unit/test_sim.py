"""The simulated accelerator: profiles are checked field by field, the roofline's numbers
are worked out here by hand from the published figures, and the runner sleeps what the
roofline says and emits a token stream that two nodes continue alike."""
import json
import math
import subprocess
import sys

import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.engine.sim_runner import SimRunner, output_length, sim_dtype
from pdserve.sim import roofline as R
from pdserve.sim.profile import (
    load_profile,
    profile_from_dict,
    scaled_head_dim,
    shipped_profiles,
    sim_identity,
)

H100 = load_profile("h100-llama3-8b")
# Llama 3 8B by hand: q and o 4096 x 4096, k and v 4096 x 1024, MLP 3 x 4096 x 14336.
LAYER = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
EMBED = 128256 * 4096


def test_the_shipped_profiles_load_and_say_where_their_figures_come_from():
    assert shipped_profiles() == ["a100-llama3-8b", "h100-llama3-70b", "h100-llama3-8b",
                                  "h200-llama3-8b"]
    for name in shipped_profiles():
        p = load_profile(name)
        assert p.name == name and any("datasheet" in s for s in p.sources)
        assert any("config.json" in s for s in p.sources)
    assert load_profile("h100-llama3-70b").tensor_parallel == 4
    assert (H100.accelerator.peak_flops, H100.accelerator.memory_bandwidth) == (989e12, 3.35e12)


def test_llama3_8b_weights_and_kv_by_hand():
    assert LAYER == 218_103_808
    assert R.num_params(H100) == 32 * LAYER + 2 * EMBED == 8_029_995_008  # Meta: "8B"
    assert R.weight_bytes_read(H100) == (32 * LAYER + EMBED) * 2
    assert R.kv_bytes_per_token(H100) == 2 * 32 * 8 * 128 * 2 == 131_072
    # 90 % of 80 GB, less the weights, in tokens of 128 KiB
    assert R.kv_capacity_tokens(H100) == int((72e9 - 8_029_995_008 * 2) // 131_072) == 426_788


def test_prefill_and_decode_times_by_hand():
    flops = 2 * 1000 * LAYER * 32 + 2 * EMBED + 4 * 32 * 32 * 128 * 1000 * (1001 / 2)
    weights = (32 * LAYER + EMBED) * 2
    expected = flops / (989e12 * 0.6) + weights / (3.35e12 * 0.8)
    assert R.prefill_seconds(H100, 1000) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.029568, abs=1e-6)
    # decode: the weights and 32 rows x 1000 tokens of KV, over bandwidth, + 2 ms
    step = (weights + 32 * 1000 * 131_072) / (3.35e12 * 0.8) + 0.002
    assert R.decode_step_seconds(H100, 32, 1000) == pytest.approx(step, rel=1e-12)
    assert step == pytest.approx(0.0091655, abs=1e-6)
    # chunks: the second chunk pays the first's KV as context (attention and reads)
    two = R.prefill_seconds(H100, 1000, chunk_tokens=500)
    assert two == pytest.approx(
        R.step_seconds(H100, [R.Chunk(500, 0, False)], [])
        + R.step_seconds(H100, [R.Chunk(500, 500, True)], []))
    assert two > R.prefill_seconds(H100, 1000)   # the weights are read twice


def test_tensor_parallel_divides_by_the_ranks():
    p = load_profile("h100-llama3-70b")
    layer = 8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672
    weights = (80 * layer + EMBED * 2) * 2
    assert R.decode_step_seconds(p, 1, 1) == pytest.approx(
        (weights + 2 * 80 * 8 * 128 * 2) / (4 * 3.35e12 * 0.8) + 0.002)


def test_a_bad_profile_is_refused_with_the_field_named(tmp_path):
    good = json.loads(json.dumps(
        {"accelerator": {"name": "g", "peak_flops": 1e12, "memory_bandwidth": 1e11,
                         "memory_bytes": 1e10},
         "model": {"name": "m", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                   "head_dim": 8, "hidden_size": 32, "intermediate_size": 64,
                   "vocab_size": 100, "max_model_len": 256},
         "roofline": {"compute_efficiency": 0.5, "bandwidth_efficiency": 0.5,
                      "step_overhead_s": 0}}))
    assert profile_from_dict(good).model.dtype == "bfloat16"
    cases = [({"roofline": {**good["roofline"], "compute_efficiency": 1.5}},
              "roofline.compute_efficiency must be in (0, 1]"),
             ({"model": {**good["model"], "num_heads": 3}}, "multiple of num_kv_heads"),
             ({"model": {**good["model"], "head_dims": 8}}, "unknown field(s) ['head_dims']"),
             ({"accelerator": {"name": "g"}}, "'peak_flops' is missing"),
             ({"eos": {"kind": "poisson"}}, "eos.kind must be one of"),
             ({"tensor_parallel": "4"}, "'tensor_parallel' must be int")]
    for change, words in cases:
        with pytest.raises(ValueError) as err:
            profile_from_dict({**good, **change})
        assert words in str(err.value)
    path = tmp_path / "mine.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="neither a file nor one of the shipped"):
        load_profile("h100-llama9")


def test_kv_scale_shrinks_head_dim_and_is_part_of_the_identity():
    assert scaled_head_dim(H100, 1.0) == 128 and scaled_head_dim(H100, 1 / 16) == 8
    assert scaled_head_dim(H100, 1e-9) == 1
    assert sim_identity(H100, 1.0) != sim_identity(H100, 1 / 16)
    # accelerators may differ in one fleet: the identity is the model's
    assert sim_identity(H100, 1.0) == sim_identity(load_profile("a100-llama3-8b"), 1.0)


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def runner(profile=H100, clock=None, vocab=1000, eos=(2,)):
    from types import SimpleNamespace
    cfg = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=1,
                          vocab_size=vocab, eos_token_ids=eos)
    clock = clock or FakeClock()
    return SimRunner(profile, cfg, 8, 16, sim_dtype(profile), sleep=clock.sleep,
                     clock=lambda: clock.now), clock


def prompt_batch(n=100, **params):
    seq = Sequence("r", list(range(10, 10 + n)), SamplingParams(max_tokens=50, **params))
    return seq, ScheduledBatch([seq], [n])


def test_the_runner_sleeps_the_predicted_step_and_ships_kv_layer_by_layer():
    run, clock = runner()
    seq, batch = prompt_batch()
    fired = []
    out = run.execute(batch, on_layer=lambda layer: fired.append((layer, clock.now)))
    predicted = R.prefill_seconds(H100, 100)
    assert clock.now - 100.0 == pytest.approx(predicted)
    assert [layer for layer, _ in fired] == [0, 1, 2, 3]
    assert fired[1][1] - 100.0 == pytest.approx(predicted / 2)   # half the layers, half the time
    assert out[0] is not None
    # back to back: the next step starts where the last one ended on the clock, so Python
    # time between steps (here 1 ms) is absorbed
    seq.token_ids.append(out[0])
    seq.num_computed_tokens = 100
    clock.now += 0.001
    run.execute(ScheduledBatch([seq], [1]))
    assert clock.now - 100.0 == pytest.approx(predicted + R.decode_step_seconds(H100, 1, 101))
    # after idle time a new prompt starts when it came, not in the past
    clock.now += 1.0
    start = clock.now
    run.execute(ScheduledBatch([Sequence("s", [5] * 100, SamplingParams())], [100]))
    assert clock.now - start == pytest.approx(predicted)


def test_the_stream_is_seeded_and_two_nodes_continue_it_alike():
    a, _ = runner()
    b, _ = runner()
    seq_a, _ = prompt_batch()
    seq_b, _ = prompt_batch()
    first = a.token(seq_a)
    seq_a.token_ids.append(first)
    seq_b.token_ids.append(first)       # the decode node's copy, first token from prefill
    assert [a.token(seq_a)] == [b.token(seq_b)]
    other, _ = prompt_batch(seed=7)
    tokens = set()
    for _ in range(20):
        t = a.token(other)
        other.token_ids.append(t)
        tokens.add(t)
    assert len(tokens) > 10 and all(250 <= t < 750 and t != 2 for t in tokens)


def eos_profile(**eos):
    return profile_from_dict({**json.loads(json.dumps({
        "accelerator": vars(H100.accelerator), "model": vars(H100.model),
        "roofline": vars(H100.roofline)})), "eos": eos})


def outputs_until_eos(run, seq, limit=100):
    for _ in range(limit):
        t = run.token(seq)
        seq.token_ids.append(t)
        if t == 2:
            break
    return seq.num_output_tokens


def test_eos_follows_the_profile_and_the_request():
    run, _ = runner(eos_profile(kind="fixed", tokens=7))
    assert outputs_until_eos(run, prompt_batch()[0]) == 7
    assert outputs_until_eos(run, prompt_batch(min_tokens=12)[0]) == 13
    assert outputs_until_eos(run, prompt_batch(ignore_eos=True)[0], limit=30) == 30
    never, _ = runner(eos_profile(kind="never"))
    assert outputs_until_eos(never, prompt_batch()[0], limit=40) == 40
    import random
    geo = eos_profile(kind="geometric", mean_tokens=50)
    lengths = [output_length(geo, random.Random(i)) for i in range(4000)]
    assert min(lengths) >= 1 and sum(lengths) / len(lengths) == pytest.approx(50, rel=0.08)
    uni = eos_profile(kind="uniform", min_tokens=3, max_tokens=5)
    assert {output_length(uni, random.Random(i)) for i in range(200)} == {3, 4, 5}
    assert math.isinf(output_length(eos_profile(kind="never"), random.Random(0)))


def test_plan_prints_the_roofline_s_predictions():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", "--sim-profile",
                          "h100-llama3-8b", "--show", "--prompt-len", "1000", "--batch", "32",
                          "--context", "1000", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"prefill_s": pytest.approx(0.029568, abs=1e-6),
                   "decode_step_s": pytest.approx(0.0091655, abs=1e-6)}
    bad = subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", "--sim-profile",
                          "nope", "--show"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "shipped profiles" in bad.stderr


def test_router_and_node_agree_on_what_a_simulated_node_announces():
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.worker import Worker
    from pdserve.router.core import sim_expectation

    for scale in (1.0, 1 / 128):
        w = Worker(EngineConfig(compute="simulated", sim_profile="h100-llama3-70b",
                                sim_kv_bytes_scale=scale, sim_token_space=(1000, (2,), 4096)))
        identity, shape = sim_expectation("h100-llama3-70b", scale)
        lay = w.kv_layout()
        assert (lay.num_layers, lay.num_kv_heads, lay.head_dim) == shape
        assert (lay.dtype, w.identity().config_hash) == ("bfloat16", identity.config_hash)
        assert w.model is None and w.num_blocks == R.kv_capacity_tokens(w.profile) // 16
        assert w.max_model_len == 4096   # the tokenizer's context caps the profile's 8192
    assert sim_expectation("h100-llama3-70b", 1.0) != sim_expectation("h100-llama3-70b", 0.5)
    with pytest.raises(ValueError, match="needs sim_profile"):
        EngineConfig(compute="simulated")
    with pytest.raises(ValueError, match="is for compute 'simulated'"):
        EngineConfig(sim_profile="h100-llama3-8b")


def test_a_router_admits_simulated_nodes_of_its_profile_only():
    from pdserve.common import protocol as P
    from pdserve.router.core import sim_expectation
    from pdserve.router.dispatch.registry import Registry

    def hello(profile, scale, compute="simulated"):
        identity, (layers, heads, dim) = sim_expectation(profile, scale)
        return P.Hello(node_id="p", role="prefill", protocol_version=P.PROTOCOL_VERSION,
                       model=identity, compute=compute, pid=1,
                       kv_layout=P.KVLayout(num_layers=layers, num_kv_heads=heads,
                                            head_dim=dim, dtype="bfloat16", block_size=16),
                       capacity=P.NodeStats(num_free_blocks=8, num_total_blocks=8,
                                            num_running=0, num_waiting=0,
                                            queued_prompt_tokens=0))
    identity, shape = sim_expectation("h100-llama3-8b", 1 / 128)
    registry = Registry(identity, *shape, heartbeat_interval_s=1.0, liveness=3)
    assert registry.admit(hello("a100-llama3-8b", 1 / 128)) == (True, "")  # another GPU
    ok, why = registry.admit(hello("h100-llama3-8b", 1.0))
    assert not ok and "--sim-kv-bytes-scale" in why
    ok, why = registry.admit(hello("h100-llama3-70b", 1 / 128))
    assert not ok and "sim-llama3-70b" in why
    real = Registry(P.ModelIdentity(name="SmolLM2", config_hash="abc"), 30, 3, 64, 1.0, 3)
    ok, why = real.admit(hello("h100-llama3-8b", 1 / 128))
    assert not ok and "give the router the same --sim-profile" in why
