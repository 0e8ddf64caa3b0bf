"""FlashAttention-style attention: forward and backward without ever storing the Nq x Nk matrix.

Shapes: q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D), Hq a multiple of Hkv (query head h reads kv head
h // (Hq // Hkv): GQA, MQA). Any strides as long as the last dim is contiguous: every stride goes to
the kernels, so views into a packed qkv projection need no copy.

Forward (``_attn_fwd``): one program per (query block, query head, batch) streams key blocks with an
online softmax in the log2 domain (log2(e) is folded into the scale, and the scale is applied once
per row to the running max and inside each exponent's fma, never to the scores themselves), and
writes o (input dtype) and the per-row log-sum-exp (fp32, natural log). Backward recomputes
P = exp(S - lse) block by block.
fp32 inputs keep the softmax offsets (running max, lse) in natural units and form every exponent
S * scale - offset with one fma (``_probs``, which takes the offset negated: a bias): with large
logits the log2-domain form loses digits in the difference and P near 1 would be 1e-5 off; 16-bit
inputs keep the cheaper log2 form.
Backward kernels: ``_attn_bwd_preprocess`` computes delta = rowsum(dO * O) (minus dLSE when the lse output has a
gradient), ``_attn_bwd_dkdv`` gives each program one key block of one kv head and loops over the
query heads of its GQA group and over query blocks, ``_attn_bwd_dq`` gives each program one query
block and loops over key blocks. Every output element is written by exactly one program: no
atomics, so gradients are bitwise reproducible.

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
autotuned per (length buckets, HEAD_DIM, causal, dtype); in the interpreter one small fixed
configuration runs, and dot operands are upcast to fp32 (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .launch import ensure_scratch_allocator, next_power_of_2
from .limits import MAX_HEAD_DIM, triton_interpreting
from .precision import round_to

LOG2E = tl.constexpr(1.4426950408889634)  # the scores run in log2 units: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # back to natural log: ln(x) = log2(x) * LN2

# The one configuration the interpreter runs (CPU; no autotuning, small blocks keep CI fast).
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


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
def _row_stats(base, batch, head, Hq, Nq):
    """Pointer to the Nq values of one batch and head of a contiguous fp32 (B, Hq, Nq) tensor."""
    return base + (batch * Hq + head) * Nq


@triton.jit
def _dot(a, b, acc, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc None: a @ b). The sum happens inside the MMA: an accumulator
    rescaled or added to outside it would be defined by non-wgmma instructions between warpgroup
    MMAs, which makes ptxas serialize them on Hopper (advisory C7515). UPCAST_DOT (interpreter):
    fp32 operands, exact products."""
    if UPCAST_DOT:
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
def _key_ranges(start_m, Nq, Nk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query block starting at start_m: key blocks [0, full_end) need no mask, key blocks
    [full_end, masked_end) need the causal and/or key-bound mask, keys from masked_end on are unseen."""
    whole_blocks_end = (Nk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # Query i sees keys j <= i + (Nk - Nq). A key block is unmasked for every row of the query
        # block when its last key is visible from the block's first row.
        first_row_sees = tl.maximum(start_m + (Nk - Nq) + 1, 0)  # keys visible to row start_m
        full_end = tl.minimum((first_row_sees // BLOCK_N) * BLOCK_N, whole_blocks_end)
        masked_end = tl.minimum(tl.maximum(start_m + BLOCK_M + (Nk - Nq), 0), Nk)
        masked_end = tl.maximum(masked_end, full_end)
    else:
        full_end = whole_blocks_end
        masked_end = Nk
    return full_end, masked_end


@triton.jit
def _visible(offs_m, keys, Nq, Nk, CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the keys each query row sees: real keys, and for causal the
    bottom-right-aligned diagonal (query i sees key j iff j <= i + Nk - Nq)."""
    visible = keys[None, :] < Nk
    if CAUSAL:
        visible = visible & (keys[None, :] <= offs_m[:, None] + (Nk - Nq))
    return visible


@triton.jit
def _key_block(
    q, k_src, v_src, stride_kn, stride_vn, start_n, Nk, D,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """k and v of the key block at start_n (rows past Nk read as zero) and the raw, unmasked scores
    q k^T (not yet scaled). k_src, v_src: _tile_source's."""
    k = _load_tile(k_src, start_n, Nk, stride_kn, D, CHECK_ROWS=MASKED, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                   BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    v = _load_tile(v_src, start_n, Nk, stride_vn, D, CHECK_ROWS=MASKED, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                   BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    return k, v, _dot(q, tl.trans(k), None, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)


@triton.jit
def _probs(s, sm_scale, qk_scale, bias, DOT_PRECISION: tl.constexpr):
    """exp(s * sm_scale + bias) for raw scores s, elementwise (bias, the negated softmax offset,
    broadcast by the caller; negated once per row rather than once per score, which the fma's own
    negation would not always absorb).

    16-bit inputs: bias is in log2 units and the exponent is one multiply-add in the log2 domain,
    exp2(s * qk_scale + bias); P is rounded to 16 bits before its dots anyway.
    fp32 inputs (IEEE dots): bias is in natural units and the exponent s * sm_scale + bias is
    one fma, rounded once, before the conversion to log2 units. With large logits (|s * scale| ~
    100) the log2-domain form rounds s * qk_scale and the offset separately at magnitude ~144 and
    their difference keeps only a few correct bits beyond fp32's relative 1e-7: P near 1 (the
    dominant keys) comes out 1e-5 off, which dominates dV and dK. The fma keeps P to fp32 accuracy."""
    if DOT_PRECISION == "ieee":
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
def _attn_fwd_inner(
    acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, Nq, Nk, D, sm_scale, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online softmax over the key blocks in [lo, hi): running max m_i, sum l_i and output acc.
    16-bit inputs run in log2 units (m_i too); fp32 inputs keep m_i in natural units and form each
    exponent with one fma (see _probs), so that lse = m_i + ln(l_i) matches the backward's P. The
    scale is applied once per row to the max and inside the exponent's fma, never to the scores."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    if DOT_PRECISION == "ieee":
        scale = sm_scale  # natural units
    else:
        scale = qk_scale  # log2 units
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk = _key_block(
            q, k_src, v_src, stride_kn, stride_vn, start_n, Nk, D, MASKED=MASKED, HEAD_DIM=HEAD_DIM,
            EVEN_D=EVEN_D, USE_TMA=USE_TMA, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        )
        visible = _visible(offs_m, start_n + offs_n, Nq, Nk, CAUSAL=CAUSAL) if MASKED else None
        m_new = tl.maximum(m_i, _scaled_row_max(qk, scale, visible, MASKED=MASKED, NEGATIVE_SCALE=NEGATIVE_SCALE))
        if MASKED:
            # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = _probs(qk, sm_scale, qk_scale, -m_shift[:, None], DOT_PRECISION=DOT_PRECISION)
        if MASKED:
            p = tl.where(visible, p, 0.0)
        if DOT_PRECISION == "ieee":
            alpha = tl.math.exp2((m_i - m_shift) * LOG2E)
        else:
            alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Nq", "Nk"])  # lengths of 1 stay runtime values
def _attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale,
    N_CTX_Q_KEY, N_CTX_K_KEY,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """o = softmax(q k^T * scale) v and lse per row. Grid: (query blocks, Hq, B); causal runs the
    last query blocks (which see the most keys) first, for a shorter tail. K and V stream through
    _tile_source (TMA descriptors when USE_TMA).

    N_CTX_Q_KEY and N_CTX_K_KEY are unused here: they are the autotuner's length buckets."""
    start_m, head, kv_head, batch = _program_place(GROUP, REVERSE=CAUSAL, BLOCK=BLOCK_M)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    k_src = _tile_source(_head(K, batch, kv_head, stride_kb, stride_kh), Nk, D, stride_kn,
                         USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    v_src = _tile_source(_head(V, batch, kv_head, stride_vb, stride_vh), Nk, D, stride_vn,
                         USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    q = _load_rows(_head(Q, batch, head, stride_qb, stride_qh), start_m, offs_r, Nq, stride_qn, offs_d, D,
                   CHECK_ROWS=True, EVEN_D=EVEN_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, masked_end = _key_ranges(start_m, Nq, Nk, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, 0, full_end, Nq, Nk, D, sm_scale,
        qk_scale, MASKED=False, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
        NEGATIVE_SCALE=NEGATIVE_SCALE, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, full_end, masked_end, Nq, Nk, D,
        sm_scale, qk_scale, MASKED=True, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
        NEGATIVE_SCALE=NEGATIVE_SCALE, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )

    empty = l_i == 0.0  # rows that saw no key
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DOT_PRECISION == "ieee":  # m_i in natural units: one rounding
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    else:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    _store_rows(_head(O, batch, head, stride_ob, stride_oh), start_m, offs_r, Nq, stride_on, offs_d, D,
                round_to(o, O.dtype.element_ty), EVEN_D=EVEN_D)
    tl.store(_row_stats(LSE, batch, head, Hq, Nq) + offs_m, lse, mask=offs_m < Nq)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_preprocess(
    O, DO, LSE, DLSE, DELTA, BIAS,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    Hq, Nq, NQ_ROUNDED, D,
    HAS_DLSE: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The per-row values the dK/dV and dQ loops read, made once so those loops do no work on them:
    delta = rowsum(dO * O) in fp32, minus dLSE when lse has a gradient (dS = P (dP - delta)), and
    the exponent bias of _probs: minus the saved lse, in log2 units (natural log for fp32 inputs),
    and -inf on rows that see no key (lse = -inf), so that their P is exactly 0 instead of NaN.

    LSE and DLSE are contiguous (B, Hq, Nq); DELTA and BIAS (B, Hq, NQ_ROUNDED), where the rows
    from Nq up to NQ_ROUNDED (a multiple of every BLOCK_M) get delta 0 and bias -inf: the loops
    load whole blocks without masks, and those rows add nothing. Grid: (NQ_ROUNDED / BLOCK_M, Hq, B)."""
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
        delta -= tl.load(_row_stats(DLSE, batch, head, Hq, Nq) + offs_m, mask=real, other=0.0).to(tl.float32)
    lse = tl.load(_row_stats(LSE, batch, head, Hq, Nq) + offs_m, mask=real, other=float("-inf"))
    if DOT_PRECISION != "ieee":
        lse = lse * LOG2E
    tl.store(_row_stats(DELTA, batch, head, Hq, NQ_ROUNDED) + offs_m, delta)
    tl.store(_row_stats(BIAS, batch, head, Hq, NQ_ROUNDED) + offs_m, tl.where(lse == float("-inf"), lse, -lse))


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_src, do_src, BIAS_row, DELTA_row, stride_qn, stride_don, start_n, lo, hi, Nq, Nk, D,
    sm_scale, qk_scale, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi), working on transposed tiles
    (keys along rows); q and dO stream from _tile_source's. Query rows past Nq read as zero with
    bias -inf, hence P = 0: they add nothing."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_r
        q = _load_tile(q_src, start_m, Nq, stride_qn, D, CHECK_ROWS=True, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                       BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        do = _load_tile(do_src, start_m, Nq, stride_don, D, CHECK_ROWS=True, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                        BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        bias = tl.load(BIAS_row + offs_m)  # padded: see _attn_bwd_preprocess
        delta = tl.load(DELTA_row + offs_m)
        # P^T recomputed from the saved lse: exp(S^T * scale - lse). The lse is only as good as the
        # match between these scores and the forward's, bit for bit: with logits ~100 a one-ulp
        # difference in S moves P by 1e-5. The GPU's fp32 (IEEE) dot is a sequential fma chain over
        # D per element, the same bits for k q^T as for (q k^T)^T; the interpreter's BLAS sums
        # k q^T in another order than q k^T (a few ulps apart), so there S^T is taken as the
        # transpose of the forward's own product.
        if UPCAST_DOT:
            qk_t = tl.trans(_dot(q, tl.trans(k), None, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION))
        else:
            qk_t = _dot(k, tl.trans(q), None, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
        p_t = _probs(qk_t, sm_scale, qk_scale, bias[None, :], DOT_PRECISION=DOT_PRECISION)
        if MASKED:  # the causal diagonal: query i sees key j iff j <= i + Nk - Nq
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + (Nk - Nq), p_t, 0.0)
        dv = _dot(p_t.to(do.dtype), do, dv, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
        dp_t = _dot(v, tl.trans(do), None, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["Nq", "Nk"])  # lengths of 1 stay runtime values
def _attn_bwd_dkdv(
    Q, K, V, DO, BIAS, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale, NQ_ROUNDED,
    N_CTX_Q_KEY, N_CTX_K_KEY,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV for one key block of one kv head, summed over the GROUP query heads that share it.
    Grid: (key blocks, Hkv, B). Rows of the key block past Nk are computed but never stored."""
    start_n, kv_head, _, batch = _program_place(1, REVERSE=False, BLOCK=BLOCK_N)
    offs_r = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(_head(K, batch, kv_head, stride_kb, stride_kh), start_n, offs_r, Nk, stride_kn, offs_d, D,
                   CHECK_ROWS=True, EVEN_D=EVEN_D)
    v = _load_rows(_head(V, batch, kv_head, stride_vb, stride_vh), start_n, offs_r, Nk, stride_vn, offs_d, D,
                   CHECK_ROWS=True, EVEN_D=EVEN_D)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    if CAUSAL:
        # Key j is seen by queries i >= j - (Nk - Nq); every key of the block by i >= last - (Nk - Nq).
        first_query = tl.maximum(start_n - (Nk - Nq), 0)
        masked_lo = (first_query // BLOCK_M) * BLOCK_M
        all_see = tl.maximum(start_n + BLOCK_N - 1 - (Nk - Nq), 0)
        full_lo = tl.cdiv(all_see, BLOCK_M) * BLOCK_M
        masked_hi = tl.minimum(full_lo, Nq)
    else:
        masked_lo = 0
        full_lo = 0
        masked_hi = 0

    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_src = _tile_source(_head(Q, batch, head, stride_qb, stride_qh), Nq, D, stride_qn,
                             USE_TMA=USE_TMA, BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        do_src = _tile_source(_head(DO, batch, head, stride_dob, stride_doh), Nq, D, stride_don,
                              USE_TMA=USE_TMA, BLOCK=BLOCK_M, HEAD_DIM=HEAD_DIM)
        BIAS_row = _row_stats(BIAS, batch, head, Hq, NQ_ROUNDED)
        DELTA_row = _row_stats(DELTA, batch, head, Hq, NQ_ROUNDED)
        if CAUSAL:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_src, do_src, BIAS_row, DELTA_row, stride_qn, stride_don, start_n, masked_lo, masked_hi,
                Nq, Nk, D, sm_scale, qk_scale, MASKED=True, HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
                UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_src, do_src, BIAS_row, DELTA_row, stride_qn, stride_don, start_n, full_lo, Nq,
            Nq, Nk, D, sm_scale, qk_scale, MASKED=False, HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
            UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )

    dk = dk * sm_scale
    _store_rows(_head(DK, batch, kv_head, stride_dkb, stride_dkh), start_n, offs_r, Nk, stride_dkn, offs_d, D,
                round_to(dk, DK.dtype.element_ty), EVEN_D=EVEN_D)
    _store_rows(_head(DV, batch, kv_head, stride_dvb, stride_dvh), start_n, offs_r, Nk, stride_dvn, offs_d, D,
                round_to(dv, DV.dtype.element_ty), EVEN_D=EVEN_D)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, bias, delta, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, Nq, Nk, D, sm_scale, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dQ (unscaled) of one query block over the key blocks in [lo, hi). Rows that see no
    key have bias = -inf (see _attn_bwd_preprocess), so their P is exactly 0."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk = _key_block(
            q, k_src, v_src, stride_kn, stride_vn, start_n, Nk, D, MASKED=MASKED, HEAD_DIM=HEAD_DIM,
            EVEN_D=EVEN_D, USE_TMA=USE_TMA, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        )
        p = _probs(qk, sm_scale, qk_scale, bias[:, None], DOT_PRECISION=DOT_PRECISION)
        if MASKED:
            p = tl.where(_visible(offs_m, start_n + offs_n, Nq, Nk, CAUSAL=CAUSAL), p, 0.0)
        dp = _dot(do, tl.trans(v), None, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["Nq", "Nk"])  # lengths of 1 stay runtime values
def _attn_bwd_dq(
    Q, K, V, DO, BIAS, DELTA, DQ,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale, NQ_ROUNDED,
    N_CTX_Q_KEY, N_CTX_K_KEY,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ for one query block of one query head, looping over key blocks. Grid: (query blocks, Hq, B)."""
    start_m, head, kv_head, batch = _program_place(GROUP, REVERSE=CAUSAL, BLOCK=BLOCK_M)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(_head(Q, batch, head, stride_qb, stride_qh), start_m, offs_r, Nq, stride_qn, offs_d, D,
                   CHECK_ROWS=True, EVEN_D=EVEN_D)
    do = _load_rows(_head(DO, batch, head, stride_dob, stride_doh), start_m, offs_r, Nq, stride_don, offs_d, D,
                    CHECK_ROWS=True, EVEN_D=EVEN_D)
    bias = tl.load(_row_stats(BIAS, batch, head, Hq, NQ_ROUNDED) + offs_m)  # padded: see _attn_bwd_preprocess
    delta = tl.load(_row_stats(DELTA, batch, head, Hq, NQ_ROUNDED) + offs_m)
    k_src = _tile_source(_head(K, batch, kv_head, stride_kb, stride_kh), Nk, D, stride_kn,
                         USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)
    v_src = _tile_source(_head(V, batch, kv_head, stride_vb, stride_vh), Nk, D, stride_vn,
                         USE_TMA=USE_TMA, BLOCK=BLOCK_N, HEAD_DIM=HEAD_DIM)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, masked_end = _key_ranges(start_m, Nq, Nk, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    dq = _attn_bwd_dq_inner(
        dq, q, do, bias, delta, k_src, v_src, stride_kn, stride_vn, start_m, 0, full_end, Nq, Nk, D, sm_scale,
        qk_scale, MASKED=False, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
        UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    dq = _attn_bwd_dq_inner(
        dq, q, do, bias, delta, k_src, v_src, stride_kn, stride_vn, start_m, full_end, masked_end, Nq, Nk, D,
        sm_scale, qk_scale, MASKED=True, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, USE_TMA=USE_TMA,
        UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    dq = dq * sm_scale
    _store_rows(_head(DQ, batch, head, stride_dqb, stride_dqh), start_m, offs_r, Nq, stride_dqn, offs_d, D,
                round_to(dq, DQ.dtype.element_ty), EVEN_D=EVEN_D)


# --------------------------------------------------------------------------------------------
# Autotuning (CUDA only)
# --------------------------------------------------------------------------------------------

_TUNE_KEY = ["N_CTX_Q_KEY", "N_CTX_K_KEY", "HEAD_DIM", "CAUSAL"]


def _configs(shapes):
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and GPU family: 90 = Hopper (sm_90) and
# newer, 80 = Ampere/Ada. Forward and dQ stream key tiles past a resident query tile; dK/dV streams
# query tiles past a resident key tile (its BLOCK_N is the resident side). Chosen from the compiled
# form (`python -m bench static`: ptxas -v and the SASS, bf16, D 64/128), not from timing:
# - Hopper: every dot a warpgroup MMA (HGMMA) doing each multiply-add once. Left out: 8-warp tiles
#   with 64 query rows in fwd/dQ (both warpgroups recompute S and dP: 1.5x / 1.67x the work), dK/dV
#   key tiles below 64 rows (BLOCK_N = 32: wgmma needs M >= 64, mma.sync instead) and 8-warp dK/dV
#   tiles of 64 key rows (M16/M32 N64 w8: 1.5x). In: the large tiles that fit 227 KiB, such as
#   fwd M128 N128 w8 s3 (225 KiB at D=128, no spills), dQ M128 N128 w8 (s2: 193 KiB at D=128), dK/dV
#   M64 N128 w8 (the fewest instructions per multiply-add; two stages leave registers and shared
#   memory to spare) and M16 N128 w8 (no spills at D=128 with GQA, where the larger tiles spill).
#   Warp specialization is not among them: tl.range(warp_specialize=True) left the forward loop
#   unchanged at 8 warps (the same SASS, no register reallocation) and failed in Triton 3.9's
#   NVGPUWarpSpecialization pass at 4 warps, on sm_90a.
# - A100: the configurations measured before the Hopper list; those that spill are in _SPILLS.
_SHAPES = {
    "fwd": {
        90: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2)],
        80: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3),
             (64, 64, 8, 3), (64, 128, 4, 3), (64, 32, 4, 2), (64, 32, 8, 2)],
    },
    "dq": {
        90: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
             (64, 16, 4, 3)],
        80: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 8, 3),
             (64, 64, 4, 3), (64, 32, 4, 4), (64, 128, 8, 2), (64, 32, 8, 2)],
    },
    "dkdv": {
        90: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 4)],
        80: [(32, 128, 8, 3), (64, 128, 8, 3), (16, 64, 8, 3), (32, 64, 8, 2),
             (32, 64, 4, 4), (16, 32, 4, 2), (32, 32, 8, 2), (64, 32, 4, 3)],
    },
}

# The pruning facts: where a configuration spills registers, read from ptxas -v on the compiled
# kernel (bf16; fp16 taken as the same), never from timing: every configuration of the lists above at
# head dims 64, 128 and 256, causal and not, MHA and GQA 4:1 (fwd and dQ do not depend on GQA), on
# Triton 3.6 and 3.9, compiled for sm_90a and sm_80 through the launchers (bench/static.py's
# stand-in driver), after the kernels moved to tensor descriptors and in-MMA accumulation (issue 11).
# An entry lists the cases where either Triton version spills: (family, kernel, (BLOCK_M, BLOCK_N,
# num_warps)) -> [(padded head dims, causal, GQA)], None = either, and a fourth element, the Triton
# versions, where only some spill; the comments give the range of spill-store bytes over those
# cases. A configuration not listed spilled nowhere.
_SPILLS = {
    # D=256: dK and dV's accumulators alone take 256 registers a thread in every Hopper dK/dV tile;
    # all spill (2 KiB and more), so the pruning falls back to those that fit.
    (90, "dkdv", (64, 128, 8)): [((128,), None, True), ((128,), True, False), ((256,), None, None)],  # 8..3328
    (90, "dkdv", (32, 128, 8)): [((128,), True, True), ((256,), None, None)],  # 20 (3.6); 2 KiB+ at 256
    (90, "dkdv", (32, 64, 4)): [((128,), True, True), ((256,), None, None)],  # 4..48; 2 KiB+ at 256
    (90, "dkdv", (16, 128, 8)): [((256,), None, None)],  # 2 KiB+
    (90, "dq", (128, 128, 8)): [((256,), None, None)],  # 196..820 (s3 is over 227 KiB anyway)
    (90, "dq", (128, 64, 8)): [((256,), None, None)],  # 84..108 (3.6)
    (90, "dq", (64, 64, 4)): [((256,), None, None)],  # 8..108
    (90, "dq", (64, 32, 4)): [((256,), None, None, "3.6")],  # 16..44 (3.9: none, 758 instructions / M MAC)
    (90, "dq", (128, 32, 8)): [((256,), None, None, "3.6")],  # 16..40 (3.9: none)
    (90, "fwd", (128, 128, 8)): [((256,), None, None)],  # 4..36 (3.6)
    (90, "fwd", (64, 128, 4)): [((256,), True, None)],  # 36 (3.6)
    (80, "dkdv", (64, 128, 8)): [((64, 128, 256), None, None)],  # 8..5084
    (80, "dkdv", (32, 128, 8)): [((64,), None, True), ((128, 256), None, None)],  # 4..6392
    (80, "dkdv", (32, 64, 4)): [((64,), None, True), ((64,), True, False), ((128, 256), None, None)],  # 8..17520
    (80, "dkdv", (32, 64, 8)): [((64,), True, True), ((256,), None, True), ((256,), True, False)],  # 8..188
    (80, "dkdv", (64, 32, 4)): [((64,), True, True), ((128, 256), None, None)],  # 8..924
    (80, "dkdv", (16, 64, 8)): [((256,), True, True)],  # 76..100
    (80, "dkdv", (16, 32, 4)): [((256,), True, None)],  # 4..172
    (80, "dq", (128, 64, 8)): [((128, 256), None, None)],  # 24..212
    (80, "dq", (128, 32, 8)): [((256,), None, None)],  # 48..180
    (80, "dq", (64, 128, 8)): [((64, 256), None, None), ((128,), True, None)],  # 4..44
    (80, "dq", (64, 64, 4)): [((128, 256), None, None)],  # 8..288
    (80, "dq", (64, 64, 8)): [((256,), True, None)],  # 8..24
    (80, "dq", (64, 32, 4)): [((256,), True, None)],  # 64..72
    (80, "fwd", (128, 128, 8)): [((128, 256), None, None)],  # 28..704
    (80, "fwd", (128, 64, 8)): [((256,), None, None)],  # 16..136
    (80, "fwd", (128, 32, 8)): [((64,), True, None), ((256,), None, None)],  # 8..124
    (80, "fwd", (64, 128, 4)): [((64, 128, 256), None, None)],  # 4..944
    (80, "fwd", (64, 64, 4)): [((128,), True, None), ((256,), None, None)],  # 4..132
    (80, "fwd", (64, 32, 8)): [((64,), True, None), ((128,), False, None)],  # 8
    (80, "fwd", (64, 32, 4)): [((256,), None, None)],  # 4..40
}
# Shared memory per block where the driver cannot say (opt-in maximum, bytes).
_SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# Tiles a kernel keeps resident for its whole loop (fwd: Q; dQ: Q and dO; dK/dV: K and V).
_RESIDENT_TILES = {"fwd": 1, "dq": 2, "dkdv": 2}


def _target_family() -> int:
    """90 when Triton compiles for Hopper or newer, 80 below: the active driver's target, which is
    the GPU's or, in bench/static.py, the stand-in's (so the compile-target tests see this choice).
    Without a CUDA driver (CPU tests) the Hopper list."""
    try:
        arch = triton.runtime.driver.active.get_current_target().arch
    except Exception:
        return 90
    return 90 if isinstance(arch, int) and arch >= 90 else 80


def _smem_limit(family: int) -> int:
    try:
        driver = triton.runtime.driver.active
        return int(driver.utils.get_device_properties(driver.get_current_device())["max_shared_mem"])
    except Exception:
        return _SMEM_LIMIT[family]


def _smem_estimate(config, head_dim: int, elem: int, kernel: str) -> int:
    """Shared memory: the pipelined stream of two tiles plus the resident tiles, and 2 KiB for the
    rest (the compiled kernels request this to within 1 KiB at D 64/128)."""
    rows = config.kwargs
    streamed, resident = ("BLOCK_M", "BLOCK_N") if kernel == "dkdv" else ("BLOCK_N", "BLOCK_M")
    return (config.num_stages * 2 * rows[streamed] + _RESIDENT_TILES[kernel] * rows[resident]) * head_dim * elem + 2048


def _spills(family: int, kernel: str, config, head_dim: int, causal, gqa) -> bool:
    blocks = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps)
    triton_version = ".".join(triton.__version__.split(".")[:2])
    return any(head_dim in dims and (c is None or causal is None or c == causal) and (g is None or gqa is None or g == gqa)
               and (not versions or triton_version in versions)
               for dims, c, g, *versions in _SPILLS.get((family, kernel, blocks), ()))


def _shape(config) -> tuple:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _fp32_config(kernel: str, head_dim: int):
    """The one configuration of ``kernel`` for fp32 inputs at this padded head dim (_FP32_SHAPES)."""
    shapes = _FP32_SHAPES[kernel]
    return _configs([shapes[min(d for d in shapes if d >= head_dim)]])[0]


def _pruner(kernel: str):
    """The autotuner's early_config_prune for ``kernel``: the target family's list, within its
    shared memory, without the configurations _SPILLS lists for this head dim, causality and GQA
    (unknown ones count as spilling). Never empty: if every configuration spills, those that fit are
    kept, and if none fits, the fp32 one (small enough for any head dim). fp32 (IEEE dots, a
    correctness path rather than a fast one) gets its one configuration of _FP32_SHAPES."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head_dim = args["HEAD_DIM"]
        elem = args["Q"].element_size()
        if elem >= 4:
            return [_fp32_config(kernel, head_dim)]
        family = _target_family()
        wanted = set(_SHAPES[kernel][family])
        limit = _smem_limit(family)
        causal = args.get("CAUSAL")
        gqa = None if "GROUP" not in args else int(args["GROUP"]) > 1
        fitting = []
        for config in configs:
            if _shape(config) not in wanted or _smem_estimate(config, head_dim, elem, kernel) > limit:
                continue
            # Register budget: a 128-row fp32 accumulator of width 256 needs 8 warps.
            if head_dim >= 256 and config.kwargs["BLOCK_N" if kernel == "dkdv" else "BLOCK_M"] >= 128 and config.num_warps < 8:
                continue
            fitting.append(config)
        keep = [c for c in fitting if not _spills(family, kernel, c, head_dim, causal, gqa)]
        return keep or fitting or [_fp32_config(kernel, head_dim)]

    return prune


# Every configuration of either family (the autotuner's list is fixed at decoration; the pruner
# picks the target's).
_FWD_CONFIGS, _DQ_CONFIGS, _DKDV_CONFIGS = (
    _configs(dict.fromkeys(_SHAPES[k][90] + _SHAPES[k][80])) for k in ("fwd", "dq", "dkdv"))

# fp32 inputs take IEEE dots, which compile to FFMA loops, not tensor-core MMAs: every product of a
# tile sits in registers, so fp32 gets small tiles, per padded head dim (up to the key), chosen from
# ptxas -v over D 64/128/256, causal and not, MHA and GQA, sm_90a and sm_80, Triton 3.6 and 3.9
# (bench/static.py). Larger tiles spill kilobytes, and from D=128 on ptxas gives up allocating (32
# registers and a stack of several KiB): the old M64 N32 w4 did both. These spill nothing in most
# cases and stay within 64 B a thread at D <= 128 (the compile-target tests' budget); at D=256 no
# fwd or dQ tile of these kernels avoids spilling and M16 N16 w8 spills least (376-448 B, against
# 4-90 KiB for the others).
_FP32_SHAPES = {
    "fwd": {64: (16, 32, 4, 2), 256: (16, 16, 8, 2)},
    "dq": {64: (16, 32, 4, 2), 256: (16, 16, 8, 2)},
    "dkdv": {256: (32, 16, 8, 2)},
}
_FWD_PRUNE, _DQ_PRUNE, _DKDV_PRUNE = (_pruner(k) for k in ("fwd", "dq", "dkdv"))

_attn_fwd_tuned = triton.autotune(
    configs=_FWD_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _FWD_PRUNE}
)(_attn_fwd)
_attn_bwd_dq_tuned = triton.autotune(
    configs=_DQ_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _DQ_PRUNE}
)(_attn_bwd_dq)
_attn_bwd_dkdv_tuned = triton.autotune(
    configs=_DKDV_CONFIGS, key=_TUNE_KEY + ["GROUP"], prune_configs_by={"early_config_prune": _DKDV_PRUNE}
)(_attn_bwd_dkdv)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention kernels take 4-D q, k, v (B, H, N, D)")
    batch, q_heads, _, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, Hkv, Nk, D) for q {tuple(q.shape)}")
    if k.shape[1] < 1 or q_heads % k.shape[1]:
        raise ValueError(f"q heads {q_heads} must be a multiple of kv heads {k.shape[1]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} outside 1..{MAX_HEAD_DIM}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


@dataclasses.dataclass(frozen=True)
class _Problem:
    """One attention call's sizes and options, as every launch needs them."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    causal: bool
    sm_scale: float
    ieee_dots: bool  # fp32 inputs: IEEE-precision dots, not TF32

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> _Problem:
        batch, q_heads, q_len, head_dim = q.shape
        return cls(batch, q_heads, k.shape[1], q_len, k.shape[2], head_dim, bool(causal), float(scale),
                   q.dtype == torch.float32)

    @property
    def padded_head_dim(self) -> int:
        return max(16, next_power_of_2(self.head_dim))

    @property
    def qk_scale(self) -> float:
        """The softmax scale with log2(e) folded in: the kernels' scores are in log2 units."""
        return self.sm_scale * LOG2E.value

    def scalars(self, *scales: float) -> tuple:
        """The kernels' arguments after the strides: Hq, Nq, Nk, D, GROUP, ``scales``, and the
        autotuner's length buckets (N_CTX_Q_KEY, N_CTX_K_KEY)."""
        return (self.q_heads, self.q_len, self.k_len, self.head_dim, self.q_heads // self.kv_heads, *scales,
                next_power_of_2(self.q_len), next_power_of_2(self.k_len))

    @property
    def dot_precision(self) -> str:
        return "ieee" if self.ieee_dots else "tf32"

    def constexprs(self, use_tma: bool) -> dict:
        return dict(
            CAUSAL=self.causal, HEAD_DIM=self.padded_head_dim, EVEN_D=self.head_dim == self.padded_head_dim,
            USE_TMA=use_tma, UPCAST_DOT=triton_interpreting(), DOT_PRECISION=self.dot_precision,
        )


def _tma_refusal(named: dict) -> str | None:
    """Why the streamed tensors in ``named`` cannot be read through tensor descriptors, or None.

    A descriptor's base address and its row stride must be multiples of 16 bytes (TMA's rule); each
    (batch, head) matrix starts at a batch and head stride from the base, so those must be too where
    the dimension has more than one entry. Descriptors run on Hopper and newer and in the interpreter;
    A100s read through pointers."""
    if not triton_interpreting() and _target_family() < 90:
        return "the GPU has no TMA (compute capability below 9.0)"
    for name, t in named.items():
        elem = t.element_size()
        if t.data_ptr() % 16:
            return f"{name}'s data pointer is not 16-byte aligned"
        batch, heads = t.shape[:2]
        strides = [t.stride(2)] + [st for st, size in ((t.stride(0), batch), (t.stride(1), heads)) if size > 1]
        if any(st * elem % 16 for st in strides):
            return f"{name}'s strides {t.stride()} are not all multiples of 16 bytes"
    return None


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


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


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


def attention_fwd(q, k, v, causal: bool, scale: float, *, out=None, config: dict | None = None,
                  tma: bool | None = None):
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), last dims contiguous.

    Returns o (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) fp32, natural log, -inf on rows that
    see no key. o is ``out`` when given (any strides with a contiguous last dim: a block passes a
    (B, Nq, Hq, D) buffer's transpose so o is already laid out for the output projection), else a
    new contiguous tensor. ``config`` ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}) pins the
    launch configuration; by default CUDA autotunes and the interpreter uses INTERPRETER_CONFIG.
    ``tma``: k and v stream through tensor descriptors (TMA) where their alignment allows (None),
    never (False), or always (True: an error where they cannot)."""
    _check(q, k, v)
    p = _Problem.of(q, k, causal, scale)
    o = _output("out", out, q)
    lse = torch.empty((p.batch, p.q_heads, p.q_len), device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    use_tma = _use_tma(tma, {"k": k, "v": v})
    kernel, cfg = _pick(_attn_fwd, _attn_fwd_tuned, config)
    kernel[lambda meta: (triton.cdiv(p.q_len, meta["BLOCK_M"]), p.q_heads, p.batch)](
        q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        *p.scalars(p.sm_scale, p.qk_scale), **p.constexprs(use_tma), NEGATIVE_SCALE=p.sm_scale < 0, **cfg,
    )
    return o, lse


def attention_bwd(do, q, k, v, o, lse, causal: bool, scale: float, *, dlse=None, out=None,
                  config: dict | None = None, dkdv_config: dict | None = None, tma: bool | None = None):
    """Gradients of attention_fwd. do like o (last dim contiguous; other strides free); lse as
    returned by attention_fwd; dlse (optional, (B, Hq, Nq)) the gradient reaching lse.

    Returns dq, dk, dv in the dtypes of q, k, v: ``out`` = (dq, dk, dv) when given (any strides
    with a contiguous last dim, e.g. views of one packed dqkv buffer), else new contiguous tensors.
    ``config`` pins the dQ kernel's launch configuration and ``dkdv_config`` the dK/dV kernel's
    (default: ``config``). ``tma`` as in attention_fwd, for the streamed k, v (dQ) and q, dO (dK/dV)."""
    _check(q, k, v)
    p = _Problem.of(q, k, causal, scale)
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq, dk, dv = (_output(name, given, like) for name, given, like in zip(("dq", "dk", "dv"), out or (None,) * 3, (q, k, v)))
    if dq.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    # delta and the exponent biases, padded to a multiple of every BLOCK_M (see _attn_bwd_preprocess)
    row_multiple = max([128] + [c["BLOCK_M"] for c in (config, dkdv_config) if c])
    nq_rounded = triton.cdiv(p.q_len, row_multiple) * row_multiple
    delta, bias = torch.empty((2, p.batch, p.q_heads, nq_rounded), device=q.device, dtype=torch.float32)
    # 4096 values of o and of dO a program: at 8192 Triton 3.6 spilled (D=128, 4 warps)
    pre_block = 16 if triton_interpreting() else max(16, min(128, 4096 // p.padded_head_dim))
    _attn_bwd_preprocess[(nq_rounded // pre_block, p.q_heads, p.batch)](
        o, do, lse, dlse if dlse is not None else lse, delta, bias, *_strides(o), *_strides(do),
        p.q_heads, p.q_len, nq_rounded, p.head_dim,
        HAS_DLSE=dlse is not None, DOT_PRECISION=p.dot_precision, HEAD_DIM=p.padded_head_dim,
        BLOCK_M=pre_block,
    )

    scalars = p.scalars(p.sm_scale, p.qk_scale, nq_rounded)
    constexprs = p.constexprs(_use_tma(tma, {"q": q, "k": k, "v": v, "do": do}))
    kernel, cfg = _pick(_attn_bwd_dkdv, _attn_bwd_dkdv_tuned, dkdv_config or config)
    kernel[lambda meta: (triton.cdiv(p.k_len, meta["BLOCK_N"]), p.kv_heads, p.batch)](
        q, k, v, do, bias, delta, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        *scalars, **constexprs, **cfg,
    )
    kernel, cfg = _pick(_attn_bwd_dq, _attn_bwd_dq_tuned, config)
    kernel[lambda meta: (triton.cdiv(p.q_len, meta["BLOCK_M"]), p.q_heads, p.batch)](
        q, k, v, do, bias, delta, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        *scalars, **constexprs, **cfg,
    )
    return dq, dk, dv


def _pick(plain, tuned, config):
    """(kernel, launch kwargs): a pinned config, the interpreter's fixed one, or the autotuner."""
    if config is not None:
        return plain, dict(config)
    if triton_interpreting():
        return plain, dict(INTERPRETER_CONFIG)
    return tuned, {}


__all__ = ["attention_fwd", "attention_bwd", "INTERPRETER_CONFIG"]
