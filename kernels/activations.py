"""GELU (exact and tanh) and SwiGLU, forward and backward, element-wise in fp32 registers.

Backward takes the pre-activation(s) and recomputes what it needs (the CDF, the sigmoid) in
registers, so the activation output is never kept for backward. Both backwards can also write the
recomputed output (gelu(x), silu(gate) * up), which a following linear layer needs for its weight
gradient: one pass produces both, bitwise what the forward writes (forward and backward are one
kernel, so the output is computed by the very same code).

Every kernel works on 2-D (M, N) tensors with unit column stride and a row stride of their own,
so a fused block passes views without copying: gate and up may be the two column halves of one
(M, 2F) buffer, and so may the preallocated dgate and dup. Offsets are int64. The grid is 1-D
(axes 1 and 2 are limited to 65535 programs): program i takes tile (i // col_blocks, i % col_blocks)
of BLOCK_M x BLOCK_N elements.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch
import triton
import triton.language as tl

from .launch import SEPARATE_ROUNDING, KeptKernel, LaunchPlans, cdiv, launch_key, new_like, next_power_of_2
from .precision import load_tile, store_tile

MAX_BLOCK_N = 1024
TILE_ELEMENTS = 4096  # elements per program: BLOCK_M x BLOCK_N, fewer only for small tensors

GELU_APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _gelu_and_derivative(x, APPROXIMATE_TANH: tl.constexpr):
    """gelu(x) and d gelu / dx for fp32 x."""
    if APPROXIMATE_TANH:
        # 0.5 (1 + tanh(z)) is sigmoid(2 z): formed from e = exp(-2|z|) <= 1 as 1 / (1 + e) or
        # e / (1 + e), never as 1 + tanh, which cancels for negative x (a tiny difference of two
        # numbers near 1 keeps few correct bits in fp32; docs/tuning.md has the case). Likewise
        # sigmoid's complement for the derivative's 1 - tanh^2 = 4 sigmoid (1 - sigmoid).
        sqrt_2_over_pi = 0.7978845608028654
        inner = sqrt_2_over_pi * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(inner))
        r = 1.0 / (1.0 + e)
        upper = tl.where(inner >= 0, r, e * r)
        lower = tl.where(inner >= 0, e * r, r)
        value = x * upper
        derivative = upper + 2.0 * x * upper * lower * sqrt_2_over_pi * (1.0 + 3.0 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        value = x * cdf
        derivative = cdf + x * pdf
    return value, derivative


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 row and column indices of this program's tile, and the in-bounds mask."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    rows = (pid // col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows, cols, mask


@triton.jit
def _gelu(
    X, DY, DX, Y, M, N, stride_x, stride_dy, stride_dx, stride_y,
    APPROXIMATE_TANH: tl.constexpr, BACKWARD: tl.constexpr, REBUILD_OUTPUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward: y = gelu(x). Backward: dx = dy * gelu'(x), and y too when REBUILD_OUTPUT."""
    rows, cols, mask = _tile(M, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    x = load_tile(X, stride_x, rows, cols, mask)
    y, derivative = _gelu_and_derivative(x, APPROXIMATE_TANH=APPROXIMATE_TANH)
    if BACKWARD:
        dy = load_tile(DY, stride_dy, rows, cols, mask)
        store_tile(DX, stride_dx, rows, cols, mask, dy * derivative)
    if not BACKWARD or REBUILD_OUTPUT:
        store_tile(Y, stride_y, rows, cols, mask, y)


@triton.jit
def _swiglu(
    GATE, UP, DY, DGATE, DUP, Y, M, N, stride_gate, stride_up, stride_dy, stride_dgate, stride_dup, stride_y,
    BACKWARD: tl.constexpr, REBUILD_OUTPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """y = silu(g) u; d/dgate = u * s * (1 + g (1 - s)) with s = sigmoid(g); d/dup = silu(g).
    Forward: y. Backward: the gradients, and y too when REBUILD_OUTPUT."""
    rows, cols, mask = _tile(M, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    gate = load_tile(GATE, stride_gate, rows, cols, mask)
    up = load_tile(UP, stride_up, rows, cols, mask)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if BACKWARD:
        dy = load_tile(DY, stride_dy, rows, cols, mask)
        store_tile(DGATE, stride_dgate, rows, cols, mask, dy * up * sig * (1.0 + gate * (1.0 - sig)))
        store_tile(DUP, stride_dup, rows, cols, mask, dy * silu)
    if not BACKWARD or REBUILD_OUTPUT:
        store_tile(Y, stride_y, rows, cols, mask, silu * up)


_GELU, _SWIGLU = KeptKernel(_gelu), KeptKernel(_swiglu)


@functools.lru_cache(maxsize=4096)  # asked at every launch, the same few shapes over and over
def _tiling(rows: int, cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs) for an (rows, cols) tensor: ~TILE_ELEMENTS a program."""
    block_n = min(next_power_of_2(cols), MAX_BLOCK_N)
    block_m = min(max(1, TILE_ELEMENTS // block_n), next_power_of_2(rows))
    num_warps = max(1, min(8, block_m * block_n // 512))
    return block_m, block_n, num_warps, cdiv(rows, block_m) * cdiv(cols, block_n)


# The launches bound per call signature (kernels.launch.LaunchPlans), and the launchers' whole calls
# (_Call) per signature of their inputs
_PLANS, _CALLS = LaunchPlans(), LaunchPlans()


def _launch(kernel, tensors: list[torch.Tensor], **constexprs):
    """Run ``kernel`` over 2-D views of one shape: all pointers, then M and N, then each row stride.
    Returns the bound launch (None where it is not kept)."""
    key = (kernel, launch_key(kernel.compiled, tensors), *constexprs.items())
    launch = _PLANS.get(key)
    if launch is not None:
        launch(*tensors)
        return launch
    rows, cols = tensors[0].shape
    block_m, block_n, num_warps, programs = _tiling(rows, cols)
    launch = kernel.bind(
        (programs,), tuple(tensors), (rows, cols, *[t.stride(0) for t in tensors]),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **constexprs, **SEPARATE_ROUNDING,
    )
    if launch is not None:
        _PLANS.keep(key, launch)
    return launch


class _Call:
    """A launcher's call for one signature of its inputs, where every input was a view of rows (no
    copy) and every output new or given: later calls allocate the new outputs like the first input
    and hand the bound launch each tensor as a (rows, cols) view, in the launch's order of inputs and
    outputs. Outputs given to the call (written in place) come among ``inputs``, new ones after."""

    __slots__ = ("launch", "outputs", "pick", "rows")

    def __init__(self, launch, outputs: int, order: tuple[int, ...], rows: torch.Size):
        self.launch, self.outputs, self.pick, self.rows = launch, outputs, operator.itemgetter(*order), rows

    def __call__(self, inputs: tuple) -> tuple:
        first = inputs[0]
        outputs = (new_like(first),) if self.outputs == 1 else tuple([new_like(first) for _ in range(self.outputs)])
        tensors = self.pick((*inputs, *outputs))
        if first.dim() != 2:  # views only where the shape changes: each costs host time
            tensors = map(torch.Tensor.view, tensors, itertools.repeat(self.rows))
        self.launch(*tensors)
        return outputs


def _keep_call(key: tuple, launch, inputs: tuple, rows: list[torch.Tensor], outputs: int,
               order: tuple[int, ...]) -> None:
    """Keeps the call just made under ``key`` where its inputs needed no copy (``rows``: the views
    it launched on) and its launch was kept."""
    if launch is not None and all(r.data_ptr() == t.data_ptr() for r, t in zip(rows, inputs)):
        _CALLS.keep(key, _Call(launch, outputs, order, rows[0].shape))


def _output_slots(given: int, written: tuple[bool, ...]) -> list[int]:
    """Where each output of a call comes from among ``_Call``'s tensors (its inputs, the outputs
    given to it, then the new ones): ``written[i]`` says whether output i was given (written in
    place) or is new. ``given``: how many tensors the call was given, inputs and outputs."""
    slots, next_given, next_new = [], given - sum(written), given
    for was_given in written:
        slots.append(next_given if was_given else next_new)
        next_given, next_new = next_given + was_given, next_new + (not was_given)
    return slots


def _unit_column_stride(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.size(1) <= 1)


def _input_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view with unit column stride as is; anything else as (-1, last dim), copied only if it must be."""
    if _unit_column_stride(t):
        return t
    t = t.reshape(-1, t.shape[-1] if t.dim() else 1)
    return t if _unit_column_stride(t) else t.contiguous()


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """t as (-1, last dim) without copying, or None where no such view exists."""
    try:
        return t.view(-1, t.shape[-1] if t.dim() else 1)
    except RuntimeError:
        return None


def _output(op: str, name: str, out: torch.Tensor | None, like: torch.Tensor,
            like_name: str = "gate") -> tuple[torch.Tensor, torch.Tensor]:
    """(what to return, its 2-D view for the kernel): a new contiguous tensor shaped like ``like``
    (the input named ``like_name``), or the caller's ``out``, which the kernel must be able to write
    in place. Each element is read before it is written, so ``out`` may be one of the inputs."""
    if out is None:
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        return out, (out if out.dim() == 2 or not out.numel() else out.view(-1, out.shape[-1] if out.dim() else 1))
    _check_shapes(op, like_name, like, **{name: out})
    if out.dtype != like.dtype:
        raise TypeError(f"{op}: {name} has dtype {out.dtype} but {like_name} has {like.dtype}; they must match")
    if out.device != like.device:
        raise ValueError(f"{op}: {name} is on {out.device} but {like_name} is on {like.device}")
    if not out.numel():
        return out, out
    rows = out if out.dim() == 2 else _rows_view(out)
    if rows is None or not _unit_column_stride(rows) or (rows.size(0) > 1 and rows.stride(0) < rows.size(1)):
        raise ValueError(
            f"{op}: {name} must be writable in place as non-overlapping rows with unit column stride, "
            f"got shape {tuple(out.shape)} strides {out.stride()}"
        )
    return out, rows


def _check_shapes(op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.shape != reference.shape:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)} but {reference_name} has {tuple(reference.shape)}; they must match"
            )


def _check_approximation(approximate: str) -> bool:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return approximate == "tanh"


def gelu_fwd(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """y = gelu(x) in x's dtype, computed in fp32; y is contiguous, in x's shape."""
    key = (("gelu_fwd", approximate), launch_key(_GELU.compiled, (x,)))
    call = _CALLS.get(key)
    if call is not None:
        return call((x,))[0]
    tanh = _check_approximation(approximate)
    y, y_rows = _output("gelu_fwd", "y", None, x)
    if x.numel():
        x_rows = _input_rows(x)
        launch = _launch(_GELU, [x_rows, x_rows, y_rows, y_rows], APPROXIMATE_TANH=tanh, BACKWARD=False,
                         REBUILD_OUTPUT=False)
        _keep_call(key, launch, (x,), [x_rows], 1, (0, 0, 1, 1))
    return y


def gelu_bwd(
    dy: torch.Tensor, x: torch.Tensor, approximate: str = "none", rebuild_output: bool = False, *,
    dx: torch.Tensor | None = None, y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, y): dx = dy * gelu'(x), recomputing gelu' from x; with ``rebuild_output`` the same pass also
    writes y = gelu(x), bitwise what gelu_fwd gives (else None). Outputs contiguous, in x's shape,
    unless ``dx`` / ``y`` are given: then written in place and returned (dy itself, x itself or
    any tensor of x's shape and dtype writable as rows with unit column stride)."""
    if not rebuild_output:
        y = None
    written = (dx is not None, y is not None) if rebuild_output else (dx is not None,)  # each output: given or new
    given = (x, dy) if dx is None and y is None else (x, dy, *[out for out in (dx, y) if out is not None])
    key = (("gelu_bwd", approximate, *written), launch_key(_GELU.compiled, given))
    call = _CALLS.get(key)
    if call is not None:
        new = iter(call(given))
        dx = next(new) if dx is None else dx
        return dx, (next(new) if y is None else y) if rebuild_output else None
    tanh = _check_approximation(approximate)
    _check_shapes("gelu_bwd", "x", x, dy=dy)
    dx, dx_rows = _output("gelu_bwd", "dx", dx, x, "x")
    y, y_rows = _output("gelu_bwd", "y", y, x, "x") if rebuild_output else (None, dx_rows)
    if x.numel():
        rows = [_input_rows(x), _input_rows(dy)]
        launch = _launch(_GELU, [*rows, dx_rows, y_rows], APPROXIMATE_TANH=tanh, BACKWARD=True,
                         REBUILD_OUTPUT=rebuild_output)
        dx_slot, *y_slot = _output_slots(len(given), written)
        _keep_call(key, launch, given, rows, len(written) - sum(written), (0, 1, dx_slot, *(y_slot or [dx_slot])))
    return dx, y


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = silu(gate) * up in gate's dtype; gate and up of one shape; y contiguous, in that shape."""
    key = (("swiglu_fwd",), launch_key(_SWIGLU.compiled, (gate, up)))
    call = _CALLS.get(key)
    if call is not None:
        return call((gate, up))[0]
    _check_shapes("swiglu_fwd", "gate", gate, up=up)
    y, y_rows = _output("swiglu_fwd", "y", None, gate)
    if gate.numel():
        gate_rows, up_rows = _input_rows(gate), _input_rows(up)
        launch = _launch(_SWIGLU, [gate_rows, up_rows, gate_rows, y_rows, y_rows, y_rows], BACKWARD=False,
                         REBUILD_OUTPUT=False)
        _keep_call(key, launch, (gate, up), [gate_rows, up_rows], 1, (0, 1, 0, 2, 2, 2))
    return y


def swiglu_bwd(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    rebuild_output: bool = False,
    *,
    dgate: torch.Tensor | None = None,
    dup: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dgate, dup, y): the gradients, plus the recomputed y = silu(gate) * up when ``rebuild_output``
    (else None), bitwise what swiglu_fwd gives.

    ``dgate`` / ``dup`` / ``y``, when given, are written in place and returned: gate's shape and
    dtype, rows with unit column stride and any row stride (e.g. the two column halves of one
    (M, 2F) gradient buffer), and they may be the inputs themselves (gate, up, dy). Otherwise they
    are new contiguous tensors in gate's shape.
    """
    if not rebuild_output:
        y = None
    written = (dgate is not None, dup is not None, *((y is not None,) if rebuild_output else ()))
    given = (gate, up, dy) if dgate is None and dup is None and y is None else (
        gate, up, dy, *[out for out in (dgate, dup, y) if out is not None])
    key = (("swiglu_bwd", *written), launch_key(_SWIGLU.compiled, given))
    call = _CALLS.get(key)
    if call is not None:
        new = iter(call(given))
        dgate = next(new) if dgate is None else dgate
        dup = next(new) if dup is None else dup
        return dgate, dup, (next(new) if y is None else y) if rebuild_output else None
    _check_shapes("swiglu_bwd", "gate", gate, up=up, dy=dy)
    dgate, dgate_rows = _output("swiglu_bwd", "dgate", dgate, gate)
    dup, dup_rows = _output("swiglu_bwd", "dup", dup, gate)
    y, y_rows = _output("swiglu_bwd", "y", y, gate) if rebuild_output else (None, dgate_rows)
    if gate.numel():
        rows = [_input_rows(gate), _input_rows(up), _input_rows(dy)]
        launch = _launch(_SWIGLU, [*rows, dgate_rows, dup_rows, y_rows], BACKWARD=True, REBUILD_OUTPUT=rebuild_output)
        dgate_slot, dup_slot, *y_slot = _output_slots(len(given), written)
        _keep_call(key, launch, given, rows, len(written) - sum(written),
                   (0, 1, 2, dgate_slot, dup_slot, *(y_slot or [dgate_slot])))
    return dgate, dup, y
