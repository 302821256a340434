"""Attention, KV-cache, norm, rotary and weight-only quantized GEMM kernels: a Triton kernel
and a torch reference each.

``backend=None`` picks Triton for CUDA tensors and torch otherwise; the torch
references are the CPU serving path and match transformers bit for bit. On the CPU in
bfloat16, ``rms_norm`` (backend None) and ``rotate_`` run their torch path's arithmetic as
one native call each where ``native.available()`` (kernels/native/decode_ops.py, with the
model's silu * up): the same bits, without the 4-9 torch operations' dispatch each took.
``backend="torch"`` and ``PDSERVE_NATIVE_KERNELS=0`` keep torch's operations; float32
always does. The attention functions take ``native`` instead (None: the C kernel where it
runs, False: SDPA, True: the C kernel or an error): ``paged_decode_attention``, and
``prefill_attention`` / ``paged_prefill_attention`` in bfloat16
(kernels/native/prefill_attention.c: as accurate against float32 as SDPA's bfloat16, not
its bits); each module's docstring says what its kernel computes.
Triton is optional: without it everything runs on torch.

Every function checks its arguments and says what was wrong. The ones the model calls in
every layer of every step (``rms_norm``, ``store_kv``, ``paged_decode_attention``) take
``check=False`` as well: the same contract, not checked, for a caller that built the
arguments itself. The model's forward passes it: the checks were a few hundred Python
calls a decode step, 0.5-0.7 ms of a 10 ms bfloat16 batch-1 step on a 2-core EPYC.
"""
from pdserve.kernels.attention_decode import (
    DecodeGather,
    DecodeWindow,
    WindowFill,
    decode_gather,
    native_decode_why_not,
    paged_decode_attention,
)
from pdserve.kernels.attention_prefill import (
    native_prefill_why_not,
    paged_prefill_attention,
    prefill_attention,
)
from pdserve.kernels.kv_cache import gather_kv, scatter_kv, store_kv
from pdserve.kernels.norm import rms_norm
from pdserve.kernels.quant_linear import quant_linear
from pdserve.kernels.rotary import RotaryTables, apply_rotary, rotary_tables, rotate_

__all__ = [
    "DecodeGather",
    "DecodeWindow",
    "RotaryTables",
    "WindowFill",
    "apply_rotary",
    "decode_gather",
    "gather_kv",
    "native_decode_why_not",
    "native_prefill_why_not",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_attention",
    "quant_linear",
    "rms_norm",
    "rotary_tables",
    "rotate_",
    "scatter_kv",
    "store_kv",
]
