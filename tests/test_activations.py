"""gelu and swiglu against a float64 reference and plain PyTorch in the same dtype."""

import pytest
import torch
import torch.nn.functional as F

import fused_remat
from fused_remat.kernels.activations import swiglu_bwd, swiglu_fwd
from fused_remat.memory import saved_memory
from numerics import assert_error_rule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (3,), (113,), (1000,), (7, 4095), (2, 3, 5120)]


def _spread(shape, dtype, device):
    """Values across the interesting range of the activations, tails included."""
    return (torch.randn(*shape, device=device) * 3).to(dtype).requires_grad_()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_matches_references(approximate, dtype, shape, device, triton_backend):
    x = _spread(shape, dtype, device)
    ours = fused_remat.gelu(x, approximate)
    dy = torch.randn_like(ours)
    (dx,) = torch.autograd.grad(ours, x, dy)

    x64 = x.detach().double().requires_grad_()
    ref = F.gelu(x64, approximate=approximate)
    (dx64,) = torch.autograd.grad(ref, x64, dy.double())
    x_same = x.detach().clone().requires_grad_()
    same = F.gelu(x_same, approximate=approximate)
    (dx_same,) = torch.autograd.grad(same, x_same, dy)

    assert ours.dtype == dtype and dx.dtype == dtype
    assert_error_rule("gelu y", ours, same, ref, dtype)
    assert_error_rule("gelu dx", dx, dx_same, dx64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_matches_references(dtype, shape, device, triton_backend):
    gate, up = _spread(shape, dtype, device), _spread(shape, dtype, device)
    ours = fused_remat.swiglu(gate, up)
    dy = torch.randn_like(ours)
    dgate, dup = torch.autograd.grad(ours, (gate, up), dy)

    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    ref = F.silu(gate64) * up64
    dgate64, dup64 = torch.autograd.grad(ref, (gate64, up64), dy.double())
    gate_same, up_same = (t.detach().clone().requires_grad_() for t in (gate, up))
    same = F.silu(gate_same) * up_same
    dgate_same, dup_same = torch.autograd.grad(same, (gate_same, up_same), dy)

    assert_error_rule("swiglu y", ours, same, ref, dtype)
    assert_error_rule("swiglu dgate", dgate, dgate_same, dgate64, dtype)
    assert_error_rule("swiglu dup", dup, dup_same, dup64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_backward_rebuilds_output_in_the_same_pass(dtype, device):
    gate, up = (torch.randn(5, 333, device=device).to(dtype) for _ in range(2))
    dy = torch.randn(5, 333, device=device).to(dtype)
    dgate, dup, rebuilt = swiglu_bwd(dy, gate, up, return_output=True)
    assert torch.equal(rebuilt, swiglu_fwd(gate, up))
    plain_dgate, plain_dup, nothing = swiglu_bwd(dy, gate, up)
    assert nothing is None and torch.equal(plain_dgate, dgate) and torch.equal(plain_dup, dup)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_saturates_without_nan(approximate, device, triton_backend):
    x = torch.tensor([-1e4, -60.0, -20.0, 0.0, 20.0, 60.0, 1e4], device=device, requires_grad=True)
    y = fused_remat.gelu(x, approximate)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert torch.allclose(y, F.gelu(x.detach(), approximate=approximate), atol=1e-6)


def test_non_contiguous_input(device, triton_backend):
    x = torch.randn(64, 9, device=device).t().requires_grad_()
    y = fused_remat.gelu(x)
    assert y.shape == x.shape
    y.backward(torch.ones_like(y))
    assert torch.allclose(x.grad, torch.autograd.grad(F.gelu(x), x, torch.ones_like(y))[0], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_bytes(dtype, device, triton_backend):
    x = torch.randn(3, 41, 100, device=device, dtype=dtype, requires_grad=True)
    with saved_memory() as meter:
        fused_remat.gelu(x)
    assert meter.bytes == x.numel() * x.element_size(), meter.report()

    # gate and up as two halves of one fc1 output: one storage, counted once.
    fc1_out = torch.randn(3, 41, 200, device=device, dtype=dtype, requires_grad=True) * 1
    gate, up = fc1_out.chunk(2, dim=-1)
    with saved_memory() as meter:
        fused_remat.swiglu(gate, up)
    assert meter.bytes == fc1_out.numel() * fc1_out.element_size(), meter.report()

    gate, up = (torch.randn(3, 41, 100, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    with saved_memory() as meter:
        fused_remat.swiglu(gate, up)
    assert meter.bytes == 2 * gate.numel() * gate.element_size(), meter.report()


def test_empty_input(device, triton_backend):
    x = torch.randn(0, 8, device=device, requires_grad=True)
    y = fused_remat.gelu(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda d: fused_remat.gelu(torch.ones(3, dtype=torch.int64, device=d)), TypeError, "x must be a floating-point"),
        (lambda d: fused_remat.gelu(torch.randn(3, device=d), approximate="erf"), ValueError, "approximate"),
        (lambda d: fused_remat.swiglu(torch.randn(3, 4, device=d), torch.randn(3, 5, device=d)), ValueError, "up has shape"),
        (lambda d: fused_remat.swiglu(torch.randn(3, device=d), torch.randn(3, device=d, dtype=torch.float16)), TypeError, "up has dtype"),
        (lambda d: fused_remat.swiglu(torch.randn(3, device=d), torch.randn(3, device="meta")), ValueError, "up is on meta"),
        (lambda d: fused_remat.swiglu(torch.randn(3, device=d, dtype=torch.float64), torch.randn(3, device=d)), TypeError, "gate has dtype"),
    ],
)
def test_rejects_bad_input(call, error, match, device):
    with pytest.raises(error, match=match):
        call(device)
