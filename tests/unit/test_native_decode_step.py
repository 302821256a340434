"""A whole bfloat16 decode step in one native call (kernels/native/decode_step.c): the same
hidden states and the same KV cache, bit for bit, as the same kernels called layer by layer
from Python, at batch sizes across the GEMM's row tiles, short contexts (one attention task
a sequence) and long ones (split and combined), on one thread and on two; models it cannot
take keep the layer path and the log says why; bad inputs are refused."""
import ctypes
import dataclasses
import logging
import time

import pytest
import torch

from pdserve.kernels import native

pytestmark = pytest.mark.skipif(native.why_unavailable() is not None,
                                reason=f"native kernels: {native.why_unavailable()}")

from pdserve.engine.inputs import build_model_inputs  # noqa: E402 (after the skip)
from pdserve.model.config import ModelConfig  # noqa: E402
from pdserve.model.llama import LlamaForCausalLM  # noqa: E402
from pdserve.model.loader import load_model  # noqa: E402
from pdserve.model.quant import Int4Linear  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def q4_model(tiny_model, tmp_path_factory):
    """A tiny checkpoint as a Q4_1 GGUF, loaded in bfloat16 with its int4 kept: llama
    (heads x head_dim = hidden) or mistral (twice hidden)."""
    gguf_files = pytest.importorskip("tests.gguf_files")
    built = {}

    def get(arch: str):
        if arch not in built:
            path = gguf_files.write_gguf(tiny_model(arch),
                                         tmp_path_factory.mktemp(arch) / "q4_1.gguf", "Q4_1")
            model = load_model(path, "bfloat16", quantization="auto")
            model.fuse_projections()
            built[arch] = model
        return built[arch]

    return get


def kv_caches(model, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = model.config
    shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
            for _ in range(cfg.num_hidden_layers)]


def run_both(model, inputs, caches):
    """The decode step layer by layer, then natively from the same cache: (hidden states,
    caches after) of each."""
    before = [(k.clone(), v.clone()) for k, v in caches]
    step, model.native_step = model.native_step, None
    try:
        want = model(inputs.input_ids, inputs.positions, inputs.meta, caches)
    finally:
        model.native_step = step
    want_caches = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    got = model(inputs.input_ids, inputs.positions, inputs.meta, caches)
    return (want, want_caches), (got, caches)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("context", [20, 300])   # 300 x 2 kv heads: a split context
@pytest.mark.parametrize("batch", [1, 3, 9])     # row tiles 1, 2 + 1, 8 + 1
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_the_step_is_the_layer_path_bit_for_bit(q4_model, arch, batch, context, threads):
    model = q4_model(arch)
    assert model.native_step is not None
    cfg, gen = model.config, torch.Generator().manual_seed(batch * 1000 + context)
    prompts = [torch.randint(3, cfg.vocab_size, (context + 5 * i,), generator=gen).tolist()
               for i in range(batch)]
    per_seq = (context + 5 * batch + 8) // BLOCK + 1
    caches = kv_caches(model, batch * per_seq)
    # each sequence's pages in reverse order: the kernel must follow the tables
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(batch)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            prefill = build_model_inputs(prompts, [0] * batch, tables, [True] * batch, BLOCK)
            model(prefill.input_ids, prefill.positions, prefill.meta, caches)
            tokens, starts = [[7 + i] for i in range(batch)], [len(p) for p in prompts]
            for _ in range(3):
                inputs = build_model_inputs(tokens, starts, tables, [True] * batch, BLOCK,
                                            native_decode=True)
                (want, want_caches), (got, got_caches) = run_both(model, inputs, caches)
                assert torch.equal(got, want)
                for (k, v), (wk, wv) in zip(got_caches, want_caches):
                    assert torch.equal(k, wk) and torch.equal(v, wv)
                tokens = [[int(t)] for t in model.compute_logits(got).argmax(-1)]
                starts = [s + 1 for s in starts]
    finally:
        torch.set_num_threads(old)


def test_models_it_cannot_take_keep_the_layer_path(tiny_model, tmp_path, caplog):
    gguf_files = pytest.importorskip("tests.gguf_files")
    caplog.set_level(logging.INFO, logger="pdserve.model.llama")
    # qwen2's q, k and v have biases
    path = gguf_files.write_gguf(tiny_model("qwen2"), tmp_path / "qwen2.gguf", "Q4_1")
    model = load_model(path, "bfloat16", quantization="auto")
    model.fuse_projections()
    assert model.native_step is None
    assert "decode step: layer by layer (not every projection is a bias-free int4" in caplog.text
    # float32 keeps torch's paths: no int4 on the native kernel, no native step
    llama = gguf_files.write_gguf(tiny_model("llama"), tmp_path / "llama.gguf", "Q4_1")
    for dtype, quantization in (("float32", "auto"), ("bfloat16", "none")):
        model = load_model(llama, dtype, quantization=quantization)
        model.fuse_projections()
        assert model.native_step is None, (dtype, quantization)


def test_inputs_of_the_wrong_type_are_refused(q4_model):
    model = q4_model("llama")
    caches = kv_caches(model, 4)
    inputs = build_model_inputs([[5]], [3], [[0]], [True], BLOCK, native_decode=True)
    meta, step = inputs.meta, model.native_step
    x = model.model.embed_tokens(inputs.input_ids)
    cos = sin = torch.zeros(1, 1, model.config.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int32"):
        step(x, cos, sin, meta.block_tables, meta.seq_lens.long(), meta.slot_mapping, caches)
    with pytest.raises(ValueError, match="bfloat16"):
        step(x.float(), cos, sin, meta.block_tables, meta.seq_lens, meta.slot_mapping, caches)
    with pytest.raises(ValueError, match="KV caches for"):
        step(x, cos, sin, meta.block_tables, meta.seq_lens, meta.slot_mapping, caches[:1])
    float_caches = [(k.float(), v.float()) for k, v in caches]
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        step(x, cos, sin, meta.block_tables, meta.seq_lens, meta.slot_mapping, float_caches)


def test_the_default_model_runs_it_and_generates_the_layer_paths_tokens():
    """SmolLM2-135M as bundled, with its defaults' bfloat16 and int4: the step runs, and
    greedy output over the chat prompts (a batch of 6, then one at a time) is the layer
    path's token for token. (No prefix cache: a second run would prefill over the first's
    pages, another kernel with other roundings.)"""
    from pdserve import LLM, SamplingParams
    from pdserve.model.default_model import bundled_model
    from tests.chat_prompts import CONVERSATIONS

    path, why = bundled_model()
    if path is None:
        pytest.skip(f"no bundled model: {why}")
    llm = LLM(dtype="bfloat16", quantization="auto", enable_prefix_caching=False)
    model = llm.engine.model
    step = model.native_step
    assert step is not None
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(m),
                                    add_special_tokens=False) for m in CONVERSATIONS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for native_step in (step, None):
        model.native_step = native_step
        batch = [o.token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in prompts[:2]]
        outs[native_step is None] = (batch, alone)
    assert outs[False] == outs[True]


def random_int4_model(hidden: int, heads: int, kv_heads: int, head_dim: int,
                      intermediate: int, layers: int = 2) -> LlamaForCausalLM:
    """Random bfloat16 weights, every projection random int4 blocks."""
    cfg = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    gen = torch.Generator().manual_seed(hidden + heads)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen))

    def int4(linear):
        n, k = linear.weight.shape
        scale = torch.rand(n, k // 32, generator=gen) / (2 * k ** 0.5)
        return Int4Linear(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          scale, -8 * scale + 0.01 * torch.randn(n, k // 32, generator=gen),
                          dtype=torch.bfloat16)

    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj, a.k_proj, a.v_proj = int4(a.q_proj), int4(a.k_proj), int4(a.v_proj)
        a.o_proj, m.gate_proj = int4(a.o_proj), int4(m.gate_proj)
        m.up_proj, m.down_proj = int4(m.up_proj), int4(m.down_proj)
    model.fuse_projections()
    model.init_rope("cpu")
    return model


SHAPES = {  # hidden, heads, kv heads, head_dim, intermediate
    "smollm2": (576, 9, 3, 64, 1536),       # the default model's: head_dim 64, group 3
    "group8_d128": (256, 8, 1, 128, 352),   # heads x head_dim = 4 x hidden
    "mha_d64": (256, 4, 4, 64, 224),        # group 1
}


def random_step_inputs(model, batch: int, context: int, padded=()):
    """A decode step's inputs over a random context (instead of a prefill): its caches and
    ModelInputs, rows ``padded`` batch padding (length 0, slot -1)."""
    gen = torch.Generator().manual_seed(batch + context)
    lens = [context + 5 * i for i in range(batch)]
    per_seq = max(lens) // BLOCK + 2
    caches = kv_caches(model, batch * per_seq)
    for k, v in caches:   # random context instead of a prefill
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(batch)]
    inputs = build_model_inputs([[7 + i] for i in range(batch)], lens, tables,
                                [True] * batch, BLOCK, native_decode=True)
    if padded:
        meta = inputs.meta
        lens_t, slots = meta.seq_lens.clone(), meta.slot_mapping.clone()
        lens_t[list(padded)], slots[list(padded)] = 0, -1
        inputs = dataclasses.replace(inputs, meta=dataclasses.replace(
            meta, seq_lens=lens_t, slot_mapping=slots, all_slots=False))
    return caches, inputs


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch,context,padded", [
    (1, 700, ()), (20, 40, ()), (5, 300, (1, 4)),
    (2, 300, (1,)),     # a split context combined by every thread, beside a padding row
    (3, 300, (0,))])    # two sequences combined by every thread of three, padding first
@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_shapes_and_padding_rows_keep_the_layer_paths_bits(shape, batch, context,
                                                                  padded, threads):
    """The attention copies specialised for head_dim 64 and 128, groups 1 to 8, batches
    past the GEMM's row tiles, split contexts (combined by one thread a sequence, or by
    every thread where the sequences are fewer), and rows of batch padding (length 0, slot
    -1: zeros out, nothing stored); three threads on two cores (a thread waiting for one
    that is not running)."""
    model = q4_random(shape)
    caches, inputs = random_step_inputs(model, batch, context, padded)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            (want, want_caches), (got, got_caches) = run_both(model, inputs, caches)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got, want)
    for (k, v), (wk, wv) in zip(got_caches, want_caches):
        assert torch.equal(k, wk) and torch.equal(v, wv)


_RANDOM: dict[str, LlamaForCausalLM] = {}


def q4_random(shape: str) -> LlamaForCausalLM:
    """A SHAPES model of 2 layers, or NAME_L of L layers"""
    if shape not in _RANDOM:
        name, _, layers = shape.partition("_") if shape not in SHAPES else (shape, "", "2")
        _RANDOM[shape] = random_int4_model(*SHAPES[name], layers=int(layers))
    assert _RANDOM[shape].native_step is not None
    return _RANDOM[shape]


PHASES = ("q/k/v", "attention", "combine", "o", "gate/up", "down")  # decode_step.c's order


STALLS = [(*case, where) for case in [
    # (combine: 2 sequences, one a thread; fewer, and each thread combines them itself)
    ("q/k/v", 1, 1, 700), ("attention", 0, 1, 700), ("combine", 1, 2, 700),
    ("o", 2, 1, 700), ("gate/up", 0, 5, 40), ("down", 3, 5, 40),
    ("down", 0, 96, 40),   # a ring of 2 layers' buffers at this batch: layer 2 waits
    ("attention", 1, 96, 40)] for where in ("before", "after")] + [("start", -1, 96, 40, "before")]


@pytest.mark.parametrize("phase,layer,batch,context,where", STALLS)
def test_a_stalled_thread_is_gone_past_with_the_same_bits(phase, layer, batch, context, where):
    """The thread that runs a phase's first chunk sleeps 30 ms (or longer) in it, before
    computing it or after: the other computes that chunk itself and goes on (a preempted
    thread on a shared machine), and the late thread's writes, when it wakes, are the same
    bits. Or thread 1 sleeps before its first layer ("start"): the other does every chunk,
    and waits for it before reusing a ring slot that the late thread's norms still read.
    The hidden states and the caches are the layer path's, and the library counted each
    chunk it computed again."""
    fn = native.function("pd_decode_step_stall", [ctypes.c_int] * 4 + [ctypes.c_int64])
    redone = native.function("pd_decode_step_redone", [], ctypes.c_uint64)
    model = q4_random("smollm2_4")
    caches, inputs = random_step_inputs(model, batch, context)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    # 30 ms, or thrice a whole step where that is longer (batch 96 on an AVX2 CPU): the
    # other thread's patience is a few of its chunks, and it must run out within the stall
    with torch.inference_mode():
        start = time.perf_counter()
        model(inputs.input_ids, inputs.positions, inputs.meta,
              [(k.clone(), v.clone()) for k, v in caches])
        us = max(30_000, int((time.perf_counter() - start) * 3e6))
    if phase == "start":
        fn(1, -1, -1, 0, us)
    else:
        fn(-1, layer, PHASES.index(phase), ["before", "after"].index(where), us)
    try:
        before = redone()
        with torch.inference_mode():
            (want, want_caches), (got, got_caches) = run_both(model, inputs, caches)
        assert torch.equal(got, want)
        for (k, v), (wk, wv) in zip(got_caches, want_caches):
            assert torch.equal(k, wk) and torch.equal(v, wv)
        if phase != "start":   # (a late start took no chunk: nothing to take over)
            assert redone() > before, "no chunk was taken over from the stalled thread"
    finally:
        fn(-1, -1, -1, -1, 0)
        torch.set_num_threads(old)
