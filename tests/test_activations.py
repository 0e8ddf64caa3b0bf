"""gelu and swiglu against a float64 reference and plain PyTorch in the same dtype."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import fused_remat
import fused_remat.kernels.activations as kernel_module
from fused_remat.kernels.activations import gelu_bwd, gelu_fwd, swiglu_bwd, swiglu_fwd
from fused_remat.memory import saved_memory
from numerics import assert_error_rule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (3,), (113,), (1000,), (7, 4095), (2, 3, 5120)]
# (rows, cols) of the strided views: odd sizes, masked row tiles, and (1500) two column tiles.
VIEW_SHAPES = [(3, 113), (17, 1000), (5, 1500)]


def _spread(shape, dtype, device):
    """Values across the interesting range of the activations, tails included."""
    return (torch.randn(*shape, device=device) * 3).to(dtype).requires_grad_()


def _assert_matches_references(op, function, inputs, dy, ours, names, dtype):
    """``ours`` (output, then the gradient of each input for ``dy``) against ``function`` in float64
    and in plain PyTorch in ``dtype``, under the error rule."""
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = function(*inputs64)
    inputs_same = [t.detach().clone().requires_grad_() for t in inputs]
    same = function(*inputs_same)
    references = [ref, *torch.autograd.grad(ref, inputs64, dy.double())]
    plain = [same, *torch.autograd.grad(same, inputs_same, dy)]
    for name, value, value_same, value64 in zip(names, ours, plain, references, strict=True):
        assert value.dtype == dtype, f"{op} {name}: dtype {value.dtype}"
        assert_error_rule(f"{op} {name}", value, value_same, value64, dtype)


def _swiglu_reference(gate, up):
    return F.silu(gate) * up


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_matches_references(approximate, dtype, shape, device, triton_backend):
    x = _spread(shape, dtype, device)
    ours = fused_remat.gelu(x, approximate)
    dy = torch.randn_like(ours)
    (dx,) = torch.autograd.grad(ours, x, dy)
    gelu = functools.partial(F.gelu, approximate=approximate)
    _assert_matches_references("gelu", gelu, [x], dy, [ours, dx], ["y", "dx"], dtype)


def test_tanh_gelu_keeps_its_relative_accuracy_on_the_negative_tail(device, triton_backend):
    """Where gelu(x) is tiny (x from -6 to -3) the output and gradient stay accurate relative to
    their own size: 1 + tanh(z) cancels there (in fp32 enough to move an fp16 output by more than
    an ulp, and to 0 at x = -6), sigmoid(2z) formed from exp(-2|z|) does not. The
    bound leaves room for exp's own condition: fp32's z, off by a few ulps, moves exp(2z) by
    |2z| (up to 25) times as much."""
    x = (-3.0 - 3.0 * torch.rand(4096, device=device)).double()  # fp32 inputs, exactly
    dy = torch.randn_like(x)
    x64 = x.clone().requires_grad_()
    # tanh gelu as x sigmoid(2z): F.gelu's own float64 form cancels too, to 0 below x = -6
    ref = x64 * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3))
    (ref_dx,) = torch.autograd.grad(ref, x64, dy)
    x32 = x.float().requires_grad_()
    ours = fused_remat.gelu(x32, "tanh")
    (dx,) = torch.autograd.grad(ours, x32, dy.float())
    for name, got, want in (("y", ours, ref), ("dx", dx, ref_dx)):
        relative = ((got.double() - want) / want).abs().max().item()
        assert relative < 2e-5, f"gelu tanh {name}: relative error {relative:.2e} on the negative tail"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_matches_references(dtype, shape, device, triton_backend):
    gate, up = _spread(shape, dtype, device), _spread(shape, dtype, device)
    ours = fused_remat.swiglu(gate, up)
    dy = torch.randn_like(ours)
    dgate, dup = torch.autograd.grad(ours, (gate, up), dy)
    _assert_matches_references("swiglu", _swiglu_reference, [gate, up], dy, [ours, dgate, dup], ["y", "dgate", "dup"], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_backward_rebuilds_output_in_the_same_pass(dtype, device):
    gate, up = (torch.randn(5, 333, device=device).to(dtype) for _ in range(2))
    dy = torch.randn(5, 333, device=device).to(dtype)
    dgate, dup, rebuilt = swiglu_bwd(dy, gate, up, rebuild_output=True)
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


def _padded(rows, cols, dtype, device, pad=7):
    """A (rows, cols) view of a wider tensor: row stride cols + pad, values of _spread."""
    return _spread((rows, cols + pad), dtype, device).detach()[:, pad // 2 : pad // 2 + cols]


def _halves(rows, cols, dtype, device):
    """gate and up as the two column halves of one (rows, 2 cols) fc1 output."""
    both = _spread((rows, 2 * cols), dtype, device).detach()
    return both[:, :cols], both[:, cols:]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", VIEW_SHAPES, ids=str)
def test_gelu_on_row_strided_views(approximate, dtype, shape, device):
    x, dy = _padded(*shape, dtype, device), _padded(*shape, dtype, device, pad=12)
    y = gelu_fwd(x, approximate)
    dx, rebuilt = gelu_bwd(dy, x, approximate, rebuild_output=True)
    assert y.is_contiguous() and dx.is_contiguous() and y.shape == dx.shape == shape
    gelu = functools.partial(F.gelu, approximate=approximate)
    _assert_matches_references("gelu", gelu, [x], dy, [y, dx], ["y", "dx"], dtype)
    assert torch.equal(rebuilt, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", VIEW_SHAPES, ids=str)
def test_swiglu_on_column_halves(dtype, shape, device):
    rows, cols = shape
    gate, up = _halves(rows, cols, dtype, device)
    dy = _padded(rows, cols, dtype, device)
    grads = torch.full((rows, 2 * cols), float("nan"), dtype=dtype, device=device)
    y = swiglu_fwd(gate, up)
    dgate, dup, rebuilt = swiglu_bwd(dy, gate, up, rebuild_output=True, dgate=grads[:, :cols], dup=grads[:, cols:])
    assert dgate.data_ptr() == grads.data_ptr() and dup.data_ptr() == grads[:, cols:].data_ptr()
    assert dgate.stride() == dup.stride() == (2 * cols, 1)
    assert not grads.isnan().any(), "every element of the preallocated gradient buffer is written"
    _assert_matches_references("swiglu", _swiglu_reference, [gate, up], dy, [y, dgate, dup], ["y", "dgate", "dup"], dtype)
    assert torch.equal(rebuilt, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", VIEW_SHAPES, ids=str)
def test_backward_writes_over_its_inputs(dtype, shape, device):
    """The block's backward writes over buffers it is done with (dx over dy, the rebuilt output
    over x or dy, dgate and dup over gate and up): bitwise what separate outputs get."""
    rows, cols = shape
    x, dy = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
    expected = gelu_bwd(dy, x, "tanh", rebuild_output=True)
    x_buffer, dy_buffer = x.clone(), dy.clone()
    dx, y = gelu_bwd(dy_buffer, x_buffer, "tanh", rebuild_output=True, dx=dy_buffer, y=x_buffer)
    assert dx.data_ptr() == dy_buffer.data_ptr() and y.data_ptr() == x_buffer.data_ptr()
    assert torch.equal(dx, expected[0]) and torch.equal(y, expected[1])

    u = torch.randn(rows, 2 * cols, device=device).to(dtype)
    expected = swiglu_bwd(dy, u[:, :cols], u[:, cols:], rebuild_output=True)
    u_buffer, dy_buffer = u.clone(), dy.clone()
    gate, up = u_buffer[:, :cols], u_buffer[:, cols:]
    dgate, dup, y = swiglu_bwd(dy_buffer, gate, up, rebuild_output=True, dgate=gate, dup=up, y=dy_buffer)
    assert dgate.data_ptr() == u_buffer.data_ptr() and y.data_ptr() == dy_buffer.data_ptr()
    assert all(torch.equal(ours, theirs) for ours, theirs in zip((dgate, dup, y), expected))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_backward_rebuilds_output_in_the_same_pass(approximate, dtype, device):
    x = _spread((2, 3, 333), dtype, device).detach()
    dy = torch.randn_like(x)
    dx, rebuilt = gelu_bwd(dy, x, approximate, rebuild_output=True)
    assert torch.equal(rebuilt, gelu_fwd(x, approximate))
    plain_dx, nothing = gelu_bwd(dy, x, approximate)
    assert nothing is None and torch.equal(plain_dx, dx)


class _LaunchSpy:
    """Stands in for a kept kernel: records the arguments of every launch, a signature's first
    (``bind``) and its planned ones, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.compiled = kernel, [], kernel.compiled

    def bind(self, grid, tensors, tail, **kwargs):
        self.launches.append((*tensors, *tail))
        bound = self.kernel.bind(grid, tensors, tail, **kwargs)

        def launch(*given):
            self.launches.append((*given, *tail))
            bound(*given)

        return launch


@pytest.fixture
def spies(monkeypatch):
    found = {name: _LaunchSpy(getattr(kernel_module, name)) for name in ("_GELU", "_SWIGLU")}
    for name, spy in found.items():
        monkeypatch.setattr(kernel_module, name, spy)
    return found


def test_strided_inputs_reach_the_kernel_uncopied(spies, device):
    rows, cols = 5, 37
    gate, up = _halves(rows, cols, torch.float16, device)
    dy = _padded(rows, cols, torch.float16, device)
    grads = torch.empty(rows, 2 * cols, dtype=torch.float16, device=device)
    dgate, dup, _ = swiglu_bwd(dy, gate, up, dgate=grads[:, :cols], dup=grads[:, cols:])
    (args,) = spies["_SWIGLU"].launches
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert [t.data_ptr() for t in tensors[:5]] == [t.data_ptr() for t in (gate, up, dy, dgate, dup)]
    assert (rows, cols, 2 * cols, 2 * cols, dy.stride(0), 2 * cols, 2 * cols) == args[6:13]

    x = _padded(rows, cols, torch.float32, device)
    gelu_bwd(dy, x)
    (args,) = spies["_GELU"].launches
    assert (args[0].data_ptr(), args[1].data_ptr()) == (x.data_ptr(), dy.data_ptr())

    # A layout the kernel cannot take (column stride 2) is copied into rows, and still right.
    spies["_GELU"].launches.clear()
    x_t = torch.randn(cols, rows, device=device).t()
    assert torch.equal(gelu_fwd(x_t), gelu_fwd(x_t.contiguous()))
    assert spies["_GELU"].launches[0][0].data_ptr() != x_t.data_ptr()


def test_in_place_calls_are_kept_and_write_the_tensors_given(spies, device):
    """A call that writes into given outputs (the block's backward: dx over dy, the rebuilt output
    into u's memory, [dgate | dup] into one buffer) is kept per signature like one with new
    outputs: its next calls launch on the very tensors given and give the first call's bits."""
    rows, cols = 5, 37

    def gelu_in_place():
        x, dy = (torch.randn(rows, cols, device=device) for _ in range(2))
        expected_dx, expected_y = gelu_bwd(dy, x, "tanh", rebuild_output=True)
        dx, y = gelu_bwd(dy, x, "tanh", rebuild_output=True, dx=dy, y=x)
        assert dx is dy and y is x and torch.equal(dx, expected_dx) and torch.equal(y, expected_y)
        return spies["_GELU"].launches[-1][:4], (x, dy, dy, x)

    def swiglu_in_place():
        u, dy = torch.randn(rows, 2 * cols, device=device), torch.randn(rows, cols, device=device)
        gate, up = u[:, :cols], u[:, cols:]
        expected = swiglu_bwd(dy, gate, up, rebuild_output=True)
        du = torch.empty_like(u)
        dgate, dup, y = swiglu_bwd(dy, gate, up, rebuild_output=True, dgate=du[:, :cols], dup=du[:, cols:], y=dy)
        assert y is dy and all(torch.equal(a, b) for a, b in zip((dgate, dup, y), expected))
        return spies["_SWIGLU"].launches[-1][:6], (gate, up, dy, dgate, dup, dy)

    for check, kept in ((gelu_in_place, ("gelu_bwd", "tanh", True, True)), (swiglu_in_place, ("swiglu_bwd", True, True, True))):
        for _ in range(3):  # the signature's first call, then kept ones
            launched, given = check()
            assert [t.data_ptr() for t in launched] == [t.data_ptr() for t in given]
        assert kept in {key[0] for key in kernel_module._CALLS._plans}, f"{kept[0]} with given outputs was not kept"


def test_any_shape_comes_back_contiguous_in_that_shape(device):
    x = torch.randn(4, 3, 6, device=device).permute(2, 0, 1)
    dy = torch.randn(6, 4, 3, device=device)
    dx, y = gelu_bwd(dy, x, rebuild_output=True)
    assert dx.shape == y.shape == x.shape and dx.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, gelu_fwd(x.contiguous()))
    scalar = torch.tensor(1.5, device=device)
    assert gelu_fwd(scalar).shape == () and torch.allclose(gelu_fwd(scalar), F.gelu(scalar))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0,)], ids=str)
def test_empty_inputs_launch_nothing(shape, spies, device):
    x = torch.randn(shape, device=device)
    dx, y = gelu_bwd(x, x, rebuild_output=True)
    dgate, dup, y2 = swiglu_bwd(x, x, x, rebuild_output=True)
    given = torch.empty(shape, device=device)
    assert swiglu_bwd(x, x, x, dgate=given)[0] is given
    assert all(t.shape == shape for t in (gelu_fwd(x), dx, y, swiglu_fwd(x, x), dgate, dup, y2))
    assert not spies["_GELU"].launches and not spies["_SWIGLU"].launches


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda a, b, buf: gelu_bwd(b, a), ValueError, r"gelu_bwd: dy has shape \(3, 6\) but x has \(3, 5\)"),
        (lambda a, b, buf: swiglu_fwd(a, b), ValueError, "swiglu_fwd: up has shape"),
        (lambda a, b, buf: swiglu_bwd(b, a, a), ValueError, "swiglu_bwd: dy has shape"),
        (lambda a, b, buf: swiglu_bwd(a, a, a, dgate=buf[:, :6]), ValueError, "swiglu_bwd: dgate has shape"),
        (lambda a, b, buf: swiglu_bwd(a, a, a, dup=buf[:, ::2]), ValueError, "dup must be writable in place"),
        (lambda a, b, buf: swiglu_bwd(a, a, a, dup=a[:1].expand(3, 5)), ValueError, "dup must be writable in place"),
        (lambda a, b, buf: swiglu_bwd(a, a, a, dgate=buf[:, :5].half()), TypeError, "dgate has dtype"),
        (lambda a, b, buf: gelu_fwd(a, approximate="erf"), ValueError, "approximate"),
        (lambda a, b, buf: gelu_bwd(a, a, dx=b), ValueError, r"gelu_bwd: dx has shape \(3, 6\) but x has \(3, 5\)"),
        (lambda a, b, buf: gelu_bwd(a, a, rebuild_output=True, y=buf[:, :5].half()), TypeError,
         "gelu_bwd: y has dtype torch.float16 but x has"),
        (lambda a, b, buf: swiglu_bwd(a, a, a, rebuild_output=True, y=buf[:, ::2]), ValueError,
         "y must be writable in place"),
    ],
)
def test_launchers_reject_mismatched_arguments(call, error, match, device):
    a, b = torch.randn(3, 5, device=device), torch.randn(3, 6, device=device)
    buf = torch.empty(3, 10, device=device)
    with pytest.raises(error, match=match):
        call(a, b, buf)


@pytest.mark.gpu
def test_row_offsets_past_2_to_the_31(device):
    # Row 1 starts 2**31 elements in: int32 offsets would wrap around and read or write elsewhere.
    big = torch.zeros(2, 2**31 + 64, dtype=torch.float16, device=device)
    x = big[:, :256]
    x.normal_()
    dx, y = gelu_bwd(x, x, rebuild_output=True)
    ref = F.gelu(x.float())
    assert torch.allclose(y.float(), ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(y, gelu_fwd(x))
