"""LayerNorm and RMSNorm whose backward keeps only x and fp32 per-row statistics.

Saved for backward: x, plus mean and rstd (LayerNorm) or rstd (RMSNorm), fp32, one per row.
Recomputed in the backward kernel: x_hat = (x - mean) * rstd, never stored.
"""

from __future__ import annotations

import torch

from . import custom_ops, reference
from .backend import use_triton
from .kernels.limits import check_eps, check_same_device, check_tensor
from .kernels.limits import MAX_NORM_WIDTH


# The argument signatures that passed _validate: a call whose signature is here skips it. A key holds
# everything the checks read (dtypes, devices, x's rank and last dim, the weight's and bias's shapes,
# eps), so it is made only of tensors and a float eps; anything else is checked at every call.
_VALID: set[tuple] = set()
_MOST_VALID = 4096


def _checked(op: str, x, weight, bias, eps) -> None:
    """``_validate`` once per argument signature (every time while torch.compile traces: it traces
    the checks, not the table)."""
    if (not torch.compiler.is_dynamo_compiling() and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and type(eps) is float
            and (bias is None or isinstance(bias, torch.Tensor))):
        key = (op, x.dtype, x.device, x.dim() and x.shape[-1], weight.shape, weight.dtype, weight.device,
               None if bias is None else (bias.shape, bias.dtype, bias.device), eps)
        if key in _VALID:
            return
        _validate(op, x, weight, bias, eps)
        if len(_VALID) >= _MOST_VALID:
            _VALID.clear()
        _VALID.add(key)
    else:
        _validate(op, x, weight, bias, eps)


def _validate(op: str, x, weight, bias, eps) -> None:
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight)
    if bias is not None:
        check_tensor(op, "bias", bias)
    check_same_device(op, "x", x, weight=weight, bias=bias)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the normalized one), got a scalar")
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_NORM_WIDTH:
        raise ValueError(f"{op}: x's last dim (the normalized size) must be in 1..{MAX_NORM_WIDTH}, got {hidden}")
    if weight.shape != (hidden,):
        raise ValueError(f"{op}: weight must have shape ({hidden},) to match x's last dim, got {tuple(weight.shape)}")
    if bias is not None:
        if bias.shape != (hidden,):
            raise ValueError(f"{op}: bias must have shape ({hidden},) to match x's last dim, got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}; they must match")
    check_eps(op, eps)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, hidden) with unit column stride, a view whenever possible (x itself where it is
    one already: a view is not free on the host, and this runs on every call)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@custom_ops.cached_forward_signature
class _NormFunction(torch.autograd.Function):
    """LayerNorm (``rms=False``) or RMSNorm of x's rows: keeps x, the weight and the fp32 statistics."""

    @staticmethod
    def forward(x, weight, bias, eps: float, rms: bool, untraced: bool):
        ops = custom_ops.direct if untraced else custom_ops.ops(x.device)
        bias = None if bias is None else bias.contiguous()
        y, mean, rstd, _ = ops.norm_fwd(_rows(x), weight.contiguous(), bias, None, eps, rms, None)
        return (y if x.dim() == 2 else y.view(x.shape)), mean, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, _, rms, _ = inputs
        _, mean, rstd = output
        # Everything kept for backward: x, the weight, mean (empty for RMSNorm) and rstd.
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        ctx.mark_non_differentiable(mean, rstd)

    @staticmethod
    def backward(ctx, dy, *_):  # mean's and rstd's gradients (never any), where they are outputs
        # The kernel rebuilds x_hat = (x - mean) * rstd in registers; it is never stored.
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias, _ = custom_ops.ops(dy.device).norm_bwd(_rows(dy), _rows(x), weight.contiguous(), None, mean,
                                                                   rstd, None, ctx.rms, ctx.has_bias, False, None)
        return custom_ops.first_order_only("rms_norm" if ctx.rms else "layer_norm",
                                           dx if dy.dim() == 2 else dx.view(dy.shape), dweight,
                                           dbias if ctx.has_bias else None, None, None, None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim of x (..., hidden), hidden in 1..65536.

    weight, bias: (hidden,), fp32 or x's dtype (fp32 weights with bf16 x is mixed precision).
    Returns x's shape and dtype. Backward keeps x plus fp32 mean and rstd per row.
    """
    _checked("layer_norm", x, weight, bias, eps)
    if not use_triton("layer_norm", x.device):
        return reference.layer_norm(x, weight, bias, eps)
    return custom_ops.apply_first(_NormFunction, x.device, x, weight, bias, float(eps), False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of x (..., hidden), hidden in 1..65536: x * rsqrt(mean(x^2) + eps) * weight.

    weight: (hidden,), fp32 or x's dtype. Returns x's shape and dtype. Backward keeps x plus fp32 rstd per row.
    """
    _checked("rms_norm", x, weight, None, eps)
    if not use_triton("rms_norm", x.device):
        return reference.rms_norm(x, weight, eps)
    return custom_ops.apply_first(_NormFunction, x.device, x, weight, None, float(eps), True)
