"""Scaled dot-product attention that saves q, k, v, o and one fp32 log-sum-exp per row for backward.

The Nq x Nk probability matrix is never stored: the backward kernels rebuild it block by block
from q, k and the log-sum-exp (P = exp(q k^T * scale - lse)) while they compute the gradients.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import custom_ops, reference
from .backend import use_triton
from .checks import check_same_device, check_same_dtype, check_tensor
from .kernels.limits import MAX_HEAD_DIM

_OP = "attention"


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        return custom_ops.attention_fwd(q, k, v, causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale = inputs
        o, lse = output
        # Everything kept for backward, in one place: the inputs q, k, v, the output o and the fp32
        # log-sum-exp (B, Hq, Nq). Nothing of size Nq x Nk.
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.set_materialize_grads(False)  # an unused output (usually lse) brings None, not zeros

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None and dlse is None:
            return None, None, None, None, None
        if do is None:
            do = torch.zeros_like(o)
        # The kernels recompute P = exp(q k^T * scale - lse) per block from q, k and the saved lse.
        # A gradient reaching lse (return_lse=True) enters as dS += P * dlse, folded into delta.
        dq, dk, dv = custom_ops.attention_bwd(do, q, k, v, o, lse, dlse, ctx.causal, ctx.scale)
        return custom_ops.first_order_only(_OP, dq, dk, dv, None, None)


def _check_attention_args(q, k, v, scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(_OP, name, t)
    check_same_device(_OP, "q", q, k=k, v=v)
    check_same_dtype(_OP, "q", q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{_OP}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape (B, Hkv, Nk, D)")
    batch, q_heads, q_len, head_dim = q.shape
    kv_batch, kv_heads, k_len, kv_dim = k.shape
    if kv_batch != batch:
        raise ValueError(f"{_OP}: batch size of k/v ({kv_batch}) does not match q ({batch})")
    if kv_dim != head_dim:
        raise ValueError(f"{_OP}: head dim D of k/v ({kv_dim}) does not match q ({head_dim})")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(
            f"{_OP}: q heads Hq={q_heads} must be a multiple of the k/v heads Hkv={kv_heads} (GQA/MQA)"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head dim D={head_dim} of q, k, v must be in 1..{MAX_HEAD_DIM}")
    if q_len == 0:
        raise ValueError(f"{_OP}: q has no query positions (Nq=0, shape {tuple(q.shape)})")
    if k_len == 0:
        raise ValueError(f"{_OP}: k and v have no key positions (Nk=0, shape {tuple(k.shape)})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{_OP}: {name} must be contiguous in its last dim (stride(-1) == 1), got strides {t.stride()}; "
                f"other dims may have any strides"
            )
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"{_OP}: scale must be a finite real number or None, got {scale!r}")
    return float(scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """softmax(q k^T * scale) v without materializing the attention matrix, forward or backward.

    Shapes:
        q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D), with Hq a multiple of Hkv (query head h uses kv
        head h // (Hq // Hkv): multi-head, grouped-query and multi-query attention).
        D in 1..256; Nq, Nk >= 1. Any strides with a contiguous last dim (e.g. views into a packed
        qkv projection). fp16, bf16 or fp32, all three the same, on one device.
    Returns:
        o: (B, Hq, Nq, D) in q's dtype; with ``return_lse=True`` also lse: (B, Hq, Nq) fp32, the
        natural-log log-sum-exp of each row's scaled scores (differentiable).

    ``scale`` defaults to 1/sqrt(D). ``causal=True`` aligns the mask to the bottom-right, as in
    FlashAttention 2: query i sees keys j <= i + Nk - Nq. When Nq > Nk the first Nq - Nk queries see
    no key: their output and all gradients through them are 0 and their lse is -inf.

    For backward only q, k, v, o and lse are saved; P is recomputed from lse.
    """
    scale = _check_attention_args(q, k, v, scale)
    causal = bool(causal)
    if use_triton(_OP, q.device):
        o, lse = _Attention.apply(q, k, v, causal, scale)
    else:
        o, lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return (o, lse) if return_lse else o


__all__ = ["attention"]
