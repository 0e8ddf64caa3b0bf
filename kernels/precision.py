"""Rounding that is the same in compiled Triton and in Triton's interpreter."""

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
