"""Rotary position embedding applied in place, forward and inverse.

Inside the block it runs on the q and k heads of the packed qkv buffer right after the qkv
projection (``qkv.view(B, N, Hq + 2 * Hkv, D)[:, :, :Hq + Hkv]``), so the rotated q and k overwrite
the projected ones and never exist as a second tensor; backward applies the inverse rotation (the
transpose) to dq and dk in place the same way.

Math as ``fused_remat.reference.rope``: half-split pairs (i, i + D/2), angle =
float32(position) * inv_freq[i] as one fp32 product (bitwise the reference's angle), cos and sin in
fp32, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); ``inverse`` negates sin.

Positions: token n of each row sits at n by default, at one of two chunk starts for context
parallelism (``chunk_starts``), wherever a (B, N) ``positions`` tensor puts it (a user's
``position_ids``), or at its place in its document for documents packed by ``cu_seqlens``: each
token finds its document's first token by a binary search over the offsets (log2 of the documents
loads from offsets of 4 bytes a document, which stay in cache), so no (B, N) positions are built for
packed documents, on the host or the GPU. The choice is a constexpr: the kernel without positions compiles
to the same code as before they existed.

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
from .limits import MAX_HEAD_DIM, check_offsets_tensor
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
    n_documents, search_steps,
    INVERSE: tl.constexpr, HAS_POSITIONS: tl.constexpr, DOCUMENTS: tl.constexpr,
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
    elif DOCUMENTS:
        # POSITIONS holds the offsets over the B * N tokens. A token's document is the last one that
        # starts at or before it (an empty document starts where the next does: same start).
        first = tl.zeros_like(tokens)
        last = first + (n_documents - 1)
        for _ in range(search_steps):
            middle = (first + last + 1) // 2
            starts_before = tl.load(POSITIONS + middle) <= tokens
            first = tl.where(starts_before, middle, first)
            last = tl.where(starts_before, last, middle - 1)
        absolute = tokens - tl.load(POSITIONS + first)
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


def _check_documents(x: torch.Tensor, cu_seqlens, positions, chunk_starts) -> None:
    if positions is not None or chunk_starts is not None:
        raise ValueError("rope_: give one of cu_seqlens, positions and chunk_starts (each places every token)")
    check_offsets_tensor("rope_", "cu_seqlens", cu_seqlens)
    if cu_seqlens.stride(0) != 1:
        raise ValueError(f"rope_: cu_seqlens must be contiguous, got strides {cu_seqlens.stride()}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"rope_: cu_seqlens is on {cu_seqlens.device} but x is on {x.device}")


def rope_(x: torch.Tensor, inv_freq: torch.Tensor, *, inverse: bool = False,
          chunk_starts: tuple[int, int] | None = None, positions: torch.Tensor | None = None,
          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (B, N, H, D) in place by the rotary embedding of positions 0..N-1 and return x.

    ``chunk_starts=(first, second)`` (N even) instead places x's first N/2 tokens at positions
    first.. and the last N/2 at second..: a context-parallel rank's two zigzag chunks.

    ``positions`` (int32 or int64 (B, N) on x's device, any strides) instead places token (b, n) at
    positions[b, n]: documents packed in one row with positions restarting at each, or a user's
    position_ids. ``positions = arange(N)`` gives bitwise the default. Not with ``chunk_starts``.

    ``cu_seqlens`` (contiguous int32 (documents + 1,) on x's device) instead places each token at its
    place in its document, for documents packed by these offsets over the B * N tokens taken row
    after row (as ``fused_remat.attention_varlen``'s): bitwise ``positions`` from
    ``reference.document_positions``. The offsets are not read on the host (no sync): they must
    start at 0, never decrease and end at B * N, which the block's and the model's checks ensure.
    Not with ``positions`` or ``chunk_starts``.

    x: fp32/fp16/bf16, any strides with a contiguous last dim (e.g. the q,k heads of a packed qkv
    buffer). inv_freq: contiguous fp32 (D/2,), as ``reference.rope_inverse_frequencies``.
    ``inverse=True`` rotates by the opposite angles: the transpose, which maps dq, dk back.

    Every position must be below 2^24 in magnitude: it becomes an fp32 before the product with
    inv_freq, and fp32 holds integers exactly only up to 2^24. Negative positions rotate backwards.
    """
    # the tensor that places the tokens, if any: POSITIONS (else inv_freq stands in, never read)
    placing = positions if cu_seqlens is None else cu_seqlens
    key = None
    if isinstance(x, torch.Tensor) and isinstance(inv_freq, torch.Tensor) and (
            placing is None or isinstance(placing, torch.Tensor)):
        # everything the checks read and the launch depends on
        key = (launch_key(_ROPE.compiled, (x, inv_freq) if placing is None else (x, inv_freq, placing)),
               bool(inverse), None if chunk_starts is None else tuple(chunk_starts), positions is None,
               cu_seqlens is None)
        launch = _PLANS.get(key)
        if launch is not None:
            launch(x, inv_freq, inv_freq if placing is None else placing)
            return x
    _check(x, inv_freq)
    if cu_seqlens is not None:
        _check_documents(x, cu_seqlens, positions, chunk_starts)
    elif positions is not None:
        _check_positions(x, positions, chunk_starts)
    batch, seq_len, n_heads, head_dim = x.shape
    if x.numel() == 0:
        return x
    n_tokens = batch * seq_len
    half = head_dim // 2
    block_t, block_h, block_half = _blocks(n_tokens, n_heads, half)
    grid = (cdiv(n_tokens, block_t), cdiv(n_heads, block_h))
    split, first_start, second_start = (seq_len, 0, 0) if chunk_starts is None else (seq_len // 2, *chunk_starts)
    n_documents = 0 if cu_seqlens is None else cu_seqlens.numel() - 1
    launch = _ROPE.bind(
        grid, (x, inv_freq, inv_freq if placing is None else placing),
        (n_tokens, seq_len, n_heads, half, split, first_start, second_start, x.stride(0), x.stride(1), x.stride(2),
         *(positions.stride() if positions is not None else (0, 0)),
         # the searched range halves at each step, from all documents to one
         n_documents, max(n_documents - 1, 0).bit_length()),
        INVERSE=bool(inverse), HAS_POSITIONS=positions is not None, DOCUMENTS=cu_seqlens is not None,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=NUM_WARPS, **FP_FUSION,
    )
    if launch is not None and key is not None:
        _PLANS.keep(key, launch)
    return x
