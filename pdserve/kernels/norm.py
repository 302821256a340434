"""RMSNorm, optionally fused with the residual add that precedes it in every layer.

The torch reference is transformers' LlamaRMSNorm line for line (normalise in
float32, round to the input dtype, then multiply by the weight in that dtype),
so the CPU path is bit-identical to it. The Triton kernel keeps those two
roundings and differs only in the order of the sum of squares. A bfloat16 CPU call with
``backend=None`` runs the same arithmetic in one native call (kernels/native/decode_ops.c,
where ``native.available()``), the sum of squares in the order of torch's own sum: the
torch path's bits, the residual add included.
"""
from __future__ import annotations

import torch

from pdserve.kernels._dispatch import (
    FLOAT_DTYPES,
    check_same_dtype,
    check_tensor,
    last_dim_contiguous,
    launch,
    pick_backend,
    tl,
    triton,
)
from pdserve.kernels.native import decode_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, backend: str | None = None,
             add_in_place: bool = False, check: bool = True
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, hidden] with weight [hidden] (x's dtype).

    Without ``residual``: returns out [T, hidden]. With ``residual`` [T, hidden]:
    returns (norm(x + residual), x + residual), the sum taken in x's dtype, as a
    transformers decoder layer does. Inputs are not modified, except that with
    ``add_in_place`` the torch path writes the sum into ``residual`` (and returns it):
    for a caller that no longer needs the old one (the native path too). Any row stride
    works. ``check``: False skips the argument checks (the package docstring).
    """
    if check:
        dims: dict[str, tuple[int, str]] = {}
        check_tensor("x", x, "[T, hidden]", FLOAT_DTYPES, dims)
        check_tensor("weight", weight, "[hidden]", FLOAT_DTYPES, dims, x.device)
        check_same_dtype("weight", weight, "x", x)
        if residual is not None:
            check_tensor("residual", residual, "[T, hidden]", FLOAT_DTYPES, dims, x.device)
            check_same_dtype("residual", residual, "x", x)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if backend is None and decode_ops.runs(x) and weight.stride(0) == 1 and (
            residual is None or residual.stride(1) == 1):
        # bfloat16 on the CPU: one native call for the torch path's 4-9 operations, same bits
        if residual is None:
            return decode_ops.rms_norm(x, weight, eps)
        new_residual = residual if add_in_place else torch.empty_like(x)
        return decode_ops.rms_norm(x, weight, eps, residual, new_residual), new_residual
    if pick_backend(backend, x.device) == "torch":
        if residual is None:
            return _rms_norm_torch(x, weight, eps)
        new_residual = residual.add_(x) if add_in_place else x + residual  # same sum
        return _rms_norm_torch(new_residual, weight, eps), new_residual
    return _rms_norm_triton(x, weight, float(eps), residual)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' operations in its order; the ones on new tensors in place, and the
    # casts skipped in float32 (no copy there, but an operation dispatched each)
    h = x if x.dtype == torch.float32 else x.float()
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()      # a new [T, hidden]
    if x.dtype != torch.float32:
        h = h.to(x.dtype)
    return h.mul_(weight)


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None):
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)  # [T, H]
    new_residual = torch.empty_like(out) if residual is not None else None
    if num_tokens == 0:
        return out if residual is None else (out, new_residual)
    x, weight = last_dim_contiguous(x), weight.contiguous()
    if residual is not None:
        residual = last_dim_contiguous(residual)
    block = triton.next_power_of_2(hidden)
    has_res = residual is not None
    launch(_rms_norm_kernel, (num_tokens,),
        x, weight, residual if has_res else x, out, new_residual if has_res else out,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0), hidden, eps,
        HAS_RESIDUAL=has_res, BLOCK=block,
        num_warps=4 if block <= 2048 else (8 if block <= 8192 else 16),
    )
    return out if residual is None else (out, new_residual)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, new_res_ptr,
                         stride_x, stride_res, stride_out, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
            # Round the sum to x's dtype, as the torch add does, before normalising it.
            h = (h + r).to(new_res_ptr.dtype.element_ty)
            tl.store(new_res_ptr + row * stride_out + offs, h, mask=mask)
            h = h.to(tl.float32)
        # Correctly rounded divisions and sqrt, like torch's mean and rsqrt on the CPU.
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(h * h, 0), hidden * 1.0) + eps))
        normed = (h * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty),
                 mask=mask)
