"""Yardsticks: the Triton tutorial's fused attention (06-fused-attention), written here from its
idea. Forward: a resident query tile, K and V streamed, online softmax in base 2, the scale
folded into the exponent's fma, causal as two stages; once with pointer loads, once with K and
V through device-side tensor descriptors (TMA on Hopper), as the tutorial does there. Backward:
dK/dV (one key block a program, a loop over query blocks) and dQ (one query block a program, a
loop over key blocks) as two kernels, pointer loads; causal: the diagonal blocks masked first,
then the rest unmasked (with the same block size, where the tutorial halves it on the diagonal).
Every accumulation happens inside tl.dot."""

from __future__ import annotations

import functools

TUTORIAL_CONFIGS = ((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3))  # its Hopper favourites at D 64/128
# (BLOCK_M, BLOCK_N, num_warps, num_stages), the tutorial's Hopper choice first. dK/dV: BLOCK_M query
# rows a step, BLOCK_N keys a program; dQ: BLOCK_M queries a program, BLOCK_N keys a step.
TUTORIAL_DKDV_CONFIGS = ((32, 128, 4, 5), (64, 128, 8, 3))
TUTORIAL_DQ_CONFIGS = ((128, 32, 4, 5), (128, 64, 8, 3))
# The tutorial's Blackwell forward (sm_100a only): K and V through descriptors and its loop warp-specialized,
# tl.range(..., warp_specialize=True), under the tutorial's register cap (maxnreg: 168 at D=128, else
# 80; the tutorial keys 168 on fp16 too, the one dtype it tunes, and these yardsticks run bf16). From its
# autotuning space (BLOCK_M 64/128, BLOCK_N 32/64/128, 2-4 stages, 4/8 warps), what compiles without
# spilling under the cap and launches: at 80 registers a 128-key tile spills (at D 64 and 128), and
# at 8 warps the partitions add up to 20 warps, too many for 168 registers each in one SM.
TUTORIAL_WS_CONFIGS = {64: ((128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3)),
                       128: ((128, 128, 4, 3), (128, 128, 4, 2), (128, 64, 4, 3))}


def tutorial_maxnreg(head_dim: int) -> int:
    return 168 if head_dim == 128 else 80


TUTORIAL_KERNELS = ("_tutorial_attn_fwd", "_tutorial_tma_attn_fwd", "_tutorial_attn_bwd_dkdv", "_tutorial_attn_bwd_dq",
                    "_tutorial_ws_attn_fwd")


@functools.lru_cache(maxsize=None)
def _tutorial_kernels() -> dict:
    """The yardstick kernels by name; each takes (tensors..., sm_scale, N_CTX) and the constexprs
    HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N. Tensors are contiguous (batch, heads, N_CTX, HEAD_DIM)."""
    import triton
    import triton.language as tl

    log2e = tl.constexpr(1.4426950408889634)

    @triton.jit
    def tile_ptrs(base, row0, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
        """Pointers to the (ROWS, HEAD_DIM) tile from row0 of a row-major matrix, or to its transpose."""
        rows = row0 + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        if TRANSPOSED:
            return base + rows[None, :] * HEAD_DIM + cols[:, None]
        else:
            return base + rows[:, None] * HEAD_DIM + cols[None, :]

    @triton.jit
    def kv_source(base, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr,
                  TMA: tl.constexpr):
        """Where K or V tiles come from: a device-side tensor descriptor, or pointers to the first tile."""
        if TMA:
            return tl.make_tensor_descriptor(base, shape=[N_CTX, HEAD_DIM], strides=[HEAD_DIM, 1],
                                             block_shape=[BLOCK_N, HEAD_DIM])
        else:
            return tile_ptrs(base, 0, BLOCK_N, HEAD_DIM, TRANSPOSED)

    @triton.jit
    def kv_tiles(k_src, v_src, n, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
        """K^T (HEAD_DIM, BLOCK_N) and V (BLOCK_N, HEAD_DIM) of the key block from row n."""
        if TMA:
            return tl.trans(k_src.load([n, 0])), v_src.load([n, 0])
        else:
            return tl.load(k_src + n * HEAD_DIM), tl.load(v_src + n * HEAD_DIM)

    @triton.jit
    def softmax_step(s, v, m, denom, acc, scale2):
        """One key block of the online softmax: s = q k^T, to be scaled by scale2 (-inf where masked)."""
        m_new = tl.maximum(m, tl.max(s, 1) * scale2)
        p = tl.math.exp2(s * scale2 - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        return m_new, denom * alpha + tl.sum(p, 1), tl.dot(p.to(v.dtype), v, acc * alpha[:, None])

    @triton.jit
    def forward(start, bh, Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
        """The query rows from start of (batch x head) bh."""
        head_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        kv_off = (bh // GROUP).to(tl.int64) * N_CTX * HEAD_DIM
        rows = start + tl.arange(0, BLOCK_M)
        q = tl.load(tile_ptrs(Q + head_off, start, BLOCK_M, HEAD_DIM, False))
        k_src = kv_source(K + kv_off, N_CTX, HEAD_DIM, BLOCK_N, True, TMA)
        v_src = kv_source(V + kv_off, N_CTX, HEAD_DIM, BLOCK_N, False, TMA)
        scale2 = sm_scale * log2e
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = start if CAUSAL else N_CTX
        for n in range(0, end, BLOCK_N):  # blocks no row of the tile needs to mask
            kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, TMA)
            m, denom, acc = softmax_step(tl.dot(q, kt), v, m, denom, acc, scale2)
        if CAUSAL:  # the diagonal tile(s)
            tl.static_assert(BLOCK_M % BLOCK_N == 0)
            for n in range(start, start + BLOCK_M, BLOCK_N):
                kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, TMA)
                s = tl.where(rows[:, None] >= (n + tl.arange(0, BLOCK_N))[None, :], tl.dot(q, kt) * scale2, float("-inf"))
                m, denom, acc = softmax_step(s, v, m, denom, acc, 1.0)  # scaled before the mask
        tl.store(M + bh * N_CTX + rows, m + tl.math.log2(denom))
        tl.store(tile_ptrs(O + head_off, start, BLOCK_M, HEAD_DIM, False), (acc / denom[:, None]).to(O.dtype.element_ty))

    @triton.jit
    def _tutorial_attn_fwd(Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        forward(tl.program_id(0) * BLOCK_M, tl.program_id(1), Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM, CAUSAL,
                BLOCK_M, BLOCK_N, False)

    @triton.jit
    def _tutorial_tma_attn_fwd(Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        forward(tl.program_id(0) * BLOCK_M, tl.program_id(1), Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM, CAUSAL,
                BLOCK_M, BLOCK_N, True)

    @triton.jit
    def forward_ws(start, bh, Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """forward through descriptors, each loop warp-specialized as the tutorial's Blackwell path; at
        BLOCK_M = HEAD_DIM = 128 the accumulator is rescaled in two column halves, as it does there."""
        head_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        kv_off = (bh // GROUP).to(tl.int64) * N_CTX * HEAD_DIM
        rows = start + tl.arange(0, BLOCK_M)
        q = tl.load(tile_ptrs(Q + head_off, start, BLOCK_M, HEAD_DIM, False))
        k_src = kv_source(K + kv_off, N_CTX, HEAD_DIM, BLOCK_N, True, True)
        v_src = kv_source(V + kv_off, N_CTX, HEAD_DIM, BLOCK_N, False, True)
        scale2 = sm_scale * log2e
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = start if CAUSAL else N_CTX
        for n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, True)
            m, denom, acc = softmax_step_ws(tl.dot(q, kt), v, m, denom, acc, scale2, BLOCK_M, HEAD_DIM)
        if CAUSAL:
            tl.static_assert(BLOCK_M % BLOCK_N == 0)
            for n in tl.range(start, start + BLOCK_M, BLOCK_N, warp_specialize=True):
                kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, True)
                s = tl.where(rows[:, None] >= (n + tl.arange(0, BLOCK_N))[None, :], tl.dot(q, kt) * scale2, float("-inf"))
                m, denom, acc = softmax_step_ws(s, v, m, denom, acc, 1.0, BLOCK_M, HEAD_DIM)
        tl.store(M + bh * N_CTX + rows, m + tl.math.log2(denom))
        tl.store(tile_ptrs(O + head_off, start, BLOCK_M, HEAD_DIM, False), (acc / denom[:, None]).to(O.dtype.element_ty))

    @triton.jit
    def softmax_step_ws(s, v, m, denom, acc, scale2, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
        m_new = tl.maximum(m, tl.max(s, 1) * scale2)
        p = tl.math.exp2(s * scale2 - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        if BLOCK_M == 128 and HEAD_DIM == 128:
            acc0, acc1 = acc.reshape([BLOCK_M, 2, HEAD_DIM // 2]).permute(0, 2, 1).split()
            acc = tl.join(acc0 * alpha[:, None], acc1 * alpha[:, None]).permute(0, 2, 1).reshape([BLOCK_M, HEAD_DIM])
        else:
            acc = acc * alpha[:, None]
        return m_new, denom * alpha + tl.sum(p, 1), tl.dot(p.to(v.dtype), v, acc)

    @triton.jit
    def _tutorial_ws_attn_fwd(Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        forward_ws(tl.program_id(0) * BLOCK_M, tl.program_id(1), Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM, CAUSAL,
                   BLOCK_M, BLOCK_N)

    @triton.jit
    def dkdv_stage(dk, dv, k, v, Q, DO, M, Delta, start_n, q0, q1, scale2, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
        """dK and dV of the key block from start_n, accumulated over query rows [q0, q1)."""
        keys = start_n + tl.arange(0, BLOCK_N)
        qt_ptrs = tile_ptrs(Q, 0, BLOCK_M, HEAD_DIM, True)
        do_ptrs = tile_ptrs(DO, 0, BLOCK_M, HEAD_DIM, False)
        for m0 in range(q0, q1, BLOCK_M):
            queries = m0 + tl.arange(0, BLOCK_M)
            qt = tl.load(qt_ptrs + m0 * HEAD_DIM)
            do = tl.load(do_ptrs + m0 * HEAD_DIM)
            pt = tl.math.exp2(tl.dot(k, qt) * scale2 - tl.load(M + queries)[None, :])
            if MASK:
                pt = tl.where(queries[None, :] >= keys[:, None], pt, 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv)
            dst = pt * (tl.dot(v, tl.trans(do)) - tl.load(Delta + queries)[None, :])
            dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
        return dk, dv

    @triton.jit
    def _tutorial_attn_bwd_dkdv(Q, K, V, DO, DK, DV, M, Delta, sm_scale, N_CTX, HEAD_DIM: tl.constexpr,
                                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_n = tl.program_id(0) * BLOCK_N
        bh = tl.program_id(1)
        off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        M += bh * N_CTX
        Delta += bh * N_CTX
        k = tl.load(tile_ptrs(K + off, start_n, BLOCK_N, HEAD_DIM, False))
        v = tl.load(tile_ptrs(V + off, start_n, BLOCK_N, HEAD_DIM, False))
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        scale2 = sm_scale * log2e
        if CAUSAL:  # the query blocks on the diagonal, then those below it
            tl.static_assert(BLOCK_N % BLOCK_M == 0)
            dk, dv = dkdv_stage(dk, dv, k, v, Q + off, DO + off, M, Delta, start_n, start_n, start_n + BLOCK_N, scale2,
                                HEAD_DIM, BLOCK_M, BLOCK_N, True)
            dk, dv = dkdv_stage(dk, dv, k, v, Q + off, DO + off, M, Delta, start_n, start_n + BLOCK_N, N_CTX, scale2,
                                HEAD_DIM, BLOCK_M, BLOCK_N, False)
        else:
            dk, dv = dkdv_stage(dk, dv, k, v, Q + off, DO + off, M, Delta, start_n, 0, N_CTX, scale2,
                                HEAD_DIM, BLOCK_M, BLOCK_N, False)
        tl.store(tile_ptrs(DV + off, start_n, BLOCK_N, HEAD_DIM, False), dv.to(DV.dtype.element_ty))
        tl.store(tile_ptrs(DK + off, start_n, BLOCK_N, HEAD_DIM, False), (dk * sm_scale).to(DK.dtype.element_ty))

    @triton.jit
    def dq_stage(dq, q, do, m, delta, K, V, start_m, k0, k1, scale2, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
        """dQ of the query block from start_m, accumulated over key rows [k0, k1)."""
        queries = start_m + tl.arange(0, BLOCK_M)
        kt_ptrs = tile_ptrs(K, 0, BLOCK_N, HEAD_DIM, True)
        vt_ptrs = tile_ptrs(V, 0, BLOCK_N, HEAD_DIM, True)
        for n0 in range(k0, k1, BLOCK_N):
            kt = tl.load(kt_ptrs + n0 * HEAD_DIM)
            vt = tl.load(vt_ptrs + n0 * HEAD_DIM)
            p = tl.math.exp2(tl.dot(q, kt) * scale2 - m[:, None])
            if MASK:
                p = tl.where(queries[:, None] >= (n0 + tl.arange(0, BLOCK_N))[None, :], p, 0.0)
            ds = p * (tl.dot(do, vt) - delta[:, None])
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
        return dq

    @triton.jit
    def _tutorial_attn_bwd_dq(Q, K, V, DO, DQ, M, Delta, sm_scale, N_CTX, HEAD_DIM: tl.constexpr,
                              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        rows = bh * N_CTX + start_m + tl.arange(0, BLOCK_M)
        q = tl.load(tile_ptrs(Q + off, start_m, BLOCK_M, HEAD_DIM, False))
        do = tl.load(tile_ptrs(DO + off, start_m, BLOCK_M, HEAD_DIM, False))
        m = tl.load(M + rows)
        delta = tl.load(Delta + rows)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        scale2 = sm_scale * log2e
        if CAUSAL:  # the key blocks on the diagonal, then those left of it
            tl.static_assert(BLOCK_M % BLOCK_N == 0)
            dq = dq_stage(dq, q, do, m, delta, K + off, V + off, start_m, start_m, start_m + BLOCK_M, scale2,
                          HEAD_DIM, BLOCK_M, BLOCK_N, True)
            dq = dq_stage(dq, q, do, m, delta, K + off, V + off, start_m, 0, start_m, scale2,
                          HEAD_DIM, BLOCK_M, BLOCK_N, False)
        else:
            dq = dq_stage(dq, q, do, m, delta, K + off, V + off, start_m, 0, N_CTX, scale2,
                          HEAD_DIM, BLOCK_M, BLOCK_N, False)
        tl.store(tile_ptrs(DQ + off, start_m, BLOCK_M, HEAD_DIM, False), (dq * sm_scale).to(DQ.dtype.element_ty))

    return {k.__name__: k for k in (_tutorial_attn_fwd, _tutorial_tma_attn_fwd, _tutorial_attn_bwd_dkdv,
                                    _tutorial_attn_bwd_dq, _tutorial_ws_attn_fwd)}


def tutorial_launch(op, q, k, v, causal, scale, config, dkdv_config) -> None:
    """Compile ``op``'s yardstick kernels: each at the pinned configuration, else at every default one."""
    import torch

    batch, heads, length, head_dim = q.shape
    kernels = _tutorial_kernels()
    stats = dict(device=q.device, dtype=torch.float32)
    m, delta = torch.empty(batch, heads, length, **stats), torch.empty(batch, heads, length, **stats)

    def launch(name, configs, pinned, by_keys, *tensors, **options):
        for block_m, block_n, warps, stages in [tuple(pinned.values())] if pinned else configs:
            grid = (length // (block_n if by_keys else block_m), batch * heads)
            kernels[name][grid](*tensors, scale, length, HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=block_m,
                                BLOCK_N=block_n, num_warps=warps, num_stages=stages, **options)

    if op == "tutorial_bwd":
        if k.shape[1] != heads:
            raise ValueError("the backward yardstick is MHA only")
        do = torch.empty_like(q)
        launch("_tutorial_attn_bwd_dkdv", TUTORIAL_DKDV_CONFIGS, dkdv_config or config, True,
               q, k, v, do, torch.empty_like(k), torch.empty_like(v), m, delta)
        launch("_tutorial_attn_bwd_dq", TUTORIAL_DQ_CONFIGS, config, False, q, k, v, do, torch.empty_like(q), m, delta)
    elif op == "tutorial_ws_fwd":
        launch("_tutorial_ws_attn_fwd", TUTORIAL_WS_CONFIGS.get(head_dim, TUTORIAL_WS_CONFIGS[64]), config, False,
               q, k, v, torch.empty_like(q), m, heads // k.shape[1], maxnreg=tutorial_maxnreg(head_dim))
    else:
        name = "_tutorial_tma_attn_fwd" if op == "tutorial_tma_fwd" else "_tutorial_attn_fwd"
        launch(name, TUTORIAL_CONFIGS, config, False, q, k, v, torch.empty_like(q), m, heads // k.shape[1])
