"""GELU and SwiGLU whose backward keeps only the pre-activation(s).

Saved for backward: gelu keeps x; swiglu keeps gate and up. Recomputed in the backward kernel: the
GELU derivative from x, the sigmoid of gate. The activation output is never stored.
"""

from __future__ import annotations

import torch

from . import reference
from .backend import use_triton
from .checks import check_same_device, check_same_dtype, check_tensor


class GeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate):
        from .kernels.activations import gelu_fwd

        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return gelu_fwd(x, approximate)

    @staticmethod
    def backward(ctx, dy):
        from .kernels.activations import gelu_bwd

        (x,) = ctx.saved_tensors
        dx, _ = gelu_bwd(dy, x, ctx.approximate)
        return dx, None


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        from .kernels.activations import swiglu_fwd

        ctx.save_for_backward(gate, up)
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        from .kernels.activations import swiglu_bwd

        gate, up = ctx.saved_tensors
        dgate, dup, _ = swiglu_bwd(dy, gate, up)
        return dgate, dup


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of x (any shape): x * Phi(x), or the tanh approximation with ``approximate="tanh"``.
    Backward keeps only x."""
    check_tensor("gelu", "x", x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if not use_triton("gelu", x.device):
        return reference.gelu(x, approximate)
    return GeluFunction.apply(x, approximate)


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
    return SwiGLUFunction.apply(gate, up)
