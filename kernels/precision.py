"""Rounding that is the same in compiled Triton and in Triton's interpreter."""

import os

import triton
import triton.language as tl

# Read once, like triton itself reads it: kernels are compiled or interpreted for the whole process.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


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
