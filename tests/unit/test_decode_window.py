"""CPU decode windows (engine/decode_window.py) against gathering the pages every step:
the same tokens and logprobs, bit for bit, while the batch changes, over the memory
budget, after a forward that failed half way, and when a sequence's pages change under
it. A real tiny model, no mocks."""
import math
import random

import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def engine_of(model_dir, **kw) -> Engine:
    cfg = dict(model=str(model_dir), block_size=4, num_kv_blocks=1024, max_num_seqs=8,
               max_num_batched_tokens=64, enable_prefix_caching=False)
    return Engine(EngineConfig(**{"dtype": "float32", **cfg, **kw}), detokenize=False)


# (arrival step, prompt length, tokens wanted): sequences join and finish at different
# steps, so the batch changes many times and stays the same in between.
WORKLOAD = [(0, 7, 30), (0, 21, 12), (0, 3, 45), (5, 30, 20), (5, 11, 8), (14, 2, 25),
            (30, 40, 10)]


def run(engine: Engine, fail_at_step: int | None = None,
        refills: list[int] | None = None) -> dict[str, list]:
    """Runs WORKLOAD to the end; returns each request's (token, logprob) pairs.
    ``refills`` gets the windows' refill count after each step."""
    got: dict[str, list] = {}
    step = 0
    while engine.has_unfinished() or step <= WORKLOAD[-1][0]:
        for i, (at, n, wanted) in enumerate(WORKLOAD):
            if at == step:
                prompt = [(7 * i + 3 * j) % 97 + 3 for j in range(n)]
                engine.add_request(str(i), prompt, SamplingParams(
                    max_tokens=wanted, temperature=0, ignore_eos=True, logprobs=0))
        if step == fail_at_step:
            fail_one_forward(engine)
        for out in engine.step():
            got.setdefault(out.req_id, []).append(
                (out.new_token_ids, list(out.logprobs.token_logprobs)))
        if refills is not None:
            refills.append(engine.runner.decode_windows.refills)
        step += 1
    return got


def fail_one_forward(engine: Engine) -> None:
    """The next decode step's forward raises half way through the layers (its windows
    have taken the new token in some layers only). Nothing else changes: scheduling a
    decode batch again reserves nothing more, so the next step runs the same batch."""
    assert not engine.scheduler.waiting
    inputs = engine.runner.prepare(engine.scheduler.schedule())
    assert inputs.meta.kind == "decode"

    def boom(layer):
        if layer == 1:
            raise RuntimeError("injected")
    with pytest.raises(RuntimeError, match="injected"):
        engine.runner.forward(inputs, on_layer=boom)


def test_windows_give_the_bits_of_the_page_gather_while_the_batch_changes(model_dir):
    windowed, gathered = engine_of(model_dir), engine_of(model_dir, decode_window_memory_gb=0)
    assert gathered.runner.decode_windows is None
    assert run(windowed) == run(gathered)
    stats = windowed.runner.decode_windows
    # Refilled at each change of the batch, appended in between: both paths ran.
    assert stats.refills >= 5 and stats.appends > 3 * stats.refills


def test_over_the_budget_the_step_gathers_the_pages(model_dir):
    reference = run(engine_of(model_dir, decode_window_memory_gb=0))
    tight = engine_of(model_dir, decode_window_memory_gb=1e-6)  # 1 KiB: no batch fits
    assert run(tight) == reference
    assert tight.runner.decode_windows.refills == tight.runner.decode_windows.appends == 0


def test_a_forward_that_failed_half_way_leaves_no_stale_window(model_dir):
    reference = run(engine_of(model_dir, decode_window_memory_gb=0))
    steady, failing = [], []
    assert run(engine_of(model_dir), refills=steady) == reference
    assert steady[20] == steady[19]  # step 20 appends when nothing fails
    assert run(engine_of(model_dir), fail_at_step=20, refills=failing) == reference
    assert failing[20] == failing[19] + 1  # after the failure it refills


def test_decode_window_budget_must_not_be_negative(model_dir):
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError,
                           match="decode_window_memory_gb must be a finite number >= 0"):
            EngineConfig(decode_window_memory_gb=bad)


def shared_prefix_run(model_dir, window_gb, num_kv_blocks: int, seed: int) -> dict[str, list]:
    """Requests that share prompt prefixes, arriving at random, on a KV cache so small
    that the scheduler preempts: a preempted sequence can be readmitted in the same
    schedule with its prefix taken from the cache, in another request's blocks."""
    rng = random.Random(seed)
    engine = engine_of(model_dir, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True,
                       decode_window_memory_gb=window_gb)
    base = [rng.randrange(3, 90) for _ in range(9)]
    got: dict[str, list] = {}
    sent = 0
    for _ in range(400):
        if sent < 12 and rng.random() < 0.3:
            prompt = (base[:rng.choice([5, 8, 9])] if rng.random() < 0.6 else
                      [rng.randrange(3, 90) for _ in range(rng.randrange(2, 12))])
            engine.add_request(str(sent), prompt, SamplingParams(
                max_tokens=rng.randrange(5, 30), temperature=0, ignore_eos=True, logprobs=0))
            sent += 1
        for out in engine.step():
            got.setdefault(out.req_id, []).append(
                (out.new_token_ids, list(out.logprobs.token_logprobs)))
        if sent == 12 and not engine.has_unfinished():
            break
    assert len(got) == 12
    return got


@pytest.mark.parametrize("num_kv_blocks", [12, 16, 24])
def test_windows_follow_a_sequence_whose_pages_change_under_it(model_dir, num_kv_blocks):
    """Prefix caching on (the default) and a full cache: the same bits as the gather."""
    for seed in range(4):
        assert (shared_prefix_run(model_dir, 0.05, num_kv_blocks, seed)
                == shared_prefix_run(model_dir, 0, num_kv_blocks, seed)), seed
