"""The native decode step from its token ids, with its greedy pick
(kernels/native/decode_step.c with a lookup and a Q8_0 head): the embedding's rows and the
rotary tables looked up in C give the torch lookups' bits; each row's token is the index
torch's max gives over the head's logits of the step's own output, the first of equal
logits, at batch sizes across the row tiles and on one to three threads (the vocabulary's
chunks taken by whichever thread is free); a NaN logit hands the row back to the logits;
ids and positions out of range are refused; the engine samples as before wherever a
request needs the logits."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import native

pytestmark = pytest.mark.skipif(native.why_unavailable() is not None,
                                reason=f"native kernels: {native.why_unavailable()}")

from pdserve.engine.inputs import build_model_inputs, decode_slots  # noqa: E402 (after the skip)
from pdserve.kernels.native import q8_gemm  # noqa: E402
from pdserve.model.q8_head import Q8Embedding, Q8Head  # noqa: E402
from tests.unit.test_native_decode_step import (  # noqa: E402
    BLOCK,
    SHAPES,
    kv_caches,
    random_int4_model,
)

VOCAB = 1000   # 62.5 blocks of 16: a padded last block


def with_q8_head(model, vocab: int = VOCAB, q8_embedding: bool = False):
    """The model with a random Q8_0 head of ``vocab`` rows (a multiple of 4) in which
    every row has three equal ones: rows come in equal pairs (2i, 2i + 1; a block's lanes)
    and the second half repeats the first (another block, another thread's share). The
    first must win. ``q8_embedding``: the embedding is the head's table too (tied, as the
    default model's), else the model's bfloat16 one. Its step is rebuilt."""
    gen = torch.Generator().manual_seed(vocab)
    hidden = model.config.hidden_size
    q = torch.randint(-127, 128, (vocab // 4, hidden), generator=gen, dtype=torch.int8)
    d = torch.rand(vocab // 4, hidden // 32, generator=gen) / 500
    q, d = q.repeat_interleave(2, 0), d.repeat_interleave(2, 0)
    table = Q8Embedding(q8_gemm.pack(torch.cat([q, q]), torch.cat([d, d])), vocab)
    model.lm_head = Q8Head(table)
    if q8_embedding:
        model.model.embed_tokens = table
    model.native_step, why = model._native_step()
    assert why is None and model.native_step.head is not None
    assert model.native_step.lookup is not None
    return model


def decode_case(model, batch: int, context: int, seed: int):
    """A decode step of ``batch`` sequences over random cached context: (ids, positions,
    block tables, slots) as lists, the same as ModelInputs, and the KV caches."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = (context + 5 * batch) // BLOCK + 2
    caches = kv_caches(model, batch * per_seq)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    # each sequence's pages in reverse order: the kernel must follow the tables
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(batch)]
    ids = torch.randint(3, 256, (batch,), generator=gen).tolist()
    positions = [context + 5 * i for i in range(batch)]
    lists = (ids, positions, tables, decode_slots(positions, tables, BLOCK))
    inputs = build_model_inputs([[t] for t in ids], positions, tables, [True] * batch, BLOCK,
                                native_decode=True)
    return lists, inputs, caches


def on_threads(threads: int, fn, *args):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            return fn(*args)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3, 9])
@pytest.mark.parametrize("q8_embedding", [True, False], ids=["q8-embedding", "bf16-embedding"])
def test_a_step_from_its_token_ids_is_the_tensor_paths_bits(q8_embedding, batch, threads):
    """decode_greedy looks the embedding's rows and the rotary tables up in C: the hidden
    states and the KV cache are those of the step fed the torch lookups' tensors."""
    model = with_q8_head(random_int4_model(*SHAPES["smollm2"]), q8_embedding=q8_embedding)
    lists, inputs, caches = decode_case(model, batch, 40 + 100 * batch, batch + threads)
    twin = [(k.clone(), v.clone()) for k, v in caches]
    want = on_threads(threads, model, inputs.input_ids, inputs.positions, inputs.meta, twin)
    hidden, tokens = on_threads(threads, model.decode_greedy, *lists, caches)
    assert torch.equal(hidden, want)
    for (k, v), (wk, wv) in zip(caches, twin):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    assert tokens == model.compute_logits(want).max(dim=-1).indices.tolist()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_each_rows_pick_is_the_first_largest_logit(batch, threads):
    model = with_q8_head(random_int4_model(*SHAPES["mha_d64"]))
    lists, _, caches = decode_case(model, batch, 40, batch * 10 + threads)
    hidden, tokens = on_threads(threads, model.decode_greedy, *lists, caches)
    logits = model.compute_logits(hidden)
    assert tokens == logits.max(dim=-1).indices.tolist()
    assert all(t < VOCAB // 2 and t % 2 == 0 for t in tokens)   # of equal logits, the first
    assert len(set(logits.max(dim=-1).values.tolist())) == batch  # rows differ


def test_a_nan_logit_hands_the_row_back_to_the_logits():
    model = with_q8_head(random_int4_model(*SHAPES["mha_d64"]))
    packed = model.lm_head.table.packed
    scales = packed[7, 0, 512:544].view(torch.float16)      # block 7: outputs 112..127
    scales[3] = float("nan")                                # output 115, every row
    lists, _, caches = decode_case(model, 3, 40, 5)
    hidden, tokens = on_threads(2, model.decode_greedy, *lists, caches)
    assert tokens is None
    assert torch.isnan(model.compute_logits(hidden)[:, 115]).all()


def test_steps_one_after_another_and_after_the_weights_move_keep_the_tensor_paths_bits():
    """decode fills one set of inputs a batch size from step to step: a step after a
    longer sequence's (its table's row left with the longer one's blocks past its own),
    one past the room the inputs had, and one after the weights' memory moved (the
    embedding and head with them, then given new values) have the tensor path's bits."""
    from pdserve.engine.host_memory import into_huge_pages

    model = with_q8_head(random_int4_model(*SHAPES["smollm2"]), q8_embedding=True)
    for i, context in enumerate([300, 40, 700, 40]):
        if i == 3:
            model.place_streamed_weights(into_huge_pages)
            packed = model.lm_head.table.packed
            fresh = with_q8_head(random_int4_model(*SHAPES["smollm2"]), vocab=VOCAB - 4)
            packed.copy_(fresh.lm_head.table.packed)  # new values, where they now lie
        lists, inputs, caches = decode_case(model, 2, context, 60 + i)
        twin = [(k.clone(), v.clone()) for k, v in caches]
        want = on_threads(2, model, inputs.input_ids, inputs.positions, inputs.meta, twin)
        hidden, tokens = on_threads(2, model.decode_greedy, *lists, caches)
        assert torch.equal(hidden, want), f"step {i}"
        assert tokens == model.compute_logits(want).max(dim=-1).indices.tolist()

def test_tokens_the_tables_and_the_cache_do_not_hold_are_refused():
    """Ids, positions, block tables and slots out of range: an IndexError, nothing
    computed or stored (the kernel trusts what it is given)."""
    model = with_q8_head(random_int4_model(*SHAPES["mha_d64"]), q8_embedding=True)
    (ids, positions, tables, slots), _, caches = decode_case(model, 2, 40, 9)
    before = [(k.clone(), v.clone()) for k, v in caches]
    rotary, blocks = model.cos_sin.shape[0], caches[0][0].shape[0]
    bad = {"a token id": ([ids[0], VOCAB], positions, tables, slots),
           "a negative id": ([-1, ids[1]], positions, tables, slots),
           "a position": (ids, [positions[0], rotary], tables, slots),
           "a position past int32": (ids, [positions[0], 2**31 - 2], tables, slots),
           "a slot": (ids, positions, tables, [slots[0], blocks * BLOCK]),
           "a short table": (ids, positions, [tables[0], tables[1][:2]], slots),
           "an empty table": (ids, positions, [tables[0], []], slots),
           "a block past the cache": (ids, positions, [tables[0], [blocks] * 9], slots)}
    for what, case in bad.items():
        with pytest.raises(IndexError, match="out of range|does not hold"):
            model.decode_greedy(*case, caches)
            pytest.fail(what)
    with pytest.raises(ValueError, match="1 ids, 2 positions"):
        model.decode_greedy(ids[:1], positions, tables, slots, caches)
    for (k, v), (k0, v0) in zip(caches, before):   # nothing was computed or stored
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_the_engine_samples_as_before_where_a_request_reads_the_logits():
    """The bundled model: a greedy request beside one asking for logprobs, one sampling
    with a seed, one with a repetition penalty, and beside another greedy one: the same
    tokens and logprobs with the pick, without it (the step's head taken away: the logits
    from the step's output), and on the runner's general path (its ModelInputs, the torch
    lookups, the logits and the sampler)."""
    from pdserve import LLM, SamplingParams
    from pdserve.model.default_model import bundled_model

    path, why = bundled_model()
    if path is None:
        pytest.skip(f"no bundled model: {why}")
    llm = LLM(dtype="bfloat16", quantization="auto", enable_prefix_caching=False)
    step = llm.engine.model.native_step
    assert step is not None and step.head is not None
    prompts = ["The capital of France is", "def fib(n):"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    beside = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3,
                             ignore_eos=True)]
    model, runner, head, runs = llm.engine.model, llm.engine.runner, step.head, []
    decode_greedy, picked = model.decode_greedy, []

    def counted(*args):  # which batches the step picked the tokens of
        out = decode_greedy(*args)
        picked.append(out is not None and out[1] is not None)
        return out

    model.decode_greedy = counted
    try:
        for step.head, general in ((head, False), (None, False), (head, True)):
            if general:
                runner._decode_greedy = lambda batch: None
            batches = []
            for other in beside:
                batches.append(llm.generate(prompts, [greedy, other]))
                assert not any(picked)   # a request reads the logits: no pick, no step call
            batches.append(llm.generate(prompts, greedy))   # every row greedy: the pick
            # 11 decode steps after each prefill, picked where the step has its head
            assert picked == ([] if general else [step.head is not None] * 11), picked
            picked.clear()
            runs.append([[(o.token_ids, o.logprobs) for o in b] for b in batches])
    finally:
        step.head = head
        vars(runner).pop("_decode_greedy", None)
        vars(model).pop("decode_greedy", None)
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0][1][1] is not None   # the logprobs asked for


def test_a_team_smaller_than_asked_still_does_every_threads_share():
    """OMP_THREAD_LIMIT=1 with two threads asked for: the step's team has one thread, which
    takes the missing thread's share of every phase (a subprocess: the limit is read once)."""
    code = """
import torch
from tests.unit.test_native_greedy_pick import (SHAPES, decode_case, on_threads,
                                                random_int4_model, with_q8_head)
model = with_q8_head(random_int4_model(*SHAPES["smollm2"]), q8_embedding=True)
lists, inputs, caches = decode_case(model, 3, 300, 1)
twin = [(k.clone(), v.clone()) for k, v in caches]
step, model.native_step = model.native_step, None
want = on_threads(2, model, inputs.input_ids, inputs.positions, inputs.meta, twin)
model.native_step = step
hidden, tokens = on_threads(2, model.decode_greedy, *lists, caches)
assert torch.equal(hidden, want)
assert tokens == model.compute_logits(want).max(dim=-1).indices.tolist()
print("same")
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_THREAD_LIMIT": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("same"), done.stderr[-3000:]
