"""Attention's Triton kernels, FlashAttention 2's algorithm: forward and backward without ever
storing the Nq x Nk matrix. The launchers that check, plan and launch them are in ``attention``.

Forward (``_attn_fwd``): one program per (query block, query head, batch or document) streams key
blocks with an online softmax in base 2 and writes o and the per-row log-sum-exp (fp32, natural
log), the only softmax statistic kept for the backward. The scale is applied once per row to the
running max and inside each exponent's fma, never to the scores themselves. 16-bit inputs run in
log2 units, log2(e) folded into the scale (qk_scale); fp32 inputs keep the running max and lse in
natural units (NATURAL_EXP, see ``_probs``), because the log2-unit difference loses the digits
that fp32's P near 1 needs.

Backward: P = exp(S - lse) is recomputed block by block. ``_attn_bwd_preprocess`` makes each row's
delta = rowsum(dO * O) (minus dLSE) and exponent bias once; ``_attn_bwd_dkdv`` gives each program
one key block of one kv head and loops over the query heads of its GQA group and over query
blocks; ``_attn_bwd_dq`` gives each program one query block and loops over key blocks. Every
output element has one writer: no atomics, so gradients are bitwise reproducible.

Masks (causal aligned bottom-right as in FlashAttention 2, windows, packed documents) decide which
tiles a program visits: tiles no row sees are skipped, tiles every row sees run the unmasked loop,
only those crossing a bound run the masked one. Head dims are padded to HEAD_DIM (a power of two,
at least 16) with masks. Scores, statistics and accumulators are fp32, and every accumulation
happens inside ``tl.dot`` (``acc = dot(a, b, acc * alpha)``): an accumulator defined by other
instructions between warpgroup MMAs makes ptxas serialize them (advisory C7515). Streamed tiles
come through tensor descriptors (USE_TMA) or masked pointer loads (``_tile_source``).

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

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .attention_configs import CONFIGS, PRUNERS, TUNE_KEY
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
