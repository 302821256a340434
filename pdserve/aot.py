"""Every Triton kernel compiled ahead of time for a GPU target, on a machine without one.

The interpreter (TRITON_INTERPRET=1, how the tests run the kernels) executes them as
Python and accepts what the GPU compiler refuses: ``tl.dot`` below 16, block shapes
that are not powers of two, dtype rules, shared memory over the chip's limit. So the
kernels are also compiled here for real targets (Triton IR -> PTX -> cubin with the
``ptxas`` the triton wheel carries), at the specializations a model would launch.

Those are not listed by hand: ``model_launches`` runs the model's own forward on meta
tensors (no memory, no compute) inside ``record_launches()``, one batch of each kind
the engine builds, so the host wrappers pick grids, block sizes, warps and argument
layouts exactly as they would on CUDA. Triton's own binder then turns each recorded
launch into the signature, constants and alignment attributes its JIT would compile.

It lives above kernels/ (which are leaves) because it drives the model and the engine's
input building; `pdserve kernels compile` (cli_kernels.py) is its command.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# Off a GPU (and without the interpreter) pdserve.kernels imports no triton and defines no
# Triton kernel unless told to, before its first import: compiling them is this module's job.
os.environ.setdefault("PDSERVE_LOAD_TRITON", "1")

from pdserve.kernels._dispatch import Launch, record_launches, triton  # noqa: E402

# The most shared memory one block may use (the opt-in limit, bytes): a kernel over it
# compiles but fails at launch, so the check is ours. cudaDevAttrMaxSharedMemoryPerBlockOptin.
MAX_SHARED_BYTES = {80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376, 90: 232_448}
REGISTERS_PER_SM = 65_536  # every sm_80..sm_90 part: regs per thread x threads must fit
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Result:
    kernel: str
    key: str
    arch: int
    shared: int = 0
    regs: int = 0
    spills: int = 0       # local memory per thread, bytes: where ptxas spills registers
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def line(self) -> str:
        status = "ok" if self.ok else "FAILED"
        text = (f"{self.kernel} {self.key} sm_{self.arch} {status} shared={self.shared} "
                f"regs={self.regs} spills={self.spills}")
        return text if self.ok else f"{text}\n    {self.error}"


def model_launches(cfg, dtype: torch.dtype, block_size: int) -> list[Launch]:
    """The kernel launches of one layer (every layer is alike) of ``cfg``'s model in
    ``dtype``: a prefill with and without a KV cache, a decode step, a mixed step (a
    chunk over a cached prefix beside a decode token), and the KV copies a transfer
    makes. Nothing is allocated: the model and its inputs live on the meta device."""
    from pdserve import kernels
    from pdserve.engine.inputs import build_model_inputs
    from pdserve.model.attention import PREFILL
    from pdserve.model.llama import LlamaForCausalLM

    one_layer = dataclasses.replace(cfg, num_hidden_layers=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(one_layer).to(dtype)
    model.tie_weights()
    model.fuse_projections()  # what ModelRunner does on every device
    model.init_rope("meta")
    shape = (8, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.empty(shape, dtype=dtype, device="meta"),
               torch.empty(shape, dtype=dtype, device="meta"))]
    bs = block_size
    batches = (  # (token chunks, start positions, block tables), as the scheduler sends them
        ([[1] * (bs + 3), [2] * 5], [0, 0], [[0, 1], [2]]),          # prefill
        ([[1], [2], [3]], [bs + 2, 4, 1], [[0, 1], [2], [3]]),         # decode
        ([[1] * 7, [2]], [bs, 3], [[0, 1], [2]]),                      # mixed
    )
    with record_launches() as launches, torch.no_grad():
        for chunks, starts, tables in batches:
            inputs = build_model_inputs(chunks, starts, tables, [True] * len(chunks), bs,
                                        device="meta")
            model(inputs.input_ids, inputs.positions, inputs.meta, caches)
            if inputs.meta.kind == PREFILL:  # attention straight from the new tokens
                model(inputs.input_ids, inputs.positions, inputs.meta, None)
        ids = torch.empty(3, dtype=torch.int64, device="meta")  # node/kv/'s ids
        k, v = kernels.gather_kv(*caches[0], ids)
        kernels.scatter_kv(*caches[0], ids, k, v)
        quant_launches(cfg, dtype)
    return launches


def quant_launches(cfg, dtype: torch.dtype) -> None:
    """The weight-only GEMMs (kernels/quant_linear.py) of ``cfg``'s projections, 4 and 8
    bits, at a decode step's rows and at a prefill chunk's (the smallest and the largest
    BLOCK_M), on meta tensors: call inside ``record_launches()``."""
    from pdserve.kernels.quant_linear import QWEIGHT_DTYPES, quant_linear

    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = [((heads + 2 * kv_heads) * d, cfg.hidden_size, cfg.attention_bias),  # q, k, v
              (cfg.hidden_size, heads * d, cfg.attention_bias),                 # o
              (2 * cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias),       # gate, up
              (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)]           # down
    for bits, qdtype in QWEIGHT_DTYPES.items():
        for n, k, bias in shapes:
            qweight = torch.empty((n, k * bits // 8), dtype=qdtype, device="meta")
            scales = torch.empty((n, k // 32), dtype=dtype, device="meta")
            b = torch.empty(n, dtype=dtype, device="meta") if bias else None
            for rows in (1, 256):
                x = torch.empty((rows, k), dtype=dtype, device="meta")
                quant_linear(x, qweight, scales, scales, bits, b)


def launch_key(launch: Launch, dtype: torch.dtype) -> str:
    """What tells one specialization of a kernel from another: the dtype, its constexprs
    and compiler options, in one word."""
    parts = [DTYPE_NAMES.get(dtype, str(dtype))]
    parts += [f"{name}={value}" for name, value in launch.kwargs.items()]
    return ",".join(parts)


def _specialize(launch: Launch, backend):
    """(signature, constexprs, attrs, options) as Triton's JIT derives them at launch
    (JITFunction.run: the binder, then _pack_args), without a device."""
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return fn._pack_args(backend, launch.kwargs, bound, specialization, options)


def _cuobjdump() -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else (shutil.which("cuobjdump") or "cuobjdump")


def _resource_usage(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread) of ``name`` in the cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", path], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    fields: dict[str, int] = {}
    in_kernel = False
    for line in out.splitlines():
        if line.strip().startswith("Function "):
            in_kernel = line.strip().removeprefix("Function ").rstrip(":") == name
        elif in_kernel:
            for item in line.split():
                key, _, value = item.partition(":")
                if value.isdigit():
                    fields[key] = int(value)
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump printed no resource usage for {name}: {out.strip()}")
    return fields["REG"], fields.get("LOCAL", 0)


def compile_launch(launch: Launch, key: str, arch: int) -> Result:
    """Compile one recorded launch for sm_<arch>; a failure is a Result with the
    compiler's message, never an exception."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    name = launch.kernel.__name__
    try:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        options, signature, constexprs, attrs = _specialize(launch, backend)
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=target, options=options.__dict__)
        shared = int(compiled.metadata.shared)
        regs, spills = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    except Exception as exc:  # noqa: BLE001 - every compiler error becomes a FAILED line
        message = " ".join(str(exc).split())[-600:] or type(exc).__name__
        return Result(name, key, arch, error=f"{type(exc).__name__}: {message}")
    threads = options.num_warps * 32
    error = ""
    limit = MAX_SHARED_BYTES.get(arch)
    if limit is not None and shared > limit:
        error = f"needs {shared} bytes of shared memory; sm_{arch} has {limit} per block"
    elif regs * threads > REGISTERS_PER_SM:
        error = f"{regs} registers x {threads} threads exceed the {REGISTERS_PER_SM} of an SM"
    return Result(name, key, arch, shared, regs, spills, error)


def distinct(launches: list[Launch], dtype: torch.dtype) -> list[tuple[str, Launch]]:
    """One (key, launch) per specialization: the layers and batches repeat them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    seen: dict[str, tuple[str, Launch]] = {}
    keys: set[tuple[str, str]] = set()
    for launch in launches:
        options, signature, constexprs, attrs = _specialize(launch, backend)
        ident = repr((launch.kernel.__name__, signature, sorted(constexprs.items()),
                      sorted(attrs.items()), sorted(launch.kwargs.items())))
        if ident in seen:
            continue
        # Alike in constexprs but not in argument types or alignment: number the key.
        key, n = launch_key(launch, dtype), 1
        while (launch.kernel.__name__, key if n == 1 else f"{key}#{n}") in keys:
            n += 1
        key = key if n == 1 else f"{key}#{n}"
        keys.add((launch.kernel.__name__, key))
        seen[ident] = (key, launch)
    return list(seen.values())
