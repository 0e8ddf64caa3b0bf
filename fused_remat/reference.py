"""Plain-PyTorch twins of every fused_remat op: the test oracle and the CPU fallback.

Same math and argument conventions as the Triton path: statistics in fp32, outputs in the input
dtype. Call them with float64 tensors to get the high-precision reference the tests compare with.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _statistics_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    compute = _statistics_dtype(x)
    xf = x.to(compute)
    mean = xf.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).square().mean(dim=-1, keepdim=True) + eps)
    y = (xf - mean) * rstd * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    compute = _statistics_dtype(x)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(compute)).to(x.dtype)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x.to(_statistics_dtype(x)), approximate=approximate).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    compute = _statistics_dtype(gate)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Materialized softmax(q k^T * scale) v with fused_remat's conventions.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq a multiple of Hkv. The causal mask is aligned to
    the bottom-right: query i sees keys j <= i + Nk - Nq. Rows that see no key give zeros, and their
    log-sum-exp is -inf. Scores and softmax in fp32 (fp64 for fp64 inputs); output in q's dtype.
    """
    compute = _statistics_dtype(q)
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k = k.repeat_interleave(group, dim=1).to(compute)
    v = v.repeat_interleave(group, dim=1).to(compute)
    scores = torch.matmul(q.to(compute), k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q_len, device=q.device).unsqueeze(1)
        cols = torch.arange(k_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows + (k_len - q_len), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0).unsqueeze(-1))
    out = torch.matmul(probs, v).to(q.dtype)
    if return_lse:
        return out, lse.to(compute)
    return out


def rotary_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/D) for i < D/2, computed in float64 and rounded once to fp32 (what the kernel reads)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return (1.0 / theta**exponents).to(torch.float32)


def rotary_embedding(x: torch.Tensor, theta: float, *, inverse: bool = False) -> torch.Tensor:
    """Rotary position embedding of x (B, N, H, D), positions 0..N-1 along dim 1.

    Half-split pairing (element i rotates with element i + D/2), as Hugging Face's LLaMA: per pair,
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with angle = position * theta^(-2i/D).
    ``inverse=True`` rotates by the opposite angle (the transpose, which is the backward).
    Angles in fp32 (fp64 for fp64 x), as the kernel; output in x's dtype.
    """
    compute = _statistics_dtype(x)
    head_dim = x.shape[-1]
    inv_freq = rotary_inverse_frequencies(head_dim, theta, x.device).to(compute)
    positions = torch.arange(x.shape[1], device=x.device, dtype=compute)
    angles = positions[:, None] * inv_freq[None, :]
    cos = torch.cos(angles)[None, :, None, :]
    sin = torch.sin(angles)[None, :, None, :]
    if inverse:
        sin = -sin
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
