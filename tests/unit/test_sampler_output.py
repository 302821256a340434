"""Sampler, sampling-parameter checks, input building and stop handling."""
import random

import pytest
import torch

from pdserve.common.sampling import SamplingParams
from pdserve.engine.inputs import build_model_inputs
from pdserve.engine.sampler import make_generator, sample
from pdserve.model.attention import DECODE, MIXED, PREFILL
from pdserve.model.text import RequestOutputState


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(lg, params):
    gens = [make_generator(p, "cpu") for p in params]
    return sample(lg, params, gens)


def test_greedy_and_top_k_1_are_argmax():
    lg = logits()
    want = lg.argmax(-1).tolist()
    assert draw(lg, [SamplingParams(temperature=0)] * 4) == want
    assert draw(lg, [SamplingParams(temperature=1.5, top_k=1, seed=3)] * 4) == want


def test_same_seed_same_tokens_whatever_the_batch():
    lg = logits(rows=6)
    p = SamplingParams(temperature=1.0, seed=42)
    runs = [[draw(lg[i:i + 1], [p])[0] for _ in range(3)] for i in range(6)]
    assert all(len(set(r)) == 1 for r in runs)
    # the same row, sampled beside other rows, gives the same token
    mixed = draw(lg, [p, SamplingParams(temperature=0.7), p, SamplingParams(temperature=0),
                      p, SamplingParams(temperature=2.0, top_p=0.5)])
    assert mixed[0] == runs[0][0] and mixed[2] == runs[2][0] and mixed[4] == runs[4][0]


def test_top_k_and_top_p_restrict_the_choices():
    lg = logits(rows=1, vocab=100)
    top3 = set(lg[0].topk(3).indices.tolist())
    got = {draw(lg, [SamplingParams(temperature=5.0, top_k=3, seed=s)])[0] for s in range(60)}
    assert got <= top3 and len(got) > 1
    probs = lg[0].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    # the smallest set whose mass reaches 0.5
    mass, allowed = 0.0, set()
    for t in order:
        allowed.add(t)
        mass += probs[t].item()
        if mass >= 0.5:
            break
    got = {draw(lg, [SamplingParams(temperature=1.0, top_p=0.5, seed=s)])[0] for s in range(60)}
    assert got <= allowed


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens=0 is invalid"),
    ({"temperature": -1}, "temperature=-1 is invalid"),
    ({"top_p": 0}, "top_p=0 is invalid"),
    ({"top_k": -2}, "top_k=-2 is invalid"),
    ({"stop": [""]}, "stop="),
    ({"stop_token_ids": [-1]}, "stop_token_ids="),
])
def test_bad_sampling_params_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_build_model_inputs_mixed_batch():
    # seq 0: decode token at position 20; seq 1: prefill chunk of 3 at 0; seq 2: chunk at 4
    inp = build_model_inputs([[9], [1, 2, 3], [5, 6]], [20, 0, 4],
                             [[7, 3], [1], [2, 4]], [True, False, True], block_size=16)
    assert inp.input_ids.tolist() == [9, 1, 2, 3, 5, 6]
    assert inp.positions.tolist() == [20, 0, 1, 2, 4, 5]
    assert inp.meta.kind == MIXED
    assert inp.meta.cu_seqlens_q.tolist() == [0, 1, 4, 6]
    assert inp.meta.seq_lens.tolist() == [21, 3, 6]
    # position 20 of seq 0 is block 3 (its second block), offset 4
    assert inp.meta.slot_mapping.tolist() == [3 * 16 + 4, 16, 17, 18, 2 * 16 + 4, 2 * 16 + 5]
    assert inp.logits_indices.tolist() == [0, 5] and inp.sample_rows == [0, 2]
    assert inp.meta.block_tables.tolist() == [[7, 3], [1, 0], [2, 4]]
    assert inp.meta.decode_gather is None  # only a decode step shares one across layers
    decode = build_model_inputs([[1], [2]], [3, 5], [[0], [1]], [True, True], 16).meta
    assert decode.kind == DECODE
    # built once for the step: sequence i's pages, then block 0 where it has none
    assert decode.decode_gather.blocks.tolist() == [0, 1]
    assert decode.decode_gather.max_len == 6 and decode.decode_gather.mask is not None
    assert build_model_inputs([[1, 2], [2]], [0, 0], [[0], [1]], [True, True], 16).meta.kind \
        == PREFILL


def test_decode_inputs_are_the_general_paths():
    """A decode step's inputs come from their own short path (engine/inputs.py): the same
    tensors, dtypes and metadata as the general path builds for that batch."""
    from pdserve.engine import inputs as I

    rng = random.Random(0)
    for num_seqs in (1, 2, 5):
        for native in (True, False):
            starts = [rng.randrange(1, 200) for _ in range(num_seqs)]
            tables = [rng.sample(range(64), p // 16 + 1 + rng.randrange(2)) for p in starts]
            args = ([[rng.randrange(1000)] for _ in starts], starts, tables,
                    [rng.random() < 0.8 for _ in starts], 16, "cpu", native)
            fast, general = I._decode_inputs(*args), I._batch_inputs(*args)
            assert I.build_model_inputs(*args[:5], native_decode=native).meta.kind == DECODE
            assert fast.sample_rows == general.sample_rows
            for name in ("input_ids", "positions", "logits_indices"):
                a, b = getattr(fast, name), getattr(general, name)
                assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
            for name in ("cu_seqlens_q", "seq_lens", "slot_mapping", "block_tables"):
                a, b = getattr(fast.meta, name), getattr(general.meta, name)
                assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
                assert a.is_contiguous()
            assert (fast.meta.kind, fast.meta.all_slots, fast.meta.decode_native) == \
                (general.meta.kind, general.meta.all_slots, general.meta.decode_native)
            gf, gg = fast.meta.decode_gather, general.meta.decode_gather
            assert (gf is None) == (gg is None) == native
            if gf is not None:
                assert gf.blocks.tolist() == gg.blocks.tolist() and gf.max_len == gg.max_len
                assert (gf.mask is None and gg.mask is None) or torch.equal(gf.mask, gg.mask)


class ByteTok:
    """A stand-in tokenizer over bytes for the stop-string logic (the real one is
    exercised end to end in test_llm_api)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def feed(state, text):
    deltas = []
    for b in text.encode():
        d = state.add([b])
        deltas.append(d.text)
        if d.finish_reason:
            break
    return "".join(deltas), state.finish_reason


def test_stop_string_cuts_text_exactly_and_streams_no_part_of_it():
    p = SamplingParams(max_tokens=100, stop=["STOP", "xyz"])
    state = RequestOutputState(ByteTok(), [65], p, eos_token_ids=(), max_model_len=1000)
    streamed, reason = feed(state, "hello STOP world")
    assert streamed == "hello " and state.text == "hello " and reason == "stop"
    state = RequestOutputState(ByteTok(), [65], p, eos_token_ids=(), max_model_len=1000)
    streamed, reason = feed(state, "abcST")  # a stop-string prefix that never completes
    assert streamed == "abc" and reason is None


def test_length_and_stop_ids_and_eos():
    p = SamplingParams(max_tokens=3)
    state = RequestOutputState(ByteTok(), [65], p, eos_token_ids=(300,), max_model_len=1000)
    assert feed(state, "abcdef") == ("abc", "length")
    state = RequestOutputState(ByteTok(), [65], SamplingParams(max_tokens=9), (300,), 1000)
    assert state.add([97, 300, 98]).finish_reason == "stop" and state.token_ids == [97, 300]
    state = RequestOutputState(ByteTok(), [65], SamplingParams(max_tokens=9, ignore_eos=True),
                               (300,), 1000)
    assert state.add([97, 300, 98]).finish_reason is None
