"""FlashAttention-style attention: forward and backward without ever storing the Nq x Nk matrix.

Shapes: q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D), Hq a multiple of Hkv (query head h reads kv head
h // (Hq // Hkv): GQA, MQA). Any strides as long as the last dim is contiguous: every stride goes to
the kernels, so views into a packed qkv projection need no copy. The arguments are validated once,
by ``limits.check_attention_args`` in the ops that call these launchers.

Forward (``_attn_fwd``): one program per (query block, query head, batch) streams key blocks with an
online softmax, applying the scale once per row to the running max and inside each exponent's fma,
never to the scores themselves, and writes o (input dtype) and the per-row log-sum-exp (fp32,
natural log). Backward recomputes P = exp(S - lse) block by block.

Softmax units (the NATURAL_EXP constexpr, set from the dtype): 16-bit inputs run in log2 units,
with log2(e) folded into the scale (qk_scale), so each exponent is exp2(fma(s, qk_scale, bias)).
fp32 inputs keep the softmax offsets (running max, lse) in natural units and form every exponent
s * sm_scale + bias with one fma before converting to log2 units (``_probs``): with large logits the
log2-domain form loses digits in the difference and P near 1 would be 1e-5 off, which fp32's
tolerances notice and 16-bit rounding of P hides.

Backward kernels: ``_attn_bwd_preprocess`` computes delta = rowsum(dO * O) (minus dLSE when the lse
output has a gradient), ``_attn_bwd_dkdv`` gives each program one key block of one kv head and
loops over the query heads of its GQA group and over query blocks, ``_attn_bwd_dq`` gives each
program one query block and loops over key blocks. Every output element is written by exactly one
program: no atomics, so gradients are bitwise reproducible.

The streamed tiles (K and V in the forward and dQ, Q and dO in dK/dV) are read through device-side
tensor descriptors (``tl.make_tensor_descriptor``; TMA on Hopper and newer, and Triton's interpreter
runs the same code) wherever the tensors' base and strides are 16-byte aligned; otherwise, and on
GPUs without TMA, through pointer loads with masks. Every accumulation happens inside ``tl.dot``
(``acc = dot(a, b, acc * alpha)``): an accumulator defined by other instructions between warpgroup
MMAs makes ptxas serialize them (advisory C7515). Descriptors built on the device need scratch
memory from Triton's allocator; the launchers set one where the calling thread has none.

Causal masks are aligned to the bottom-right (FlashAttention 2): query i sees keys
j <= i + Nk - Nq. Blocks that no query of a block can see are skipped; blocks that every query of a
block sees fully run without a mask; only the blocks crossing the diagonal (and the ragged last key
block) run the masked loop. A row that sees no key (causal, Nq > Nk) gets o = 0, lse = -inf, and
zero gradients.

Head dims 1..256 are padded to HEAD_DIM = next power of two (at least 16) with masks; any Nq, Nk >= 1.
Scores, softmax statistics and all accumulators are fp32. On CUDA the launch configuration is
autotuned per (length buckets, HEAD_DIM, causal, dtype) over the lists of ``attention_configs``; in
the interpreter one small fixed configuration runs, and dot operands are upcast to fp32 (the
interpreter's bf16 dot is wrong).

How the inner loops are called: runtime values travel in small tuples, so that a call shows what
changes between its two uses (the loop bounds and MASKED):
    keys = (k_src, v_src, stride_kn, stride_vn)    key and value tiles streamed by fwd and dQ
    queries = (q_src, do_src, stride_qn, stride_don)  query and dO tiles streamed by dK/dV
    sizes = (Nq, Nk, D)                              sequence lengths and the real head dim
    scales = (sm_scale, qk_scale)                    the softmax scale, and with log2(e) folded in
and the constexprs follow as keywords: MASKED (the one flag that differs between the calls), then the
problem's (CAUSAL, EVEN_D, USE_TMA, NEGATIVE_SCALE, NATURAL_EXP, DOT_PRECISION), then the tile
(HEAD_DIM, BLOCK_M, BLOCK_N).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .attention_configs import (CONFIGS, INTERPRETER_CONFIG, PRUNERS, TUNE_KEY, target_family,
                                warp_specialization_compiles)
from .launch import (FP_FUSION, NO_SCRATCH_ALLOCATOR, SCRATCH_ALLOCATOR, KeptKernel, LaunchPlans, cdiv,
                     ensure_scratch_allocator, launch_key, new_like, next_power_of_2)
from .precision import INTERPRETED, round_to

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # back to natural log: ln(x) = log2(x) * LN2


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _program_place(GROUP, REVERSE: tl.constexpr, BLOCK: tl.constexpr):
    """Where this program sits on a (row blocks, heads, batch) grid: (first row, head, head // GROUP,
    batch), the last three int64 for the offsets. REVERSE hands the row blocks out last first."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    return pid * BLOCK, head.to(tl.int64), (head // GROUP).to(tl.int64), batch


@triton.jit
def _head(base, batch, head, stride_b, stride_h):
    """Pointer to the (N, D) matrix of one batch and head of a (B, H, N, D) tensor."""
    return base + batch * stride_b + head * stride_h


@triton.jit
def _sequence(CU_SEQLENS, batch, n_rows, VARLEN: tl.constexpr):
    """(first row, rows) of this program's sequence: all n_rows rows of batch entry ``batch`` in
    the dense layout; document ``batch`` of the packed layout (VARLEN), read from cu_seqlens."""
    if VARLEN:
        first = tl.load(CU_SEQLENS + batch)
        rows = tl.load(CU_SEQLENS + batch + 1) - first
    else:
        first = 0
        rows = n_rows
    return first, rows


@triton.jit
def _rows_of(base, batch, head, first, stride_b, stride_h, stride_n, VARLEN: tl.constexpr):
    """Pointer to the first row of this program's sequence in one head: batch entry ``batch``
    (dense), or the document that starts at packed row ``first`` (VARLEN; stride_b unused)."""
    if VARLEN:
        return base + head * stride_h + tl.cast(first, tl.int64) * stride_n
    else:
        return base + batch * stride_b + head * stride_h


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc None: a @ b). The sum happens inside the MMA: an accumulator
    rescaled or added to outside it would be defined by non-wgmma instructions between warpgroup
    MMAs, which makes ptxas serialize them on Hopper (advisory C7515). In the interpreter (whose
    bf16 dot is wrong) the operands are upcast to fp32: exact products."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _load_rows(base, row0, offs_r, n_rows, stride_r, offs_d, D, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load rows row0 + offs_r (all HEAD_DIM columns) of a (n_rows, D) matrix with row stride
    stride_r; out-of-range rows and columns read as zero. row0 is scaled in int64 so long
    sequences with big strides cannot overflow the offset."""
    ptrs = base + tl.cast(row0, tl.int64) * stride_r + (offs_r[:, None] * stride_r + offs_d[None, :])
    if CHECK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=(row0 + offs_r)[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=((row0 + offs_r)[:, None] < n_rows) & (offs_d[None, :] < D), other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return tile


@triton.jit
def _tile_source(base, n_rows, D, stride_r, USE_TMA: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Where a kernel streams (BLOCK, HEAD_DIM) tiles of an (n_rows, D) matrix from: a tensor
    descriptor (USE_TMA; on Hopper the copies are TMA, asynchronous and address-free for the
    threads, and rows and columns out of range read as zero) or the plain base pointer."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, D], strides=[stride_r, 1], block_shape=[BLOCK, HEAD_DIM])
    else:
        return base


@triton.jit
def _load_tile(source, row0, n_rows, stride_r, D, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
               USE_TMA: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The BLOCK rows from row0 of a _tile_source, zero outside the matrix."""
    if USE_TMA:
        return source.load([row0, 0])
    else:
        return _load_rows(source, row0, tl.arange(0, BLOCK), n_rows, stride_r, tl.arange(0, HEAD_DIM), D,
                          CHECK_ROWS=CHECK_ROWS, EVEN_D=EVEN_D)


@triton.jit
def _store_rows(base, row0, offs_r, n_rows, stride_r, offs_d, D, value, EVEN_D: tl.constexpr):
    ptrs = base + tl.cast(row0, tl.int64) * stride_r + (offs_r[:, None] * stride_r + offs_d[None, :])
    if EVEN_D:
        tl.store(ptrs, value, mask=(row0 + offs_r)[:, None] < n_rows)
    else:
        tl.store(ptrs, value, mask=((row0 + offs_r)[:, None] < n_rows) & (offs_d[None, :] < D))


@triton.jit
def _clamp_ranges(lo, full_lo, full_hi, hi, start, n_rows, VARLEN: tl.constexpr):
    """(lo, full_lo, full_hi, hi) put in order, lo <= full_lo <= full_hi <= hi, where a range with
    no whole tile leaves everything to the masked loops; and all empty for a VARLEN program whose
    tile starts past the end of its document (the grid covers the longest one)."""
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    if VARLEN:
        hi = tl.where(start < n_rows, hi, 0)
        full_hi = tl.minimum(full_hi, hi)
        full_lo = tl.minimum(full_lo, full_hi)
        lo = tl.minimum(lo, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_ranges(start_m, Nq, Nk, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which keys the query block starting at start_m visits: (lo, full_lo, full_hi, hi). Key tiles
    in [full_lo, full_hi) are seen whole by every row of the block and run without a mask; those in
    [lo, full_lo) and [full_hi, hi) run with the mask; keys outside [lo, hi) are never loaded.

    Query i's visible keys, aligned bottom-right (diagonal = Nk - Nq): j <= i + diagonal (CAUSAL),
    or i + diagonal - left <= j <= i + diagonal + right (WINDOW; window = (left, right), an
    unbounded side given as a bound past every key)."""
    whole_blocks_end = (Nk // BLOCK_N) * BLOCK_N
    diagonal = Nk - Nq
    rows_end = tl.minimum(start_m + BLOCK_M, Nq)  # a last, partial block's rows past Nq see nothing
    if WINDOW:
        left, right = window
        lo = (tl.maximum(start_m + diagonal - left, 0) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(tl.maximum(rows_end + diagonal + right, 0), Nk)
        # keys every row sees: from the last row's left edge to the first row's right edge
        full_lo = tl.cdiv(tl.maximum(rows_end - 1 + diagonal - left, 0), BLOCK_N) * BLOCK_N
        full_hi = tl.minimum((tl.maximum(start_m + diagonal + right + 1, 0) // BLOCK_N) * BLOCK_N, whole_blocks_end)
    elif CAUSAL:
        # A key tile is whole for every row of the block when the block's first row sees its last key.
        lo = 0
        full_lo = 0
        full_hi = tl.minimum((tl.maximum(start_m + diagonal + 1, 0) // BLOCK_N) * BLOCK_N, whole_blocks_end)
        hi = tl.minimum(tl.maximum(rows_end + diagonal, 0), Nk)
    else:
        lo = 0
        full_lo = 0
        full_hi = whole_blocks_end
        hi = Nk
    return _clamp_ranges(lo, full_lo, full_hi, hi, start_m, Nq, VARLEN=VARLEN)


@triton.jit
def _query_ranges(start_n, Nq, Nk, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The transpose of _key_ranges, for the key block starting at start_n: query rows
    [full_lo, full_hi) see every key of the block, [lo, full_lo) and [full_hi, hi) some of them.
    full_hi and hi may end inside a query tile: its rows past Nq have P = 0 (bias -inf). VARLEN
    leaves the partial tile to the masked range."""
    diagonal = Nk - Nq
    keys_end = tl.minimum(start_n + BLOCK_N, Nk)  # keys past Nk are never stored: no one needs to see them
    if WINDOW:
        left, right = window
        lo = (tl.maximum(start_n - diagonal - right, 0) // BLOCK_M) * BLOCK_M
        hi = tl.minimum(tl.maximum(keys_end + left - diagonal, 0), Nq)
        # rows that see every key: from the last key's first viewer to the first key's last viewer
        full_lo = tl.cdiv(tl.maximum(keys_end - 1 - diagonal - right, 0), BLOCK_M) * BLOCK_M
        all_see_end = tl.maximum(start_n - diagonal + left + 1, 0)
        full_hi = tl.where(all_see_end >= Nq, Nq, (all_see_end // BLOCK_M) * BLOCK_M)
    elif CAUSAL:
        # Key j is seen by queries i >= j - diagonal; every key of the block by i >= last - diagonal.
        lo = (tl.maximum(start_n - diagonal, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(keys_end - 1 - diagonal, 0), BLOCK_M) * BLOCK_M
        full_hi = Nq
        hi = Nq
    else:
        lo = 0
        full_lo = 0
        full_hi = Nq
        hi = Nq
    if VARLEN:
        # A document's last, partial query tile goes to the masked loop, which masks its row
        # statistics (past Nq they are the next document's), so the unmasked loop loads them bare.
        full_hi = tl.minimum(full_hi, (Nq // BLOCK_M) * BLOCK_M)
    return _clamp_ranges(lo, full_lo, full_hi, hi, start_n, Nk, VARLEN=VARLEN)


@triton.jit
def _visible(queries, keys, Nq, Nk, window, CHECK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Which (query, key) pairs count, for broadcastable index tiles ``queries`` and ``keys`` (a
    (BLOCK_M, 1) and a (1, BLOCK_N) tile, or the transpose): real keys (CHECK_KEYS), and the causal
    or window bounds of _key_ranges, aligned bottom-right."""
    diagonal = queries + (Nk - Nq)
    if CHECK_KEYS:
        visible = keys < Nk
    else:
        visible = keys >= 0
    if CAUSAL:
        visible = visible & (keys <= diagonal)
    if WINDOW:
        left, right = window
        visible = visible & (keys <= diagonal + right) & (keys >= diagonal - left)
    return visible


@triton.jit
def _tanh(x, APPROX: tl.constexpr):
    """tanh of fp32 x. Compiled: the hardware's tanh.approx.f32 (one MUFU op, relative error about
    2^-11) where APPROX, for 16-bit inputs whose own rounding of the scores is coarser; else
    libdevice's __nv_tanhf (a few ulp, many more instructions). Interpreted, where neither exists:
    (e^2x - 1) / (e^2x + 1) in float64, clamped where fp32's tanh is +-1."""
    if INTERPRETED:
        e = tl.exp(2.0 * tl.minimum(tl.maximum(x.to(tl.float64), -20.0), 20.0))
        return ((e - 1.0) / (e + 1.0)).to(tl.float32)
    elif APPROX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return libdevice.tanh(x)


@triton.jit
def _softcapped(qk, softcap, APPROX: tl.constexpr):
    """Raw scores q k^T to softcapped ones, cap * tanh(q k^T * scale / cap), and the tanh (the
    gradient's factor 1 - tanh^2). softcap: (cap, scale / cap). The result is already scaled: the
    exponent then takes scale 1 (see _exponent_scales). APPROX: see _tanh."""
    cap, cap_scale = softcap
    t = _tanh(qk * cap_scale, APPROX=APPROX)
    return cap * t, t


@triton.jit
def _key_block(
    q, keys, start_n, Nk, D,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """k and v of the key block at start_n (rows past Nk read as zero) and the raw, unmasked scores
    q k^T (not yet scaled). keys: (k_src, v_src, stride_kn, stride_vn), the _tile_sources."""
    k_src, v_src, stride_kn, stride_vn = keys
    k = _load_tile(k_src, start_n, Nk, stride_kn, D, CHECK_ROWS=MASKED, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                   BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    v = _load_tile(v_src, start_n, Nk, stride_vn, D, CHECK_ROWS=MASKED, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                   BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    return k, v, _dot(q, tl.trans(k), None, DOT_PRECISION=DOT_PRECISION)


@triton.jit
def _probs(s, scales, bias, NATURAL_EXP: tl.constexpr):
    """exp(s * sm_scale + bias) for raw scores s, elementwise (bias, the negated softmax offset,
    broadcast by the caller; negated once per row rather than once per score, which the fma's own
    negation would not always absorb). scales: (sm_scale, qk_scale).

    Log2 units (16-bit inputs): bias is in log2 units and the exponent is one multiply-add in the
    log2 domain, exp2(s * qk_scale + bias); P is rounded to 16 bits before its dots anyway.
    NATURAL_EXP (fp32 inputs): bias is in natural units and the exponent s * sm_scale + bias is
    one fma, rounded once, before the conversion to log2 units. With large logits (|s * scale| ~
    100) the log2-domain form rounds s * qk_scale and the offset separately at magnitude ~144 and
    their difference keeps only a few correct bits beyond fp32's relative 1e-7: P near 1 (the
    dominant keys) comes out 1e-5 off, which dominates dV and dK. The fma keeps P to fp32 accuracy."""
    sm_scale, qk_scale = scales
    if NATURAL_EXP:
        return tl.math.exp2(tl.fma(s, sm_scale, bias) * LOG2E)
    else:
        return tl.math.exp2(tl.fma(s, qk_scale, bias))


@triton.jit
def _scaled_row_max(qk, scale, visible, MASKED: tl.constexpr, NEGATIVE_SCALE: tl.constexpr):
    """max over each row's visible keys of qk * scale, with one multiply per row instead of one per
    score (rounding is monotonic, so the result is the same bits); -inf where a row sees no key."""
    if NEGATIVE_SCALE:
        fill = float("inf")
        extreme = tl.min(tl.where(visible, qk, fill) if MASKED else qk, 1)
    else:
        fill = float("-inf")
        extreme = tl.max(tl.where(visible, qk, fill) if MASKED else qk, 1)
    if MASKED:  # a row with nothing visible is -inf for any scale ((+-inf) * 0 would be NaN)
        empty = extreme == fill
        return tl.where(empty, float("-inf"), tl.where(empty, 0.0, extreme) * scale)
    else:
        return extreme * scale


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _exponent_scales(sm_scale, qk_scale, SOFTCAP: tl.constexpr):
    """The scales of the exponent, (natural units, log2 units): the softmax scale, or 1 when the
    softcap has already scaled the scores."""
    if SOFTCAP:
        return 1.0, LOG2E
    else:
        return sm_scale, qk_scale


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, keys,
    start_m, lo, hi,
    sizes, scales, window, softcap,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, NATURAL_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online softmax of the query block at start_m over the key blocks in [lo, hi): running max
    m_i, sum l_i and output acc. m_i is in the units NATURAL_EXP says (see _probs), so that
    lse = m_i + ln(l_i) matches the backward's P. The scale is applied once per row to the max and
    inside the exponent's fma, never to the scores (softcapped scores come scaled: scales is 1).
    WARP_SPECIALIZE: Triton splits the loop into partitions (loads, MMAs, softmax, the
    accumulator's rescaling), each on warps of its own (see _rescaled)."""
    Nq, Nk, D = sizes
    sm_scale, qk_scale = scales
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    if NATURAL_EXP:
        scale = sm_scale
    else:
        scale = qk_scale
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k, v, qk = _key_block(q, keys, start_n, Nk, D, MASKED=MASKED, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                              DOT_PRECISION=DOT_PRECISION, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N)
        if SOFTCAP:
            qk, _ = _softcapped(qk, softcap, APPROX=not NATURAL_EXP)
        if MASKED:
            visible = _visible(offs_m[:, None], (start_n + offs_n)[None, :], Nq, Nk, window, CHECK_KEYS=True,
                               CAUSAL=CAUSAL, WINDOW=WINDOW)
        else:
            visible = None
        m_new = tl.maximum(m_i, _scaled_row_max(qk, scale, visible, MASKED=MASKED, NEGATIVE_SCALE=NEGATIVE_SCALE))
        if MASKED:
            # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = _probs(qk, scales, -m_shift[:, None], NATURAL_EXP=NATURAL_EXP)
        if MASKED:
            p = tl.where(visible, p, 0.0)
        if NATURAL_EXP:
            alpha = tl.math.exp2((m_i - m_shift) * LOG2E)
        else:
            alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, _rescaled(acc, alpha, HALVES=WARP_SPECIALIZE), DOT_PRECISION=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _rescaled(acc, alpha, HALVES: tl.constexpr):
    """acc * alpha per row. HALVES: one column half at a time, the same products. Warp-specialized
    on Blackwell, the rescaling runs in a partition of 4 warps with few registers a thread (Triton's
    choice), each thread one row of the tensor-memory accumulator: a whole row of 128 fp32 columns
    does not fit those registers and spills, half a row does not (docs/tuning.md)."""
    if HALVES:
        rows: tl.constexpr = acc.shape[0]
        cols: tl.constexpr = acc.shape[1]
        left, right = acc.reshape([rows, 2, cols // 2]).permute(0, 2, 1).split()
        return tl.join(left * alpha[:, None], right * alpha[:, None]).permute(0, 2, 1).reshape([rows, cols])
    else:
        return acc * alpha[:, None]


@triton.jit(do_not_specialize=["Nq", "Nk", "window_left", "window_right"])  # values of 1 stay runtime values
def _attn_fwd(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale, window_left, window_right, softcap, cap_scale,
    N_CTX_Q_KEY, N_CTX_K_KEY,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    NATURAL_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
):
    """o = softmax(q k^T * scale) v and lse per row. Grid: (query blocks, Hq, B or documents);
    causal runs the last query blocks (which see the most keys) first, for a shorter tail. K and V
    stream through _tile_source (TMA descriptors when USE_TMA). VARLEN: program (m, h, b) takes
    query block m of document b, whose rows CU_SEQLENS_Q and CU_SEQLENS_K give (Nq and Nk are then
    the packed totals).

    N_CTX_Q_KEY and N_CTX_K_KEY are unused here: they are the autotuner's length buckets."""
    start_m, head, kv_head, batch = _program_place(GROUP, REVERSE=CAUSAL, BLOCK=BLOCK_M)
    q_first, Nq = _sequence(CU_SEQLENS_Q, batch, Nq, VARLEN=VARLEN)
    k_first, Nk = _sequence(CU_SEQLENS_K, batch, Nk, VARLEN=VARLEN)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    k_src = _tile_source(_rows_of(K, batch, kv_head, k_first, stride_kb, stride_kh, stride_kn, VARLEN=VARLEN),
                         Nk, D, stride_kn, USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    v_src = _tile_source(_rows_of(V, batch, kv_head, k_first, stride_vb, stride_vh, stride_vn, VARLEN=VARLEN),
                         Nk, D, stride_vn, USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    q = _load_rows(_rows_of(Q, batch, head, q_first, stride_qb, stride_qh, stride_qn, VARLEN=VARLEN),
                   start_m, offs_r, Nq, stride_qn, offs_d, D, CHECK_ROWS=True, EVEN_D=EVEN_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    window = (window_left, window_right)
    lo, full_lo, full_hi, hi = _key_ranges(start_m, Nq, Nk, window, CAUSAL=CAUSAL, WINDOW=WINDOW, VARLEN=VARLEN,
                                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    keys = (k_src, v_src, stride_kn, stride_vn)
    sizes = (Nq, Nk, D)
    scales = _exponent_scales(sm_scale, qk_scale, SOFTCAP=SOFTCAP)
    softcaps = (softcap, cap_scale)
    if WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, keys, start_m, lo, full_lo, sizes, scales, window, softcaps, MASKED=True,
            CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
            NEGATIVE_SCALE=NEGATIVE_SCALE, NATURAL_EXP=NATURAL_EXP, DOT_PRECISION=DOT_PRECISION,
            WARP_SPECIALIZE=WARP_SPECIALIZE, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, keys, start_m, full_lo, full_hi, sizes, scales, window, softcaps, MASKED=False,
        CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
        NEGATIVE_SCALE=NEGATIVE_SCALE, NATURAL_EXP=NATURAL_EXP, DOT_PRECISION=DOT_PRECISION,
        WARP_SPECIALIZE=WARP_SPECIALIZE, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, keys, start_m, full_hi, hi, sizes, scales, window, softcaps, MASKED=True,
        CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
        NEGATIVE_SCALE=NEGATIVE_SCALE, NATURAL_EXP=NATURAL_EXP, DOT_PRECISION=DOT_PRECISION,
        WARP_SPECIALIZE=WARP_SPECIALIZE, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )

    empty = l_i == 0.0  # rows that saw no key
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if NATURAL_EXP:  # m_i in natural units: one rounding
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    else:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    _store_rows(_rows_of(O, batch, head, q_first, stride_ob, stride_oh, stride_on, VARLEN=VARLEN),
                start_m, offs_r, Nq, stride_on, offs_d, D, round_to(o, O.dtype.element_ty), EVEN_D=EVEN_D)
    tl.store(_rows_of(LSE, batch, head, q_first, stride_lb, stride_lh, 1, VARLEN=VARLEN) + offs_m, lse,
             mask=offs_m < Nq)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_preprocess(
    O, DO, LSE, DLSE, DELTA, BIAS,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    Hq, Nq, NQ_ROUNDED, D,
    HAS_DLSE: tl.constexpr, NATURAL_EXP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The per-row values the dK/dV and dQ loops read, made once so those loops do no work on them:
    delta = rowsum(dO * O) in fp32, minus dLSE when lse has a gradient (dS = P (dP - delta)), and
    the exponent bias of _probs: minus the saved lse, in log2 units (natural units with
    NATURAL_EXP), and -inf on rows that see no key (lse = -inf), so that their P is exactly 0
    instead of NaN.

    LSE and DLSE are contiguous (B, Hq, Nq); DELTA and BIAS (B, Hq, NQ_ROUNDED), where the rows
    from Nq up to NQ_ROUNDED (a multiple of every BLOCK_M) get delta 0 and bias -inf: the loops
    load whole blocks without masks, and those rows add nothing. The packed variable-length layout
    runs as one batch entry of all its rows (B = 1, Nq the total). Grid: (NQ_ROUNDED / BLOCK_M, Hq, B)."""
    start_m, head, _, batch = _program_place(1, REVERSE=False, BLOCK=BLOCK_M)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = _load_rows(_head(O, batch, head, stride_ob, stride_oh), start_m, offs_r, Nq, stride_on, offs_d, D,
                   CHECK_ROWS=True, EVEN_D=False)
    do = _load_rows(_head(DO, batch, head, stride_dob, stride_doh), start_m, offs_r, Nq, stride_don, offs_d, D,
                    CHECK_ROWS=True, EVEN_D=False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_m = start_m + offs_r
    real = offs_m < Nq
    if HAS_DLSE:
        delta -= tl.load(_head(DLSE, batch, head, Hq * Nq, Nq) + offs_m, mask=real, other=0.0).to(tl.float32)
    lse = tl.load(_head(LSE, batch, head, Hq * Nq, Nq) + offs_m, mask=real, other=float("-inf"))
    if not NATURAL_EXP:
        lse = lse * LOG2E
    tl.store(_head(DELTA, batch, head, Hq * NQ_ROUNDED, NQ_ROUNDED) + offs_m, delta)
    tl.store(_head(BIAS, batch, head, Hq * NQ_ROUNDED, NQ_ROUNDED) + offs_m,
             tl.where(lse == float("-inf"), lse, -lse))


@triton.jit
def _load_row_stats(row_stats, offs_m, Nq, CHECK_ROWS: tl.constexpr):
    """(bias, delta) of rows offs_m from the preprocess's output. Rows past Nq are padding (bias
    -inf, delta 0) and load without a mask, except in the packed layout, where they belong to the
    next document: CHECK_ROWS masks them to the same values."""
    BIAS_row, DELTA_row = row_stats
    if CHECK_ROWS:
        bias = tl.load(BIAS_row + offs_m, mask=offs_m < Nq, other=float("-inf"))
        delta = tl.load(DELTA_row + offs_m, mask=offs_m < Nq, other=0.0)
    else:
        bias = tl.load(BIAS_row + offs_m)
        delta = tl.load(DELTA_row + offs_m)
    return bias, delta


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, queries, row_stats,
    start_n, lo, hi,
    sizes, scales, window, softcap,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, NATURAL_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dK, dV of the key block at start_n over query blocks [lo, hi), working on
    transposed tiles (keys along rows). queries: (q_src, do_src, stride_qn, stride_don), the
    _tile_sources of q and dO; row_stats: (BIAS_row, DELTA_row), pointers to this head's rows of
    the preprocess's output. Query rows past Nq read as zero with bias -inf, hence P = 0: they add
    nothing."""
    q_src, do_src, stride_qn, stride_don = queries
    Nq, Nk, D = sizes
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_r
        q = _load_tile(q_src, start_m, Nq, stride_qn, D, CHECK_ROWS=True, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                       BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        do = _load_tile(do_src, start_m, Nq, stride_don, D, CHECK_ROWS=True, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                        BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        bias, delta = _load_row_stats(row_stats, offs_m, Nq, CHECK_ROWS=VARLEN and MASKED)
        # P^T recomputed from the saved lse: exp(S^T * scale - lse). The lse is only as good as the
        # match between these scores and the forward's, bit for bit: with logits ~100 a one-ulp
        # difference in S moves P by 1e-5. The GPU's fp32 (IEEE) dot is a sequential fma chain over
        # D per element, the same bits for k q^T as for (q k^T)^T; the interpreter's BLAS sums
        # k q^T in another order than q k^T (a few ulps apart), so there S^T is taken as the
        # transpose of the forward's own product.
        if INTERPRETED:
            qk_t = tl.trans(_dot(q, tl.trans(k), None, DOT_PRECISION=DOT_PRECISION))
        else:
            qk_t = _dot(k, tl.trans(q), None, DOT_PRECISION=DOT_PRECISION)
        if SOFTCAP:
            qk_t, tanh_t = _softcapped(qk_t, softcap, APPROX=not NATURAL_EXP)
        p_t = _probs(qk_t, scales, bias[None, :], NATURAL_EXP=NATURAL_EXP)
        if MASKED:  # keys past Nk need no mask here: their rows of dK and dV are never stored
            p_t = tl.where(_visible(offs_m[None, :], offs_n[:, None], Nq, Nk, window, CHECK_KEYS=False,
                                    CAUSAL=CAUSAL, WINDOW=WINDOW), p_t, 0.0)
        dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION=DOT_PRECISION)
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        dk = _dot(ds_t.to(q.dtype), q, dk, DOT_PRECISION=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["Nq", "Nk", "window_left", "window_right"])  # values of 1 stay runtime values
def _attn_bwd_dkdv(
    Q, K, V, DO, BIAS, DELTA, DK, DV, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale, window_left, window_right, softcap, cap_scale, NQ_ROUNDED,
    N_CTX_Q_KEY, N_CTX_K_KEY,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    NATURAL_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV for one key block of one kv head, summed over the GROUP query heads that share it.
    Grid: (key blocks, Hkv, B or documents). Rows of the key block past Nk are computed but never
    stored."""
    start_n, kv_head, _, batch = _program_place(1, REVERSE=False, BLOCK=BLOCK_N)
    q_first, Nq = _sequence(CU_SEQLENS_Q, batch, Nq, VARLEN=VARLEN)
    k_first, Nk = _sequence(CU_SEQLENS_K, batch, Nk, VARLEN=VARLEN)
    offs_r = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(_rows_of(K, batch, kv_head, k_first, stride_kb, stride_kh, stride_kn, VARLEN=VARLEN),
                   start_n, offs_r, Nk, stride_kn, offs_d, D, CHECK_ROWS=True, EVEN_D=EVEN_D)
    v = _load_rows(_rows_of(V, batch, kv_head, k_first, stride_vb, stride_vh, stride_vn, VARLEN=VARLEN),
                   start_n, offs_r, Nk, stride_vn, offs_d, D, CHECK_ROWS=True, EVEN_D=EVEN_D)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    window = (window_left, window_right)
    lo, full_lo, full_hi, hi = _query_ranges(start_n, Nq, Nk, window, CAUSAL=CAUSAL, WINDOW=WINDOW, VARLEN=VARLEN,
                                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    sizes = (Nq, Nk, D)
    scales = _exponent_scales(sm_scale, qk_scale, SOFTCAP=SOFTCAP)
    softcaps = (softcap, cap_scale)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_src = _tile_source(_rows_of(Q, batch, head, q_first, stride_qb, stride_qh, stride_qn, VARLEN=VARLEN),
                             Nq, D, stride_qn, USE_TMA=USE_TMA, BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        do_src = _tile_source(_rows_of(DO, batch, head, q_first, stride_dob, stride_doh, stride_don, VARLEN=VARLEN),
                              Nq, D, stride_don, USE_TMA=USE_TMA, BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        queries = (q_src, do_src, stride_qn, stride_don)
        row_stats = (_rows_of(BIAS, batch, head, q_first, Hq * NQ_ROUNDED, NQ_ROUNDED, 1, VARLEN=VARLEN),
                     _rows_of(DELTA, batch, head, q_first, Hq * NQ_ROUNDED, NQ_ROUNDED, 1, VARLEN=VARLEN))
        if CAUSAL or WINDOW:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, queries, row_stats, start_n, lo, full_lo, sizes, scales, window, softcaps, MASKED=True,
                CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, VARLEN=VARLEN, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                NATURAL_EXP=NATURAL_EXP, DOT_PRECISION=DOT_PRECISION, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
            )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, queries, row_stats, start_n, full_lo, full_hi, sizes, scales, window, softcaps, MASKED=False,
            CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, VARLEN=VARLEN, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
            NATURAL_EXP=NATURAL_EXP, DOT_PRECISION=DOT_PRECISION, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )
        if WINDOW or VARLEN:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, queries, row_stats, start_n, full_hi, hi, sizes, scales, window, softcaps, MASKED=True,
                CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, VARLEN=VARLEN, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                NATURAL_EXP=NATURAL_EXP, DOT_PRECISION=DOT_PRECISION, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
            )

    dk = dk * sm_scale
    _store_rows(_rows_of(DK, batch, kv_head, k_first, stride_dkb, stride_dkh, stride_dkn, VARLEN=VARLEN),
                start_n, offs_r, Nk, stride_dkn, offs_d, D, round_to(dk, DK.dtype.element_ty), EVEN_D=EVEN_D)
    _store_rows(_rows_of(DV, batch, kv_head, k_first, stride_dvb, stride_dvh, stride_dvn, VARLEN=VARLEN),
                start_n, offs_r, Nk, stride_dvn, offs_d, D, round_to(dv, DV.dtype.element_ty), EVEN_D=EVEN_D)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, bias, delta, keys,
    start_m, lo, hi,
    sizes, scales, window, softcap,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    NATURAL_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dQ (unscaled) of the query block at start_m over the key blocks in [lo, hi). Rows
    that see no key have bias = -inf (see _attn_bwd_preprocess), so their P is exactly 0.
    WARP_SPECIALIZE: as in _attn_fwd_inner (loads, MMAs and the elementwise work on warps of their
    own)."""
    Nq, Nk, D = sizes
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k, v, qk = _key_block(q, keys, start_n, Nk, D, MASKED=MASKED, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                              DOT_PRECISION=DOT_PRECISION, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N)
        if SOFTCAP:
            qk, tanh_s = _softcapped(qk, softcap, APPROX=not NATURAL_EXP)
        p = _probs(qk, scales, bias[:, None], NATURAL_EXP=NATURAL_EXP)
        if MASKED:
            p = tl.where(_visible(offs_m[:, None], (start_n + offs_n)[None, :], Nq, Nk, window, CHECK_KEYS=True,
                                  CAUSAL=CAUSAL, WINDOW=WINDOW), p, 0.0)
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["Nq", "Nk", "window_left", "window_right"])  # values of 1 stay runtime values
def _attn_bwd_dq(
    Q, K, V, DO, BIAS, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale, window_left, window_right, softcap, cap_scale, NQ_ROUNDED,
    N_CTX_Q_KEY, N_CTX_K_KEY,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    NATURAL_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
):
    """dQ for one query block of one query head, looping over key blocks. Grid: (query blocks, Hq,
    B or documents)."""
    start_m, head, kv_head, batch = _program_place(GROUP, REVERSE=CAUSAL, BLOCK=BLOCK_M)
    q_first, Nq = _sequence(CU_SEQLENS_Q, batch, Nq, VARLEN=VARLEN)
    k_first, Nk = _sequence(CU_SEQLENS_K, batch, Nk, VARLEN=VARLEN)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(_rows_of(Q, batch, head, q_first, stride_qb, stride_qh, stride_qn, VARLEN=VARLEN),
                   start_m, offs_r, Nq, stride_qn, offs_d, D, CHECK_ROWS=True, EVEN_D=EVEN_D)
    do = _load_rows(_rows_of(DO, batch, head, q_first, stride_dob, stride_doh, stride_don, VARLEN=VARLEN),
                    start_m, offs_r, Nq, stride_don, offs_d, D, CHECK_ROWS=True, EVEN_D=EVEN_D)
    row_stats = (_rows_of(BIAS, batch, head, q_first, Hq * NQ_ROUNDED, NQ_ROUNDED, 1, VARLEN=VARLEN),
                 _rows_of(DELTA, batch, head, q_first, Hq * NQ_ROUNDED, NQ_ROUNDED, 1, VARLEN=VARLEN))
    bias, delta = _load_row_stats(row_stats, offs_m, Nq, CHECK_ROWS=VARLEN)
    k_src = _tile_source(_rows_of(K, batch, kv_head, k_first, stride_kb, stride_kh, stride_kn, VARLEN=VARLEN),
                         Nk, D, stride_kn, USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    v_src = _tile_source(_rows_of(V, batch, kv_head, k_first, stride_vb, stride_vh, stride_vn, VARLEN=VARLEN),
                         Nk, D, stride_vn, USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    window = (window_left, window_right)
    lo, full_lo, full_hi, hi = _key_ranges(start_m, Nq, Nk, window, CAUSAL=CAUSAL, WINDOW=WINDOW, VARLEN=VARLEN,
                                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    keys = (k_src, v_src, stride_kn, stride_vn)
    sizes = (Nq, Nk, D)
    scales = _exponent_scales(sm_scale, qk_scale, SOFTCAP=SOFTCAP)
    softcaps = (softcap, cap_scale)
    if WINDOW:
        dq = _attn_bwd_dq_inner(
            dq, q, do, bias, delta, keys, start_m, lo, full_lo, sizes, scales, window, softcaps, MASKED=True,
            CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, EVEN_D=EVEN_D, USE_TMA=USE_TMA, NATURAL_EXP=NATURAL_EXP,
            DOT_PRECISION=DOT_PRECISION, WARP_SPECIALIZE=WARP_SPECIALIZE, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
        )
    dq = _attn_bwd_dq_inner(
        dq, q, do, bias, delta, keys, start_m, full_lo, full_hi, sizes, scales, window, softcaps, MASKED=False,
        CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, EVEN_D=EVEN_D, USE_TMA=USE_TMA, NATURAL_EXP=NATURAL_EXP,
        DOT_PRECISION=DOT_PRECISION, WARP_SPECIALIZE=WARP_SPECIALIZE, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    dq = _attn_bwd_dq_inner(
        dq, q, do, bias, delta, keys, start_m, full_hi, hi, sizes, scales, window, softcaps, MASKED=True,
        CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, EVEN_D=EVEN_D, USE_TMA=USE_TMA, NATURAL_EXP=NATURAL_EXP,
        DOT_PRECISION=DOT_PRECISION, WARP_SPECIALIZE=WARP_SPECIALIZE, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    dq = dq * sm_scale
    _store_rows(_rows_of(DQ, batch, head, q_first, stride_dqb, stride_dqh, stride_dqn, VARLEN=VARLEN),
                start_m, offs_r, Nq, stride_dqn, offs_d, D, round_to(dq, DQ.dtype.element_ty), EVEN_D=EVEN_D)


# CUDA autotunes over every configuration of attention_configs; the pruner keeps the target's.
_attn_fwd_tuned = triton.autotune(
    configs=CONFIGS["fwd"], key=TUNE_KEY, prune_configs_by={"early_config_prune": PRUNERS["fwd"]}
)(_attn_fwd)
_attn_bwd_dq_tuned = triton.autotune(
    configs=CONFIGS["dq"], key=TUNE_KEY, prune_configs_by={"early_config_prune": PRUNERS["dq"]}
)(_attn_bwd_dq)
_attn_bwd_dkdv_tuned = triton.autotune(
    configs=CONFIGS["dkdv"], key=TUNE_KEY + ["GROUP"], prune_configs_by={"early_config_prune": PRUNERS["dkdv"]}
)(_attn_bwd_dkdv)

# Each launched through its kept compiled form (launch.KeptKernel): the plain kernels for a pinned
# configuration and the interpreter, the autotuned ones otherwise.
_ATTN_FWD, _ATTN_FWD_TUNED = KeptKernel(_attn_fwd), KeptKernel(_attn_fwd_tuned)
_ATTN_DQ, _ATTN_DQ_TUNED = KeptKernel(_attn_bwd_dq), KeptKernel(_attn_bwd_dq_tuned)
_ATTN_DKDV, _ATTN_DKDV_TUNED = KeptKernel(_attn_bwd_dkdv), KeptKernel(_attn_bwd_dkdv_tuned)
_ATTN_BWD_PREPROCESS = KeptKernel(_attn_bwd_preprocess)
# Whether Triton interprets, as it decided when it wrapped these kernels.
_INTERPRETING = not _ATTN_FWD.compiled
_INTERPRETER_LAUNCH = {**INTERPRETER_CONFIG, **FP_FUSION}


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
#
# The launchers trust the shapes they are given: every op of the library validates q, k, v with
# limits.check_attention_args before it calls one, and the other tensors the library passes (views
# of one packed buffer, slices of validated tensors) are consistent by construction. A launcher
# refuses only what it cannot express in a launch: a last dim that is not contiguous (the kernels
# take no stride for it), a given output that does not fit, and tma=True where descriptors cannot
# be used. Callers outside the library validate with check_attention_args first.


@dataclasses.dataclass(frozen=True)
class Documents:
    """The packed variable-length layout of FlashAttention 2's varlen API: q (total_q, Hq, D) and
    k, v (total_k, Hkv, D) hold documents one after another; document i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v
    (int32, on the tensors' device), and no document is longer than max_seqlen_q / max_seqlen_k.
    Validated by ``limits.check_varlen_args``."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def count(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def _heads_views(tensors) -> tuple[torch.Tensor, ...]:
    """Packed (total, H, D) tensors as the (1, H, total, D) views the kernels address (by C
    callables: no Python frame per tensor)."""
    ones, twos = itertools.repeat(1), itertools.repeat(2)
    return (*map(torch.Tensor.transpose, map(torch.Tensor.unsqueeze, tensors, itertools.repeat(0)), ones, twos),)


@dataclasses.dataclass(frozen=True)
class _Problem:
    """One attention call's sizes and options, as every launch needs them: made once per distinct
    call (``of``) and kept, with what the launches derive from it (``scalars``, ``constexprs``), so
    that a training step's repeated calls only look it up. With documents, the lengths are the
    packed totals, and the grid's extent the longest document's."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    causal: bool
    sm_scale: float
    fp32: bool  # fp32 inputs: IEEE dots and the softmax in natural units
    window: tuple[int, int]  # (left, right), -1 unbounded, causal's right bound 0 folded in
    softcap: float
    documents: int  # how many documents are packed; 0 in the dense layout
    grid_lengths: tuple[int, int]  # the longest query and key sequence one program may see

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0,
           documents: Documents | None = None) -> _Problem:
        """q, k as the kernels see them: (B, H, N, D), or (1, H, total, D) views with documents."""
        left, right = window
        if causal:
            right = 0  # FlashAttention 2: causal is the window's right bound 0
        if documents is None:
            count, lengths = 0, (q.shape[2], k.shape[2])
        else:
            count, lengths = documents.count, (documents.max_seqlen_q, documents.max_seqlen_k)
        return _problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], bool(causal),
                        float(scale), q.dtype == torch.float32, (int(left), int(right)), float(softcap), count,
                        lengths)

    @property
    def grid_batch(self) -> int:
        return self.documents or self.batch

    @functools.cached_property
    def padded_head_dim(self) -> int:
        return max(16, next_power_of_2(self.head_dim))

    @property
    def qk_scale(self) -> float:
        """The softmax scale with log2(e) folded in: the scale of the log2-unit softmax."""
        return self.sm_scale * LOG2E.value

    @property
    def mask_kind(self) -> str:
        """"window" when a bound other than causal's applies, else "causal" or "none"."""
        left, right = self.window
        if left < 0 and right < 0:
            return "none"
        return "causal" if left < 0 and right == 0 else "window"

    @property
    def window_bounds(self) -> tuple[int, int]:
        """The kernels' (window_left, window_right): an unbounded side as a bound past every key."""
        unbounded = sum(self.grid_lengths) + 1
        return tuple(unbounded if side < 0 else side for side in self.window)

    @functools.cached_property
    def scalars(self) -> tuple:
        """The kernels' arguments after the strides: Hq, Nq, Nk, D, GROUP, the scales, the window
        and the softcap. The backward kernels take the padded query length next; all take the
        autotuner's length buckets (``length_buckets``: N_CTX_Q_KEY, N_CTX_K_KEY) last."""
        cap_scale = self.sm_scale / self.softcap if self.softcap else 0.0
        return (self.q_heads, self.q_len, self.k_len, self.head_dim, self.q_heads // self.kv_heads, self.sm_scale,
                self.qk_scale, *self.window_bounds, self.softcap, cap_scale)

    @functools.cached_property
    def length_buckets(self) -> tuple[int, int]:
        return next_power_of_2(self.grid_lengths[0]), next_power_of_2(self.grid_lengths[1])

    def grid(self, lengths: int, block: str, heads: int):
        """The launch grid over ``lengths`` (0: queries, 1: keys) in tiles of the configuration's
        ``block`` (BLOCK_M or BLOCK_N), ``heads``, and the batch or the documents."""
        extent, batch = self.grid_lengths[lengths], self.grid_batch
        return lambda meta: (cdiv(extent, meta[block]), heads, batch)

    @property
    def dot_precision(self) -> str:
        """fp32 inputs take IEEE dots (TF32 would round the operands to 10 mantissa bits); for 16-bit
        inputs the setting does not apply."""
        return "ieee" if self.fp32 else "tf32"

    @property
    def natural_exp(self) -> bool:
        """The kernels' NATURAL_EXP: fp32 inputs keep the softmax offsets in natural units and form
        each exponent with one fma before the conversion to log2 units (see _probs): the cheaper
        log2-unit form is 1e-5 off for P near 1 at large logits, invisible once P is rounded to 16
        bits but not at fp32's accuracy."""
        return self.fp32

    @functools.cached_property
    def _constexprs(self) -> dict[bool, dict]:
        mask = self.mask_kind
        common = dict(
            CAUSAL=mask == "causal", WINDOW=mask == "window", SOFTCAP=self.softcap > 0, VARLEN=self.documents > 0,
            EVEN_D=self.head_dim == self.padded_head_dim, NATURAL_EXP=self.natural_exp,
            DOT_PRECISION=self.dot_precision, HEAD_DIM=self.padded_head_dim,
        )
        return {use_tma: {**common, "USE_TMA": use_tma} for use_tma in (False, True)}

    def constexprs(self, use_tma: bool) -> dict:
        return self._constexprs[use_tma]


# Distinct calls of a run are few (a training step repeats the same shapes); the bound keeps a run
# whose shapes vary from batch to batch from growing it without end.
_problem = functools.lru_cache(maxsize=4096)(_Problem)


def _sequence_args(documents: Documents | None, placeholder: torch.Tensor) -> tuple:
    """CU_SEQLENS_Q, CU_SEQLENS_K (any tensor in the dense layout, where they are not read)."""
    if documents is not None:
        return documents.cu_seqlens_q, documents.cu_seqlens_k
    return placeholder, placeholder


def _require_contiguous_last_dim(named: dict) -> None:
    """The kernels address the last dim as contiguous (they take no stride for it)."""
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got strides {t.stride()}")


def _tma_refusal(named: dict) -> str | None:
    """Why the streamed tensors in ``named`` cannot be read through tensor descriptors, or None.

    A descriptor's base address and its row stride must be multiples of 16 bytes (TMA's rule); each
    (batch, head) matrix starts at a batch and head stride from the base, so those must be too where
    the dimension has more than one entry. Descriptors run on Hopper and newer and in the interpreter;
    A100s read through pointers."""
    if not _INTERPRETING and target_family() < 90:
        return "the GPU has no TMA (compute capability below 9.0)"
    for name, t in named.items():
        if t.data_ptr() % 16:
            return f"{name}'s data pointer is not 16-byte aligned"
        if not _tma_strides(t.shape, t.stride(), t.element_size()):
            return f"{name}'s strides {t.stride()} are not all multiples of 16 bytes"
    return None


@functools.lru_cache(maxsize=4096)
def _tma_strides(shape, strides, elem: int) -> bool:
    """Whether a (B, H, N, D) tensor's row stride, and its batch and head strides where that
    dimension has more than one entry, are multiples of 16 bytes (asked once per layout)."""
    batch, heads = shape[:2]
    checked = [strides[2]] + [st for st, size in ((strides[0], batch), (strides[1], heads)) if size > 1]
    return not any(st * elem % 16 for st in checked)


def _use_tma(tma: bool | None, named: dict) -> bool:
    """The launch's USE_TMA: descriptors where they can be used (``tma`` None), or as ``tma`` says
    (False: pointer loads; True: descriptors, a clear error where they cannot be)."""
    refusal = _tma_refusal(named) if tma is not False else None
    if tma and refusal:
        raise ValueError(f"tma=True: {refusal}")
    use = tma is not False and refusal is None
    if use:
        ensure_scratch_allocator()
    return use


def _output(name: str, given, like: torch.Tensor) -> torch.Tensor:
    """A caller's preallocated output (any strides, last dim contiguous), or a fresh contiguous one.

    A given output may also be fp32: the result unrounded, for callers that sum partial results
    (ring attention merges one block of keys at a time)."""
    if given is None:
        return torch.empty(like.shape, device=like.device, dtype=like.dtype)
    if (given.shape != like.shape or given.dtype not in (like.dtype, torch.float32) or given.device != like.device
            or given.stride(-1) != 1):
        raise ValueError(
            f"{name} must be a {like.dtype} or float32 tensor of shape {tuple(like.shape)} on {like.device} with a "
            f"contiguous last dim, got {given.dtype} {tuple(given.shape)} strides {given.stride()} on {given.device}"
        )
    return given


def attention_fwd(q, k, v, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0, *,
                  documents: Documents | None = None, out=None, config: dict | None = None,
                  tma: bool | None = None):
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), last dims contiguous, as
    ``limits.check_attention_args`` accepts them (not checked again here; Nq or Nk may be 0). With
    ``documents`` (a Documents), the packed variable-length layout instead: q (total_q, Hq, D), k and v
    (total_k, Hkv, D), as ``limits.check_varlen_args`` accepts them.

    ``window`` = (left, right): query i sees keys i + diagonal - left .. i + diagonal + right
    (diagonal = Nk - Nq per sequence, -1 = unbounded side; causal sets right to 0), and key tiles
    outside every row's window are skipped. ``softcap`` > 0 turns the scaled scores s into
    softcap * tanh(s / softcap) before the softmax.

    Returns o in q's shape and dtype and lse fp32, natural log, -inf on rows that see no key:
    (B, Hq, Nq), or (Hq, total_q) with documents (FlashAttention 2's varlen layout). o is ``out``
    when given (any strides with a contiguous last dim: a block passes a (B, Nq, Hq, D) buffer's
    transpose so o is already laid out for the output projection), else a new contiguous tensor.
    ``config`` ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}) pins the launch configuration;
    by default CUDA autotunes and the interpreter uses INTERPRETER_CONFIG. ``tma``: k and v stream
    through tensor descriptors (TMA) where their alignment allows (None), never (False), or always
    (True: an error where they cannot). ``window`` may be a list (the custom operator's form)."""
    window = tuple(window)
    offsets = () if documents is None else (documents.cu_seqlens_q, documents.cu_seqlens_k)
    key = (launch_key(_ATTN_FWD.compiled, (q, k, v, *(() if out is None else (out,)), *offsets)), causal, scale,
           window, softcap, None if documents is None else (documents.max_seqlen_q, documents.max_seqlen_k),
           out is None, None if config is None else tuple(sorted(config.items())), tma)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        return _attention_fwd_planned(key, q, k, v, causal, scale, window, softcap, documents, out, config, tma)
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype) if out is None else out
    lse = torch.empty(plan.lse_shape, device=q.device, dtype=torch.float32)
    if plan.launch is not None:
        if plan.tma and isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
            ensure_scratch_allocator()
        if documents is not None:
            q, k, v, o_heads = _heads_views((q, k, v, o))
        else:
            o_heads = o
        plan.launch(q, k, v, o_heads, lse, *(offsets or (lse, lse)))
    return o, lse[0] if documents is not None else lse


# The launchers' plans (kernels.launch.LaunchPlans): what a call of one signature launches, bound
# with everything but its tensors.
_FWD_PLANS, _BWD_PLANS = LaunchPlans(), LaunchPlans()


@dataclasses.dataclass(frozen=True)
class _ForwardPlan:
    lse_shape: tuple
    launch: object  # the bound kernel launch, None when there is nothing to compute
    tma: bool


def _attention_fwd_planned(key, q, k, v, causal, scale, window, softcap, documents, out, config, tma):
    """attention_fwd's first call of a signature: every check, the launch through Triton's path, and
    the plan its next calls take (not kept where a launch cannot be bound)."""
    _require_contiguous_last_dim({"q": q, "k": k, "v": v})
    o = _output("out", out, q)
    if documents is not None:
        q, k, v, o_heads = _heads_views((q, k, v, o))
    else:
        o_heads = o
    p = _Problem.of(q, k, causal, scale, window, softcap, documents)
    lse = torch.empty((p.batch, p.q_heads, p.q_len), device=q.device, dtype=torch.float32)
    if o.numel() == 0 or p.grid_batch == 0:
        _FWD_PLANS.keep(key, _ForwardPlan(tuple(lse.shape), None, False))
        return o, lse[0] if documents is not None else lse
    _check_warp_specialization("config", config, kernel_has_it=True)
    use_tma = _use_tma(tma, {"k": k, "v": v})
    kernel, cfg = _pick(_ATTN_FWD, _ATTN_FWD_TUNED, config)
    launch = kernel.bind(
        p.grid(0, "BLOCK_M", p.q_heads), (q, k, v, o_heads, lse, *_sequence_args(documents, lse)),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_heads.stride()[:3], *lse.stride()[:2], *p.scalars,
         *p.length_buckets), **p.constexprs(use_tma), NEGATIVE_SCALE=p.sm_scale < 0 and not p.softcap, **cfg,
    )
    if launch is not None:
        _FWD_PLANS.keep(key, _ForwardPlan(tuple(lse.shape), launch, use_tma))
    return o, lse[0] if documents is not None else lse


def attention_bwd(do, q, k, v, o, lse, causal: bool, scale: float, *, window=(-1, -1), softcap: float = 0.0,
                  documents: Documents | None = None, dlse=None, out=None, config: dict | None = None,
                  dkdv_config: dict | None = None, tma: bool | None = None):
    """Gradients of attention_fwd (q, k, v, window, softcap and documents as there). do like o
    (last dim contiguous; other strides free); lse as returned by attention_fwd; dlse (optional,
    lse's shape) the gradient reaching lse.

    Returns dq, dk, dv in the shapes and dtypes of q, k, v: ``out`` = (dq, dk, dv) when given (any
    strides with a contiguous last dim, e.g. views of one packed dqkv buffer), else new contiguous
    tensors. ``config`` pins the dQ kernel's launch configuration and ``dkdv_config`` the dK/dV
    kernel's (default: ``config`` without warp specialization, which only dQ takes). ``tma`` as in
    attention_fwd, for the streamed k, v (dQ) and q, dO (dK/dV)."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    offsets = () if documents is None else (documents.cu_seqlens_q, documents.cu_seqlens_k)
    key = (launch_key(_ATTN_DQ.compiled, (q, k, v, o, do, lse, *(() if dlse is None else (dlse,)), *(out or ()),
                                          *offsets)),
           causal, scale, tuple(window), softcap,
           None if documents is None else (documents.max_seqlen_q, documents.max_seqlen_k), dlse is None, out is None,
           None if config is None else tuple(sorted(config.items())),
           None if dkdv_config is None else tuple(sorted(dkdv_config.items())), tma)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        return _attention_bwd_planned(key, do, q, k, v, o, lse, causal, scale, window, softcap, documents, dlse, out,
                                      config, dkdv_config, tma)
    grads = out or (new_like(q), new_like(k), new_like(v))
    if plan.launches is None:
        return grads[0], grads[1].zero_(), grads[2].zero_()
    if plan.tma and isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
        ensure_scratch_allocator()
    dq, dk, dv = grads
    if documents is not None:
        q, k, v, o, do, dq, dk, dv = _heads_views((q, k, v, o, do, dq, dk, dv))
        lse = lse.unsqueeze(0)
        dlse = None if dlse is None else dlse.unsqueeze(0)
    delta, bias = torch.empty(plan.delta_shape, device=q.device, dtype=torch.float32).unbind(0)
    offsets = offsets or (lse, lse)
    preprocess, dkdv, dq_launch = plan.launches
    preprocess(o, do, lse, lse if dlse is None else dlse, delta, bias)
    dkdv(q, k, v, do, bias, delta, dk, dv, *offsets)
    dq_launch(q, k, v, do, bias, delta, dq, *offsets)
    return tuple(grads)


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    delta_shape: tuple
    launches: tuple | None  # the bound preprocess, dK/dV and dQ launches; None: nothing to compute
    tma: bool


def _attention_bwd_planned(key, do, q, k, v, o, lse, causal, scale, window, softcap, documents, dlse, out, config,
                           dkdv_config, tma):
    """attention_bwd's first call of a signature: every check, the launches through Triton's path,
    and the plan its next calls take (not kept where a launch cannot be bound)."""
    _require_contiguous_last_dim({"q": q, "k": k, "v": v, "o": o})
    _check_warp_specialization("config", config, kernel_has_it=True)
    _check_warp_specialization("dkdv_config", dkdv_config, kernel_has_it=False)
    grads = [_output(name, given, like) for name, given, like in zip(("dq", "dk", "dv"), out or (None,) * 3, (q, k, v))]
    if documents is not None:
        q, k, v, o, do = _heads_views((q, k, v, o, do))
        dq, dk, dv = _heads_views(grads)
        lse = lse.unsqueeze(0)
        dlse = None if dlse is None else dlse.unsqueeze(0)
    else:
        dq, dk, dv = grads
    p = _Problem.of(q, k, causal, scale, window, softcap, documents)
    if dq.numel() == 0 or p.grid_batch == 0:
        _BWD_PLANS.keep(key, _BackwardPlan((), None, False))
        return grads[0], grads[1].zero_(), grads[2].zero_()
    # delta and the exponent biases, padded to a multiple of every BLOCK_M (see _attn_bwd_preprocess)
    row_multiple = max([128] + [c["BLOCK_M"] for c in (config, dkdv_config) if c])
    nq_rounded = cdiv(p.q_len, row_multiple) * row_multiple
    delta, bias = torch.empty((2, p.batch, p.q_heads, nq_rounded), device=q.device, dtype=torch.float32)
    # 4096 values of o and of dO a program: larger blocks spilled registers (the preprocess rows of
    # static.json)
    pre_block = 16 if _INTERPRETING else max(16, min(128, 4096 // p.padded_head_dim))
    preprocess = _ATTN_BWD_PREPROCESS.bind(
        (nq_rounded // pre_block, p.q_heads, p.batch), (o, do, lse, dlse if dlse is not None else lse, delta, bias),
        (*o.stride()[:3], *do.stride()[:3], p.q_heads, p.q_len, nq_rounded, p.head_dim),
        HAS_DLSE=dlse is not None, NATURAL_EXP=p.natural_exp, HEAD_DIM=p.padded_head_dim,
        BLOCK_M=pre_block, **FP_FUSION,
    )

    scalars = (*p.scalars, nq_rounded, *p.length_buckets)
    use_tma = _use_tma(tma, {"q": q, "k": k, "v": v, "do": do})
    constexprs = p.constexprs(use_tma)
    offsets = _sequence_args(documents, lse)
    streamed = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    kernel, cfg = _pick(_ATTN_DKDV, _ATTN_DKDV_TUNED, dkdv_config or _without_warp_specialization(config))
    dkdv = kernel.bind(
        p.grid(1, "BLOCK_N", p.kv_heads), (q, k, v, do, bias, delta, dk, dv, *offsets),
        (*streamed, *dk.stride()[:3], *dv.stride()[:3], *scalars), **constexprs, **cfg,
    )
    kernel, cfg = _pick(_ATTN_DQ, _ATTN_DQ_TUNED, config)
    dq_launch = kernel.bind(
        p.grid(0, "BLOCK_M", p.q_heads), (q, k, v, do, bias, delta, dq, *offsets),
        (*streamed, *dq.stride()[:3], *scalars), **constexprs, **cfg,
    )
    if None not in (preprocess, dkdv, dq_launch):
        _BWD_PLANS.keep(key, _BackwardPlan((2, p.batch, p.q_heads, nq_rounded), (preprocess, dkdv, dq_launch), use_tma))
    return tuple(grads)


def _check_warp_specialization(name: str, config: dict | None, kernel_has_it: bool) -> None:
    """Refuse a pinned configuration asking for WARP_SPECIALIZE where it cannot compile: for the
    dK/dV kernel, which has no such loop, and on a GPU other than datacenter Blackwell or a Triton
    before 3.9 (Hopper's and Triton 3.6's warp-specialization passes fail on these kernels). The
    interpreter runs the loop as written, whatever the flag."""
    if not config or not config.get("WARP_SPECIALIZE"):
        return
    if not kernel_has_it:
        raise ValueError(f"{name}: the dK/dV kernel is never warp-specialized (WARP_SPECIALIZE is dQ's and the forward's)")
    if not _INTERPRETING and (target_family() != 100 or not warp_specialization_compiles()):
        raise ValueError(f"{name}: WARP_SPECIALIZE needs a datacenter Blackwell GPU (sm_100 to 119) and Triton 3.9 "
                         f"or later; this is GPU family {target_family()}, Triton {triton.__version__}")


def _without_warp_specialization(config: dict | None) -> dict | None:
    """A pinned dQ configuration as dK/dV's, whose kernel is never warp-specialized."""
    if config is None:
        return None
    return {key: value for key, value in config.items() if key not in ("WARP_SPECIALIZE", "maxnreg")}


def _pick(plain, tuned, config):
    """(kernel, launch kwargs): a pinned config, the interpreter's fixed one, or the autotuner;
    always asking for fused multiply-adds (the autotuner hands them to every configuration)."""
    if config is not None:
        return plain, {**config, **FP_FUSION}
    if _INTERPRETING:
        return plain, _INTERPRETER_LAUNCH
    return tuned, FP_FUSION


__all__ = ["Documents", "attention_fwd", "attention_bwd", "INTERPRETER_CONFIG"]
