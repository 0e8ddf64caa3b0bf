"""What the op library must know about the kernels before it launches one, without importing triton.

``fused_remat`` validates arguments and picks a backend from these: the limits, whether Triton
interprets, and the argument checks (every error names the op and the argument). Importing this
module must not import triton, so that ``TRITON_INTERPRET=1`` set after ``import fused_remat`` still
takes effect.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

MAX_HEAD_DIM = 256  # attention pads the head dim to a power of two up to this
MAX_NORM_WIDTH = 65536  # the norm kernels stream rows of up to this many columns
INTERPRET_ENV = "TRITON_INTERPRET"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what every kernel compiles for
_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter instead of compiling them.

    Triton decides this once per kernel, when ``@triton.jit`` wraps it at import, from the same
    variable; every part of the project asks here rather than reading the environment itself."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def check_tensor(op: str, name: str, value) -> torch.Tensor:
    """``value`` if it is a tensor of a supported floating dtype, else an error naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor ({_DTYPE_NAMES}), got {value.dtype}")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {value.dtype}; supported: {_DTYPE_NAMES}")
    return value


def check_same_device(op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, other in others.items():
        if other is not None and other.device != reference.device:
            raise ValueError(
                f"{op}: {name} is on {other.device} but {reference_name} is on {reference.device}; "
                "all tensors must be on one device"
            )


def check_same_dtype(op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, other in others.items():
        if other.dtype != reference.dtype:
            raise TypeError(f"{op}: {name} has dtype {other.dtype} but {reference_name} has {reference.dtype}; they must match")


def check_eps(op: str, eps) -> float:
    """``eps`` as a float if it is a finite real number > 0 (not a bool), else a ValueError naming it.

    The one check of a norm's epsilon: the norm ops, both TransformerBlock classes and ModelConfig
    call it. eps = 0 divides by zero on a constant row, and inf turns every output into zero."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or not eps > 0:
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")
    return float(eps)


def check_attention_args(op: str, q, k, v, scale=None) -> float:
    """Validate the arguments of an attention op and return the softmax scale to use.

    The one check of attention inputs: the public op and ring attention call it before their
    kernels run; the launchers in ``kernels/attention.py`` trust it (see ``attention_fwd``). q is
    (B, Hq, Nq, D) and k, v are (B, Hkv, Nk, D) tensors of one floating dtype the kernels compile for
    (SUPPORTED_DTYPES), on one device, with Hq a multiple of Hkv, D in 1..MAX_HEAD_DIM, Nq and Nk
    at least 1, and a contiguous last dim (other strides free). ``scale`` None gives 1/sqrt(D);
    otherwise a finite real number. Every error starts with ``op`` and names the argument."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        check_tensor(op, name, t)
    check_same_device(op, "q", q, k=k, v=v)
    check_same_dtype(op, "q", q, k=k, v=v)
    for name, t in tensors:
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape (B, Hkv, Nk, D)")
    batch, q_heads, q_len, head_dim = q.shape
    kv_batch, kv_heads, k_len, kv_dim = k.shape
    if kv_batch != batch:
        raise ValueError(f"{op}: batch size of k/v ({kv_batch}) does not match q ({batch})")
    if kv_dim != head_dim:
        raise ValueError(f"{op}: head dim D of k/v ({kv_dim}) does not match q ({head_dim})")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{op}: q heads Hq={q_heads} must be a multiple of the k/v heads Hkv={kv_heads} (GQA/MQA)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D={head_dim} of q, k, v must be in 1..{MAX_HEAD_DIM}")
    if q_len == 0:
        raise ValueError(f"{op}: q has no query positions (Nq=0, shape {tuple(q.shape)})")
    if k_len == 0:
        raise ValueError(f"{op}: k and v have no key positions (Nk=0, shape {tuple(k.shape)})")
    for name, t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dim (stride(-1) == 1), got strides "
                             f"{t.stride()}; other dims may have any strides")
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite real number or None, got {scale!r}")
    return float(scale)
