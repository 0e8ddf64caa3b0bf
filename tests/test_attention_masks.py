"""Attention for real batches: sliding windows, softcapping and documents packed with cu_seqlens.

Against a float64 reference and plain PyTorch in the same dtype (the error rule), FlashAttention 2's
edge cases (empty and length-1 documents, one document, a thousand tiny ones, windows of 0 and
wider than the sequence, large logits under a softcap, rows that see nothing), each document
bitwise equal to itself attended alone, determinism, and the work the masks skip: the key tiles
the kernels visit, counted in the interpreter, against the tiles that hold a visible pair.
"""

import math

import pytest
import torch
from test_attention import _assert_lse, _check, _inputs, manual_attention

import fused_remat
from fused_remat import reference
from numerics import assert_error_rule

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# (B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype)
DENSE_MASKS = [
    (1, 2, 1, 113, 203, 64, False, (17, 5), 0.0, F16),
    (1, 2, 2, 203, 113, 40, True, (30, -1), 0.0, F32),
    (2, 4, 2, 100, 100, 64, False, (-1, 0), 0.0, F16),  # causal spelled as a window
    (1, 2, 1, 70, 70, 32, False, (0, 0), 0.0, F32),  # each query its diagonal key only
    (1, 1, 1, 50, 90, 16, True, (500, -1), 0.0, F16),  # a window wider than the keys
    (1, 2, 1, 90, 50, 96, False, (-1, 2), 0.0, F32),  # Nq > Nk: the first 38 rows see no key
    (1, 2, 1, 113, 113, 64, True, (-1, -1), 50.0, F16),
    (2, 2, 1, 40, 75, 37, False, (8, 8), 2.0, F32),
    # bf16 dots run upcast in the interpreter; this case checks the rest of the bf16 path.
    (1, 2, 1, 113, 203, 64, True, (64, -1), 30.0, BF16),
]


def _dense_id(case):
    b, hq, hkv, nq, nk, d, causal, window, softcap, dtype = case
    return (f"b{b}-h{hq}:{hkv}-{nq}x{nk}-d{d}-{'causal' if causal else 'full'}-w{window[0]},{window[1]}"
            f"-cap{softcap:g}-{str(dtype).removeprefix('torch.')}")


@pytest.mark.parametrize("case", DENSE_MASKS, ids=_dense_id)
def test_window_and_softcap_match_references(case, device, triton_backend):
    b, hq, hkv, nq, nk, d, causal, window, softcap, dtype = case
    _check(*_inputs(b, hq, hkv, nq, nk, d, dtype, device), causal, window=window, softcap=softcap)


@pytest.mark.parametrize("window", [(-1, -1), (10, 3)], ids=["full", "window"])
def test_softcap_with_large_logits(window, device, triton_backend):
    """Scale 3.0 puts raw scores near 100: the cap (5) saturates tanh, and P near 1 must still come
    back from the saved lse to fp32 accuracy, through the 1 - tanh^2 factor of the gradient."""
    _check(*_inputs(1, 2, 2, 70, 40, 64, F32, device), False, scale=3.0, window=window, softcap=5.0)


# --------------------------------------------------------------------------------- packed documents

# (query lengths, key lengths, Hq, Hkv, D, causal, window, softcap, dtype)
DOCUMENTS = [
    ([70, 1, 0, 33], [70, 1, 0, 33], 2, 1, 64, True, (-1, -1), 0.0, F16),
    ([5, 40, 1, 70], [7, 33, 2, 70], 2, 2, 40, True, (-1, -1), 0.0, F32),  # bottom-right per document
    ([5, 3, 40], [7, 0, 33], 2, 1, 32, False, (-1, -1), 0.0, F32),  # a document without keys
    ([50, 3, 100], [77, 1, 60], 4, 2, 32, False, (6, 2), 3.0, F32),
    ([113], [113], 2, 1, 64, True, (-1, -1), 0.0, F16),  # one document
    ([96, 64], [96, 64], 2, 1, 64, True, (20, -1), 0.0, BF16),
]


def _documents_id(case):
    lq, lk, hq, hkv, d, causal, window, softcap, dtype = case
    lengths = ",".join(map(str, lq)) + ("" if lq == lk else "/" + ",".join(map(str, lk)))
    return (f"{lengths}-h{hq}:{hkv}-d{d}-{'causal' if causal else 'full'}-w{window[0]},{window[1]}-cap{softcap:g}"
            f"-{str(dtype).removeprefix('torch.')}")


def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _packed(q_lengths, k_lengths, hq, hkv, d, dtype, device):
    q = torch.randn(sum(q_lengths), hq, d, device=device).to(dtype).requires_grad_()
    k = torch.randn(sum(k_lengths), hkv, d, device=device).to(dtype).requires_grad_()
    v = torch.randn(sum(k_lengths), hkv, d, device=device).to(dtype).requires_grad_()
    return q, k, v, _offsets(q_lengths, device), _offsets(k_lengths, device)


def _per_document_in_dtype(q, k, v, do, cu_q, cu_k, causal, scale, window, softcap, dtype):
    """Plain PyTorch in ``dtype``, one document at a time: o, dq, dk, dv in the packed layout."""
    o, dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, q, k, v))
    q_offsets, k_offsets = cu_q.tolist(), cu_k.tolist()
    for i in range(len(q_offsets) - 1):
        rows, keys = slice(q_offsets[i], q_offsets[i + 1]), slice(k_offsets[i], k_offsets[i + 1])
        heads = [t[r].transpose(0, 1).unsqueeze(0) for t, r in ((q, rows), (k, keys), (v, keys), (do, rows))]
        if heads[0].shape[2] == 0:
            continue
        o_doc, _, dq_doc, dk_doc, dv_doc = manual_attention(*heads, causal, scale, dtype, window, softcap)
        for out, r, value in ((o, rows, o_doc), (dq, rows, dq_doc), (dk, keys, dk_doc), (dv, keys, dv_doc)):
            out[r] = value[0].transpose(0, 1)
    return o, dq, dk, dv


@pytest.mark.parametrize("case", DOCUMENTS, ids=_documents_id)
def test_documents_match_references(case, device, triton_backend):
    q_lengths, k_lengths, hq, hkv, d, causal, window, softcap, dtype = case
    q, k, v, cu_q, cu_k = _packed(q_lengths, k_lengths, hq, hkv, d, dtype, device)
    mask = dict(causal=causal, window=window, softcap=softcap)
    o, lse = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths), return_lse=True, **mask)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (hq, q.shape[0])
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = reference.attention_varlen(*leaves, cu_q, cu_k, max(q_lengths), max(k_lengths), return_lse=True,
                                            **mask)
    grads64 = torch.autograd.grad(o64, leaves, do.double())
    same = _per_document_in_dtype(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, causal, 1 / math.sqrt(d),
                                  window, softcap, dtype)
    for name, got, same_dtype, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), same, (o64, *grads64)):
        assert_error_rule(name, got, same_dtype, ref, dtype)
    _assert_lse(lse, lse64)


@pytest.mark.parametrize("causal, window, softcap", [(True, (-1, -1), 0.0), (False, (9, 4), 7.0)],
                         ids=["causal", "window-softcap"])
def test_each_document_is_itself_attended_alone_bitwise(causal, window, softcap, device, triton_backend):
    """A document's tiles start at its own first row, so packing changes no arithmetic: its output,
    log-sum-exp and gradients are the bits of fused_remat.attention on that document alone."""
    q_lengths, k_lengths = [37, 1, 70, 0, 12], [50, 3, 70, 4, 12]
    q, k, v, cu_q, cu_k = _packed(q_lengths, k_lengths, 4, 2, 40, F32, device)
    mask = dict(causal=causal, window=window, softcap=softcap)
    o, lse = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, 70, 70, return_lse=True, **mask)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    q_offsets, k_offsets = cu_q.tolist(), cu_k.tolist()
    for i in range(len(q_lengths)):
        rows, keys = slice(q_offsets[i], q_offsets[i + 1]), slice(k_offsets[i], k_offsets[i + 1])
        if q_lengths[i] == 0:
            assert dk[keys].abs().max() == 0 and dv[keys].abs().max() == 0
            continue
        alone = [t.detach()[r].transpose(0, 1).unsqueeze(0).requires_grad_() for t, r in ((q, rows), (k, keys), (v, keys))]
        o_alone, lse_alone = fused_remat.attention(*alone, return_lse=True, **mask)
        grads_alone = torch.autograd.grad(o_alone, alone, do[rows].transpose(0, 1).unsqueeze(0))
        assert torch.equal(o[rows], o_alone[0].transpose(0, 1))
        assert torch.equal(lse[:, rows], lse_alone[0])
        for packed, r, single in ((dq, rows, grads_alone[0]), (dk, keys, grads_alone[1]), (dv, keys, grads_alone[2])):
            assert torch.equal(packed[r], single[0].transpose(0, 1))


def test_a_thousand_tiny_documents(device, triton_backend):
    lengths = torch.randint(0, 4, (1000,)).tolist()
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 1, 1, 16, F32, device)
    o = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64 = reference.attention_varlen(*leaves, cu_q, cu_k, max(lengths), max(lengths), causal=True)
    grads64 = torch.autograd.grad(o64, leaves, do.double())
    for got, ref in zip((o, *grads), (o64, *grads64)):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)


def test_rows_that_see_nothing_give_zeros(device, triton_backend):
    """A key-less document, and a window that leaves the first rows nothing (Nq > Nk, right bound):
    output and every gradient through them are 0, their lse -inf."""
    q, k, v, cu_q, cu_k = _packed([20, 30], [0, 10], 2, 1, 32, F32, device)
    o, lse = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, 30, 10, window=(-1, 0), return_lse=True)
    seen_nothing = torch.cat([torch.ones(20, dtype=torch.bool), torch.arange(30) < 20])
    assert (o[seen_nothing] == 0).all() and (lse[:, seen_nothing] == float("-inf")).all()
    assert torch.isfinite(lse[:, ~seen_nothing]).all()
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert (dq[seen_nothing] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_a_window_given_as_flash_attention_callers_give_it(device, triton_backend):
    """FlashAttention 2's tests draw window_size as torch.randint(0, n, (2,)): the same call as with
    the ints it holds, bitwise, dense and packed."""
    window = torch.randint(0, 12, (2,))
    sides = tuple(window.tolist())
    q, k, v, cu_q, cu_k = _packed([20, 30], [20, 30], 2, 1, 32, F32, device)
    assert torch.equal(fused_remat.attention_varlen(q, k, v, cu_q, cu_k, 30, 30, window=window),
                       fused_remat.attention_varlen(q, k, v, cu_q, cu_k, 30, 30, window=sides))
    q, k, v = (t.detach().unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    assert torch.equal(fused_remat.attention(q, k, v, window=tuple(window.unbind())),
                       fused_remat.attention(q, k, v, window=sides))


def test_documents_backward_is_deterministic(device, triton_backend):
    q, k, v, cu_q, cu_k = _packed([40, 7, 66], [40, 7, 66], 4, 2, 32, F32, device)
    do = torch.randn_like(q)

    def grads():
        o = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, 66, 66, causal=True, window=(20, -1), softcap=4.0)
        return torch.autograd.grad(o, (q, k, v), do)

    for first, second in zip(grads(), grads()):
        assert torch.equal(first, second)


def test_documents_keep_only_inputs_outputs_and_lse(device, triton_backend):
    from fused_remat.memory import saved_memory

    q, k, v, cu_q, cu_k = _packed([40, 7, 66], [40, 7, 66], 4, 2, 32, F32, device)
    with saved_memory() as meter:
        o = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, 66, 66, causal=True)
    expected = (q.numel() + k.numel() + v.numel() + o.numel()) * 4 + 4 * 4 * q.shape[0] + 2 * 4 * cu_q.numel()
    assert meter.device_bytes == expected


# --------------------------------------------------------------------------------- work skipped

def _tiles_with_a_visible_pair(q_len, k_len, causal, window, block_m, block_n):
    """(query tile, key tile) pairs of one sequence and head that hold at least one visible pair."""
    left, right = window
    if causal:
        right = 0
    diagonal = torch.arange(q_len)[:, None] + (k_len - q_len)
    keys = torch.arange(k_len)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if right >= 0:
        visible &= keys <= diagonal + right
    if left >= 0:
        visible &= keys >= diagonal - left
    return sum(bool(visible[m:m + block_m, n:n + block_n].any())
               for m in range(0, q_len, block_m) for n in range(0, k_len, block_n))


def _counting_dots(monkeypatch) -> list:
    """Every matrix product the interpreter runs from now on, one entry each."""
    from triton.runtime import interpreter

    calls, create_dot = [], interpreter.InterpreterBuilder.create_dot

    def counting(self, *args, **kwargs):
        calls.append(1)
        return create_dot(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", counting)
    return calls


# Three mixes of documents in one packed row of 512 tokens, and a sliding window over it.
WORK_CASES = {
    "documents-equal": ([128] * 4, True, (-1, -1)),
    "documents-mixed": ([300, 100, 60, 40, 12], True, (-1, -1)),
    "documents-tiny": ([16] * 32, True, (-1, -1)),
    "window-64": ([512], True, (64, -1)),
}


@pytest.mark.parametrize("name", WORK_CASES)
def test_masked_tiles_are_never_visited(name, device, monkeypatch):
    """Forward: two products per visited (query tile, key tile); backward: seven (dK/dV's S, dV, dP,
    dK; dQ's S, dP, dQ). The visits equal the tiles holding a visible pair, so a packed row costs its
    documents' sum of n_i^2 / 2 and a window W about N W, never the packed N^2 / 2."""
    if device.type != "cpu":
        pytest.skip("counts the interpreter's products")
    from fused_remat.kernels.attention_configs import INTERPRETER_CONFIG

    lengths, causal, window = WORK_CASES[name]
    heads = 2
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, heads, heads, 16, F32, device)
    tiles = heads * sum(_tiles_with_a_visible_pair(n, n, causal, window, INTERPRETER_CONFIG["BLOCK_M"],
                                                   INTERPRETER_CONFIG["BLOCK_N"]) for n in lengths)
    dots = _counting_dots(monkeypatch)
    o = fused_remat.attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=causal, window=window)
    assert len(dots) == 2 * tiles
    dots.clear()
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert len(dots) == 7 * tiles
    packed_causal_tiles = heads * _tiles_with_a_visible_pair(sum(lengths), sum(lengths), True, (-1, -1), 32, 32)
    if len(lengths) > 1 or window != (-1, -1):
        assert tiles < packed_causal_tiles


def test_dense_window_skips_tiles(device, monkeypatch):
    """The same count for the dense layout: a window over a batch of two sequences."""
    if device.type != "cpu":
        pytest.skip("counts the interpreter's products")
    q, k, v = _inputs(2, 2, 1, 200, 200, 16, F32, device)
    tiles = 2 * 2 * _tiles_with_a_visible_pair(200, 200, False, (40, 10), 32, 32)
    dots = _counting_dots(monkeypatch)
    o = fused_remat.attention(q, k, v, window=(40, 10))
    assert len(dots) == 2 * tiles
    dots.clear()
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert len(dots) == 7 * tiles
