"""Rotary position embedding applied in place, forward and inverse.

Inside the block it runs on the q and k heads of the packed qkv buffer right after the qkv
projection (``qkv.view(B, N, Hq + 2 * Hkv, D)[:, :, :Hq + Hkv]``), so the rotated q and k overwrite
the projected ones and never exist as a second tensor; backward applies the inverse rotation (the
transpose) to dq and dk in place the same way.

Math as ``fused_remat.reference.rope``: half-split pairs (i, i + D/2), angle =
float32(position) * inv_freq[i] as one fp32 product (bitwise the reference's angle), cos and sin in
fp32, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); ``inverse`` negates sin.

Positions: token n of each row sits at n by default, at one of two chunk starts for context
parallelism (``chunk_starts``), or wherever a (B, N) ``positions`` tensor puts it: packed documents
whose positions restart at each document, or a user's ``position_ids``. The choice is a constexpr, so
the kernel without positions compiles to the same code as before they existed.

Tiling: a program owns BLOCK_T tokens x BLOCK_H heads x all D/2 pairs. cos and sin depend only on
(token, pair), so each program computes them once for its [BLOCK_T, pairs] tile and reuses them for
every head it holds: with ~40 heads per token the trigonometry is amortised away and the kernel stays
memory-bound. Tokens (B*N, up to millions) go on grid axis 0; head blocks (a handful) on axis 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .launch import FP_FUSION, KeptKernel, LaunchPlans, cdiv, launch_key, next_power_of_2
from .limits import MAX_HEAD_DIM
from .precision import INTERPRETED, round_to

# Pairs (2 elements each) one program rotates: 4096 elements, 8 KiB of bf16 in and out.
PAIRS_PER_PROGRAM = 2048
NUM_WARPS = 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POSITION_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _cos_sin(angle):
    """fp32 cos and sin with full range reduction (angles reach ~1e6 at long positions).

    Compiled: libdevice's __nv_cosf/__nv_sinf, named explicitly so no approximate hardware sine
    can slip in. Interpreted: tl.cos/tl.sin (numpy fp32); libdevice calls return None there.
    """
    if INTERPRETED:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    else:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    return cos, sin


@triton.jit
def _rope(
    X, INV_FREQ, POSITIONS,
    n_tokens, seq_len, n_heads, half,
    split, first_start, second_start,
    stride_b, stride_n, stride_h,
    stride_positions_b, stride_positions_n,
    INVERSE: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    batch = tokens // seq_len
    position = tokens - batch * seq_len
    if HAS_POSITIONS:
        # int64 offsets (batch and position are int64), as for x: B * N may pass 2^31.
        absolute = tl.load(POSITIONS + batch * stride_positions_b + position * stride_positions_n,
                           mask=token_mask, other=0)
    else:
        # Local tokens before ``split`` sit at first_start + i, the rest at second_start + (i - split).
        absolute = tl.where(position < split, position + first_start, position - split + second_start)

    pairs = tl.arange(0, BLOCK_HALF)
    pair_mask = pairs < half
    inv_freq = tl.load(INV_FREQ + pairs, mask=pair_mask, other=0.0)
    # One rounded fp32 product, as the reference: position is exact in fp32 below 2^24.
    angle = absolute.to(tl.float32)[:, None] * inv_freq[None, :]
    cos, sin = _cos_sin(angle)
    if INVERSE:
        sin = -sin
    cos = cos[:, None, :]
    sin = sin[:, None, :]

    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = batch * stride_b + position * stride_n
    offsets = rows[:, None, None] + (heads * stride_h)[None, :, None] + pairs[None, None, :]
    mask = token_mask[:, None, None] & (heads < n_heads)[None, :, None] & pair_mask[None, None, :]

    x1 = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offsets + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(X + offsets, round_to(out1, X.dtype.element_ty), mask=mask)
    tl.store(X + offsets + half, round_to(out2, X.dtype.element_ty), mask=mask)


_ROPE = KeptKernel(_rope)
# The launch bound per call signature (kernels.launch.LaunchPlans)
_PLANS = LaunchPlans()


def _check(x: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"rope_ takes x of shape (B, N, H, D), got {getattr(x, 'shape', type(x))}")
    if x.dtype not in DTYPES:
        raise ValueError(f"rope_: x dtype must be one of {DTYPES}, got {x.dtype}")
    head_dim = x.shape[-1]
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"rope_: head dim D={head_dim} must be even and in 2..{MAX_HEAD_DIM}")
    if x.stride(-1) != 1:
        raise ValueError(f"rope_: x must have a contiguous last dim, got strides {x.stride()}")
    if not isinstance(inv_freq, torch.Tensor) or (
        inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32
        or not inv_freq.is_contiguous() or inv_freq.device != x.device
    ):
        got = (  # formatted only to raise: it cost more host time than the launch's other checks
            f"{inv_freq.dtype} {tuple(inv_freq.shape)} on {inv_freq.device}"
            if isinstance(inv_freq, torch.Tensor) else type(inv_freq).__name__
        )
        raise ValueError(
            f"rope_: inv_freq must be a contiguous float32 tensor of shape ({head_dim // 2},) "
            f"on {x.device} for D={head_dim}, got {got}"
        )


def _blocks(n_tokens: int, n_heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_HALF): all pairs, then as many heads, then as many tokens as fit
    PAIRS_PER_PROGRAM (at least one of each)."""
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(n_heads), max(1, PAIRS_PER_PROGRAM // block_half))
    block_t = min(next_power_of_2(n_tokens), max(1, PAIRS_PER_PROGRAM // (block_h * block_half)))
    return block_t, block_h, block_half


def _check_positions(x: torch.Tensor, positions, chunk_starts) -> None:
    if chunk_starts is not None:
        raise ValueError("rope_: give positions or chunk_starts, not both (each places every token)")
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"rope_: positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"rope_: positions must be int32 or int64, got {positions.dtype}")
    if positions.shape != x.shape[:2]:
        raise ValueError(
            f"rope_: positions must have shape (B, N) = {tuple(x.shape[:2])} of x, got {tuple(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"rope_: positions is on {positions.device} but x is on {x.device}")


def rope_(x: torch.Tensor, inv_freq: torch.Tensor, *, inverse: bool = False,
          chunk_starts: tuple[int, int] | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (B, N, H, D) in place by the rotary embedding of positions 0..N-1 and return x.

    ``chunk_starts=(first, second)`` (N even) instead places x's first N/2 tokens at positions
    first.. and the last N/2 at second..: a context-parallel rank's two zigzag chunks.

    ``positions`` (int32 or int64 (B, N) on x's device, any strides) instead places token (b, n) at
    positions[b, n]: documents packed in one row with positions restarting at each, or a user's
    position_ids. ``positions = arange(N)`` gives bitwise the default. Not with ``chunk_starts``.

    x: fp32/fp16/bf16, any strides with a contiguous last dim (e.g. the q,k heads of a packed qkv
    buffer). inv_freq: contiguous fp32 (D/2,), as ``reference.rope_inverse_frequencies``.
    ``inverse=True`` rotates by the opposite angles: the transpose, which maps dq, dk back.

    Every position must be below 2^24 in magnitude: it becomes an fp32 before the product with
    inv_freq, and fp32 holds integers exactly only up to 2^24. Negative positions rotate backwards.
    """
    has_positions = positions is not None
    key = None
    if isinstance(x, torch.Tensor) and isinstance(inv_freq, torch.Tensor) and (
            not has_positions or isinstance(positions, torch.Tensor)):
        # everything the checks read and the launch depends on
        key = (launch_key(_ROPE.compiled, (x, inv_freq, positions) if has_positions else (x, inv_freq)),
               bool(inverse), None if chunk_starts is None else tuple(chunk_starts))
        launch = _PLANS.get(key)
        if launch is not None:
            launch(x, inv_freq, positions if has_positions else inv_freq)
            return x
    _check(x, inv_freq)
    if has_positions:
        _check_positions(x, positions, chunk_starts)
    batch, seq_len, n_heads, head_dim = x.shape
    if x.numel() == 0:
        return x
    n_tokens = batch * seq_len
    half = head_dim // 2
    block_t, block_h, block_half = _blocks(n_tokens, n_heads, half)
    grid = (cdiv(n_tokens, block_t), cdiv(n_heads, block_h))
    split, first_start, second_start = (seq_len, 0, 0) if chunk_starts is None else (seq_len // 2, *chunk_starts)
    launch = _ROPE.bind(
        # Without positions the pointer is never read: inv_freq stands in.
        grid, (x, inv_freq, positions if has_positions else inv_freq),
        (n_tokens, seq_len, n_heads, half, split, first_start, second_start, x.stride(0), x.stride(1), x.stride(2),
         *(positions.stride() if has_positions else (0, 0))),
        INVERSE=bool(inverse), HAS_POSITIONS=has_positions,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=NUM_WARPS, **FP_FUSION,
    )
    if launch is not None and key is not None:
        _PLANS.keep(key, launch)
    return x
