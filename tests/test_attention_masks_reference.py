"""The plain-PyTorch twin of attention with sliding windows, softcapping and variable-length
documents (FlashAttention 2's semantics), and the argument checks of those options.

The twin is compared with a naive implementation written from the definition, one row at a time;
the varlen twin with each document computed alone. CPU and float64 only.
"""

import math

import pytest
import torch

from fused_remat import reference
from fused_remat.kernels.limits import check_softcap, check_varlen_args, check_window

F64 = torch.float64


def naive_attention(q, k, v, *, causal, scale, window, softcap):
    """FlashAttention 2's definition, row by row: query i sees key j iff
    j >= i + offset - left (left >= 0) and j <= i + offset + right (right >= 0), offset = Nk - Nq,
    causal meaning right = 0; softcap > 0 caps the scaled scores with softcap * tanh(s / softcap)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    offset = k_len - q_len
    left, right = window
    if causal:
        right = 0
    visible = torch.tensor([[(left < 0 or j >= i + offset - left) and (right < 0 or j <= i + offset + right)
                             for j in range(k_len)] for i in range(q_len)], dtype=torch.bool).reshape(q_len, k_len)
    out = torch.zeros(batch, q_heads, q_len, head_dim, dtype=F64)
    lse = torch.full((batch, q_heads, q_len), -math.inf, dtype=F64)
    for b in range(batch):
        for h in range(q_heads):
            kv_head = h // (q_heads // kv_heads)
            scores = q[b, h] @ k[b, kv_head].T * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            for i in range(q_len):
                keys = visible[i]
                if not keys.any():
                    continue
                row = scores[i, keys]
                weights = torch.exp(row - row.max())
                lse[b, h, i] = row.max() + torch.log(weights.sum())
                out[b, h, i] = (weights / weights.sum()) @ v[b, kv_head, keys]
    return out, lse


def _qkv(batch, q_heads, kv_heads, q_len, k_len, head_dim):
    return (torch.randn(batch, q_heads, q_len, head_dim, dtype=F64),
            torch.randn(batch, kv_heads, k_len, head_dim, dtype=F64),
            torch.randn(batch, kv_heads, k_len, head_dim, dtype=F64))


LENGTHS = [(7, 7), (11, 5), (5, 11)]
# (causal, window)
MASKS = [
    (False, (-1, -1)),
    (False, (0, 0)),
    (False, (3, -1)),
    (False, (-1, 2)),
    (False, (2, 5)),
    (False, (100, 100)),
    (True, (-1, -1)),
    (True, (2, -1)),
    (True, (2, 5)),  # causal overrides the right side
]


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["nocap", "cap5"])
@pytest.mark.parametrize("causal,window", MASKS, ids=[f"{'causal-' if c else ''}w{w[0]}_{w[1]}" for c, w in MASKS])
@pytest.mark.parametrize("q_len,k_len", LENGTHS, ids=[f"{nq}x{nk}" for nq, nk in LENGTHS])
def test_masks_and_softcap_match_the_definition(q_len, k_len, causal, window, softcap):
    q, k, v = _qkv(2, 4, 2, q_len, k_len, 8)
    scale = 3.0  # large logits, where the cap changes the softmax
    out, lse = reference.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                   return_lse=True)
    expected_out, expected_lse = naive_attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


@pytest.mark.parametrize("q_len,k_len,causal,window", [(11, 5, True, (-1, -1)), (11, 5, False, (2, 5)),
                                                       (11, 5, False, (0, 0))])
def test_rows_that_see_no_key_give_zeros_and_minus_inf(q_len, k_len, causal, window):
    q, k, v = _qkv(1, 2, 1, q_len, k_len, 8)
    out, lse = reference.attention(q, k, v, causal=causal, window=window, return_lse=True)
    hidden = torch.isneginf(lse)
    assert hidden.any() and not hidden.all()
    assert torch.equal(out[hidden], torch.zeros_like(out[hidden]))


def test_default_window_and_softcap_keep_plain_attention():
    q, k, v = _qkv(1, 4, 2, 9, 13, 8)
    for causal in (False, True):
        torch.testing.assert_close(reference.attention(q, k, v, causal=causal, window=(-1, -1), softcap=0.0),
                                   reference.attention(q, k, v, causal=causal), rtol=0, atol=0)


# Per document: (query length, key length): empty, one token, Nq > Nk, Nq < Nk, keys of length 0.
DOCUMENTS = [(3, 5), (0, 2), (1, 1), (6, 4), (2, 0), (4, 4), (0, 0), (2, 7)]


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (2, -1), 5.0), (False, (1, 3), 0.0)],
                         ids=["full", "causal", "causal-left2-cap5", "w1_3"])
def test_varlen_is_each_document_alone(causal, window, softcap):
    q_lens, k_lens = zip(*DOCUMENTS)
    q_heads, kv_heads, head_dim = 4, 2, 8
    q = torch.randn(sum(q_lens), q_heads, head_dim, dtype=F64, requires_grad=True)
    k = torch.randn(sum(k_lens), kv_heads, head_dim, dtype=F64, requires_grad=True)
    v = torch.randn(sum(k_lens), kv_heads, head_dim, dtype=F64, requires_grad=True)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    options = dict(causal=causal, scale=0.7, window=window, softcap=softcap)
    out, lse = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max(q_lens), max(k_lens),
                                          return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == F64
    assert lse.shape == (q_heads, q.shape[0]) and lse.dtype == F64
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected_outs, expected_lses = [], []
    for doc, (q_len, k_len) in enumerate(DOCUMENTS):
        q_rows = slice(sum(q_lens[:doc]), sum(q_lens[:doc]) + q_len)
        k_rows = slice(sum(k_lens[:doc]), sum(k_lens[:doc]) + k_len)
        doc_q, doc_k, doc_v = (t[rows].permute(1, 0, 2)[None] for t, rows in zip(leaves, (q_rows, k_rows, k_rows)))
        if k_len == 0:
            expected_outs.append(torch.zeros(q_len, q_heads, head_dim, dtype=F64))
            expected_lses.append(torch.full((q_heads, q_len), -math.inf, dtype=F64))
            continue
        doc_out, doc_lse = reference.attention(doc_q, doc_k, doc_v, return_lse=True, **options)
        expected_outs.append(doc_out[0].permute(1, 0, 2))
        expected_lses.append(doc_lse[0])
    expected_out = torch.cat(expected_outs)
    expected_grads = torch.autograd.grad(expected_out, leaves, grad_out)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, torch.cat(expected_lses, dim=1))
    for name, grad, expected in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(grad, expected, msg=lambda m, name=name: f"d{name}: {m}")
    empty_keys_rows = slice(sum(q_lens[:4]), sum(q_lens[:5]))
    assert torch.equal(grads[0][empty_keys_rows], torch.zeros_like(grads[0][empty_keys_rows]))


@pytest.mark.parametrize("window,expected", [
    ((-1, -1), (-1, -1)), ([3, 0], (3, 0)), ((0, 100), (0, 100)),
    (torch.tensor([5, -1]), (5, -1)), ((torch.tensor(7), torch.tensor(0, dtype=torch.int32)), (7, 0)),
], ids=repr)
def test_check_window_accepts(window, expected):
    """FlashAttention 2's forms: a pair of ints, or integer tensors as its tests draw them."""
    checked = check_window("attention", window)
    assert checked == expected
    assert all(type(side) is int for side in checked)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (0,), (0, 1, 2), (True, 0), (1.0, 2), "12", None, 5, {0, 1},
                                    torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3]), torch.tensor([-2, 0]),
                                    (torch.tensor([1]), 0), torch.tensor([True, False]), torch.tensor([[1, 2]])],
                         ids=repr)
def test_check_window_rejects(window):
    with pytest.raises(ValueError, match=r"^attention: window must be a pair \(left, right\) of ints >= -1"):
        check_window("attention", window)


@pytest.mark.parametrize("softcap,expected", [(0, 0.0), (5, 5.0), (30.5, 30.5)])
def test_check_softcap_accepts(softcap, expected):
    assert check_softcap("attention", softcap) == expected


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf"), True, "5", None, 1j], ids=repr)
def test_check_softcap_rejects(softcap):
    with pytest.raises(ValueError, match=r"^attention: softcap must be a finite real number >= 0"):
        check_softcap("attention", softcap)


def _varlen(**overrides):
    """Valid arguments (three documents of q lengths 2, 0, 4 and k lengths 3, 1, 3), then overrides."""
    args = dict(q=torch.randn(6, 4, 8), k=torch.randn(7, 2, 8), v=torch.randn(7, 2, 8),
                cu_seqlens_q=torch.tensor([0, 2, 2, 6], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 4, 7], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=3)
    args.update(overrides)
    return args


def _offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_check_varlen_args_accepts():
    assert check_varlen_args("attention_varlen", **_varlen()) == pytest.approx(1 / math.sqrt(8))
    assert check_varlen_args("attention_varlen", **_varlen(), scale=2) == 2.0
    every_document_empty = _varlen(q=torch.randn(0, 4, 8), k=torch.randn(0, 2, 8), v=torch.randn(0, 2, 8),
                                   cu_seqlens_q=_offsets(0, 0, 0), cu_seqlens_k=_offsets(0, 0, 0),
                                   max_seqlen_q=0, max_seqlen_k=0)
    check_varlen_args("attention_varlen", **every_document_empty)


def test_check_varlen_args_reads_no_values_on_meta_or_under_compile(monkeypatch):
    """Where the offsets have no values to read (meta) or reading them would break the graph
    (torch.compile), only their type, shape and device are checked."""
    decreasing = _offsets(0, 5, 2, 6)
    meta = {name: t.to("meta") for name, t in _varlen(cu_seqlens_q=decreasing).items() if isinstance(t, torch.Tensor)}
    check_varlen_args("attention_varlen", **_varlen(**meta))
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        check_varlen_args("attention_varlen", **_varlen(**{**meta, "cu_seqlens_q": decreasing.to("meta", torch.int64)}))
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    check_varlen_args("attention_varlen", **_varlen(cu_seqlens_q=decreasing))


BAD_VARLEN = [
    (lambda: dict(q=torch.randn(1, 6, 4, 8)), ValueError, r"q must be 3-D \(total_q, H, D\)"),
    (lambda: dict(k=torch.randn(7, 2, 8, 1)), ValueError, r"k must be 3-D"),
    (lambda: dict(v=torch.randn(6, 2, 8)), ValueError, r"k \(7, 2, 8\) and v \(6, 2, 8\) must have the same shape \(total_k, Hkv, D\)"),
    (lambda: dict(k=torch.randn(7, 3, 8), v=torch.randn(7, 3, 8)), ValueError, r"q heads Hq=4 must be a multiple of the k/v heads Hkv=3"),
    (lambda: dict(k=torch.randn(7, 2, 16), v=torch.randn(7, 2, 16)), ValueError, r"head dim D of k/v \(16\) does not match q"),
    (lambda: dict(q=torch.randn(6, 4, 300), k=torch.randn(7, 2, 300), v=torch.randn(7, 2, 300)), ValueError, r"head dim D=300"),
    (lambda: dict(q=torch.randn(6, 8, 4).transpose(1, 2)), ValueError, r"q must be contiguous in its last dim"),
    (lambda: dict(q=torch.randn(6, 4, 8, dtype=F64)), TypeError, r"q has dtype torch.float64"),
    (lambda: dict(v=torch.randn(7, 2, 8, dtype=torch.float16)), TypeError, r"v has dtype torch.float16 but q"),
    (lambda: dict(k=torch.randn(7, 2, 8, device="meta")), ValueError, r"k is on meta but q is on cpu"),
    (lambda: dict(cu_seqlens_q=[0, 2, 2, 6]), TypeError, r"cu_seqlens_q must be a torch.Tensor"),
    (lambda: dict(cu_seqlens_q=torch.tensor([0, 2, 2, 6])), TypeError, r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    (lambda: dict(cu_seqlens_k=_offsets(0, 3, 4, 7).float()), TypeError, r"cu_seqlens_k must have dtype torch.int32"),
    (lambda: dict(cu_seqlens_q=_offsets(0, 2, 2, 6)[None]), ValueError, r"cu_seqlens_q must be 1-D with \(documents \+ 1\) >= 2"),
    (lambda: dict(cu_seqlens_k=_offsets(7)), ValueError, r"cu_seqlens_k must be 1-D with \(documents \+ 1\) >= 2"),
    (lambda: dict(cu_seqlens_k=_offsets(0, 3, 4, 7).to("meta")), ValueError, r"cu_seqlens_k is on meta but q is on cpu"),
    (lambda: dict(cu_seqlens_k=_offsets(0, 7)), ValueError, r"cu_seqlens_q has 4 entries but cu_seqlens_k has 2"),
    (lambda: dict(max_seqlen_q=True), ValueError, r"max_seqlen_q must be an int >= 0, got True"),
    (lambda: dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be an int >= 0, got -1"),
    (lambda: dict(max_seqlen_q=4.0), ValueError, r"max_seqlen_q must be an int >= 0, got 4.0"),
    (lambda: dict(cu_seqlens_q=_offsets(1, 2, 2, 6)), ValueError, r"cu_seqlens_q must start at 0, got 1"),
    (lambda: dict(cu_seqlens_k=_offsets(0, 4, 3, 7), max_seqlen_k=4), ValueError,
     r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[2\]=3 < cu_seqlens_k\[1\]=4"),
    (lambda: dict(cu_seqlens_q=_offsets(0, 2, 2, 5)), ValueError, r"cu_seqlens_q must end at the number of rows of q \(6\), got 5"),
    (lambda: dict(cu_seqlens_k=_offsets(0, 3, 4, 8), max_seqlen_k=4), ValueError,
     r"cu_seqlens_k must end at the number of rows of k and v \(7\), got 8"),
    (lambda: dict(max_seqlen_q=3), ValueError, r"document 2 has length 4 in cu_seqlens_q, more than max_seqlen_q=3"),
    (lambda: dict(max_seqlen_k=2), ValueError, r"document 0 has length 3 in cu_seqlens_k, more than max_seqlen_k=2"),
    (lambda: dict(scale=float("nan")), ValueError, r"scale must be a finite real number or None"),
]


@pytest.mark.parametrize("make,error,match", BAD_VARLEN, ids=[m for _, _, m in BAD_VARLEN])
def test_check_varlen_args_rejects(make, error, match):
    with pytest.raises(error, match=r"^attention_varlen: " + match):
        check_varlen_args("attention_varlen", **_varlen(**make()))
