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


def _check_qkv_tensors(op: str, q, k, v, dims: tuple[str, ...], kv_dims: tuple[str, ...]) -> None:
    """q, k, v are tensors of one supported dtype on one device, of rank len(dims), with k and v of
    one shape; ``dims`` and ``kv_dims`` name the dims of q and of k, v in the messages."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        check_tensor(op, name, t)
    check_same_device(op, "q", q, k=k, v=v)
    check_same_dtype(op, "q", q, k=k, v=v)
    for name, t in tensors:
        if t.dim() != len(dims):
            raise ValueError(f"{op}: {name} must be {len(dims)}-D ({', '.join(dims)}), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape ({', '.join(kv_dims)})")


def _check_heads_strides_scale(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale) -> float:
    """The checks both attention layouts share, heads at dim 1 and the head dim last in either:
    matching head dims, GQA head counts, the head-dim limit, a contiguous last dim, and the scale
    (returned; None gives 1/sqrt(D))."""
    q_heads, head_dim = q.shape[1], q.shape[-1]
    kv_heads, kv_dim = k.shape[1], k.shape[-1]
    if kv_dim != head_dim:
        raise ValueError(f"{op}: head dim D of k/v ({kv_dim}) does not match q ({head_dim})")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{op}: q heads Hq={q_heads} must be a multiple of the k/v heads Hkv={kv_heads} (GQA/MQA)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D={head_dim} of q, k, v must be in 1..{MAX_HEAD_DIM}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dim (stride(-1) == 1), got strides "
                             f"{t.stride()}; other dims may have any strides")
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite real number or None, got {scale!r}")
    return float(scale)


def check_attention_args(op: str, q, k, v, scale=None) -> float:
    """Validate the arguments of an attention op and return the softmax scale to use.

    The one check of attention inputs: the public op and ring attention call it before their
    kernels run; the launchers in ``kernels/attention.py`` trust it (see ``attention_fwd``). q is
    (B, Hq, Nq, D) and k, v are (B, Hkv, Nk, D) tensors of one floating dtype the kernels compile for
    (SUPPORTED_DTYPES), on one device, with Hq a multiple of Hkv, D in 1..MAX_HEAD_DIM, Nq and Nk
    at least 1, and a contiguous last dim (other strides free). ``scale`` None gives 1/sqrt(D);
    otherwise a finite real number. Every error starts with ``op`` and names the argument."""
    _check_qkv_tensors(op, q, k, v, dims=("B", "H", "N", "D"), kv_dims=("B", "Hkv", "Nk", "D"))
    batch, kv_batch = q.shape[0], k.shape[0]
    if kv_batch != batch:
        raise ValueError(f"{op}: batch size of k/v ({kv_batch}) does not match q ({batch})")
    if q.shape[2] == 0:
        raise ValueError(f"{op}: q has no query positions (Nq=0, shape {tuple(q.shape)})")
    if k.shape[2] == 0:
        raise ValueError(f"{op}: k and v have no key positions (Nk=0, shape {tuple(k.shape)})")
    return _check_heads_strides_scale(op, q, k, v, scale)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_window(op: str, window) -> tuple[int, int]:
    """``window`` as ``(left, right)`` ints if it is a pair of ints >= -1, else a ValueError naming it.
    The pair may come as FlashAttention 2's callers and tests give it: a tuple or list of ints or of
    0-dim integer tensors, or one integer tensor of two elements (``torch.randint(0, n, (2,))``), on
    the CPU (its values choose the kernel's mask, so a device tensor would cost a synchronization).

    FlashAttention 2's sliding window: query i sees key j within ``left`` positions before and
    ``right`` after its bottom-right-aligned diagonal; -1 leaves that side unbounded."""
    sides = _window_sides(window)
    if sides is None or not all(_is_int(side) and side >= -1 for side in sides):
        raise ValueError(f"{op}: window must be a pair (left, right) of ints >= -1 (-1 = unbounded), or integer "
                         f"tensors on the CPU holding them, got {window!r}")
    left, right = sides
    return int(left), int(right)


def _window_sides(window) -> list | None:
    """The two sides of a window as Python values (integer CPU tensors read), or None if it is not a pair."""
    if isinstance(window, torch.Tensor):
        if window.shape != (2,):
            return None
        window = list(window.unbind())
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        return None
    sides = []
    for side in window:
        if isinstance(side, torch.Tensor):
            if side.dim() != 0 or side.is_floating_point() or side.is_complex() or side.dtype == torch.bool \
                    or side.device.type != "cpu":
                return None
            side = side.item()
        sides.append(side)
    return sides


def check_softcap(op: str, softcap) -> float:
    """``softcap`` as a float if it is a finite real number >= 0 (not a bool; 0 = off), else a
    ValueError naming it. A negative cap would flip the scores' order, and inf is no cap at all."""
    if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap)
            or softcap < 0):
        raise ValueError(f"{op}: softcap must be a finite real number >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def check_attention_scale(op: str, attention_scale) -> float | None:
    """A block's ``attention_scale``: None (head_dim ** -0.5) or a finite real number > 0, as a float."""
    if attention_scale is None:
        return None
    if (isinstance(attention_scale, bool) or not isinstance(attention_scale, numbers.Real)
            or not math.isfinite(attention_scale) or attention_scale <= 0):
        raise ValueError(f"{op}: attention_scale must be a finite real number > 0 or None, got {attention_scale!r}")
    return float(attention_scale)


def check_rope_inv_freq(op: str, rope_inv_freq, head_dim: int, device: torch.device) -> None:
    """``rope_inv_freq``: RoPE's inverse frequencies, an fp32 tensor of shape (head_dim / 2,) on ``device``
    (its values are not read: that would cost a host sync per layer)."""
    if not isinstance(rope_inv_freq, torch.Tensor):
        raise TypeError(f"{op}: rope_inv_freq must be a torch.Tensor, got {type(rope_inv_freq).__name__}")
    if rope_inv_freq.dtype != torch.float32:
        raise TypeError(f"{op}: rope_inv_freq must be float32, got {rope_inv_freq.dtype}")
    if tuple(rope_inv_freq.shape) != (head_dim // 2,):
        raise ValueError(f"{op}: rope_inv_freq must have shape (head_dim / 2,) = ({head_dim // 2},), got "
                         f"{tuple(rope_inv_freq.shape)} (RoPE over part of the head is not supported)")
    if rope_inv_freq.device != device:
        raise ValueError(f"{op}: rope_inv_freq is on {rope_inv_freq.device} but x is on {device}")


def check_varlen_args(op: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None) -> float:
    """Validate the arguments of a variable-length attention op and return the softmax scale to use.

    FlashAttention 2's ``flash_attn_varlen_func`` layout: the documents of a batch packed along
    dim 0, q (total_q, Hq, D) and k, v (total_k, Hkv, D), with the tensor rules of
    ``check_attention_args``. Document i is rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and
    cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v; both offsets are 1-D int32 tensors on q's device
    of one length (documents + 1), starting at 0, non-decreasing (a document may be empty) and
    ending at total_q and total_k. ``max_seqlen_q``/``max_seqlen_k`` are ints bounding every
    document's length. The offsets' values are read on the host (a sync on a GPU) once per tensor
    version and bounds, except under torch.compile (reading them would break the graph) and on the
    meta device (no values), where only their type, shape and device are checked. Every error
    starts with ``op`` and names the argument."""
    _check_qkv_tensors(op, q, k, v, dims=("total_q", "H", "D"), kv_dims=("total_k", "Hkv", "D"))
    scale = _check_heads_strides_scale(op, q, k, v, scale)
    for name, cu_seqlens in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_offsets_tensor(op, name, cu_seqlens)
    check_same_device(op, "q", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{op}: cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                         f"{cu_seqlens_k.numel()}; both must be (documents + 1)")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{op}: {name} must be an int >= 0, got {value!r}")
    check_varlen_offsets(op, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return scale


def check_varlen_offsets(op: str, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The part of ``check_varlen_args`` that reads the offsets' values (the rest reads only what a
    call's signature holds, so a caller may keep its answer per signature; this part it may not)."""
    if torch.compiler.is_dynamo_compiling() or q.device.type == "meta":
        return
    # _check_offsets_once's kept reading, looked up here first: a call per layer and step
    if getattr(cu_seqlens_q, _CHECKED_OFFSETS, None) != (cu_seqlens_q._version, q.shape[0], max_seqlen_q):
        _check_offsets_once(op, "cu_seqlens_q", cu_seqlens_q, "q", q.shape[0], "max_seqlen_q", max_seqlen_q)
    if cu_seqlens_k is not cu_seqlens_q or k.shape[0] != q.shape[0] or max_seqlen_k != max_seqlen_q:  # else just done
        _check_offsets_once(op, "cu_seqlens_k", cu_seqlens_k, "k and v", k.shape[0], "max_seqlen_k", max_seqlen_k)


def _check_offsets_once(op: str, name: str, cu_seqlens, packed: str, total: int, max_name: str, max_len: int) -> None:
    """``_check_offsets`` on the values of ``cu_seqlens``, read on the host once per tensor version
    and bounds (kept on the tensor, as check_documents keeps its reading): the same offsets handed
    to every layer, or to a step captured in a CUDA graph after its warm-up, are not read again."""
    key = (cu_seqlens._version, total, max_len)
    if getattr(cu_seqlens, _CHECKED_OFFSETS, None) == key:
        return
    _check_offsets(op, name, cu_seqlens.tolist(), packed, total, max_name, max_len)
    setattr(cu_seqlens, _CHECKED_OFFSETS, key)


_CHECKED_OFFSETS = "_fused_remat_offsets_checked"  # the attribute that keeps an offsets tensor's reading


def check_offsets_tensor(op: str, name: str, cu_seqlens) -> None:
    """Document offsets as a tensor: int32, 1-D, at least two entries (their values unread)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: {name} must be 1-D with (documents + 1) >= 2 entries, got shape "
                         f"{tuple(cu_seqlens.shape)}")


def _check_offsets(op: str, name: str, offsets: list[int], packed: str, total: int, max_name: str,
                   max_len: int | None) -> None:
    """Document offsets read on the host: from 0, non-decreasing, to ``total`` rows of ``packed``,
    no document longer than ``max_len`` (None: no bound)."""
    if offsets[0] != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {offsets[0]}")
    for doc, (start, end) in enumerate(zip(offsets, offsets[1:])):
        if end < start:
            raise ValueError(f"{op}: {name} must be non-decreasing, got {name}[{doc + 1}]={end} < "
                             f"{name}[{doc}]={start}")
        if max_len is not None and end - start > max_len:
            raise ValueError(f"{op}: document {doc} has length {end - start} in {name}, more than "
                             f"{max_name}={max_len}")
    if offsets[-1] != total:
        raise ValueError(f"{op}: {name} must end at the number of rows of {packed} ({total}), got {offsets[-1]}")


def check_documents(op: str, cu_seqlens, tokens: int, device: torch.device, max_seqlen=None,
                    offsets: list[int] | None = None) -> int:
    """The longest document of ``cu_seqlens``, the documents packed in a block's or a model's
    ``tokens`` = B N tokens (int32 offsets on ``device``, as check_varlen_args's). ``max_seqlen``
    None reads it from the offsets (one sync on a GPU; under torch.compile, pass it); given, it is
    checked like the varlen op's. ``offsets``: the values of ``cu_seqlens`` as the caller holds
    them on the host (what it put there, or read), checked instead of reading the tensor. Errors
    name the argument."""
    check_offsets_tensor(op, "cu_seqlens", cu_seqlens)
    if cu_seqlens.device != device:
        raise ValueError(f"{op}: cu_seqlens is on {cu_seqlens.device} but x is on {device}")
    if max_seqlen is not None and (not _is_int(max_seqlen) or max_seqlen < 0):
        raise ValueError(f"{op}: max_seqlen must be an int >= 0 or None, got {max_seqlen!r}")
    if torch.compiler.is_dynamo_compiling() or device.type == "meta":
        if max_seqlen is None:
            raise ValueError(f"{op}: pass max_seqlen with cu_seqlens under torch.compile or on the meta device "
                             "(reading it from the offsets needs their values)")
        return int(max_seqlen)
    # A model hands the same offsets to every layer: they are read once, and the result is kept on
    # the tensor with its version counter, which any in-place change of the offsets moves, with the
    # values read (or given), so that a check against other tokens or max_seqlen reads none again.
    if offsets is None:
        checked = _current_check(cu_seqlens)
        if checked is None:
            offsets = cu_seqlens.tolist()
        elif checked[1] == tokens and max_seqlen in (None, checked[2]):
            return checked[2]
        else:
            offsets = checked[3]
    elif len(offsets) != cu_seqlens.numel():
        raise ValueError(f"{op}: offsets has {len(offsets)} entries for cu_seqlens of {cu_seqlens.numel()}")
    _check_offsets(op, "cu_seqlens", offsets, "x (B N tokens)", tokens, "max_seqlen", max_seqlen)
    longest = max(end - start for start, end in zip(offsets, offsets[1:]))
    longest = longest if max_seqlen is None else int(max_seqlen)
    cu_seqlens._fused_remat_checked = (cu_seqlens._version, tokens, longest, tuple(offsets))
    return longest


def _current_check(cu_seqlens: torch.Tensor) -> tuple | None:
    """What ``check_documents`` last kept on ``cu_seqlens`` (version, tokens, longest, offsets), where
    the tensor has not changed since (its version counter), else None."""
    checked = getattr(cu_seqlens, "_fused_remat_checked", None)
    return checked if checked is not None and checked[0] == cu_seqlens._version else None


def known_offsets(cu_seqlens: torch.Tensor) -> list[int] | None:
    """The values of ``cu_seqlens`` as ``check_documents`` last checked them, where the tensor has
    not changed since, else None: the caller reads them from the tensor."""
    checked = _current_check(cu_seqlens)
    return None if checked is None else list(checked[3])


def check_position_ids(op: str, position_ids, shape: tuple[int, int], device: torch.device) -> None:
    """``position_ids``: an int32 or int64 (B, N) tensor on ``device``, RoPE's position per token."""
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"{op}: position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: position_ids must be int32 or int64, got {position_ids.dtype}")
    if tuple(position_ids.shape) != tuple(shape):
        raise ValueError(f"{op}: position_ids must have shape (B, N) = {tuple(shape)}, got {tuple(position_ids.shape)}")
    if position_ids.device != device:
        raise ValueError(f"{op}: position_ids is on {position_ids.device} but x is on {device}")
