"""GELU (exact and tanh) and SwiGLU, forward and backward, element-wise in fp32 registers.

Backward takes the pre-activation(s) and recomputes what it needs (the CDF, the sigmoid) in
registers, so the activation output is never kept for backward. The SwiGLU backward can also write
the recomputed output silu(gate) * up, which a following linear layer needs for its weight
gradient: one pass produces both.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .precision import round_to

BLOCK = 1024
NUM_WARPS = 4

GELU_APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _tanh(z):
    # Through exp of a non-positive argument: portable to every Triton version and the
    # interpreter, never overflows, and saturates to +-1 cleanly.
    e = tl.exp(-2.0 * tl.abs(z))
    magnitude = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -magnitude, magnitude)


@triton.jit
def _gelu_and_derivative(x, APPROXIMATE_TANH: tl.constexpr):
    """gelu(x) and d gelu / dx for fp32 x."""
    if APPROXIMATE_TANH:
        sqrt_2_over_pi = 0.7978845608028654
        inner = sqrt_2_over_pi * (x + 0.044715 * x * x * x)
        t = _tanh(inner)
        value = 0.5 * x * (1.0 + t)
        derivative = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * sqrt_2_over_pi * (1.0 + 3.0 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        value = x * cdf
        derivative = cdf + x * pdf
    return value, derivative


@triton.jit
def _gelu_fwd(X, Y, n_elements, APPROXIMATE_TANH: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    y, _ = _gelu_and_derivative(x, APPROXIMATE_TANH)
    tl.store(Y + offsets, round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(X, DY, DX, n_elements, APPROXIMATE_TANH: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    _, derivative = _gelu_and_derivative(x, APPROXIMATE_TANH)
    tl.store(DX + offsets, round_to(dy * derivative, DX.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd(GATE, UP, Y, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + offsets, round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(GATE, UP, DY, DGATE, DUP, Y, n_elements, WRITE_Y: tl.constexpr, BLOCK: tl.constexpr):
    """d/dgate silu(g) u = u * s * (1 + g (1 - s)), s = sigmoid(g); d/dup = silu(g)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(DGATE + offsets, round_to(dgate, DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offsets, round_to(dy * silu, DUP.dtype.element_ty), mask=mask)
    if WRITE_Y:
        tl.store(Y + offsets, round_to(silu * up, Y.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _grid(n_elements: int) -> tuple[int]:
    return (max(1, triton.cdiv(n_elements, BLOCK)),)


def _check_approximation(approximate: str) -> bool:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return approximate == "tanh"


def gelu_fwd(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """y = gelu(x) in x's dtype, computed in fp32. Any shape; non-contiguous x is copied."""
    tanh = _check_approximation(approximate)
    x = _flat(x)
    y = torch.empty_like(x)
    if x.numel():
        _gelu_fwd[_grid(x.numel())](x, y, x.numel(), APPROXIMATE_TANH=tanh, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return y


def gelu_bwd(dy: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """dx = dy * gelu'(x), recomputing gelu' from x."""
    tanh = _check_approximation(approximate)
    x, dy = _flat(x), _flat(dy)
    dx = torch.empty_like(x)
    if x.numel():
        _gelu_bwd[_grid(x.numel())](x, dy, dx, x.numel(), APPROXIMATE_TANH=tanh, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dx


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = silu(gate) * up in gate's dtype; gate and up of one shape."""
    gate, up = _flat(gate), _flat(up)
    y = torch.empty_like(gate)
    if gate.numel():
        _swiglu_fwd[_grid(gate.numel())](gate, up, y, gate.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, return_output: bool = False):
    """(dgate, dup), plus the recomputed y = silu(gate) * up when ``return_output`` (else None)."""
    gate, up, dy = _flat(gate), _flat(up), _flat(dy)
    dgate = torch.empty_like(gate)
    dup = torch.empty_like(up)
    y = torch.empty_like(gate) if return_output else dgate
    if gate.numel():
        _swiglu_bwd[_grid(gate.numel())](
            gate, up, dy, dgate, dup, y, gate.numel(), WRITE_Y=return_output, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return dgate, dup, (y if return_output else None)
