"""LayerNorm and RMSNorm over the last dim, forward and backward, keeping only per-row statistics.

Forward writes y and the fp32 statistics (mean and rstd for LayerNorm, rstd for RMSNorm). Backward
rebuilds x-hat from x and the statistics in registers, so the normalized output is never stored.
RMSNorm is LayerNorm without centering: one pair of kernels serves both through ``IS_RMS``.

Rows of up to ``MAX_SINGLE_PASS_N`` columns (16384 forward, 8192 backward) are held in registers,
``BLOCK_M`` rows per program: each input read once, each output written once. Wider rows (up to
``limits.MAX_NORM_WIDTH``) are streamed in ``BLOCK_N`` chunks, one row per program, in two sweeps:
the row's input is read twice (``python -m bench traffic`` counts the bytes).

Weight/bias gradients are deterministic: each program of the backward grid accumulates its own
rows into its own row of an fp32 partial buffer, written once, and a second kernel
(``_sum_partials``) sums that buffer's rows in a fixed order into dW and dB, in the weight's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .launch import (SEPARATE_ROUNDING, KeptKernel, LaunchPlans, cdiv, launch_key, new_like, next_power_of_2,
                     persistent_program_count)
from .limits import MAX_NORM_WIDTH
from .precision import load_tile, round_to, store_tile

# Widest row held in registers. Backward holds more per element (x, dy, w, x-hat), so it spills at
# a narrower row than forward (ptxas on sm_90 at 16 warps) and streams sooner.
MAX_SINGLE_PASS_N = {"forward": 16384, "backward": 8192}
# Chunk of a streamed row, at 8 warps. The backward's persistent grid has 2 programs an SM: its
# chunk is small enough for both to be resident (docs/design.md, "Global-memory traffic").
STREAM_BLOCK_N = {"forward": 4096, "backward": 2048}


@triton.jit
def _load_vector(PTR, col, col_mask):
    return tl.load(PTR + col, mask=col_mask, other=0.0).to(tl.float32)


@triton.jit
def _scale_shift(x_hat, w, B, col, col_mask, HAS_BIAS: tl.constexpr):
    """The norm's output x_hat * w (+ b) in fp32."""
    y = x_hat * w[None, :]
    if HAS_BIAS:
        y += _load_vector(B, col, col_mask)[None, :]
    return y


@triton.jit
def _load_row_input(X, R, H, rows64, col, mask, stride_x, stride_r, stride_h, HAS_RESIDUAL: tl.constexpr):
    """One tile of the norm's input in fp32: x, or with HAS_RESIDUAL h = x + r, stored rounded to
    H's dtype and normalized as rounded (backward rebuilds x-hat from the stored h and must agree)."""
    x = load_tile(X, stride_x, rows64, col, mask)
    if HAS_RESIDUAL:
        x += load_tile(R, stride_r, rows64, col, mask)
        h = round_to(x, H.dtype.element_ty)
        tl.store(H + rows64[:, None] * stride_h + col[None, :], h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _norm_fwd(
    X, R, H, W, B, Y, MEAN, RSTD,
    M, N, stride_x, stride_r, stride_h, stride_y, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """y = norm(x) * w + b; with HAS_RESIDUAL, first h = x + r (stored, rounded to H's dtype) and y = norm(h).

    Streamed rows take two sweeps: the statistics, each chunk's mean and centred second moment
    merged into the row's (Chan, Golub and LeVeque), which stays accurate when |mean| is large
    against the spread; then y, from x or the h the first sweep stored."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_row_input(X, R, H, rows64, cols, mask, stride_x, stride_r, stride_h, HAS_RESIDUAL=HAS_RESIDUAL)
        if IS_RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            centred = x
        else:
            mean = tl.sum(x, axis=1) / N
            centred = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=1) / N + eps)
        w = _load_vector(W, cols, col_mask)
        y = _scale_shift(centred * rstd[:, None], w, B, cols, col_mask, HAS_BIAS=HAS_BIAS)
        store_tile(Y, stride_y, rows64, cols, mask, y)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        second_moment = tl.zeros([BLOCK_M], dtype=tl.float32)
        seen = 0.0
        for start in range(0, N, BLOCK_N):
            col = start + cols
            mask = row_mask[:, None] & (col < N)[None, :]
            x = _load_row_input(X, R, H, rows64, col, mask, stride_x, stride_r, stride_h, HAS_RESIDUAL=HAS_RESIDUAL)
            if IS_RMS:
                second_moment += tl.sum(x * x, axis=1)
            else:
                count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                chunk_mean = tl.sum(x, axis=1) / count
                centred = tl.where(mask, x - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                total = seen + count
                mean += delta * (count / total)
                second_moment += tl.sum(centred * centred, axis=1) + delta * delta * (seen * count / total)
                seen = total
        rstd = tl.math.rsqrt(second_moment / N + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # h was stored by other threads of this program
        for start in range(0, N, BLOCK_N):
            col = start + cols
            col_mask = col < N
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RESIDUAL:
                x = load_tile(H, stride_h, rows64, col, mask)
            else:
                x = load_tile(X, stride_x, rows64, col, mask)
            w = _load_vector(W, col, col_mask)
            y = _scale_shift((x - mean[:, None]) * rstd[:, None], w, B, col, col_mask, HAS_BIAS=HAS_BIAS)
            store_tile(Y, stride_y, rows64, col, mask, y)
    if not IS_RMS:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _load_statistics(MEAN, RSTD, rows, row_mask, IS_RMS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The saved mean (0 for RMSNorm) and rstd of rows."""
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    if IS_RMS:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    return mean, rstd


@triton.jit
def _load_bwd_tile(X, DY, W, rows64, col, col_mask, mask, mean, rstd, stride_x, stride_dy):
    """(x_hat, dy, w) of one tile in fp32, x_hat rebuilt from x and the row statistics (0 outside ``mask``)."""
    x = load_tile(X, stride_x, rows64, col, mask)
    dy = load_tile(DY, stride_dy, rows64, col, mask)
    w = _load_vector(W, col, col_mask)
    x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return x_hat, dy, w


@triton.jit
def _bwd_tile(X, DY, W, MEAN, RSTD, row_block, M, col, col_mask, stride_x, stride_dy,
              IS_RMS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block ``row_block``'s rows, their mask, the tile's mask, rstd, and the tile's (x_hat, dy, w)."""
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    mean, rstd = _load_statistics(MEAN, RSTD, rows, row_mask, IS_RMS=IS_RMS, BLOCK_M=BLOCK_M)
    mask = row_mask[:, None] & col_mask[None, :]
    x_hat, dy, w = _load_bwd_tile(X, DY, W, rows.to(tl.int64), col, col_mask, mask, mean, rstd, stride_x, stride_dy)
    return rows, row_mask, mask, rstd, x_hat, dy, w


@triton.jit
def _finish_rows(
    x_hat, dy, w, c1, c2, rstd, dw_acc, db_acc, B, DRES, DX, Y, rows64, col, col_mask, mask, stride_dres, stride_dx,
    stride_y, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr, REBUILD_OUTPUT: tl.constexpr,
):
    """Store one tile of dx = rstd * (w*dy - x_hat * c1 - c2) (no c2 for RMSNorm) plus the residual
    gradient and, when asked, the rebuilt output; return the weight gradients' accumulators with the
    tile's columns added."""
    w_dy = w[None, :] * dy
    if IS_RMS:
        dx = (w_dy - x_hat * c1[:, None]) * rstd[:, None]
    else:
        dx = (w_dy - x_hat * c1[:, None] - c2[:, None]) * rstd[:, None]
    if HAS_DRES:
        dx += load_tile(DRES, stride_dres, rows64, col, mask)
    store_tile(DX, stride_dx, rows64, col, mask, dx)
    if REBUILD_OUTPUT:
        store_tile(Y, stride_y, rows64, col, mask, _scale_shift(x_hat, w, B, col, col_mask, HAS_BIAS=HAS_BIAS))
    dw_acc += tl.sum(dy * x_hat, axis=0)
    if HAS_BIAS:
        db_acc += tl.sum(dy, axis=0)
    return dw_acc, db_acc


@triton.jit
def _store_partials(DW_PARTIAL, DB_PARTIAL, col, col_mask, dw_acc, db_acc, HAS_BIAS: tl.constexpr):
    tl.store(DW_PARTIAL + col, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + col, db_acc, mask=col_mask)


@triton.jit
def _row_sums(X, DY, W, rows64, row_mask, mean, rstd, N, stride_x, stride_dy,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """c1 = mean(x_hat * w * dy) and c2 = mean(w * dy) of rows streamed in chunks."""
    cols = tl.arange(0, BLOCK_N)
    c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        col = start + cols
        col_mask = col < N
        mask = row_mask[:, None] & col_mask[None, :]
        x_hat, dy, w = _load_bwd_tile(X, DY, W, rows64, col, col_mask, mask, mean, rstd, stride_x, stride_dy)
        c1 += tl.sum(x_hat * w[None, :] * dy, axis=1)
        c2 += tl.sum(w[None, :] * dy, axis=1)
    return c1 / N, c2 / N


@triton.jit
def _norm_bwd(
    X, W, B, DY, DRES, DX, Y, MEAN, RSTD, PARTIALS, SUMS,
    M, N, stride_x, stride_dy, stride_dres, stride_dx, stride_y,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr, REBUILD_OUTPUT: tl.constexpr,
    SINGLE_PASS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = rstd * (w*dy - x_hat * mean(x_hat*w*dy) - mean(w*dy)), the last term for LayerNorm only.

    HAS_DRES adds a residual branch's gradient into dx. REBUILD_OUTPUT also writes the rebuilt forward
    output x_hat * w + b, for the weight gradient of the linear layer the norm feeds.
    Program p owns row blocks p, p + P, p + 2P, ... and row p of the partial buffers, which it writes
    once: PARTIALS holds dW's (P, N) and then, with HAS_BIAS, dB's. Streamed rows take two sweeps:
    row by row the sums c1 and c2 (kept in SUMS, two per row), then chunk by chunk over the
    program's rows dx and that chunk's weight gradients, accumulated in registers."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    row_blocks = tl.cdiv(M, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    partial_row = PARTIALS + pid.to(tl.int64) * N
    bias_partial_row = PARTIALS + (programs + pid).to(tl.int64) * N
    if SINGLE_PASS:
        col_mask = cols < N
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for row_block in range(pid, row_blocks, programs):
            rows, row_mask, mask, rstd, x_hat, dy, w = _bwd_tile(
                X, DY, W, MEAN, RSTD, row_block, M, cols, col_mask, stride_x, stride_dy, IS_RMS=IS_RMS, BLOCK_M=BLOCK_M)
            w_dy = w[None, :] * dy
            c1 = tl.sum(x_hat * w_dy, axis=1) / N
            c2 = tl.sum(w_dy, axis=1) / N
            dw_acc, db_acc = _finish_rows(
                x_hat, dy, w, c1, c2, rstd, dw_acc, db_acc, B, DRES, DX, Y, rows.to(tl.int64), cols, col_mask, mask,
                stride_dres, stride_dx, stride_y,
                IS_RMS=IS_RMS, HAS_BIAS=HAS_BIAS, HAS_DRES=HAS_DRES, REBUILD_OUTPUT=REBUILD_OUTPUT,
            )
        _store_partials(partial_row, bias_partial_row, cols, col_mask, dw_acc, db_acc, HAS_BIAS=HAS_BIAS)
    else:
        for row_block in range(pid, row_blocks, programs):
            rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            mean, rstd = _load_statistics(MEAN, RSTD, rows, row_mask, IS_RMS=IS_RMS, BLOCK_M=BLOCK_M)
            c1, c2 = _row_sums(X, DY, W, rows.to(tl.int64), row_mask, mean, rstd, N, stride_x, stride_dy,
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
            tl.store(SUMS + 2 * rows, c1, mask=row_mask)
            tl.store(SUMS + 2 * rows + 1, c2, mask=row_mask)
        # the sums were stored by other threads of this program
        tl.debug_barrier()
        for start in range(0, N, BLOCK_N):
            col = start + cols
            col_mask = col < N
            dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for row_block in range(pid, row_blocks, programs):
                rows, row_mask, mask, rstd, x_hat, dy, w = _bwd_tile(
                    X, DY, W, MEAN, RSTD, row_block, M, col, col_mask, stride_x, stride_dy, IS_RMS=IS_RMS, BLOCK_M=BLOCK_M)
                c1 = tl.load(SUMS + 2 * rows, mask=row_mask, other=0.0)
                c2 = tl.load(SUMS + 2 * rows + 1, mask=row_mask, other=0.0)
                dw_acc, db_acc = _finish_rows(
                    x_hat, dy, w, c1, c2, rstd, dw_acc, db_acc, B, DRES, DX, Y, rows.to(tl.int64), col, col_mask, mask,
                    stride_dres, stride_dx, stride_y,
                    IS_RMS=IS_RMS, HAS_BIAS=HAS_BIAS, HAS_DRES=HAS_DRES, REBUILD_OUTPUT=REBUILD_OUTPUT,
                )
            _store_partials(partial_row, bias_partial_row, col, col_mask, dw_acc, db_acc, HAS_BIAS=HAS_BIAS)


@triton.jit
def _sum_partials(
    PARTIALS, DW, DB, P, N,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dW (and dB) = the sum of the P rows of _norm_bwd's fp32 partials (dW's P rows of N, then
    dB's), ``BLOCK_N`` columns a program, in a fixed order (deterministic), rounded once to DW's
    (DB's) dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = (start + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (rows < P)[:, None] & col_mask[None, :]
        dw += tl.sum(load_tile(PARTIALS, N, rows, cols, mask), axis=0)
        if HAS_BIAS:
            db += tl.sum(load_tile(PARTIALS, N, rows + P, cols, mask), axis=0)
    tl.store(DW + cols, round_to(dw, DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, round_to(db, DB.dtype.element_ty), mask=col_mask)


_NORM_FWD, _NORM_BWD, _SUM_PARTIALS = KeptKernel(_norm_fwd), KeptKernel(_norm_bwd), KeptKernel(_sum_partials)
# _sum_partials' tile: columns a program (many programs even for narrow rows) and partial rows a step
SUM_BLOCK_N, SUM_TILE = 64, 4096


@functools.lru_cache(maxsize=4096)  # asked at every launch, the same few shapes over and over
def _tiling(n_cols: int, direction: str) -> tuple[bool, int, int, int]:
    """(single_pass, BLOCK_M, BLOCK_N, num_warps) for rows of ``n_cols`` elements."""
    if n_cols > MAX_SINGLE_PASS_N[direction]:
        return False, 1, STREAM_BLOCK_N[direction], 8
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(16, 2048 // block_n))
    tile = block_m * block_n
    num_warps = max(1, min(16, tile // 512))
    return True, block_m, block_n, num_warps


def _check_launch(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or (x.stride(-1) != 1 and x.numel() > 0):
        raise ValueError(f"norm kernels take a 2-D x with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    rows, cols = x.shape
    if not 1 <= cols <= MAX_NORM_WIDTH:
        raise ValueError(f"norm kernels support 1 to {MAX_NORM_WIDTH} columns, got {cols}")
    if weight.shape != (cols,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous with shape ({cols},), got {tuple(weight.shape)}")
    return rows, cols


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape or (t.stride(-1) != 1 and t.numel() > 0):
        raise ValueError(f"{name} must match x's shape {tuple(like.shape)} with unit column stride, got {tuple(t.shape)}")


def norm_fwd(x, weight, bias, residual, eps, rms: bool, out_dtype=None):
    """LayerNorm (``rms=False``) or RMSNorm over the rows of x (M, N), unit column stride.

    With ``residual`` (like x) the kernel first forms h = x + residual, stores it in x's dtype and
    normalizes h: the pre-norm block's residual add and the next norm in one pass.
    Returns (y, mean, rstd, h): y (M, N) in ``out_dtype`` (default x's dtype), fp32 mean (empty for
    RMSNorm) and rstd (M,), h (None without residual).
    """
    given = (x, weight, *(() if bias is None else (bias,)), *(() if residual is None else (residual,)))
    key = (launch_key(_NORM_FWD.compiled, given), eps, rms, bias is None, residual is None, out_dtype)
    launch = _FWD_PLANS.get(key)
    if launch is None:
        rows, cols = _check_launch(x, weight)
        if residual is not None:
            _check_rows("residual", residual, x)
    else:
        rows = x.shape[0]
    h = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format)
    mean = torch.empty(0 if rms else rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows == 0:
        return y, mean, rstd, h
    fused_residual = residual is not None
    tensors = (x, residual if fused_residual else x, h if fused_residual else x, weight,
               bias if bias is not None else weight, y, mean if not rms else rstd, rstd)
    if launch is not None:
        launch(*tensors)
        return y, mean, rstd, h
    single_pass, block_m, block_n, num_warps = _tiling(cols, "forward")
    launch = _NORM_FWD.bind(
        (cdiv(rows, block_m),), tensors,
        (rows, cols, x.stride(0), residual.stride(0) if fused_residual else 0, h.stride(0) if fused_residual else 0,
         y.stride(0), float(eps)),
        IS_RMS=rms, HAS_BIAS=bias is not None, HAS_RESIDUAL=fused_residual, SINGLE_PASS=single_pass,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **SEPARATE_ROUNDING,
    )
    if launch is not None:
        _FWD_PLANS.keep(key, launch)
    return y, mean, rstd, h


# The launchers' plans (kernels.launch.LaunchPlans), per call signature: the launch bound with
# everything but its tensors, and for backward what the call allocates.
_FWD_PLANS, _BWD_PLANS = LaunchPlans(), LaunchPlans()


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    programs: int
    single_pass: bool  # streamed rows need a scratch for their sums
    launch: object
    sum_partials: object  # the bound _sum_partials launch


def _sum_partials_launch(partials, dw, db, has_bias: bool):
    """Launches _sum_partials over ``partials`` (1 or 2, P, N) into dw (and db); returns the bound
    launch (None where it is not kept)."""
    _, programs, cols = partials.shape
    block_n = min(SUM_BLOCK_N, next_power_of_2(cols))
    block_p = min(next_power_of_2(programs), SUM_TILE // block_n)
    return _SUM_PARTIALS.bind((cdiv(cols, block_n),), (partials, dw, db if has_bias else dw), (programs, cols),
                              HAS_BIAS=has_bias, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4,
                              **SEPARATE_ROUNDING)


def norm_bwd(dy, x, weight, bias, mean, rstd, residual_grad, rms: bool, has_bias: bool, rebuild_output: bool = False,
             out_dtype=None):
    """Gradients of norm_fwd from dy (like x, any float dtype) and the saved x, mean, rstd.

    ``residual_grad`` (like x) is added into dx: the gradient reaching a pre-norm block's residual
    stream. ``rebuild_output`` also writes the rebuilt y = x_hat * w + b in ``out_dtype`` (default
    x's dtype), for the next linear layer's weight gradient, in the same pass.
    Returns (dx in x's dtype, dweight and dbias in weight's dtype (dbias None without bias), y or None).
    """
    given = (dy, x, weight, *(() if bias is None else (bias,)), *(() if rms else (mean,)), rstd,
             *(() if residual_grad is None else (residual_grad,)))
    key = (launch_key(_NORM_BWD.compiled, given), rms, has_bias, bias is None, residual_grad is None, rebuild_output,
           out_dtype)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        rows, cols = _check_launch(x, weight)
        _check_rows("dy", dy, x)
        if residual_grad is not None:
            _check_rows("residual_grad", residual_grad, x)
        single_pass, block_m, block_n, num_warps = _tiling(cols, "backward")
        programs = persistent_program_count(x.device, cdiv(rows, block_m))
    else:
        rows, cols = x.shape
        programs, single_pass = plan.programs, plan.single_pass
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = (torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format) if rebuild_output
         else None)
    # dW and dB are separate tensors (a custom operator's outputs may not alias)
    dw = new_like(weight)  # weight: (cols,), contiguous
    db = new_like(weight) if has_bias else None
    if rows == 0:
        return dx, dw.zero_(), None if db is None else db.zero_(), y
    # dW's partial sums and dB's, one row per program, each written once
    partials = torch.empty(2 if has_bias else 1, programs, cols, device=x.device, dtype=torch.float32)
    # streamed rows: each row's two sums between the sweeps
    sums = partials if single_pass else torch.empty(2 * rows, device=x.device, dtype=torch.float32)
    tensors = (x, weight, bias if bias is not None else weight, dy,
               residual_grad if residual_grad is not None else dy, dx, y if rebuild_output else dx,
               mean if not rms else rstd, rstd, partials, sums)
    if plan is not None:
        plan.launch(*tensors)
        plan.sum_partials(partials, dw, db if has_bias else dw)
        return dx, dw, db, y
    launch = _NORM_BWD.bind(
        (programs,), tensors,
        (rows, cols, x.stride(0), dy.stride(0), residual_grad.stride(0) if residual_grad is not None else 0,
         dx.stride(0), y.stride(0) if rebuild_output else 0),
        IS_RMS=rms, HAS_BIAS=has_bias, HAS_DRES=residual_grad is not None, REBUILD_OUTPUT=rebuild_output,
        SINGLE_PASS=single_pass, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **SEPARATE_ROUNDING,
    )
    sum_partials = _sum_partials_launch(partials, dw, db, has_bias)
    if launch is not None and sum_partials is not None:
        _BWD_PLANS.keep(key, _BackwardPlan(programs, single_pass, launch, sum_partials))
    return dx, dw, db, y
