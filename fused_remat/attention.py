"""Scaled dot-product attention that saves q, k, v, o and one fp32 log-sum-exp per row for backward.

The Nq x Nk probability matrix is never stored: the backward kernels rebuild it block by block
from q, k and the log-sum-exp (P = exp(q k^T * scale - lse)) while they compute the gradients.
"""

from __future__ import annotations

import torch

from . import custom_ops, reference
from .backend import use_triton
from .kernels.limits import check_attention_args

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
    scale = check_attention_args(_OP, q, k, v, scale)
    causal = bool(causal)
    if use_triton(_OP, q.device):
        o, lse = _Attention.apply(q, k, v, causal, scale)
    else:
        o, lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return (o, lse) if return_lse else o


__all__ = ["attention"]
