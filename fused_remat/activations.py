"""GELU and SwiGLU whose backward keeps only the pre-activation(s).

Saved for backward: gelu keeps x; swiglu keeps gate and up. Recomputed in the backward kernel: the
GELU derivative from x, the sigmoid of gate. The activation output is never stored.
"""

from __future__ import annotations

import torch

from . import custom_ops, reference
from .backend import use_triton
from .kernels.limits import check_same_device, check_same_dtype, check_tensor


@custom_ops.cached_forward_signature
class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(x, approximate: str, untraced: bool):
        return (custom_ops.direct if untraced else custom_ops.ops(x.device)).gelu_fwd(x, approximate)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, approximate, _ = inputs
        ctx.save_for_backward(x)  # only the input: the kernel recomputes gelu'(x)
        ctx.approximate = approximate

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx, _ = custom_ops.ops(dy.device).gelu_bwd(dy, x, ctx.approximate, False)
        return custom_ops.first_order_only("gelu", dx, None, None)


@custom_ops.cached_forward_signature
class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(gate, up, untraced: bool):
        return (custom_ops.direct if untraced else custom_ops.ops(gate.device)).swiglu_fwd(gate, up)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:2])  # gate and up: the kernel recomputes the sigmoid

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup, _ = custom_ops.ops(dy.device).swiglu_bwd(dy, gate, up, False)
        return custom_ops.first_order_only("swiglu", dgate, dup, None)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of x (any shape): x * Phi(x), or the tanh approximation with ``approximate="tanh"``.
    Backward keeps only x."""
    check_tensor("gelu", "x", x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if not use_triton("gelu", x.device):
        return reference.gelu(x, approximate)
    return custom_ops.apply(_Gelu, x.device, x, approximate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of one shape and dtype. Backward keeps only gate and up."""
    check_tensor("swiglu", "gate", gate)
    check_tensor("swiglu", "up", up)
    check_same_device("swiglu", "gate", gate, up=up)
    check_same_dtype("swiglu", "gate", gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: up has shape {tuple(up.shape)} but gate has {tuple(gate.shape)}; they must match")
    if not use_triton("swiglu", gate.device):
        return reference.swiglu(gate, up)
    return custom_ops.apply(_SwiGLU, gate.device, gate, up)
