"""GGUF's Q4_0/Q4_1/Q4_K blocks kept as stored (model/quant.py): each weight the int4 kernel forms
is the gguf package's dequantized float32 value bit for bit, the layer equals
dequantize-then-F.linear within float tolerance, a tiny model loads with its projections
int4 and computes what its dequantized self does within bfloat16 tolerance, and the modes
that cannot work are refused, through the CLI too."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from pdserve.cli import main
from pdserve.kernels import native
from pdserve.kernels.native import int4_gemm
from pdserve.model.loader import load_model
from pdserve.model.quant import DENSE_ROWS, Int4Linear, QuantError, plan, unpack_q4

gguf = pytest.importorskip("gguf")
gguf_files = pytest.importorskip("tests.gguf_files")


def blocks(qtype: str, n: int = 96, k: int = 160, seed: int = 0):
    """A [n, k] float32 weight quantized by the gguf package: (raw blocks, dequantized)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2, (n, 1))).astype(np.float32)
    w[0, :32] = 0.0                     # a block of zeros: d = 0
    w[1] += 5                           # all-positive rows: m far from 0
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, kind)
    return raw, gguf.quants.dequantize(raw, kind)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_every_weight_is_the_reference_dequantization_bit_for_bit(qtype):
    raw, ref = blocks(qtype)
    q, scale, zero = unpack_q4(raw, qtype)
    assert q.max() <= 15 and q.shape == ref.shape and scale.shape == (96, 5)
    lin = Int4Linear.from_gguf(raw, qtype)
    assert torch.equal(lin.dequantized(), torch.from_numpy(ref))       # unpacked
    assert torch.equal(lin.pack().dequantized(), torch.from_numpy(ref))  # as the kernel forms


def q4_k_blocks(n: int = 48, k: int = 512, seed: int = 0, dmin_low: float = 0.01):
    """Random Q4_K super-blocks (every scale/min bit pattern, f16 d in [0.01, 0.05], dmin
    in [dmin_low, 0.05]): (raw blocks, the gguf package's dequantization)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(0.01, 0.05, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    raw[..., 2:4] = rng.uniform(dmin_low, 0.05, (n, k // 256, 1)).astype(np.float16).view(
        np.uint8)
    raw = raw.reshape(n, -1)
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)


def test_q4_k_weights_are_the_reference_dequantization_bit_for_bit():
    raw, ref = q4_k_blocks()
    assert ref.shape == (48, 512)
    lin = Int4Linear.from_gguf(raw, "Q4_K")
    assert torch.equal(lin.dequantized(), torch.from_numpy(ref))
    assert torch.equal(lin.pack().dequantized(), torch.from_numpy(ref))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    want = F.linear(x, torch.from_numpy(ref))  # weights up to ~50: sums of order 1e3
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-6 * want.abs().max())
    # dmin far below d: some zeros round in float32, so float32 refuses to keep the
    # tensor (the loader then dequantizes it); bfloat16 rounds the zero anyway
    raw, ref = q4_k_blocks(dmin_low=1e-6)
    with pytest.raises(QuantError, match="round in float32"):
        Int4Linear.from_gguf(raw, "Q4_K")
    lin = Int4Linear.from_gguf(raw, "Q4_K", torch.bfloat16).pack()
    ref = torch.from_numpy(ref)  # errors of the order of a bfloat16 ulp of the block's zero
    torch.testing.assert_close(lin.dequantized().float(), ref, rtol=0,
                               atol=2**-7 * ref.abs().max())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_the_layer_is_dequantize_then_linear(qtype, rows):
    raw, ref = blocks(qtype, seed=rows)
    w = torch.from_numpy(ref)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    out, want = Int4Linear.from_gguf(raw, qtype).pack()(x), F.linear(x, w)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max())
    # bfloat16 through torch's kernel: the scales rounded to bfloat16, and at more rows the
    # kernel rounds each weight it forms to bfloat16 too: within bfloat16 tolerance of the
    # exact product
    lin = Int4Linear.from_gguf(raw, qtype, torch.bfloat16).pack(backend="torch")
    xb = x.bfloat16()
    out, ref = lin(xb), F.linear(xb.double(), lin.dequantized().double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=4e-3 * ref.abs().max())
    scale_error = (lin.dequantized().float() - w).abs().max()
    assert 0 < scale_error <= 2**-8 * w.abs().max() * 2


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_prefill_forms_the_weight_the_kernel_forms_and_runs_a_dense_gemm(qtype):
    """DENSE_ROWS rows or more: the weight formed from the packed blocks (torch's packing
    read back: checked at pack, so a torch that packs otherwise fails here) is the kernel's
    bit for bit, and the rows' outputs are the int4 kernel's within the order of the sums."""
    raw = q4_k_blocks(128, 256)[0] if qtype == "Q4_K" else blocks(qtype, 128, 256)[0]
    lin = Int4Linear.from_gguf(raw, qtype, torch.bfloat16)
    lin.bias = torch.randn(128, generator=torch.Generator().manual_seed(2))
    lin.pack(backend="torch")
    assert lin.dense_rows == DENSE_ROWS
    eye = torch.eye(256, dtype=torch.bfloat16)  # the kernel's own weights, one row at a time
    kernel_w = torch.stack([torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye[i:i + 1], lin.packed, 32, lin.scales_and_zeros)[0] for i in range(256)])  # [K, N]
    assert torch.equal(lin._weight_t(), kernel_w)
    x = torch.randn(DENSE_ROWS + 3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    dense = lin(x)                                                      # [T, N]
    per_row = torch.cat([lin(x[i:i + 1]) for i in range(4)])            # the int4 kernel
    want = x[:4].double() @ kernel_w.double() + lin.bias.double()
    assert dense.dtype == torch.bfloat16 and dense.shape == (DENSE_ROWS + 3, 128)
    for out in (dense[:4], per_row):
        torch.testing.assert_close(out.double(), want, rtol=1e-2,
                                   atol=4e-3 * want.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_for_triton_the_layer_computes_what_the_cpu_kernel_does(qtype, dtype):
    """CUDA's packing (the Triton W4A16 kernel, interpreted here) against the CPU's: the
    same weights bit for bit, the same outputs within the order of the sums."""
    raw = q4_k_blocks(64, 256)[0] if qtype == "Q4_K" else blocks(qtype, 64, 256)[0]
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(64, generator=gen)
    cpu, tri = (Int4Linear.from_gguf(raw, qtype, dtype) for _ in range(2))
    cpu.bias, tri.bias = bias, bias.clone()
    cpu.pack("cpu", backend="torch"), tri.pack("cpu", backend="triton")
    assert (cpu.backend, tri.backend) == ("torch", "triton")
    assert torch.equal(tri.dequantized().to(dtype), cpu.dequantized().to(dtype))
    x = torch.randn(2, 3, 256, generator=gen).to(dtype)
    want, out = cpu(x), tri(x)
    assert out.shape == (2, 3, 64) and out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), rtol=0,
                               atol=(2e-2 if dtype == torch.bfloat16 else 1e-5)
                               * want.float().abs().max().item())


@pytest.mark.skipif(not native.available(), reason=f"native: {native.why_unavailable()}")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
def test_a_bfloat16_layer_on_the_native_kernel_is_the_files_weights_times_int8_rows(
        qtype, rows):
    """Where the native kernels run, a bfloat16 layer takes the VNNI kernel at every row
    count: Q4_0's and Q4_1's weights are the file's own bit for bit (its float16 d and
    m), and the output is the exact product's but for the activations' int8 rounding."""
    raw, ref = q4_k_blocks(96, 256) if qtype == "Q4_K" else blocks(qtype, 96, 256, seed=rows)
    w = torch.from_numpy(ref)
    lin = Int4Linear.from_gguf(raw, qtype, torch.bfloat16)
    lin.bias = torch.randn(96, generator=torch.Generator().manual_seed(rows))
    lin.pack()
    assert lin.backend == "native"
    if qtype == "Q4_K":  # d sc rounded to float16 (bfloat16 in torch's kernel: 3 bits less)
        torch.testing.assert_close(lin.dequantized(), w, rtol=0, atol=2**-10 * w.abs().max())
    else:
        assert torch.equal(lin.dequantized(), w)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    exact = x.double() @ w.double().T + lin.bias.double()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 2e-2
    if qtype != "Q4_K":  # the kernel's own arithmetic in float64: one bfloat16 rounding off
        q, scale, zero = (torch.from_numpy(a) for a in unpack_q4(raw, qtype))
        want = int4_gemm.reference(x, q, scale, zero - 8 * scale) + lin.bias.double()
        torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max())


def test_a_strided_input_computes_what_its_contiguous_copy_does():
    lin = Int4Linear.from_gguf(blocks("Q4_1", 64, 128)[0], "Q4_1", torch.bfloat16).pack()
    wide = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(lin(wide[:, 128:]), lin(wide[:, 128:].contiguous()))


def test_fused_parts_are_the_parts_side_by_side():
    parts = [Int4Linear.from_gguf(blocks("Q4_1", n, seed=n)[0], "Q4_1") for n in (64, 32)]
    ref = torch.cat([p.dequantized() for p in parts])
    assert torch.equal(Int4Linear.cat(parts).pack().dequantized(), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_a_q4_model_keeps_its_projections_int4_and_computes_as_dequantized(
        tiny_model, tmp_path, arch, caplog):
    q4_model = gguf_files.write_gguf(tiny_model(arch), tmp_path / "q4_1.gguf", "Q4_1")
    caplog.set_level("INFO")
    ours = load_model(q4_model, "bfloat16", quantization="auto")
    ref = load_model(q4_model, "bfloat16", quantization="none")
    for m in (ours, ref):
        m.fuse_projections()
    layer = ours.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear)   # q/k rows unpermuted
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    assert "int4 (Q4_1)" in caplog.text and "token_embd.weight" in caplog.text
    # The same weights to bfloat16 precision (the native kernel: int8 activations), hidden
    # states close layer by layer: a few percent of their norm at most
    x = torch.randn(3, ours.config.hidden_size, dtype=torch.bfloat16,
                    generator=torch.Generator().manual_seed(0))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    with torch.inference_mode():
        for a, b in [(ours.model.layers[1].self_attn.qkv_proj, ref.model.layers[1].self_attn
                      .qkv_proj), (layer.mlp.gate_up_proj, ref.model.layers[1].mlp.gate_up_proj)]:
            assert rel(a(x), b(x)) < 0.03
        # the whole MLP: silu(gate) * up of the fused output's halves feeds the int4 GEMM,
        # which takes only a contiguous input
        assert rel(layer.mlp(x), ref.model.layers[1].mlp(x)) < 0.05
    # float32: auto dequantizes (the kernel's float32 path is slow): the same model as none
    f32 = load_model(q4_model, "float32", quantization="auto")
    assert not any(isinstance(m, Int4Linear) for m in f32.modules())


@pytest.mark.parametrize("mode, gguf_file, dtype, words", [
    ("int8", True, torch.bfloat16, "'int8' is not implemented"),
    ("int4", False, torch.bfloat16, "stores float weights"),
    ("int4", True, torch.float32, "pass --dtype bfloat16"),
    ("int4", True, torch.float16, "fast in bfloat16 only"),
])
def test_modes_that_cannot_work_are_refused(mode, gguf_file, dtype, words):
    with pytest.raises(ValueError, match=words):
        plan(mode, gguf_file, dtype, "cpu")
    assert plan("auto", gguf_file, dtype, "cpu") is (gguf_file and dtype == torch.bfloat16)
    assert plan("none", gguf_file, dtype, "cpu") is False


def test_on_cuda_int4_is_the_triton_kernels_or_refused():
    # here no CUDA Triton runs (none, or only the interpreter, which serves no model)
    with pytest.raises(ValueError, match="Triton kernel .* cannot run here"):
        plan("int4", True, torch.float16, "cuda")


@pytest.mark.parametrize("args, words", [
    (["--quantization", "int4", "--dtype", "bfloat16"], "has no Q4_0, Q4_1 or Q4_K projection"),
    (["--quantization", "int4"], "pass --dtype bfloat16"),
    (["--quantization", "int8", "--dtype", "bfloat16"], "'int8' is not implemented"),
])
def test_the_cli_says_why_a_quantization_cannot_be_served(tiny_model, tmp_path, args, words):
    f32_file = gguf_files.write_gguf(tiny_model("llama"), tmp_path / "f32.gguf", "F32")
    out = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--max-tokens", "1",
                                    "--model", str(f32_file), *args], terminal_width=10_000)
    assert out.exit_code == 1 and words in out.output, out.output


def test_the_cli_refuses_an_unknown_quantization():
    out = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--quantization", "int2"],
                             terminal_width=10_000)
    assert out.exit_code == 2 and "'auto', 'none', 'int8', 'int4'" in out.output, out.output


def test_int4_and_dequantized_nodes_of_one_file_do_not_share_a_cluster():
    import msgspec

    from pdserve.common import protocol as P
    from pdserve.router.dispatch.registry import Registry
    from tests.unit.test_dispatch import hello as plain

    def hello(role, node_id, model=None):
        h = plain(role, node_id)
        return h if model is None else msgspec.structs.replace(h, model=model)

    reg = Registry(P.ModelIdentity(name="m", config_hash="h"), 2, 2, 16, 1.0, 3)
    int4 = P.ModelIdentity(name="m", config_hash="h+int4")
    assert reg.admit(hello("prefill", "p1", int4))[0]  # the router's file
    ok, why = reg.admit(hello("decode", "d1"))
    assert not ok and "holds the model's weights dequantized, the cluster's nodes as int4" \
        in why and "--quantization" in why
    assert reg.admit(hello("decode", "d2", int4))[0]
    ok, why = reg.admit(hello("decode", "d3", P.ModelIdentity(name="m",
                                                              config_hash="other+int4")))
    assert not ok and "differs from the router's" in why
    for suffix in ("int8", "int4+int4", "x" * 100_000):   # only the forms a node can hold
        ok, why = reg.admit(hello("decode", "d4", P.ModelIdentity(name="m",
                                                                  config_hash=f"h+{suffix}")))
        assert not ok and "only '+int4' may follow" in why and len(why) < 400, why
