"""What the op library must know about the kernels before it launches one, without importing triton.

``fused_remat`` validates arguments and picks a backend from these; importing this module must
not import triton, so that ``TRITON_INTERPRET=1`` set after ``import fused_remat`` still takes effect.
"""

from __future__ import annotations

import os

MAX_HEAD_DIM = 256  # attention pads the head dim to a power of two up to this
MAX_NORM_WIDTH = 65536  # the norm kernels stream rows of up to this many columns
INTERPRET_ENV = "TRITON_INTERPRET"


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter instead of compiling them.

    Triton decides this once per kernel, when ``@triton.jit`` wraps it at import, from the same
    variable; every part of the project asks here rather than reading the environment itself."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"
