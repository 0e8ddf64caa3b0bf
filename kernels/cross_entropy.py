"""Cross-entropy of rows of logits, and its gradient written over the logits, in one kernel.

``cross_entropy_rows_`` is the per-chunk step of ``fused_remat.linear_cross_entropy``: for each row
of a chunk of logits (in the compute dtype, as the LM head's matmul wrote them) it takes the
log-sum-exp in fp32 and the row's loss, and, where a gradient is wanted, turns the row in place
into ``scale * (softmax - onehot)`` rounded to the logits' dtype, ready for the two gradient
matmuls. Each program takes a few rows (one where the vocabulary is wide) in two sweeps: the
log-sum-exp online (a running maximum and the sum rescaled to it, Milakov and Gimelshein), then the
gradient. Eager PyTorch runs the same step as about twenty element-wise operations, each a launch
and a pass over the chunk, with an fp32 copy of it between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, KeptKernel, LaunchPlans, cdiv, launch_key, next_power_of_2
from .precision import round_to

# Logits a program holds at a time: 16 fp32 values a thread at 32 warps. A default chunk has few
# rows (about as many logits as hidden has elements: 128 rows of GPT-2's vocabulary at 8k tokens),
# so each row's program must keep many loads in flight to draw the memory bandwidth. Narrow rows
# share a program, up to 16 of them.
TILE_ELEMENTS = 16384


@triton.jit
def _cross_entropy_rows(
    LOGITS, TARGETS, LOSSES, SCALE, M, V, stride_logits, ignore_index,
    WANT_GRAD: tl.constexpr, SCALE_ON_DEVICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """losses[r] = lse(logits[r]) - logits[r, t] for a target t other than ignore_index, else 0 (a
    row that does not count); with WANT_GRAD, logits[r] = scale * (softmax(logits[r]) - onehot(t)),
    0 on a row that does not count. SCALE: the scale, or with SCALE_ON_DEVICE a pointer to it.

    exp(x - (lse - log scale)) is scale * softmax(x): the scale costs no multiply of its own, and
    a row that does not count is shifted by +inf, which makes its gradient exactly 0."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # rows past M read row M - 1 (and store nothing): every value loaded is a real logit
    rows64 = tl.minimum(rows, M - 1).to(tl.int64)
    target = tl.load(TARGETS + rows64)
    counted = target != ignore_index
    base = LOGITS + rows64 * stride_logits
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        col = start + cols
        x = tl.load(base[:, None] + col[None, :], mask=(col < V)[None, :], other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target_logit = tl.load(base + tl.where(counted, target, 0)).to(tl.float32)
    tl.store(LOSSES + rows, tl.where(counted, lse - target_logit, 0.0), mask=row_mask)
    if WANT_GRAD:
        if SCALE_ON_DEVICE:
            scale = tl.load(SCALE)
        else:
            scale = SCALE
        shift = tl.where(counted, lse - tl.log(scale), float("inf"))
        onehot_col = tl.where(counted, target, -1)  # ignore_index may be a column
        for start in range(0, V, BLOCK_V):
            col = start + cols
            mask = row_mask[:, None] & (col < V)[None, :]
            x = tl.load(base[:, None] + col[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            grad = tl.exp(x - shift[:, None])
            grad = tl.where(col[None, :] == onehot_col[:, None], grad - scale, grad)
            tl.store(base[:, None] + col[None, :], round_to(grad, LOGITS.dtype.element_ty), mask=mask)


_CROSS_ENTROPY = KeptKernel(_cross_entropy_rows)
# Per call signature (kernels.launch.LaunchPlans): the launch bound with everything but its tensors
_PLANS = LaunchPlans()


def _tiling(vocab: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_V, num_warps) for rows of ``vocab`` logits."""
    block_v = min(next_power_of_2(vocab), TILE_ELEMENTS)
    block_m = max(1, min(16, TILE_ELEMENTS // block_v))
    return block_m, block_v, max(1, min(32, block_m * block_v // 512))


def _check(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, scale) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"logits must be 2-D (rows, vocab >= 1) with unit column stride, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    rows = logits.shape[0]
    if targets.shape != (rows,) or targets.dtype != torch.int64 or (rows > 1 and targets.stride(0) != 1):
        raise ValueError(f"targets must be contiguous int64 of shape ({rows},), got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if losses.shape != (rows,) or losses.dtype != torch.float32 or (rows > 1 and losses.stride(0) != 1):
        raise ValueError(f"losses must be contiguous float32 of shape ({rows},), got {losses.dtype} "
                         f"{tuple(losses.shape)}")
    if isinstance(scale, torch.Tensor) and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(f"scale must be a float or a one-element float32 tensor, got {scale.dtype} {tuple(scale.shape)}")


def cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, ignore_index: int,
                        scale: float | torch.Tensor | None = None) -> None:
    """Writes each row's cross-entropy into ``losses`` (fp32): the log-sum-exp of ``logits`` (rows,
    V) in fp32 less the logit of ``targets`` (int64 class ids; a row whose target is
    ``ignore_index`` does not count: loss 0). With ``scale`` (a float, or a one-element fp32 tensor
    on the device, read there: no host sync) also writes ``scale * (softmax - onehot)`` over
    ``logits``, in place, rounded to their dtype (0 on rows that do not count). Every other target
    must lie in [0, V): the caller checks them."""
    on_device = isinstance(scale, torch.Tensor)
    key = (launch_key(_CROSS_ENTROPY.compiled, (logits, targets, losses, *((scale,) if on_device else ()))),
           ignore_index, scale is None)
    launch = _PLANS.get(key)
    if launch is None:
        _check(logits, targets, losses, scale)
    if logits.shape[0] == 0:
        return
    tensors = (logits, targets, losses, losses if scale is None else scale)
    if launch is not None:
        launch(*tensors)
        return
    rows, vocab = logits.shape
    block_m, block_v, num_warps = _tiling(vocab)
    launch = _CROSS_ENTROPY.bind((cdiv(rows, block_m),), tensors, (rows, vocab, logits.stride(0), ignore_index),
                                 WANT_GRAD=scale is not None, SCALE_ON_DEVICE=scale is None or on_device,
                                 BLOCK_M=block_m, BLOCK_V=block_v, num_warps=num_warps, **FP_FUSION)
    if launch is not None:
        _PLANS.keep(key, launch)
