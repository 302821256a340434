"""Engine.step's hooks and outputs against a real tiny model (no processes, no sockets)."""
import os

import pytest
import torch

from pdserve.bench.cluster import memory_mib
from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine, layer_groups
from pdserve.engine.sequence import Sequence

BLOCK = 4


def engine_of(model_dir, **kw) -> Engine:
    cfg = dict(model=str(model_dir), block_size=BLOCK, num_kv_blocks=64,
               max_num_batched_tokens=8, enable_prefix_caching=False)
    return Engine(EngineConfig(**{"dtype": "float32", **cfg, **kw}), detokenize=False)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def slot_written(engine: Engine, seq: Sequence, layer: int, pos: int) -> bool:
    """Whether the K cache of ``layer`` holds anything at token position ``pos`` of seq
    (the cache starts zeroed)."""
    k = engine.runner.kv_caches[layer][0]                 # [blocks, BLOCK, KVH, D]
    return bool(k[seq.block_table[pos // BLOCK], pos % BLOCK].abs().sum() > 0)


def test_layer_group_hook_fires_per_group_in_order_in_the_last_chunk_only(model_dir):
    engine = engine_of(model_dir)
    layers = engine.model_config.num_hidden_layers
    assert layers >= 2, "the tiny model must have layer groups to tell apart"
    engine.layer_groups = layer_groups(layers, 1)
    long = engine.add_request("long", list(range(3, 23)), greedy(3))   # 20 tokens: 3 chunks
    calls, batches = [], []

    def on_group(prompts, start, end):
        last = long.num_prompt_tokens - 1  # the last chunk's last position
        # KV of the finished layers is in place, the later layers' not yet.
        calls.append(([s.seq_id for s in prompts], start, end,
                      [slot_written(engine, long, layer, last) for layer in range(layers)]))

    steps = []
    while engine.has_unfinished():
        steps.append(engine.step(on_batch=lambda b: batches.append(len(b)),
                                 on_layer_group=on_group))
    # Chunks of 8, 8, 4 tokens, then 2 decode steps: the hook fired in step 3 only.
    assert [len(o) for o in steps] == [0, 0, 1, 1, 1]
    assert batches == [1] * 5
    assert [(ids, s, e) for ids, s, e, _ in calls] == [(["long"], i, i + 1)
                                                       for i in range(layers)]
    for _, _, end, written in calls:
        assert written == [layer < end for layer in range(layers)]


def test_outputs_mark_the_first_token_of_prompts_prefilled_here(model_dir):
    """A prompt prefilled here gives one first output (with its prompt logprobs); a sequence
    whose KV arrived from another engine (add_prefilled) never does, and decodes on to the
    tokens the first engine makes alone."""
    prefill, decode = engine_of(model_dir), engine_of(model_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    prompt = list(range(5, 19))
    here = prefill.add_request("a", prompt, params)
    outs = []
    while not outs:
        outs = prefill.step()
    (first,) = outs
    assert first.first and first.prompt_logprobs is not None
    assert len(first.prompt_logprobs.token_logprobs) == len(prompt) - 1

    # Hand the prompt's KV to the other engine, as a prefill node does a decode node.
    there = Sequence("a", prompt, params, prefill_here=False)
    there.block_table = decode.allocator.allocate(decode.scheduler.blocks_for(len(prompt)))
    for (src_k, src_v), (dst_k, dst_v) in zip(prefill.runner.kv_caches,
                                              decode.runner.kv_caches):
        src = torch.tensor(here.block_table[:len(there.block_table)])
        dst = torch.tensor(there.block_table)
        dst_k[dst], dst_v[dst] = src_k[src], src_v[src]
    decode.add_prefilled(there, first.new_token_ids[0])

    rest_here, rest_there = [], []
    while prefill.has_unfinished() or decode.has_unfinished():
        rest_here += prefill.step()
        rest_there += decode.step()
    assert not any(o.first or o.prompt_logprobs for o in rest_here + rest_there)
    assert [o.new_token_ids for o in rest_there] == [o.new_token_ids for o in rest_here]
    assert len(rest_there) == params.max_tokens - 1  # the first token counted toward it
    assert rest_there[-1].finish_reason == "length"
    for e in (prefill, decode):
        assert e.allocator.num_free_blocks == e.allocator.num_blocks


def test_detach_hands_the_blocks_to_the_owner(model_dir):
    engine = engine_of(model_dir)
    engine.add_request("p", list(range(3, 12)), greedy(4))
    while not engine.step():
        pass
    blocks = engine.detach("p")
    assert len(blocks) == engine.scheduler.blocks_for(10) and not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - len(blocks)
    assert engine.step() == [] and not engine.finish("p")  # no longer the engine's
    engine.allocator.free(blocks)
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_the_kv_cache_takes_memory_only_as_it_is_written(model_dir):
    """The CPU KV cache is zeros the OS maps as blocks are written (issue 34): 1 GiB of it
    costs next to nothing until requests use it, reads as zeros, and serves."""
    before = memory_mib(os.getpid())["rss"]
    engine = engine_of(model_dir, block_size=256, num_kv_blocks=None, kv_cache_memory_gb=1.0)
    assert memory_mib(os.getpid())["rss"] - before < 200
    k, v = engine.runner.kv_caches[0]                     # [blocks, 256, KVH, D]
    assert k.shape[0] * k[0].nbytes * 2 * len(engine.runner.kv_caches) > 0.9 * 2**30
    assert not k[:2].any() and not v[-2:].any()
    seq = engine.add_request("a", list(range(3, 23)), greedy(2))
    while engine.scheduler.has_unfinished():
        engine.step()
    assert seq.num_output_tokens == 2
