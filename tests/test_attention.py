"""attention against a float64 reference and plain PyTorch in the same dtype, plus its contracts:
saved memory, determinism, rows that see no key, GQA, strided inputs and argument errors.

On CPU the kernels run in Triton's interpreter, so the sweep is a covering set (every length pair,
head dim, GQA ratio, causal value and dtype appears) rather than the full product.
"""

import math

import pytest
import torch

import fused_remat
from fused_remat import reference
from fused_remat.memory import saved_memory
from numerics import assert_error_rule

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# (B, Hq, Hkv, Nq, Nk, D, causal, dtype)
SWEEP = [
    (1, 1, 1, 1, 1, 16, False, F32),
    (2, 8, 1, 1, 1, 256, True, F16),
    (1, 4, 1, 1, 300, 40, True, F16),
    (2, 1, 1, 1, 300, 128, False, F32),
    (1, 2, 2, 113, 203, 96, True, F32),
    (1, 8, 1, 113, 203, 64, False, F16),
    (1, 4, 1, 128, 128, 128, True, F16),
    (2, 2, 2, 128, 128, 40, False, F32),
    (1, 8, 1, 257, 64, 16, True, F32),
    (1, 4, 1, 257, 64, 256, False, F16),
    (1, 1, 1, 1000, 1000, 64, True, F16),
    (1, 1, 1, 1000, 1000, 96, False, F32),
    # bf16 dots run upcast in the interpreter; this case checks the rest of the bf16 path.
    (1, 2, 1, 113, 203, 64, True, BF16),
]


# fp32 with large logits (FlashAttention's edge cases): scale 0.5 and 3.0 put |q k^T * scale| near
# 10 and 100, where P near 1 must come back from the saved lse to fp32 accuracy for dV and dK to
# meet the rule. (B, Hq, Hkv, Nq, Nk, D, causal, scale); every pair of lengths, head dim (64 and an
# odd one), scale, causal value and MHA/GQA appears.
LARGE_LOGITS = [
    (1, 2, 2, 40, 70, 64, False, 0.5),
    (1, 2, 2, 40, 70, 64, True, 3.0),
    (1, 4, 2, 70, 40, 64, True, 0.5),
    (1, 4, 2, 70, 40, 64, False, 3.0),
    (1, 2, 1, 40, 70, 37, True, 3.0),
    (1, 2, 2, 70, 40, 37, False, 0.5),
    (1, 4, 2, 70, 40, 37, True, 3.0),
]


def _case_id(case):
    b, hq, hkv, nq, nk, d, causal, dtype = case
    return f"b{b}-h{hq}:{hkv}-{nq}x{nk}-d{d}-{'causal' if causal else 'full'}-{str(dtype).removeprefix('torch.')}"


def manual_attention(q, k, v, do, causal, scale, dtype, window=(-1, -1), softcap=0.0):
    """Plain PyTorch attention forward and backward, every product in ``dtype``, one query head at
    a time (so long GPU cases fit). Returns o, lse, dq, dk, dv. Rows that see no key give zeros.
    ``window`` and ``softcap`` as in fused_remat.attention (the softcap's tanh in ``dtype`` too)."""
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    batch, q_heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    o, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    left, right = window
    if causal:
        right = 0
    diagonal = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    keys = torch.arange(k_len, device=q.device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= keys <= diagonal + right
    if left >= 0:
        visible &= keys >= diagonal - left
    for b in range(batch):
        for h in range(q_heads):
            qh, kh, vh, doh = q[b, h], k[b, h // group], v[b, h // group], do[b, h]
            s = (qh @ kh.T) * scale
            if softcap:
                tanh = torch.tanh(s / softcap)
                s = softcap * tanh
            s = s.masked_fill(~visible, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
            lse[b, h] = torch.logsumexp(s.to(lse.dtype), dim=-1)
            o[b, h] = p @ vh
            dv[b, h // group] += p.T @ doh
            dp = doh @ vh.T
            ds = p * (dp - (doh * o[b, h]).sum(-1, keepdim=True))
            if softcap:
                ds = ds * (1 - tanh * tanh)
            dq[b, h] = (ds @ kh) * scale
            dk[b, h // group] += (ds.T @ qh) * scale
    return o, lse, dq, dk, dv


def _inputs(b, hq, hkv, nq, nk, d, dtype, device):
    q = torch.randn(b, hq, nq, d, device=device).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, nk, d, device=device).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, nk, d, device=device).to(dtype).requires_grad_()
    return q, k, v


def _reference64(q, k, v, do, causal, scale, window=(-1, -1), softcap=0.0):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = reference.attention(*leaves, causal=causal, scale=scale, window=window, softcap=softcap, return_lse=True)
    grads = torch.autograd.grad(o, leaves, do.double())
    return o, lse, grads


def _assert_lse(lse, lse64):
    assert lse.dtype == torch.float32 and lse.shape == lse64.shape
    seen = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), seen), "lse: finite where the reference is -inf, or the reverse"
    assert (lse[~seen] == float("-inf")).all()
    if seen.any():
        torch.testing.assert_close(lse[seen].double(), lse64[seen], rtol=0, atol=1e-5 * max(1.0, lse64[seen].abs().max().item()))


def _check(q, k, v, causal, scale=None, window=(-1, -1), softcap=0.0):
    dtype = q.dtype
    o, lse = fused_remat.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    used_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    o64, lse64, grads64 = _reference64(q, k, v, do, causal, used_scale, window, softcap)
    same_o, _, *same_grads = manual_attention(q.detach(), k.detach(), v.detach(), do, causal, used_scale, dtype,
                                              window, softcap)
    assert_error_rule("o", o, same_o, o64, dtype)
    _assert_lse(lse, lse64)
    for name, got, same, ref in zip(("dq", "dk", "dv"), grads, same_grads, grads64):
        assert got.dtype == dtype
        assert_error_rule(name, got, same, ref, dtype)
    return o, lse, grads


@pytest.mark.parametrize("case", SWEEP, ids=_case_id)
def test_attention_matches_references(case, device, triton_backend):
    b, hq, hkv, nq, nk, d, causal, dtype = case
    _check(*_inputs(b, hq, hkv, nq, nk, d, dtype, device), causal)


@pytest.mark.parametrize("case", LARGE_LOGITS, ids=lambda c: f"b{c[0]}-h{c[1]}:{c[2]}-{c[3]}x{c[4]}-d{c[5]}-"
                         f"{'causal' if c[6] else 'full'}-scale{c[7]}")
def test_fp32_large_logits(case, device, triton_backend):
    b, hq, hkv, nq, nk, d, causal, scale = case
    _check(*_inputs(b, hq, hkv, nq, nk, d, F32, device), causal, scale=scale)


def test_custom_scale(device, triton_backend):
    _check(*_inputs(1, 2, 1, 45, 70, 32, F32, device), causal=True, scale=0.37)


@pytest.mark.parametrize("scale,dtype", [(-0.4, F32), (0.0, F32), (-0.3, F16)], ids=["negative", "zero", "negative-f16"])
def test_negative_and_zero_scales(scale, dtype, device, triton_backend):
    """The forward scales each row's maximum instead of every score: a negative scale must take the
    row minimum, and a zero scale (uniform attention) must never form inf * 0 on masked keys. Causal
    with Nq > Nk also has rows that see no key."""
    _check(*_inputs(1, 2, 1, 70, 40, 32, dtype, device), causal=True, scale=scale)


# ------------------------------------------------------------------ tensor descriptors and pointer loads

DESCRIPTOR_CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, causal, dtype): ragged lengths, a padded head dim, GQA, both dtypes
    (1, 4, 2, 70, 45, 40, True, F32),
    (2, 2, 2, 33, 100, 64, False, F16),
]


@pytest.mark.parametrize("case", DESCRIPTOR_CASES, ids=_case_id)
def test_descriptor_and_pointer_loads_give_the_same_bits(case, device):
    """Aligned inputs stream through tensor descriptors (TMA on Hopper) by default; the pointer loads
    kept for strides a descriptor cannot take must read the same tiles, so every output is bitwise
    the same (the error rule for the default path is the sweep's)."""
    from fused_remat.kernels.attention import attention_bwd, attention_fwd

    b, hq, hkv, nq, nk, d, causal, dtype = case
    q, k, v = (t.detach() for t in _inputs(b, hq, hkv, nq, nk, d, dtype, device))
    do = torch.randn_like(q)
    results = {}
    for tma in (None, True, False):
        o, lse = attention_fwd(q, k, v, causal, 0.3, tma=tma)
        results[tma] = (o, lse, *attention_bwd(do, q, k, v, o, lse, causal, 0.3, tma=tma))
    for tma in (None, False):
        for name, ours, descriptor in zip(("o", "lse", "dq", "dk", "dv"), results[tma], results[True]):
            assert torch.equal(ours, descriptor), f"{name}: tma={tma} differs from the descriptor path"


def test_unaligned_inputs_fall_back_to_pointer_loads(device):
    """A descriptor needs a 16-byte aligned base and 16-byte multiple strides: other inputs take the
    pointer loads (same results), and tma=True says which tensor it cannot read."""
    from fused_remat.kernels.attention import attention_bwd, attention_fwd

    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 50, 60, 37, F32, device))  # 148-byte rows
    with pytest.raises(ValueError, match=r"tma=True: k's strides .* multiples of 16 bytes"):
        attention_fwd(q, k, v, True, 0.2, tma=True)
    o, lse = attention_fwd(q, k, v, True, 0.2)
    assert torch.equal(o, attention_fwd(q, k, v, True, 0.2, tma=False)[0])
    do = torch.randn_like(o)
    with pytest.raises(ValueError, match=r"tma=True: q's strides"):
        attention_bwd(do, q, k, v, o, lse, True, 0.2, tma=True)

    packed = torch.randn(1, 2, 60, 1 + 32, device=device)  # rows of 132 bytes, viewed from element 1
    k_off, v_off = packed[:, :1, :, 1:], packed[:, 1:, :, 1:]
    q = torch.randn(1, 2, 50, 32, device=device)
    with pytest.raises(ValueError, match=r"tma=True: k's data pointer is not 16-byte aligned"):
        attention_fwd(q, k_off, v_off, False, 0.2, tma=True)
    o, _ = attention_fwd(q, k_off, v_off, False, 0.2)
    assert torch.equal(o, attention_fwd(q, k_off.contiguous(), v_off.contiguous(), False, 0.2, tma=False)[0])


def test_every_descriptor_launch_has_a_scratch_allocator(device, monkeypatch):
    """Device-side descriptors need Triton's scratch allocator at launch. Triton keeps it in a
    context variable that a new thread (autograd's backward threads among them) starts without, so
    the launchers set one before each launch where none is set, and keep the caller's own: on a
    signature's first call and on the planned calls after it."""
    import threading

    import triton
    from triton.runtime import _allocation

    from fused_remat.kernels import attention as kernels
    from fused_remat.kernels import launch as launcher

    at_launch = []  # (thread, USE_TMA, the allocator set) per kept or interpreted launch
    interpret, compiled_call = launcher._interpret, launcher._Compiled.__call__

    def recording_interpret(fn, grid, args, kwargs):
        at_launch.append((threading.current_thread().name, kwargs.get("USE_TMA"), _allocation._allocator.get()))
        return interpret(fn, grid, args, kwargs)

    def recording_call(self, grid, active, device, args):
        at_launch.append((threading.current_thread().name, self.meta.get("USE_TMA"), _allocation._allocator.get()))
        return compiled_call(self, grid, active, device, args)

    monkeypatch.setattr(launcher, "_interpret", recording_interpret)
    monkeypatch.setattr(launcher._Compiled, "__call__", recording_call)
    launcher.KeptKernel.forget_all()  # the first call of each signature below takes the unplanned path
    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 20, 30, 16, F32, device))

    def fwd_and_bwd():
        for _ in range(2):
            o, lse = kernels.attention_fwd(q, k, v, True, 0.25)
            kernels.attention_bwd(torch.randn_like(o), q, k, v, o, lse, True, 0.25)

    def own(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    def with_own_allocator():
        triton.set_allocator(own)
        fwd_and_bwd()

    for name, target in (("plain", fwd_and_bwd), ("own", with_own_allocator)):  # fresh threads: no allocator set
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    for name in ("plain", "own"):
        descriptors = [allocator for thread, use_tma, allocator in at_launch if thread == name and use_tma]
        assert len(descriptors) >= 3, "the forward, dK/dV and dQ launches of a planned call"
        assert not any(isinstance(allocator, _allocation.NullAllocator) for allocator in descriptors)
        assert name == "plain" or all(allocator is own for allocator in descriptors)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (30, 0))],
                         ids=["full", "causal", "window"])
def test_warp_specialized_tiles_give_the_same_bits(causal, window, device):
    """Blackwell's warp-specialized forward and dQ tiles (kernels/attention_configs.py:
    WARP_SPECIALIZE under a register cap; the forward rescales its accumulator one column half at a
    time) give the bits of the plain loops; a pinned warp-specialized dQ configuration reaches dK/dV
    without it. Warp specialization itself is Triton's (sm_100a only; the interpreter runs the
    loops as written)."""
    from fused_remat.kernels.attention import attention_bwd, attention_fwd
    from fused_remat.kernels.attention_configs import target_family

    if device.type == "cuda" and target_family() != 100:
        pytest.skip("warp-specialized tiles are Blackwell's (sm_100a)")
    q, k, v = (t.detach() for t in _inputs(2, 4, 2, 100, 77, 40, F16, device))
    blocks = 128 if device.type == "cuda" else 32  # the Blackwell tile; small ones interpret faster
    plain = {"BLOCK_M": blocks, "BLOCK_N": blocks, "num_warps": 4, "num_stages": 2}
    specialized = dict(plain, maxnreg=168, WARP_SPECIALIZE=True)
    o, lse = attention_fwd(q, k, v, causal, 0.3, window=window, config=plain)
    o_ws, lse_ws = attention_fwd(q, k, v, causal, 0.3, window=window, config=specialized)
    assert torch.equal(o, o_ws) and torch.equal(lse, lse_ws)
    do = torch.randn_like(o)
    grads = attention_bwd(do, q, k, v, o, lse, causal, 0.3, window=window, config=plain)
    grads_ws = attention_bwd(do, q, k, v, o, lse, causal, 0.3, window=window, config=specialized)
    for name, ours, specialized_grad in zip(("dq", "dk", "dv"), grads, grads_ws):
        assert torch.equal(ours, specialized_grad), name


def test_warp_specialized_configs_are_refused_where_they_cannot_compile(monkeypatch):
    """A pinned WARP_SPECIALIZE configuration: refused for dK/dV (its kernel has no such loop), and
    on a GPU that is not datacenter Blackwell or with a Triton before 3.9, naming the argument,
    before anything is launched."""
    from fused_remat.kernels import attention as launchers

    q, k, v = (torch.randn(1, 2, 16, 16, dtype=F16) for _ in range(3))
    specialized = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "maxnreg": 168,
                   "WARP_SPECIALIZE": True}
    o, lse = launchers.attention_fwd(q, k, v, True, 0.25)
    with pytest.raises(ValueError, match="dkdv_config: the dK/dV kernel is never warp-specialized"):
        launchers.attention_bwd(torch.randn_like(o), q, k, v, o, lse, True, 0.25, dkdv_config=specialized)
    monkeypatch.setattr(launchers, "_INTERPRETING", False)
    for family, version in ((90, "3.9.0"), (100, "3.6.0")):
        monkeypatch.setattr(launchers, "target_family", lambda: family)
        monkeypatch.setattr(launchers.triton, "__version__", version)
        with pytest.raises(ValueError, match=f"config: WARP_SPECIALIZE needs .* family {family}, Triton {version}"):
            launchers.attention_fwd(q, k, v, True, 0.25, config=specialized)
        with pytest.raises(ValueError, match="^config: WARP_SPECIALIZE needs"):
            launchers.attention_bwd(torch.randn_like(o), q, k, v, o, lse, True, 0.25, config=specialized)


@pytest.mark.parametrize("block_m,block_n", [(16, 64), (64, 16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unequal_block_shapes(block_m, block_n, causal, device):
    """The GPU autotuner picks BLOCK_M != BLOCK_N; the diagonal split must hold for those too."""
    from fused_remat.kernels.attention import attention_bwd, attention_fwd

    q, k, v = (t.detach() for t in _inputs(1, 4, 2, 100, 77, 24, F32, device))
    scale = 0.2
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
    o, lse = attention_fwd(q, k, v, causal, scale, config=config)
    do = torch.randn_like(o)
    grads = attention_bwd(do, q, k, v, o, lse, causal, scale, config=config)
    o64, lse64, grads64 = _reference64(q, k, v, do, causal, scale)
    same_o, _, *same_grads = manual_attention(q, k, v, do, causal, scale, F32)
    assert_error_rule("o", o, same_o, o64, F32)
    _assert_lse(lse, lse64)
    for name, got, same, ref in zip(("dq", "dk", "dv"), grads, same_grads, grads64):
        assert_error_rule(name, got, same, ref, F32)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_packed_qkv_views_need_no_copy(hq, hkv, device, triton_backend):
    """q, k, v as strided views of one (B, N, (Hq + 2 Hkv) * D) projection: the kernels read them in
    place (autograd saves the packed storage once) and gradients land in the packed tensor."""
    b, n, d = 2, 70, 40
    packed = torch.randn(b, n, (hq + 2 * hkv) * d, device=device, requires_grad=True)

    def split(x):
        heads = x.view(b, n, hq + 2 * hkv, d).transpose(1, 2)  # (B, H, N, D), strides not contiguous
        return heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]

    q, k, v = split(packed)
    assert not q.is_contiguous() and q.stride(-1) == 1
    with saved_memory() as meter:
        o, lse = fused_remat.attention(q, k, v, causal=True, return_lse=True)
    assert meter.bytes == packed.numel() * 4 + o.numel() * 4 + lse.numel() * 4, meter.report()
    do = torch.randn_like(o)
    (dpacked,) = torch.autograd.grad(o, packed, do)

    packed64 = packed.detach().double().requires_grad_()
    o64 = reference.attention(*split(packed64), causal=True)
    (dpacked64,) = torch.autograd.grad(o64, packed64, do.double())
    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    same_o = fused_remat.reference.attention(*contiguous, causal=True)
    same_grads = torch.autograd.grad(same_o, contiguous, do)
    assert_error_rule("o", o, same_o, o64, F32)
    same_packed = torch.cat([g.transpose(1, 2).reshape(b, n, -1) for g in same_grads], dim=-1)
    assert_error_rule("dpacked", dpacked, same_packed, dpacked64, F32)


def test_preallocated_outputs_in_token_major_layout(device):
    """The block's layouts: o written into a (B, N, Hq, D) buffer, dq/dk/dv into one packed dqkv
    buffer. Same bits as the default contiguous outputs."""
    from fused_remat.kernels.attention import attention_bwd, attention_fwd

    b, n, hq, hkv, d = 2, 37, 4, 2, 16
    q, k, v = (torch.randn(b, h, n, d, device=device) for h in (hq, hkv, hkv))
    o, lse = attention_fwd(q, k, v, True, 0.25)
    token_major = torch.empty(b, n, hq, d, device=device)
    o_view, lse_again = attention_fwd(q, k, v, True, 0.25, out=token_major.transpose(1, 2))
    assert o_view.data_ptr() == token_major.data_ptr()
    assert torch.equal(o_view, o) and torch.equal(lse_again, lse)

    do = torch.randn_like(o)
    packed = torch.empty(b, n, hq + 2 * hkv, d, device=device).transpose(1, 2)
    views = (packed[:, :hq], packed[:, hq:hq + hkv], packed[:, hq + hkv:])
    into = attention_bwd(do, q, k, v, o, lse, True, 0.25, out=views)
    for default, written, view in zip(attention_bwd(do, q, k, v, o, lse, True, 0.25), into, views):
        assert written.data_ptr() == view.data_ptr() and torch.equal(written, default)
    with pytest.raises(ValueError, match="out must be"):
        attention_fwd(q, k, v, True, 0.25, out=torch.empty(b, hq, n, d + 1, device=device))


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_packed_buffers_after_the_first_call_give_the_views_bits(documents, device):
    """The block's attention of a packed qkv (custom_ops.direct.attention_packed_fwd and _bwd): after
    a signature's first call, a call keys its plan on the buffers (qkv, o, dO, lse, dqkv) and hands
    the launches buffers and column slices, not head views. Calls on fresh buffers, two at one
    alignment and two at another (one element in: not 16-byte aligned, its own plan), each give
    bitwise what the launchers give on the head views."""
    from fused_remat import custom_ops
    from fused_remat.kernels import attention as launchers

    batch, n, hq, hkv, d = (1, 45, 4, 2, 16) if documents else (2, 37, 4, 2, 16)
    cu = torch.tensor([0, 20, 20, 45], dtype=torch.int32, device=device) if documents else None
    longest, tokens, width = (25 if documents else 0), batch * n, (hq + 2 * hkv) * d
    layout = launchers.Documents((cu, cu, longest, longest)) if documents else None

    def heads(buffer):
        if documents:
            return custom_ops.split_token_heads(buffer, hq, hkv)
        return custom_ops.split_heads(buffer, batch, hq, hkv)

    def token_major(buffer):
        return custom_ops.token_heads(buffer, hq) if documents else custom_ops.token_major_heads(buffer, batch, hq)

    plans = (launchers._PACKED_FWD_PLANS, launchers._PACKED_BWD_PLANS)
    for packed in plans:
        packed.clear()
    for call, offset in enumerate((0, 0, 1, 1)):
        qkv = torch.randn(tokens * width + offset, device=device)[offset:].view(tokens, width)
        do = torch.randn(tokens, hq * d, device=device)
        o, lse = custom_ops.direct.attention_packed_fwd(qkv, batch, hq, hkv, True, 0.25, [-1, -1], 0.0, cu, longest)
        dqkv = custom_ops.direct.attention_packed_bwd(do, qkv, o, lse, batch, hq, hkv, True, 0.25, [-1, -1], 0.0, cu,
                                                      longest)
        o_views, lse_views = launchers.attention_fwd(*heads(qkv), True, 0.25, documents=layout)
        assert torch.equal(token_major(o), o_views) and torch.equal(lse, lse_views)
        grads = launchers.attention_bwd(token_major(do), *heads(qkv), o_views, lse_views, True, 0.25,
                                        documents=layout)
        for name, got, expected in zip("qkv", heads(dqkv), grads):
            assert torch.equal(got, expected), f"d{name}, call {call}"
        # a plan for each alignment, made at its first call
        assert [len(packed._plans) for packed in plans] == [call // 2 + 1] * 2, call


def test_gradients_are_bitwise_deterministic(device, triton_backend):
    q, k, v = _inputs(1, 8, 2, 150, 97, 48, F16, device)
    o = fused_remat.attention(q, k, v, causal=True)
    do = torch.randn_like(o)
    first = torch.autograd.grad(o, (q, k, v), do)
    for _ in range(2):
        again = torch.autograd.grad(fused_remat.attention(q, k, v, causal=True), (q, k, v), do)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [32])
def test_saved_memory_is_inputs_output_and_lse(n, device, triton_backend):
    """Autograd keeps q, k, v, o and 4 bytes of lse per query row: linear in N, nothing N x N."""
    b, hq, hkv, d = 2, 4, 2, 16

    def saved(length):
        q, k, v = _inputs(b, hq, hkv, length, length, d, F16, device)
        with saved_memory() as meter:
            o = fused_remat.attention(q, k, v, causal=True)
        expected = sum(t.numel() * t.element_size() for t in (q, k, v, o)) + 4 * b * hq * length
        assert meter.bytes == expected, meter.report()
        return meter.bytes

    assert saved(4 * n) == 4 * saved(n)


def test_rows_that_see_no_key_give_zeros(device, triton_backend):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key: zero output and gradients."""
    q, k, v = _inputs(1, 4, 2, 90, 20, 32, F32, device)
    o, lse, (dq, dk, dv) = _check(q, k, v, causal=True)
    empty = 90 - 20
    assert torch.equal(o[:, :, :empty], torch.zeros_like(o[:, :, :empty]))
    assert torch.equal(dq[:, :, :empty], torch.zeros_like(dq[:, :, :empty]))
    assert (lse[:, :, :empty] == float("-inf")).all() and torch.isfinite(lse[:, :, empty:]).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


def test_lse_gradient(device, triton_backend):
    """lse is differentiable: a loss on it flows back as dS += P * dlse."""
    q, k, v = _inputs(1, 2, 1, 40, 33, 16, F32, device)
    o, lse = fused_remat.attention(q, k, v, return_lse=True)
    do, dl = torch.randn_like(o), torch.randn_like(lse)
    grads = torch.autograd.grad((o * do).sum() + (lse * dl).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = reference.attention(*leaves, return_lse=True)
    grads64 = torch.autograd.grad((o64 * do.double()).sum() + (lse64 * dl.double()).sum(), leaves)
    for got, ref in zip(grads, grads64):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_reference_backend_agrees(device, monkeypatch):
    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 30, 41, 24, F32, device))
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    ref_o, ref_lse = fused_remat.attention(q, k, v, causal=True, return_lse=True)
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "triton")
    o, lse = fused_remat.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def _bad(**overrides):
    shapes = {"q": (1, 4, 8, 16), "k": (1, 2, 8, 16), "v": (1, 2, 8, 16)}
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    tensors.update(overrides)
    return tensors


BAD_INPUTS = [
    (lambda: _bad(q=torch.randn(4, 8, 16)), ValueError, r"q must be 4-D"),
    (lambda: _bad(k=torch.randn(1, 2, 8, 16, 1)), ValueError, r"k must be 4-D"),
    (lambda: _bad(k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16)), ValueError, r"batch size of k/v"),
    (lambda: _bad(k=torch.randn(1, 2, 8, 32), v=torch.randn(1, 2, 8, 32)), ValueError, r"head dim D of k/v"),
    (lambda: _bad(v=torch.randn(1, 2, 9, 16)), ValueError, r"k .* and v .* must have the same shape"),
    (lambda: _bad(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 16)), ValueError, r"Hq=4 must be a multiple of .* Hkv=3"),
    (lambda: _bad(q=torch.randn(1, 2, 8, 300), k=torch.randn(1, 2, 8, 300), v=torch.randn(1, 2, 8, 300)), ValueError, r"head dim D=300"),
    (lambda: _bad(q=torch.randn(1, 2, 8, 0), k=torch.randn(1, 2, 8, 0), v=torch.randn(1, 2, 8, 0)), ValueError, r"head dim D=0"),
    (lambda: _bad(q=torch.randn(1, 4, 0, 16)), ValueError, r"q has no query positions"),
    (lambda: _bad(k=torch.randn(1, 2, 0, 16), v=torch.randn(1, 2, 0, 16)), ValueError, r"k and v have no key positions"),
    (lambda: _bad(q=torch.randn(1, 4, 16, 8).transpose(2, 3)), ValueError, r"q must be contiguous in its last dim"),
    (lambda: _bad(v=torch.randn(1, 2, 16, 8).transpose(2, 3)), ValueError, r"v must be contiguous in its last dim"),
    (lambda: _bad(k=torch.randn(1, 2, 8, 16, dtype=torch.float16)), TypeError, r"k has dtype torch.float16 but q"),
    (lambda: _bad(q=torch.randn(1, 4, 8, 16, dtype=torch.float64)), TypeError, r"q has dtype torch.float64"),
    (lambda: _bad(v=torch.ones(1, 2, 8, 16, dtype=torch.int32)), TypeError, r"v must be a floating-point tensor"),
    (lambda: _bad(k="k"), TypeError, r"k must be a torch.Tensor"),
    (lambda: _bad(k=torch.randn(1, 2, 8, 16, device="meta")), ValueError, r"k is on meta but q is on cpu"),
]


@pytest.mark.parametrize("make,error,match", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        fused_remat.attention(**make())


def test_bad_scale():
    with pytest.raises(ValueError, match="scale must be a finite real number"):
        fused_remat.attention(**_bad(), scale=float("nan"))


@pytest.mark.parametrize("make,error,match", BAD_INPUTS[::4], ids=[m for _, _, m in BAD_INPUTS[::4]])
def test_ring_attention_rejects_bad_inputs_in_the_same_words(make, error, match):
    """One check owns attention's arguments: ring attention raises what the public op raises, under
    its own name, before it needs a process group."""
    from fused_remat.context_parallel import ring_attention

    with pytest.raises(error, match=r"^ring_attention: .*" + match):
        ring_attention(**make())


def test_launchers_refuse_a_strided_last_dim(device):
    """The launchers trust the shapes check_attention_args accepted, but refuse what a launch cannot
    express: the kernels take no stride for the last dim."""
    from fused_remat.kernels.attention import attention_bwd, attention_fwd

    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 16, 16, 16, F32, device))
    with pytest.raises(ValueError, match=r"^k must be contiguous in its last dim"):
        attention_fwd(q, k.transpose(2, 3), v, False, 0.25)
    o, lse = attention_fwd(q, k, v, False, 0.25)
    with pytest.raises(ValueError, match=r"^o must be contiguous in its last dim"):
        attention_bwd(torch.randn_like(o), q, k, v, o.transpose(2, 3), lse, False, 0.25)


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_gpu_autotune_pruning_leaves_configs(dtype, head_dim):
    """Every (dtype, HEAD_DIM) keeps at least one configuration within the shared-memory budget."""
    from fused_remat.kernels import attention_configs as tuning

    for kernel in tuning.KERNELS:
        kept = tuning.PRUNERS[kernel](tuning.CONFIGS[kernel], {"Q": torch.empty(0, dtype=dtype)}, HEAD_DIM=head_dim)
        assert kept and all(min(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) >= 16 for c in kept)


# ------------------------------------------------------------------ GPU: long sequences, bf16/fp16

GPU_CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, causal, dtype)
    (2, 8, 2, 4096, 4096, 128, True, BF16),
    (1, 4, 4, 4096, 4096, 64, False, F16),
    (1, 4, 1, 8192, 8192, 128, False, BF16),
    (1, 2, 2, 16384, 16384, 64, True, F16),
    (1, 2, 1, 3000, 16384, 128, True, BF16),
]


@pytest.mark.gpu
def test_descriptor_launches_from_a_new_thread_on_gpu(device):
    """A thread that never set Triton's allocator (as autograd's backward threads) launches the
    descriptor kernels: the launchers provide the scratch memory."""
    import threading

    q, k, v = _inputs(1, 4, 2, 1000, 1000, 64, BF16, device)
    errors = []

    def step():
        try:
            o = fused_remat.attention(q, k, v, causal=True)
            torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
        except Exception as exc:  # reported below: a thread's exception would otherwise only print
            errors.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert not errors, errors


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_long_sequences_on_gpu(case, device):
    b, hq, hkv, nq, nk, d, causal, dtype = case
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype, device)
    scale = 1.0 / math.sqrt(d)
    o, lse = fused_remat.attention(q, k, v, causal=causal, return_lse=True)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = manual_attention(q.detach(), k.detach(), v.detach(), do, causal, scale, torch.float64)
    same = manual_attention(q.detach(), k.detach(), v.detach(), do, causal, scale, dtype)
    assert_error_rule("o", o, same[0], ref[0], dtype)
    _assert_lse(lse, ref[1])
    for name, got, s, r in zip(("dq", "dk", "dv"), grads, same[2:], ref[2:]):
        assert_error_rule(name, got, s, r, dtype)
