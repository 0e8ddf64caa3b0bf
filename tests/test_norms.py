"""layer_norm and rms_norm against a float64 reference and plain PyTorch in the same dtype."""

import re

import pytest
import torch
import torch.nn.functional as F

import fused_remat
from fused_remat import reference
from fused_remat.memory import saved_memory
from numerics import assert_error_rule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [1, 3, 113, 1000, 4095, 5120]
# (leading shape, hidden): single row, odd batches, many rows through the grid-stride loop, and a
# row wider than a register tile (streamed in chunks).
SHAPES = [((1,), h) for h in HIDDEN] + [((2, 3), 113), ((257,), 64), ((3,), 10000), ((5,), 20000), ((1,), 65536)]


def _inputs(leading, hidden, dtype, weight_dtype, device, with_bias=True):
    x = (torch.randn(*leading, hidden, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(weight_dtype).requires_grad_()
    bias = (0.5 * torch.randn(hidden, device=device)).to(weight_dtype).requires_grad_() if with_bias else None
    return x, weight, bias


def _grads(output, tensors, dy):
    return torch.autograd.grad(output, [t for t in tensors if t is not None], dy)


def _torch_norm(kind, x, weight, bias):
    """What a PyTorch user computes in x's dtype (weights cast to it)."""
    weight = weight.to(x.dtype)
    if kind == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), weight, None if bias is None else bias.to(x.dtype), 1e-5)
    return F.rms_norm(x, (x.shape[-1],), weight, 1e-6)


def _ours(kind, x, weight, bias):
    if kind == "layer_norm":
        return fused_remat.layer_norm(x, weight, bias)
    return fused_remat.rms_norm(x, weight)


def _reference64(kind, x, weight, bias):
    x64, w64 = x.double(), weight.double()
    if kind == "layer_norm":
        return reference.layer_norm(x64, w64, None if bias is None else bias.double())
    return reference.rms_norm(x64, w64)


def _check_against_references(kind, x, weight, bias):
    tensors = [x, weight, bias if kind == "layer_norm" else None]
    used_bias = tensors[2]
    ours = _ours(kind, x, weight, used_bias)
    assert ours.dtype == x.dtype and ours.shape == x.shape
    dy = torch.randn_like(ours)
    ours_grads = _grads(ours, tensors, dy)

    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in tensors]
    ref = _reference64(kind, *leaves64)
    ref_grads = _grads(ref, leaves64, dy.double())

    leaves_same = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    same = _torch_norm(kind, *leaves_same)
    same_grads = _grads(same, leaves_same, dy)

    assert_error_rule(f"{kind} y", ours, same, ref, x.dtype)
    names = ["dx", "dweight", "dbias"]
    for name, got, expected_same, expected64 in zip(names, ours_grads, same_grads, ref_grads):
        assert_error_rule(f"{kind} {name}", got, expected_same, expected64, x.dtype)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("leading,hidden", SHAPES, ids=[f"{l}x{h}" for l, h in SHAPES])
def test_norm_matches_references(kind, dtype, leading, hidden, device, triton_backend):
    x, weight, bias = _inputs(leading, hidden, dtype, dtype, device)
    _check_against_references(kind, x, weight, bias)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_weights_with_half_input(kind, dtype, device, triton_backend):
    x, weight, bias = _inputs((7,), 1000, dtype, torch.float32, device)
    out = _ours(kind, x, weight, bias if kind == "layer_norm" else None)
    assert out.dtype == dtype
    out.backward(torch.randn_like(out))
    assert weight.grad.dtype == torch.float32 and x.grad.dtype == dtype
    _check_against_references(kind, x, weight, bias)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_layer_norm_without_bias_and_non_contiguous_input(kind, device, triton_backend):
    base = torch.randn(113, 6, device=device)
    x = base.t().requires_grad_()  # (6, 113) with column stride 6
    weight = torch.randn(113, device=device, requires_grad=True)
    _check_against_references(kind, x, weight, None)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_large_mean_keeps_precision(kind, device, triton_backend):
    """Rows whose mean dwarfs their spread: a one-pass E[x^2] - E[x]^2 would lose every digit."""
    x = (1000 + torch.randn(4, 20000, device=device)).requires_grad_()
    weight = torch.randn(20000, device=device, requires_grad=True)
    _check_against_references(kind, x, weight, torch.randn(20000, device=device, requires_grad=True))


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows,hidden", [(67, 1000), (9, 20000)])
def test_weight_gradients_are_bitwise_deterministic(kind, rows, hidden, device, triton_backend):
    """Several programs each reduce their own rows: the sum over programs is in a fixed order."""
    x, weight, bias = _inputs((rows,), hidden, torch.bfloat16, torch.float32, device)
    bias = bias if kind == "layer_norm" else None
    dy = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    runs = [_grads(_ours(kind, x, weight, bias), [x, weight, bias], dy) for _ in range(3)]
    for later in runs[1:]:
        for first, again in zip(runs[0], later):
            assert torch.equal(first, again)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_empty_batch(kind, device, triton_backend):
    x, weight, bias = _inputs((0,), 16, torch.float32, torch.float32, device)
    out = _ours(kind, x, weight, bias if kind == "layer_norm" else None)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_bytes_layer_norm(dtype, device, triton_backend):
    x, weight, bias = _inputs((3, 37), 1000, dtype, torch.float32, device)
    with saved_memory(exclude=[weight, bias]) as meter:
        fused_remat.layer_norm(x, weight, bias)
    rows = 3 * 37
    assert meter.bytes == x.numel() * x.element_size() + 2 * 4 * rows, meter.report()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_bytes_rms_norm(dtype, device, triton_backend):
    x, weight, _ = _inputs((3, 37), 1000, dtype, dtype, device)
    with saved_memory(exclude=[weight]) as meter:
        fused_remat.rms_norm(x, weight)
    assert meter.bytes == x.numel() * x.element_size() + 4 * 3 * 37, meter.report()


def test_saved_bytes_leave_out_parameters(device, triton_backend):
    norm = torch.nn.LayerNorm(64, device=device)
    x = torch.randn(5, 64, device=device, requires_grad=True)
    with saved_memory() as meter:
        fused_remat.layer_norm(x, norm.weight, norm.bias)
    assert meter.bytes == x.numel() * 4 + 8 * 5
    assert meter.excluded_count == 1  # the weight; the bias is not needed by backward


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(7, device=d)), ValueError, "weight must have shape"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(8, device=d), torch.randn(3, device=d)), ValueError, "bias must have shape"),
        (lambda d: (torch.ones(4, 8, dtype=torch.int32, device=d), torch.randn(8, device=d)), TypeError, "x must be a floating-point"),
        (lambda d: (torch.randn(4, 8, dtype=torch.float64, device=d), torch.randn(8, device=d)), TypeError, "x has dtype torch.float64"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(8, device="meta")), ValueError, "weight is on meta"),
        (lambda d: (torch.randn(4, 0, device=d), torch.randn(0, device=d)), ValueError, "last dim"),
        (lambda d: (torch.randn(2, 65537, device=d), torch.randn(65537, device=d)), ValueError, "last dim"),
        (lambda d: (torch.tensor(1.0, device=d), torch.randn(1, device=d)), ValueError, "scalar"),
        (lambda d: ([1.0, 2.0], torch.randn(2, device=d)), TypeError, "x must be a torch.Tensor"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(8, device=d), torch.randn(8, device=d, dtype=torch.float16)), TypeError, "bias has dtype"),
    ],
)
def test_layer_norm_rejects_bad_input(make_args, error, match, device):
    with pytest.raises(error, match=match):
        fused_remat.layer_norm(*make_args(device))


def test_rms_norm_rejects_bad_eps(device):
    with pytest.raises(ValueError, match="eps"):
        fused_remat.rms_norm(torch.randn(2, 4, device=device), torch.randn(4, device=device), eps=-1.0)


# The block's fused entry points: residual add + norm in one forward pass; norm backward that adds the
# residual stream's gradient and rebuilds the normalized output for the next linear's weight gradient.
FUSED_CASES = [((3,), 113), ((17,), 64), ((2,), 20000)]  # the last one streams its rows


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("leading,hidden", FUSED_CASES, ids=[f"{l}x{h}" for l, h in FUSED_CASES])
def test_fused_residual_norm_matches_references(rms, dtype, leading, hidden, device):
    from fused_remat.kernels.norm import norm_bwd, norm_fwd

    x, weight, bias = _inputs(leading, hidden, dtype, torch.float32, device)
    bias = None if rms else bias
    x, weight = x.detach(), weight.detach()
    residual = torch.randn_like(x)
    dy = torch.randn_like(x)
    residual_grad = torch.randn_like(x)
    kind = "rms_norm" if rms else "layer_norm"

    y, mean, rstd, h = norm_fwd(x, weight, bias, residual, 1e-6 if rms else 1e-5, rms)
    dx, dw, db, rebuilt = norm_bwd(
        dy, h, weight, bias, mean, rstd, residual_grad, rms, has_bias=bias is not None, rebuild_output=True,
    )
    assert torch.equal(rebuilt, y), "backward must rebuild exactly the forward's output"

    def pipeline(x, residual, weight, bias, norm):
        h = x + residual
        return h, norm(kind, h, weight, bias)

    leaves = [x, residual, weight, bias]
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in leaves]
    h64, y64 = pipeline(*leaves64, lambda kind, h, w, b: _reference64(kind, h, w, b))
    leaves_same = [t.clone().requires_grad_() if t is not None else None for t in leaves]
    h_same, y_same = pipeline(*leaves_same, _torch_norm)

    assert_error_rule("h", h, h_same, h64, dtype)
    assert_error_rule("y", y, y_same, y64, dtype)
    # dx of the whole pipeline: through the norm plus the residual stream's own gradient.
    grads64 = torch.autograd.grad([y64, h64], [t for t in leaves64 if t is not None], [dy.double(), residual_grad.double()])
    grads_same = torch.autograd.grad([y_same, h_same], [t for t in leaves_same if t is not None], [dy, residual_grad])
    ours = [dx, dw] + ([db] if bias is not None else [])
    for name, got, same, ref in zip(["dx", "dweight", "dbias"], ours, [grads_same[0]] + list(grads_same[2:]), [grads64[0]] + list(grads64[2:])):
        assert_error_rule(f"{kind} {name}", got, same, ref, dtype)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_norm_output_dtype_differs_from_input(rms, device):
    """fp32 residual stream under autocast: the norm reads fp32 and writes the bf16 matmul input."""
    from fused_remat.kernels.norm import norm_bwd, norm_fwd

    x = torch.randn(5, 96, device=device) * 3
    weight = torch.randn(96, device=device)
    y, mean, rstd, _ = norm_fwd(x, weight, None, None, 1e-5, rms, out_dtype=torch.bfloat16)
    expected = (reference.rms_norm(x, weight) if rms else reference.layer_norm(x, weight)).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, rtol=2**-8, atol=0)  # within one bf16 rounding
    dx, _, _, rebuilt = norm_bwd(torch.randn_like(y), x, weight, None, mean, rstd, None, rms, has_bias=False,
                                 rebuild_output=True, out_dtype=torch.bfloat16)
    assert dx.dtype == torch.float32 and torch.equal(rebuilt, y)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("eps", [0, 0.0, -1.0, float("inf"), float("nan"), True, "1e-5", None], ids=repr)
def test_norms_reject_eps_that_is_not_finite_and_positive(op, eps, device):
    x, weight = torch.ones(2, 4, device=device), torch.ones(4, device=device)  # constant rows: eps=0 gives NaN
    with pytest.raises(ValueError, match=rf"^{op}: eps must be a finite number > 0, got {re.escape(repr(eps))}$"):
        getattr(fused_remat, op)(x, weight, eps=eps)
