"""Cross-entropy of rows of logits, and its gradient written over the logits, in one kernel.

``cross_entropy_rows_`` is the per-chunk step of ``fused_remat.linear_cross_entropy``: for each row
of a chunk of logits (in the compute dtype, as the LM head's matmul wrote them) it takes the
log-sum-exp in fp32 and the row's loss, and, where a gradient is wanted, turns the row in place
into ``scale * (softmax - onehot)`` rounded to the logits' dtype, ready for the two gradient
matmuls. Each program takes a few rows (one where the vocabulary is wide) in two sweeps: the
log-sum-exp online (a running maximum and the sum rescaled to it, Milakov and Gimelshein), then the
gradient. Eager PyTorch runs the same step as about twenty element-wise operations, each a launch
and a pass over the chunk, with an fp32 copy of it between them.

``target_statistics_`` runs once per call before the chunks: it counts the targets that are not
ignored, finds any outside the vocabulary and writes the mean's scales (the forward's share, baked
into the gradient, and the backward's), all on the device, so that no value has to reach the host
before the chunks are launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, SEPARATE_ROUNDING, KeptKernel, LaunchPlans, cdiv, launch_key, next_power_of_2
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
    """losses[r] = lse(logits[r]) - logits[r, t] for a target t in [0, V) other than ignore_index,
    else 0 (a row that does not count); with WANT_GRAD, logits[r] = scale * (softmax(logits[r]) -
    onehot(t)), 0 on a row that does not count. SCALE: the scale, or with SCALE_ON_DEVICE a pointer
    to it.

    exp(x - (lse - log scale)) is scale * softmax(x): the scale costs no multiply of its own, and
    a row that does not count is shifted by +inf, which makes its gradient exactly 0."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # rows past M read row M - 1 (and store nothing): every value loaded is a real logit
    rows64 = tl.minimum(rows, M - 1).to(tl.int64)
    target = tl.load(TARGETS + rows64)
    # a target outside [0, V) (which target_statistics_ has turned into a NaN step) reads no logit
    counted = (target != ignore_index) & (target >= 0) & (target < V)
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


# What target_statistics_ writes into its statistics, by index: the forward's scale, the loss's
# divisor and whether some target lies outside the vocabulary (1.0) or none does (0.0); the
# backward's scale goes into a tensor of its own (the one thing backward keeps of them)
FORWARD_SCALE, DIVISOR, OUT_OF_RANGE = range(3)
STATISTICS = 3
# the same indices as the kernel reads them (a kernel sees only constexpr globals)
_AT_FORWARD_SCALE, _AT_DIVISOR, _AT_OUT_OF_RANGE = map(tl.constexpr, (FORWARD_SCALE, DIVISOR, OUT_OF_RANGE))


@triton.jit
def _target_statistics(TARGETS, STATS, BACKWARD_SCALE, T, V, ignore_index, BLOCK: tl.constexpr):
    """STATS[FORWARD_SCALE, DIVISOR, OUT_OF_RANGE] and BACKWARD_SCALE for the T targets: with n those
    other than ignore_index (at least 1) and 2**k the power of two with n in [2**k, 2**(k+1)), the
    mean's 1/n as 2**k / n (in (0.5, 1], rounded to fp32 from fp64 as the host's double would be)
    times 2**-k (exact), the divisor n, and whether one of the n lies outside [0, V). Where one does,
    the scales and the divisor are NaN: the loss and every gradient come out NaN, never silently
    wrong. One program: a call's targets are a few thousand to a few million, a few loads each."""
    offsets = tl.arange(0, BLOCK)
    counted = tl.zeros([BLOCK], dtype=tl.int32)
    outside = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, T, BLOCK):
        index = start + offsets
        target = tl.load(TARGETS + index, mask=index < T, other=ignore_index)
        counts = target != ignore_index
        counted += counts.to(tl.int32)
        outside += (counts & ((target < 0) | (target >= V))).to(tl.int32)
    n = tl.maximum(tl.sum(counted, axis=0), 1).to(tl.float64)
    # 2**k: n's fp64 bits with the mantissa cleared
    power = ((n.to(tl.int64, bitcast=True) >> 52) << 52).to(tl.float64, bitcast=True)
    poison = tl.where(tl.sum(outside, axis=0) > 0, float("nan"), 0.0)
    tl.store(STATS + _AT_FORWARD_SCALE, (power / n).to(tl.float32) + poison)
    tl.store(BACKWARD_SCALE, (1.0 / power).to(tl.float32) + poison)
    tl.store(STATS + _AT_DIVISOR, n.to(tl.float32) + poison)
    tl.store(STATS + _AT_OUT_OF_RANGE, tl.where(poison != poison, 1.0, 0.0))


_CROSS_ENTROPY, _TARGET_STATISTICS = KeptKernel(_cross_entropy_rows), KeptKernel(_target_statistics)
# Per call signature (kernels.launch.LaunchPlans): the launch bound with everything but its tensors
_PLANS, _STATISTICS_PLANS = LaunchPlans(), LaunchPlans()
# Targets a step of _target_statistics loads
STATISTICS_BLOCK = 4096


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
    if isinstance(scale, torch.Tensor) and (scale.numel() < 1 or scale.dtype != torch.float32):
        raise ValueError(f"scale must be a float or a float32 tensor holding it first, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


def cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, ignore_index: int,
                        scale: float | torch.Tensor | None = None) -> None:
    """Writes each row's cross-entropy into ``losses`` (fp32): the log-sum-exp of ``logits`` (rows,
    V) in fp32 less the logit of ``targets`` (int64 class ids; a row whose target is
    ``ignore_index`` does not count: loss 0). With ``scale`` (a float, or an fp32 tensor on the
    device holding it first, read there: no host sync) also writes ``scale * (softmax - onehot)``
    over ``logits``, in place, rounded to their dtype (0 on rows that do not count). A target outside
    [0, V) does not count either and reads no logit: the caller makes such a step NaN
    (``target_statistics_``) or refuses it."""
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


def target_statistics_(targets: torch.Tensor, vocab: int, ignore_index: int, stats: torch.Tensor,
                       backward_scale: torch.Tensor) -> None:
    """Writes ``stats`` (fp32, STATISTICS elements, contiguous) and ``backward_scale`` (a 0-dim fp32
    tensor) from ``targets`` (contiguous int64 class ids) as ``_target_statistics`` says: nothing is
    read on the host."""
    key = (launch_key(_TARGET_STATISTICS.compiled, (targets, stats, backward_scale)), vocab, ignore_index)
    launch = _STATISTICS_PLANS.get(key)
    if launch is not None:
        launch(targets, stats, backward_scale)
        return
    if targets.dim() != 1 or targets.dtype != torch.int64 or (targets.numel() > 1 and targets.stride(0) != 1):
        raise ValueError(f"targets must be contiguous 1-D int64, got {targets.dtype} {tuple(targets.shape)} "
                         f"strides {targets.stride()}")
    if stats.shape != (STATISTICS,) or stats.dtype != torch.float32 or stats.stride(0) != 1:
        raise ValueError(f"stats must be contiguous float32 of shape ({STATISTICS},), got {stats.dtype} "
                         f"{tuple(stats.shape)}")
    if backward_scale.shape != () or backward_scale.dtype != torch.float32:
        raise ValueError(f"backward_scale must be a 0-dim float32 tensor, got {backward_scale.dtype} "
                         f"{tuple(backward_scale.shape)}")
    launch = _TARGET_STATISTICS.bind((1,), (targets, stats, backward_scale), (targets.numel(), vocab, ignore_index),
                                     BLOCK=STATISTICS_BLOCK, num_warps=8, **SEPARATE_ROUNDING)
    if launch is not None:
        _STATISTICS_PLANS.keep(key, launch)
