"""Scaled dot-product attention that saves q, k, v, o and one fp32 log-sum-exp per row for backward.

The Nq x Nk probability matrix is never stored: the backward kernels rebuild it block by block
from q, k and the log-sum-exp (P = exp(q k^T * scale - lse)) while they compute the gradients.
Two layouts: dense batches (``attention``) and documents packed one after another with
FlashAttention 2's ``cu_seqlens`` (``attention_varlen``). Both take FlashAttention 2's sliding
window and softcap; key tiles that the mask hides from every row of a query tile are skipped.
"""

from __future__ import annotations

import itertools
import operator

import torch

from . import custom_ops, reference
from .backend import use_triton
from .kernels.limits import (check_attention_args, check_softcap, check_varlen_args, check_varlen_offsets,
                             check_window)

_OP = "attention"
_VARLEN_OP = "attention_varlen"


@custom_ops.cached_forward_signature
class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, window: list[int], softcap: float, untraced: bool):
        ops = custom_ops.direct if untraced else custom_ops.ops(q.device)
        return ops.attention_fwd(q, k, v, causal, scale, window, softcap)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale, window, softcap, _ = inputs
        o, lse = output
        # Everything kept for backward, in one place: the inputs q, k, v, the output o and the fp32
        # log-sum-exp (B, Hq, Nq). Nothing of size Nq x Nk.
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask = (causal, scale, window, softcap)
        ctx.set_materialize_grads(False)  # an unused output (usually lse) brings None, not zeros

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None and dlse is None:
            return None, None, None, None, None, None, None, None
        if do is None:
            do = torch.zeros_like(o)
        # The kernels recompute P = exp(q k^T * scale - lse) per block from q, k and the saved lse.
        # A gradient reaching lse (return_lse=True) enters as dS += P * dlse, folded into delta.
        dq, dk, dv = custom_ops.ops(q.device).attention_bwd(do, q, k, v, o, lse, dlse, *ctx.mask)
        return custom_ops.first_order_only(_OP, dq, dk, dv, None, None, None, None, None)


@custom_ops.cached_forward_signature
class _VarlenAttention(torch.autograd.Function):
    """cu_seqlens_k None: the keys' offsets are the queries' (torch.compile cannot trace a Function
    given one tensor twice, and self-attention passes the same offsets for both)."""

    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                scale: float, window: list[int], softcap: float, untraced: bool):
        ops = custom_ops.direct if untraced else custom_ops.ops(q.device)
        key_offsets = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        return ops.attention_varlen_fwd(q, k, v, cu_seqlens_q, key_offsets, max_seqlen_q, max_seqlen_k, causal, scale,
                                        window, softcap)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, _ = inputs
        o, lse = output
        # Everything kept for backward, in one place: q, k, v, o, the fp32 log-sum-exp (Hq, total_q)
        # and the document offsets (int32, documents + 1 each).
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k)
        ctx.mask = (max_seqlen_q, max_seqlen_k, causal, scale, window, softcap)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        nothing = (None,) * 9
        if do is None and dlse is None:
            return None, None, None, *nothing
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = custom_ops.ops(q.device).attention_varlen_bwd(do, q, k, v, o, lse, dlse, cu_seqlens_q,
                                                                   cu_seqlens_k, *ctx.mask)
        return custom_ops.first_order_only(_VARLEN_OP, dq, dk, dv, *nothing)


# The argument signatures that passed an op's checks, each with the (scale, window, softcap) they
# gave: a call whose signature is here skips them. A key holds everything the checks read (the
# tensors' shapes, dtypes, devices and last strides, the options), so it is made only where the
# options are plain Python values (a window given as tensors is checked at every call). The
# offsets' values are not in it: attention_varlen checks them at every call (check_varlen_offsets,
# which reads each tensor version once).
_CHECKED: dict[tuple, tuple] = {}
_MOST_CHECKED = 4096


def _checked(op: str, tensors: tuple, scale, window, softcap, check) -> tuple[float, tuple[int, int], float]:
    """(scale, window, softcap) as ``op``'s checks give them (``check()`` runs all but the window's
    and softcap's, and gives the scale), once per signature of ``tensors`` and the options; ``op``
    may carry more options that the checks read. While torch.compile traces, every time (it traces
    the checks, not the table)."""
    key = None
    if (not torch.compiler.is_dynamo_compiling() and all(map(isinstance, tensors, itertools.repeat(torch.Tensor))) and (scale is None or type(scale) is float) and type(softcap) is float
            and type(window) in (tuple, list) and len(window) == 2 and type(window[0]) is int
            and type(window[1]) is int):
        key = (op, *map(_SIGNATURE, tensors), *map(_LAST_STRIDE, tensors), scale, *window, softcap)
        checked = _CHECKED.get(key)
        if checked is not None:
            return checked
    checked = (check(), check_window(op, window), check_softcap(op, softcap))
    if key is not None:
        if len(_CHECKED) >= _MOST_CHECKED:
            _CHECKED.clear()
        _CHECKED[key] = checked
    return checked


_SIGNATURE = operator.attrgetter("shape", "dtype", "device")
_LAST_STRIDE = operator.methodcaller("stride", -1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
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
        natural-log log-sum-exp of each row's (softcapped) scaled scores (differentiable).

    ``scale`` defaults to 1/sqrt(D). Masks are aligned to the bottom-right, as in FlashAttention 2:
    query i's diagonal key is i + Nk - Nq. ``causal=True``: query i sees keys up to its diagonal.
    ``window=(left, right)``: it sees keys from ``left`` before to ``right`` after its diagonal (-1:
    unbounded; with causal, right is 0), and key tiles outside every row's window are skipped, so a
    window W costs about N W, not N^2 (ints, or integer CPU tensors as FlashAttention 2's callers
    pass them). ``softcap`` > 0 turns the scaled scores s into
    softcap * tanh(s / softcap) before the softmax (Gemma 2); 0 is off. A row that sees no key
    (causal with Nq > Nk, a window beyond the keys) gives output 0, zero gradients and lse -inf.

    For backward only q, k, v, o and lse are saved; P is recomputed from lse.
    """
    scale, window, softcap = _checked(_OP, (q, k, v), scale, window, softcap,
                                      lambda: check_attention_args(_OP, q, k, v, scale))
    causal = bool(causal)
    if use_triton(_OP, q.device):
        o, lse = custom_ops.apply(_Attention, q.device, q, k, v, causal, scale, list(window), softcap)
    else:
        o, lse = reference.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                     return_lse=True)
    return (o, lse) if return_lse else o


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """``attention`` over documents packed one after another (FlashAttention 2's
    ``flash_attn_varlen_func``): each document attends only within itself, and its cost is its own
    length's, never the packed total's.

    Shapes:
        q: (total_q, Hq, D); k, v: (total_k, Hkv, D), dtypes, head counts and strides as in
        ``attention``. cu_seqlens_q, cu_seqlens_k: int32 (documents + 1,) on q's device, starting
        at 0, non-decreasing, ending at total_q / total_k: document i is rows
        cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v
        (empty documents allowed). max_seqlen_q, max_seqlen_k: at least the longest document.
    Returns:
        o: (total_q, Hq, D) in q's dtype; with ``return_lse=True`` also lse: (Hq, total_q) fp32.

    ``causal``, ``window`` and ``softcap`` as in ``attention``, aligned to each document's own
    bottom-right corner (its query and key lengths may differ). The offsets are checked on the host
    (one device-to-host copy per tensor version, so the same offsets are read once; skipped under
    torch.compile).
    """
    if type(max_seqlen_q) is int and type(max_seqlen_k) is int:
        scale, window, softcap = _checked(
            (_VARLEN_OP, max_seqlen_q, max_seqlen_k), (q, k, v, cu_seqlens_q, cu_seqlens_k), scale, window, softcap,
            lambda: check_varlen_args(_VARLEN_OP, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      scale))
        check_varlen_offsets(_VARLEN_OP, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    else:
        scale = check_varlen_args(_VARLEN_OP, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
        window, softcap = check_window(_VARLEN_OP, window), check_softcap(_VARLEN_OP, softcap)
    causal = bool(causal)
    if use_triton(_VARLEN_OP, q.device):
        key_offsets = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
        o, lse = custom_ops.apply(_VarlenAttention, q.device, q, k, v, cu_seqlens_q, key_offsets, int(max_seqlen_q),
                                  int(max_seqlen_k), causal, scale, list(window), softcap)
    else:
        o, lse = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            causal=causal, scale=scale, window=window, softcap=softcap,
                                            return_lse=True)
    return (o, lse) if return_lse else o


__all__ = ["attention", "attention_varlen"]
