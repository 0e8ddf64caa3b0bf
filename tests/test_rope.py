"""In-place rotary embedding kernel against the float64 reference and plain PyTorch in the same dtype."""

import pytest
import torch

from fused_remat import custom_ops, reference
from fused_remat.kernels.rope import rope_
from numerics import assert_error_rule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, N, H, D): odd B and N, several heads, D with D/2 not a power of two (6, 80, 96).
SHAPES = [
    (1, 1, 1, 2),
    (3, 17, 2, 6),
    (2, 130, 3, 16),
    (1, 17, 4, 64),
    (3, 17, 2, 80),
    (1, 130, 2, 96),
    (2, 17, 3, 128),
    (1, 3, 2, 256),
]


def _check_against_references(name, ours, x, theta, inverse, dtype, positions=None):
    """ours = rotation of x (taken before the in-place call) under the error rule."""
    same = reference.rope(x, theta, inverse=inverse, positions=positions)
    ref64 = reference.rope(x.double(), theta, inverse=inverse, positions=positions)
    assert ours.dtype == dtype
    assert_error_rule(name, ours, same, ref64, dtype)


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_references(shape, dtype, inverse, device):
    theta = 10000.0
    x = torch.randn(shape, device=device).to(dtype)
    original = x.clone()
    out = rope_(x, reference.rope_inverse_frequencies(shape[-1], theta, device), inverse=inverse)
    assert out is x, "rope_ must return its (rotated in place) input"
    _check_against_references("rope", x, original, theta, inverse, dtype)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_theta(theta, dtype, device):
    x = torch.randn(2, 130, 2, 64, device=device).to(dtype)
    original = x.clone()
    rope_(x, reference.rope_inverse_frequencies(64, theta, device))
    _check_against_references(f"rope theta={theta:g}", x, original, theta, False, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_qkv_view(dtype, device):
    """The block's call: q and k heads of the packed (B*N, (Hq + 2 Hkv) * D) buffer rotate in
    place; the v heads are left bitwise untouched."""
    batch, seq, q_heads, kv_heads, head_dim, theta = 3, 17, 4, 2, 16, 10000.0
    qkv = torch.randn(batch * seq, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    before = qkv.clone().view(batch, seq, q_heads + 2 * kv_heads, head_dim)
    qk = qkv.view(batch, seq, q_heads + 2 * kv_heads, head_dim)[:, :, : q_heads + kv_heads]
    assert not qk.is_contiguous()
    out = rope_(qk, reference.rope_inverse_frequencies(head_dim, theta, device))
    assert out is qk
    after = qkv.view(batch, seq, q_heads + 2 * kv_heads, head_dim)
    split = q_heads + kv_heads
    assert torch.equal(after[:, :, split:], before[:, :, split:]), "v heads changed"
    _check_against_references("rope qk of packed qkv", after[:, :, :split], before[:, :, :split], theta, False, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inverse_undoes_forward(dtype, device):
    x = torch.randn(3, 130, 3, 80, device=device).to(dtype)
    original = x.clone()
    inv_freq = reference.rope_inverse_frequencies(80, 10000.0, device)
    rope_(rope_(x, inv_freq), inv_freq, inverse=True)
    # Rotation is norm-preserving: two rotations, each rounded once to the dtype, move an element by
    # about two ulps of the largest element; fp32 must come back to within a few fp32 ulps.
    ulps = {torch.float32: 8, torch.float16: 4, torch.bfloat16: 4}[dtype]
    tol = ulps * torch.finfo(dtype).eps * original.abs().max().item()
    err = (x.double() - original.double()).abs().max().item()
    assert err <= tol, f"inverse(forward(x)) off by {err:.3e} > {tol:.3e} ({dtype})"


def test_inverse_is_transpose(device):
    """<rope(x), g> == <x, rope_inverse(g)>: the inverse is the backward of the forward."""
    shape, theta = (2, 130, 3, 96), 500000.0
    inv_freq = reference.rope_inverse_frequencies(shape[-1], theta, device)
    x = torch.randn(shape, device=device)
    g = torch.randn(shape, device=device)
    lhs = (rope_(x.clone(), inv_freq).double() * g.double()).sum().item()
    rhs = (x.double() * rope_(g.clone(), inv_freq, inverse=True).double()).sum().item()
    scale = x.double().norm().item() * g.double().norm().item()
    assert abs(lhs - rhs) <= 1e-6 * scale, f"<rope(x), g> = {lhs!r} but <x, rope^T(g)> = {rhs!r}"


def test_angle_is_the_fp32_product(device):
    """Long positions with inverse frequencies that are not powers of two: the fp32 angle differs
    from the exact one by up to half an ulp (~1e-4 rad near 3000), so matching plain fp32 PyTorch far
    more tightly than that shows the kernel forms the very same fp32 product."""
    seq = 4096
    inv_freq = torch.tensor([0.7310585975646973, 0.4142135679721832], device=device)
    x = torch.randn(1, seq, 1, 4, device=device)
    original = x.clone()
    rope_(x, inv_freq)

    def rotate(t, freqs):
        angles = torch.arange(seq, device=device, dtype=t.dtype)[:, None] * freqs[None, :]
        cos, sin = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]
        x1, x2 = t.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    same = rotate(original, inv_freq)
    exact = rotate(original.double(), inv_freq.double())
    scale = original.abs().max().item()
    assert (same.double() - exact).abs().max().item() > 1e-5 * scale, "test lost its power: angles rounded too little"
    err = (x - same).abs().max().item()
    assert err <= 4e-6 * scale, f"kernel differs from fp32 PyTorch by {err:.3e}: not the same fp32 angles"


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8)], ids=str)
def test_empty(shape, device):
    x = torch.empty(shape, device=device)
    assert rope_(x, reference.rope_inverse_frequencies(8, 10000.0, device)) is x


def test_bad_arguments(device):
    inv8 = reference.rope_inverse_frequencies(8, 10000.0, device)
    with pytest.raises(ValueError, match="D=7"):
        rope_(torch.randn(1, 2, 1, 7, device=device), torch.ones(3, device=device))
    with pytest.raises(ValueError, match="D=258"):
        rope_(torch.randn(1, 2, 1, 258, device=device), torch.ones(129, device=device))
    x = torch.randn(1, 2, 1, 8, device=device)
    for bad in (inv8[:3].clone(), inv8.double(), inv8.repeat(2)[::2], inv8[None]):
        with pytest.raises(ValueError, match="inv_freq"):
            rope_(x, bad)
    with pytest.raises(ValueError, match="B, N, H, D"):
        rope_(torch.randn(2, 1, 8, device=device), inv8)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rope_(torch.randn(1, 2, 1, 16, device=device)[..., ::2], inv8)
    with pytest.raises(ValueError, match="dtype"):
        rope_(torch.randn(1, 2, 1, 8, device=device, dtype=torch.float64), inv8)


# Two packed rows of 100 tokens, each its own split into documents (empty ones included).
DOCUMENT_LENGTHS = [[5, 1, 70, 0, 24], [24, 0, 33, 42, 1]]
POSITION_DTYPES = [torch.int32, torch.int64]


def _document_positions(lengths_per_row, dtype, device):
    """(B, N) positions restarting at 0 at each document, as a packed batch's position_ids."""
    rows = [torch.cat([torch.arange(length) for length in lengths]) for lengths in lengths_per_row]
    return torch.stack(rows).to(device=device, dtype=dtype)


def _random_position_ids(batch, seq, dtype, device):
    """Arbitrary positions < 10000, as a non-contiguous (every other column) view."""
    positions = torch.randint(0, 10000, (batch, 2 * seq), device=device, dtype=dtype)[:, ::2]
    assert not positions.is_contiguous()
    return positions


def _positions(kind, dtype, device):
    if kind == "documents":
        return _document_positions(DOCUMENT_LENGTHS, dtype, device)
    return _random_position_ids(2, 100, dtype, device)


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("position_dtype", POSITION_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["documents", "position_ids"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_positions_match_references(dtype, kind, position_dtype, inverse, device):
    theta = 10000.0
    positions = _positions(kind, position_dtype, device)
    x = torch.randn(*positions.shape, 3, 80, device=device).to(dtype)
    original = x.clone()
    out = rope_(x, reference.rope_inverse_frequencies(80, theta, device), inverse=inverse, positions=positions)
    assert out is x
    _check_against_references(f"rope {kind}", x, original, theta, inverse, dtype, positions=positions)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_documents_rotate_as_if_alone(dtype, device):
    """Positions restarting per document give bitwise each document rotated alone from position 0."""
    theta, head_dim = 10000.0, 16
    inv_freq = reference.rope_inverse_frequencies(head_dim, theta, device)
    positions = _document_positions(DOCUMENT_LENGTHS, torch.int32, device)
    x = torch.randn(*positions.shape, 3, head_dim, device=device).to(dtype)
    packed = rope_(x.clone(), inv_freq, positions=positions)
    packed_reference = reference.rope(x.double(), theta, positions=positions)
    for row, lengths in enumerate(DOCUMENT_LENGTHS):
        start = 0
        for length in lengths:
            document = x[row:row + 1, start:start + length]
            alone = rope_(document.clone(), inv_freq)
            where = f"row {row}, tokens {start}..{start + length}"
            assert torch.equal(packed[row:row + 1, start:start + length], alone), f"kernel differs at {where}"
            torch.testing.assert_close(packed_reference[row:row + 1, start:start + length],
                                       reference.rope(document.double(), theta), msg=f"reference differs at {where}")
            start += length


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("position_dtype", POSITION_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arange_positions_are_the_default(dtype, position_dtype, inverse, device):
    """positions = arange(N) (broadcast over the batch: stride 0) gives bitwise the default rotation."""
    batch, seq, heads, head_dim = 3, 130, 2, 80
    inv_freq = reference.rope_inverse_frequencies(head_dim, 500000.0, device)
    x = torch.randn(batch, seq, heads, head_dim, device=device).to(dtype)
    positions = torch.arange(seq, device=device, dtype=position_dtype).expand(batch, seq)
    by_positions = rope_(x.clone(), inv_freq, inverse=inverse, positions=positions)
    assert torch.equal(by_positions, rope_(x.clone(), inv_freq, inverse=inverse))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inverse_undoes_forward_with_positions(dtype, device):
    positions = _random_position_ids(3, 130, torch.int64, device)
    x = torch.randn(3, 130, 3, 80, device=device).to(dtype)
    original = x.clone()
    inv_freq = reference.rope_inverse_frequencies(80, 10000.0, device)
    rope_(rope_(x, inv_freq, positions=positions), inv_freq, inverse=True, positions=positions)
    # As test_inverse_undoes_forward: both rotations use the same fp32 angles, each rounds once.
    ulps = {torch.float32: 8, torch.float16: 4, torch.bfloat16: 4}[dtype]
    tol = ulps * torch.finfo(dtype).eps * original.abs().max().item()
    err = (x.double() - original.double()).abs().max().item()
    assert err <= tol, f"inverse(forward(x)) off by {err:.3e} > {tol:.3e} ({dtype})"


# Offsets over B * N tokens taken row after row: documents that cross rows, empty ones (first, in
# the middle, last), one document, and one per token (the deepest search: 2^7 > 113 documents).
def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)


OFFSET_CASES = {
    "across rows": ((2, 100), [0, 5, 1, 120, 0, 33, 41, 0]),
    "one document": ((3, 17), [51]),
    "one token each": ((1, 113), [1] * 113),
    "long and short": ((1, 1000), [3, 990, 7]),
}


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("case", list(OFFSET_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offsets_give_each_documents_positions(dtype, case, inverse, device):
    """cu_seqlens places every token where document_positions of the same offsets does, bitwise, and
    under the error rule against the float64 reference."""
    (batch, seq), lengths = OFFSET_CASES[case]
    cu_seqlens = _offsets(lengths, device)
    positions = reference.document_positions(cu_seqlens, batch * seq).view(batch, seq)
    theta, head_dim = 10000.0, 80
    inv_freq = reference.rope_inverse_frequencies(head_dim, theta, device)
    x = torch.randn(batch, seq, 3, head_dim, device=device).to(dtype)
    by_offsets = rope_(x.clone(), inv_freq, inverse=inverse, cu_seqlens=cu_seqlens)
    assert torch.equal(by_offsets, rope_(x.clone(), inv_freq, inverse=inverse, positions=positions))
    _check_against_references(f"rope {case}", by_offsets, x, theta, inverse, dtype, positions=positions)


def test_bad_offsets(device):
    inv8 = reference.rope_inverse_frequencies(8, 10000.0, device)
    x = torch.randn(2, 5, 1, 8, device=device)
    offsets = torch.tensor([0, 4, 10], device=device, dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype torch.int32"):
        rope_(x, inv8, cu_seqlens=offsets.long())
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        rope_(x, inv8, cu_seqlens=[0, 4, 10])
    for bad, why in ((offsets[:1], "1-D with"), (offsets.view(1, 3), "1-D with"),
                     (torch.arange(6, device=device, dtype=torch.int32)[::2], "contiguous")):
        with pytest.raises(ValueError, match=f"cu_seqlens must be {why}"):
            rope_(x, inv8, cu_seqlens=bad)
    other_device = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="cu_seqlens is on"):
        rope_(x, inv8, cu_seqlens=offsets.to(other_device))
    rope_(x, inv8, cu_seqlens=offsets)  # a valid call first: its kept launch must not serve the bad ones
    with pytest.raises(ValueError, match="one of cu_seqlens, positions and chunk_starts"):
        rope_(x, inv8, cu_seqlens=offsets, positions=torch.arange(5, device=device).expand(2, 5))
    with pytest.raises(ValueError, match="one of cu_seqlens, positions and chunk_starts"):
        rope_(torch.randn(2, 4, 1, 8, device=device), inv8, cu_seqlens=offsets, chunk_starts=(0, 6))


def test_packed_qkv_operator_takes_positions(device, triton_backend):
    """rope_qk_ passes positions and document offsets to the kernel; its fake and schema agree (opcheck)."""
    batch, seq, q_heads, kv_heads, head_dim = 2, 100, 4, 2, 16
    inv_freq = reference.rope_inverse_frequencies(head_dim, 10000.0, device)
    positions = _document_positions(DOCUMENT_LENGTHS, torch.int64, device)
    qkv = torch.randn(batch * seq, (q_heads + 2 * kv_heads) * head_dim, device=device)
    expected = qkv.clone()
    rope_(expected.view(batch, seq, -1, head_dim)[:, :, :q_heads + kv_heads], inv_freq, positions=positions)
    custom_ops.rope_qk_(qkv, inv_freq, batch, q_heads, kv_heads, False, None, positions)
    assert torch.equal(qkv, expected)
    torch.library.opcheck(custom_ops.rope_qk_, (qkv, inv_freq, batch, q_heads, kv_heads, False, None, positions),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    cu_seqlens = _offsets([lengths for row in DOCUMENT_LENGTHS for lengths in row], device)
    by_offsets = qkv.clone()
    custom_ops.rope_qk_(by_offsets, inv_freq, batch, q_heads, kv_heads, True, None, None, cu_seqlens)
    custom_ops.rope_qk_(qkv, inv_freq, batch, q_heads, kv_heads, True, None, positions)
    assert torch.equal(by_offsets, qkv)
    torch.library.opcheck(custom_ops.rope_qk_, (qkv, inv_freq, batch, q_heads, kv_heads, False, None, None, cu_seqlens),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_bad_positions(device):
    inv8 = reference.rope_inverse_frequencies(8, 10000.0, device)
    x = torch.randn(2, 5, 1, 8, device=device)
    positions = torch.arange(5, device=device).expand(2, 5)
    for bad_shape in [(5,), (2, 6), (5, 2), (2, 5, 1)]:
        with pytest.raises(ValueError, match="positions"):
            rope_(x, inv8, positions=torch.zeros(bad_shape, device=device, dtype=torch.int64))
    for bad_dtype in (torch.float32, torch.int16, torch.bool):
        with pytest.raises(TypeError, match="positions"):
            rope_(x, inv8, positions=positions.to(bad_dtype))
    with pytest.raises(TypeError, match="positions"):
        rope_(x, inv8, positions=[[0, 1, 2, 3, 4]] * 2)
    other_device = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="positions"):
        rope_(x, inv8, positions=positions.to(other_device))
    with pytest.raises(ValueError, match="positions or chunk_starts"):
        rope_(torch.randn(2, 4, 1, 8, device=device), inv8, chunk_starts=(0, 6),
              positions=torch.arange(4, device=device).expand(2, 4))


@pytest.mark.gpu
def test_many_tokens_gpu(device):
    """B*N far past the 65535 limit of grid axes 1 and 2: tokens must sit on axis 0."""
    batch, seq, heads, head_dim, theta = 2, 1 << 18, 3, 64, 10000.0
    x = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16)
    original = x.clone()
    rope_(x, reference.rope_inverse_frequencies(head_dim, theta, device))
    _check_against_references("rope long", x, original, theta, False, torch.bfloat16)
