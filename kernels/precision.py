"""How values move between a tensor's dtype and fp32 registers, the same in compiled Triton and in
Triton's interpreter: rounding, and the row-major tile loads and stores the kernels share."""

import triton
import triton.language as tl

from .limits import triton_interpreting

# Fixed at import, as triton fixes interpretation per kernel when @triton.jit wraps it.
INTERPRETED = tl.constexpr(triton_interpreting())


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` cast to ``DTYPE`` with round-to-nearest-even.

    The GPU rounds to nearest already. The interpreter truncates fp32 -> bf16 (even when asked for
    "rtne"), a bias of up to one ulp, so there the rounding is done on the bit pattern first.
    """
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def load_tile(PTR, stride, rows, cols, mask):
    """The (rows, cols) tile of a row-major matrix with row stride ``stride``, in fp32; 0 outside
    ``mask``. Pass int64 ``rows`` so that rows * stride cannot overflow."""
    return tl.load(PTR + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(PTR, stride, rows, cols, mask, value):
    """Store an fp32 tile into PTR's dtype, rounded to nearest (see round_to)."""
    tl.store(PTR + rows[:, None] * stride + cols[None, :], round_to(value, PTR.dtype.element_ty), mask=mask)
