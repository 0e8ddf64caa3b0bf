"""Attention's launchers: the host side of the kernels in ``attention_kernels`` (argument handling,
launch plans, outputs, grids and the launches), torch tensors in and out, no autograd.

Shapes: q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D), Hq a multiple of Hkv (query head h reads kv head
h // (Hq // Hkv): GQA, MQA). Any strides as long as the last dim is contiguous: every stride goes to
the kernels, so views into a packed qkv projection need no copy. The arguments are validated once,
by ``limits.check_attention_args`` in the ops that call these launchers. With ``documents`` (a
``Documents``), FlashAttention 2's packed variable-length layout instead.

``attention_fwd`` launches ``_attn_fwd``; ``attention_bwd`` launches ``_attn_bwd_preprocess``,
``_attn_bwd_dkdv`` and ``_attn_bwd_dq``; ``attention_packed_fwd`` and ``attention_packed_bwd`` launch
them on the heads of one packed buffer (the block's qkv), their plans keyed on the buffers. A row
that sees no key (causal, Nq > Nk) gets o = 0, lse = -inf, and zero gradients; any Nq, Nk >= 1 and
head dims 1..256.

The streamed tiles (K and V in the forward and dQ, Q and dO in dK/dV) are read through device-side
tensor descriptors (``tl.make_tensor_descriptor``; TMA on Hopper and newer, and Triton's interpreter
runs the same code) wherever the tensors' base and strides are 16-byte aligned; otherwise, and on
GPUs without TMA, through pointer loads with masks. Descriptors built on the device need scratch
memory from Triton's allocator; the launchers set one where the calling thread has none.

On CUDA the launch configuration is autotuned per (length buckets, HEAD_DIM, causal, dtype) over the
lists of ``attention_configs``; in the interpreter one small fixed configuration runs, and dot
operands are upcast to fp32 (the interpreter's bf16 dot is wrong). A signature's first call checks
its arguments and binds its launches; the calls after it take that plan.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator

import torch
import triton

from .attention_configs import INTERPRETER_CONFIG, target_family, warp_specialization_compiles
from .attention_kernels import (LOG2E, _attn_bwd_dkdv, _attn_bwd_dkdv_tuned, _attn_bwd_dq, _attn_bwd_dq_tuned,
                                _attn_bwd_preprocess, _attn_fwd, _attn_fwd_tuned)
from .launch import (FP_FUSION, NO_SCRATCH_ALLOCATOR, SCRATCH_ALLOCATOR, KeptKernel, LaunchPlans, cdiv,
                     ensure_scratch_allocator, launch_key, new_like, next_power_of_2)


# Each launched through its kept compiled form (launch.KeptKernel): the plain kernels for a pinned
# configuration and the interpreter, the autotuned ones otherwise.
_ATTN_FWD, _ATTN_FWD_TUNED = KeptKernel(_attn_fwd), KeptKernel(_attn_fwd_tuned)
_ATTN_DQ, _ATTN_DQ_TUNED = KeptKernel(_attn_bwd_dq), KeptKernel(_attn_bwd_dq_tuned)
_ATTN_DKDV, _ATTN_DKDV_TUNED = KeptKernel(_attn_bwd_dkdv), KeptKernel(_attn_bwd_dkdv_tuned)
_ATTN_BWD_PREPROCESS = KeptKernel(_attn_bwd_preprocess)
# Whether Triton interprets, as it decided when it wrapped these kernels.
_INTERPRETING = not _ATTN_FWD.compiled
_INTERPRETER_LAUNCH = {**INTERPRETER_CONFIG, **FP_FUSION}


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
#
# The launchers trust the shapes they are given: every op of the library validates q, k, v with
# limits.check_attention_args before it calls one, and the other tensors the library passes (views
# of one packed buffer, slices of validated tensors) are consistent by construction. A launcher
# refuses only what it cannot express in a launch: a last dim that is not contiguous (the kernels
# take no stride for it), a given output that does not fit, and tma=True where descriptors cannot
# be used. Callers outside the library validate with check_attention_args first.


class Documents(tuple):
    """The packed variable-length layout of FlashAttention 2's varlen API: q (total_q, Hq, D) and
    k, v (total_k, Hkv, D) hold documents one after another; document i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v
    (int32, on the tensors' device), and no document is longer than max_seqlen_q / max_seqlen_k.
    Validated by ``limits.check_varlen_args``.

    Made as ``Documents((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))``: a tuple with
    named fields read by C getters, so that making one and reading its fields (every
    packed-document launch) runs no Python call."""

    __slots__ = ()

    cu_seqlens_q = property(operator.itemgetter(0))
    cu_seqlens_k = property(operator.itemgetter(1))
    max_seqlen_q = property(operator.itemgetter(2))
    max_seqlen_k = property(operator.itemgetter(3))

    @property
    def count(self) -> int:
        return self[0].shape[0] - 1


def _heads_views(tensors) -> tuple[torch.Tensor, ...]:
    """Packed (total, H, D) tensors as the (1, H, total, D) views the kernels address (by C
    callables: no Python frame per tensor)."""
    ones, twos = itertools.repeat(1), itertools.repeat(2)
    return (*map(torch.Tensor.transpose, map(torch.Tensor.unsqueeze, tensors, itertools.repeat(0)), ones, twos),)


@dataclasses.dataclass(frozen=True)
class _Problem:
    """One attention call's sizes and options, as every launch needs them: made once per distinct
    call (``of``) and kept, with what the launches derive from it (``scalars``, ``constexprs``), so
    that a training step's repeated calls only look it up. With documents, the lengths are the
    packed totals, and the grid's extent the longest document's."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    causal: bool
    sm_scale: float
    fp32: bool  # fp32 inputs: IEEE dots and the softmax in natural units
    window: tuple[int, int]  # (left, right), -1 unbounded, causal's right bound 0 folded in
    softcap: float
    documents: int  # how many documents are packed; 0 in the dense layout
    grid_lengths: tuple[int, int]  # the longest query and key sequence one program may see

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0,
           documents: Documents | None = None) -> _Problem:
        """q, k as the kernels see them: (B, H, N, D), or (1, H, total, D) views with documents."""
        left, right = window
        if causal:
            right = 0  # FlashAttention 2: causal is the window's right bound 0
        if documents is None:
            count, lengths = 0, (q.shape[2], k.shape[2])
        else:
            count, lengths = documents.count, (documents.max_seqlen_q, documents.max_seqlen_k)
        return _problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], bool(causal),
                        float(scale), q.dtype == torch.float32, (int(left), int(right)), float(softcap), count,
                        lengths)

    @property
    def grid_batch(self) -> int:
        return self.documents or self.batch

    @functools.cached_property
    def padded_head_dim(self) -> int:
        return max(16, next_power_of_2(self.head_dim))

    @property
    def qk_scale(self) -> float:
        """The softmax scale with log2(e) folded in: the scale of the log2-unit softmax."""
        return self.sm_scale * LOG2E.value

    @property
    def mask_kind(self) -> str:
        """"window" when a bound other than causal's applies, else "causal" or "none"."""
        left, right = self.window
        if left < 0 and right < 0:
            return "none"
        return "causal" if left < 0 and right == 0 else "window"

    @property
    def window_bounds(self) -> tuple[int, int]:
        """The kernels' (window_left, window_right): an unbounded side as a bound past every key."""
        unbounded = sum(self.grid_lengths) + 1
        return tuple(unbounded if side < 0 else side for side in self.window)

    @functools.cached_property
    def scalars(self) -> tuple:
        """The kernels' arguments after the strides: Hq, Nq, Nk, D, GROUP, the scales, the window
        and the softcap. The backward kernels take the padded query length next; all take the
        autotuner's length buckets (``length_buckets``: N_CTX_Q_KEY, N_CTX_K_KEY) last."""
        cap_scale = self.sm_scale / self.softcap if self.softcap else 0.0
        return (self.q_heads, self.q_len, self.k_len, self.head_dim, self.q_heads // self.kv_heads, self.sm_scale,
                self.qk_scale, *self.window_bounds, self.softcap, cap_scale)

    @functools.cached_property
    def length_buckets(self) -> tuple[int, int]:
        return next_power_of_2(self.grid_lengths[0]), next_power_of_2(self.grid_lengths[1])

    def grid(self, lengths: int, block: str, heads: int):
        """The launch grid over ``lengths`` (0: queries, 1: keys) in tiles of the configuration's
        ``block`` (BLOCK_M or BLOCK_N), ``heads``, and the batch or the documents."""
        extent, batch = self.grid_lengths[lengths], self.grid_batch
        return lambda meta: (cdiv(extent, meta[block]), heads, batch)

    @property
    def dot_precision(self) -> str:
        """fp32 inputs take IEEE dots (TF32 would round the operands to 10 mantissa bits); for 16-bit
        inputs the setting does not apply."""
        return "ieee" if self.fp32 else "tf32"

    @property
    def natural_exp(self) -> bool:
        """The kernels' NATURAL_EXP: fp32 inputs keep the softmax offsets in natural units and form
        each exponent with one fma before the conversion to log2 units (see attention_kernels._probs):
        the cheaper log2-unit form is 1e-5 off for P near 1 at large logits, invisible once P is
        rounded to 16 bits but not at fp32's accuracy."""
        return self.fp32

    @functools.cached_property
    def _constexprs(self) -> dict[bool, dict]:
        mask = self.mask_kind
        common = dict(
            CAUSAL=mask == "causal", WINDOW=mask == "window", SOFTCAP=self.softcap > 0, VARLEN=self.documents > 0,
            EVEN_D=self.head_dim == self.padded_head_dim, NATURAL_EXP=self.natural_exp,
            DOT_PRECISION=self.dot_precision, HEAD_DIM=self.padded_head_dim,
        )
        return {use_tma: {**common, "USE_TMA": use_tma} for use_tma in (False, True)}

    def constexprs(self, use_tma: bool) -> dict:
        return self._constexprs[use_tma]


# Distinct calls of a run are few (a training step repeats the same shapes); the bound keeps a run
# whose shapes vary from batch to batch from growing it without end.
_problem = functools.lru_cache(maxsize=4096)(_Problem)


def _sequence_args(documents: Documents | None, placeholder: torch.Tensor) -> tuple:
    """CU_SEQLENS_Q, CU_SEQLENS_K (any tensor in the dense layout, where they are not read)."""
    if documents is not None:
        return documents.cu_seqlens_q, documents.cu_seqlens_k
    return placeholder, placeholder


def _require_contiguous_last_dim(named: dict) -> None:
    """The kernels address the last dim as contiguous (they take no stride for it)."""
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got strides {t.stride()}")


def _tma_refusal(named: dict) -> str | None:
    """Why the streamed tensors in ``named`` cannot be read through tensor descriptors, or None.

    A descriptor's base address and its row stride must be multiples of 16 bytes (TMA's rule); each
    (batch, head) matrix starts at a batch and head stride from the base, so those must be too where
    the dimension has more than one entry. Descriptors run on Hopper and newer and in the interpreter;
    A100s read through pointers."""
    if not _INTERPRETING and target_family() < 90:
        return "the GPU has no TMA (compute capability below 9.0)"
    for name, t in named.items():
        if t.data_ptr() % 16:
            return f"{name}'s data pointer is not 16-byte aligned"
        if not _tma_strides(t.shape, t.stride(), t.element_size()):
            return f"{name}'s strides {t.stride()} are not all multiples of 16 bytes"
    return None


@functools.lru_cache(maxsize=4096)
def _tma_strides(shape, strides, elem: int) -> bool:
    """Whether a (B, H, N, D) tensor's row stride, and its batch and head strides where that
    dimension has more than one entry, are multiples of 16 bytes (asked once per layout)."""
    batch, heads = shape[:2]
    checked = [strides[2]] + [st for st, size in ((strides[0], batch), (strides[1], heads)) if size > 1]
    return not any(st * elem % 16 for st in checked)


def _use_tma(tma: bool | None, named: dict) -> bool:
    """The launch's USE_TMA: descriptors where they can be used (``tma`` None), or as ``tma`` says
    (False: pointer loads; True: descriptors, a clear error where they cannot be)."""
    refusal = _tma_refusal(named) if tma is not False else None
    if tma and refusal:
        raise ValueError(f"tma=True: {refusal}")
    use = tma is not False and refusal is None
    if use:
        ensure_scratch_allocator()
    return use


def _output(name: str, given, like: torch.Tensor) -> torch.Tensor:
    """A caller's preallocated output (any strides, last dim contiguous), or a fresh contiguous one.

    A given output may also be fp32: the result unrounded, for callers that sum partial results
    (ring attention merges one block of keys at a time)."""
    if given is None:
        return torch.empty(like.shape, device=like.device, dtype=like.dtype)
    if (given.shape != like.shape or given.dtype not in (like.dtype, torch.float32) or given.device != like.device
            or given.stride(-1) != 1):
        raise ValueError(
            f"{name} must be a {like.dtype} or float32 tensor of shape {tuple(like.shape)} on {like.device} with a "
            f"contiguous last dim, got {given.dtype} {tuple(given.shape)} strides {given.stride()} on {given.device}"
        )
    return given


def attention_fwd(q, k, v, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0, *,
                  documents: Documents | None = None, out=None, config: dict | None = None,
                  tma: bool | None = None):
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), last dims contiguous, as
    ``limits.check_attention_args`` accepts them (not checked again here; Nq or Nk may be 0). With
    ``documents`` (a Documents), the packed variable-length layout instead: q (total_q, Hq, D), k and v
    (total_k, Hkv, D), as ``limits.check_varlen_args`` accepts them.

    ``window`` = (left, right): query i sees keys i + diagonal - left .. i + diagonal + right
    (diagonal = Nk - Nq per sequence, -1 = unbounded side; causal sets right to 0), and key tiles
    outside every row's window are skipped. ``softcap`` > 0 turns the scaled scores s into
    softcap * tanh(s / softcap) before the softmax.

    Returns o in q's shape and dtype and lse fp32, natural log, -inf on rows that see no key:
    (B, Hq, Nq), or (Hq, total_q) with documents (FlashAttention 2's varlen layout). o is ``out``
    when given (any strides with a contiguous last dim: a block passes a (B, Nq, Hq, D) buffer's
    transpose so o is already laid out for the output projection), else a new contiguous tensor.
    ``config`` ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}) pins the launch configuration;
    by default CUDA autotunes and the interpreter uses INTERPRETER_CONFIG. ``tma``: k and v stream
    through tensor descriptors (TMA) where their alignment allows (None), never (False), or always
    (True: an error where they cannot). ``window`` may be a list (the custom operator's form)."""
    window = tuple(window)
    offsets = () if documents is None else (documents.cu_seqlens_q, documents.cu_seqlens_k)
    key = (launch_key(_ATTN_FWD.compiled, (q, k, v, *(() if out is None else (out,)), *offsets)), causal, scale,
           window, softcap, None if documents is None else (documents.max_seqlen_q, documents.max_seqlen_k),
           out is None, None if config is None else tuple(sorted(config.items())), tma)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        return _attention_fwd_planned(key, q, k, v, causal, scale, window, softcap, documents, out, config, tma)
    o = new_like(q) if out is None else out
    lse = torch.empty(*plan.lse_shape, device=q.device, dtype=torch.float32)
    if plan.launch is not None:
        if plan.tma and isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
            ensure_scratch_allocator()
        # the packed tensors themselves, not their (1, H, total, D) views: a bound launch reads only
        # each tensor's address, the same for the view, and its strides are bound already
        plan.launch(q, k, v, o, lse, *(offsets or (lse, lse)))
    return o, lse[0] if documents is not None else lse


# The launchers' plans (kernels.launch.LaunchPlans): what a call of one signature launches, bound
# with everything but its tensors.
_FWD_PLANS, _BWD_PLANS = LaunchPlans(), LaunchPlans()


@dataclasses.dataclass(frozen=True)
class _ForwardPlan:
    lse_shape: tuple
    launch: object  # the bound kernel launch, None when there is nothing to compute
    tma: bool


def _attention_fwd_planned(key, q, k, v, causal, scale, window, softcap, documents, out, config, tma,
                           keep=_FWD_PLANS.keep):
    """attention_fwd's first call of a signature: every check, the launch through Triton's path, and
    the plan its next calls take, ``keep(key, plan)`` (not kept where a launch cannot be bound)."""
    _require_contiguous_last_dim({"q": q, "k": k, "v": v})
    o = _output("out", out, q)
    if documents is not None:
        q, k, v, o_heads = _heads_views((q, k, v, o))
    else:
        o_heads = o
    p = _Problem.of(q, k, causal, scale, window, softcap, documents)
    lse = torch.empty((p.batch, p.q_heads, p.q_len), device=q.device, dtype=torch.float32)
    if o.numel() == 0 or p.grid_batch == 0:
        keep(key, _ForwardPlan(tuple(lse.shape), None, False))
        return o, lse[0] if documents is not None else lse
    _check_warp_specialization("config", config, kernel_has_it=True)
    use_tma = _use_tma(tma, {"k": k, "v": v})
    kernel, cfg = _pick(_ATTN_FWD, _ATTN_FWD_TUNED, config)
    launch = kernel.bind(
        p.grid(0, "BLOCK_M", p.q_heads), (q, k, v, o_heads, lse, *_sequence_args(documents, lse)),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_heads.stride()[:3], *lse.stride()[:2], *p.scalars,
         *p.length_buckets), **p.constexprs(use_tma), NEGATIVE_SCALE=p.sm_scale < 0 and not p.softcap, **cfg,
    )
    if launch is not None:
        keep(key, _ForwardPlan(tuple(lse.shape), launch, use_tma))
    return o, lse[0] if documents is not None else lse


def attention_bwd(do, q, k, v, o, lse, causal: bool, scale: float, *, window=(-1, -1), softcap: float = 0.0,
                  documents: Documents | None = None, dlse=None, out=None, config: dict | None = None,
                  dkdv_config: dict | None = None, tma: bool | None = None):
    """Gradients of attention_fwd (q, k, v, window, softcap and documents as there). do like o
    (last dim contiguous; other strides free); lse as returned by attention_fwd; dlse (optional,
    lse's shape) the gradient reaching lse.

    Returns dq, dk, dv in the shapes and dtypes of q, k, v: ``out`` = (dq, dk, dv) when given (any
    strides with a contiguous last dim, e.g. views of one packed dqkv buffer), else new contiguous
    tensors. ``config`` pins the dQ kernel's launch configuration and ``dkdv_config`` the dK/dV
    kernel's (default: ``config`` without warp specialization, which only dQ takes). ``tma`` as in
    attention_fwd, for the streamed k, v (dQ) and q, dO (dK/dV)."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    offsets = () if documents is None else (documents.cu_seqlens_q, documents.cu_seqlens_k)
    key = (launch_key(_ATTN_DQ.compiled, (q, k, v, o, do, lse, *(() if dlse is None else (dlse,)), *(out or ()),
                                          *offsets)),
           causal, scale, tuple(window), softcap,
           None if documents is None else (documents.max_seqlen_q, documents.max_seqlen_k), dlse is None, out is None,
           None if config is None else tuple(sorted(config.items())),
           None if dkdv_config is None else tuple(sorted(dkdv_config.items())), tma)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        return _attention_bwd_planned(key, do, q, k, v, o, lse, causal, scale, window, softcap, documents, dlse, out,
                                      config, dkdv_config, tma)
    grads = out or (new_like(q), new_like(k), new_like(v))
    if plan.launches is None:
        return grads[0], grads[1].zero_(), grads[2].zero_()
    if plan.tma and isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
        ensure_scratch_allocator()
    dq, dk, dv = grads
    # with documents, the packed tensors stand for their views as in attention_fwd
    delta, bias = torch.empty(*plan.delta_shape, device=q.device, dtype=torch.float32).unbind(0)
    offsets = offsets or (lse, lse)
    preprocess, dkdv, dq_launch = plan.launches
    preprocess(o, do, lse, lse if dlse is None else dlse, delta, bias)
    dkdv(q, k, v, do, bias, delta, dk, dv, *offsets)
    dq_launch(q, k, v, do, bias, delta, dq, *offsets)
    return tuple(grads)


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    delta_shape: tuple
    launches: tuple | None  # the bound preprocess, dK/dV and dQ launches; None: nothing to compute
    tma: bool


def _attention_bwd_planned(key, do, q, k, v, o, lse, causal, scale, window, softcap, documents, dlse, out, config,
                           dkdv_config, tma, keep=_BWD_PLANS.keep):
    """attention_bwd's first call of a signature: every check, the launches through Triton's path,
    and the plan its next calls take, ``keep(key, plan)`` (not kept where a launch cannot be bound)."""
    _require_contiguous_last_dim({"q": q, "k": k, "v": v, "o": o})
    _check_warp_specialization("config", config, kernel_has_it=True)
    _check_warp_specialization("dkdv_config", dkdv_config, kernel_has_it=False)
    grads = [_output(name, given, like) for name, given, like in zip(("dq", "dk", "dv"), out or (None,) * 3, (q, k, v))]
    if documents is not None:
        q, k, v, o, do = _heads_views((q, k, v, o, do))
        dq, dk, dv = _heads_views(grads)
        lse = lse.unsqueeze(0)
        dlse = None if dlse is None else dlse.unsqueeze(0)
    else:
        dq, dk, dv = grads
    p = _Problem.of(q, k, causal, scale, window, softcap, documents)
    if dq.numel() == 0 or p.grid_batch == 0:
        keep(key, _BackwardPlan((), None, False))
        return grads[0], grads[1].zero_(), grads[2].zero_()
    # delta and the exponent biases, padded to a multiple of every BLOCK_M (see _attn_bwd_preprocess)
    row_multiple = max([128] + [c["BLOCK_M"] for c in (config, dkdv_config) if c])
    nq_rounded = cdiv(p.q_len, row_multiple) * row_multiple
    delta, bias = torch.empty((2, p.batch, p.q_heads, nq_rounded), device=q.device, dtype=torch.float32)
    # 4096 values of o and of dO a program: larger blocks spilled registers (the preprocess rows of
    # static.json)
    pre_block = 16 if _INTERPRETING else max(16, min(128, 4096 // p.padded_head_dim))
    preprocess = _ATTN_BWD_PREPROCESS.bind(
        (nq_rounded // pre_block, p.q_heads, p.batch), (o, do, lse, dlse if dlse is not None else lse, delta, bias),
        (*o.stride()[:3], *do.stride()[:3], p.q_heads, p.q_len, nq_rounded, p.head_dim),
        HAS_DLSE=dlse is not None, NATURAL_EXP=p.natural_exp, HEAD_DIM=p.padded_head_dim,
        BLOCK_M=pre_block, **FP_FUSION,
    )

    scalars = (*p.scalars, nq_rounded, *p.length_buckets)
    use_tma = _use_tma(tma, {"q": q, "k": k, "v": v, "do": do})
    constexprs = p.constexprs(use_tma)
    offsets = _sequence_args(documents, lse)
    streamed = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    kernel, cfg = _pick(_ATTN_DKDV, _ATTN_DKDV_TUNED, dkdv_config or _without_warp_specialization(config))
    dkdv = kernel.bind(
        p.grid(1, "BLOCK_N", p.kv_heads), (q, k, v, do, bias, delta, dk, dv, *offsets),
        (*streamed, *dk.stride()[:3], *dv.stride()[:3], *scalars), **constexprs, **cfg,
    )
    kernel, cfg = _pick(_ATTN_DQ, _ATTN_DQ_TUNED, config)
    dq_launch = kernel.bind(
        p.grid(0, "BLOCK_M", p.q_heads), (q, k, v, do, bias, delta, dq, *offsets),
        (*streamed, *dq.stride()[:3], *scalars), **constexprs, **cfg,
    )
    if None not in (preprocess, dkdv, dq_launch):
        keep(key, _BackwardPlan((2, p.batch, p.q_heads, nq_rounded), (preprocess, dkdv, dq_launch), use_tma))
    return tuple(grads)


# --------------------------------------------------------------------------------------------
# Heads packed in one buffer (the block's qkv): plans keyed on the buffers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PackedPlan:
    """attention_fwd's or attention_bwd's plan for the views of one packed layout, and the columns
    of the packed buffer where k's and v's heads start."""

    plan: object
    k_column: int
    v_column: int


_PACKED_FWD_PLANS, _PACKED_BWD_PLANS = LaunchPlans(), LaunchPlans()


def _column(view: torch.Tensor, buffer: torch.Tensor) -> int:
    return view.storage_offset() - buffer.storage_offset()


def attention_packed_fwd(qkv, o, layout: tuple, views, causal: bool, scale: float, window, softcap: float,
                         cu_seqlens) -> torch.Tensor:
    """attention_fwd of the heads of a packed qkv (T, (Hq + 2 Hkv) D) into o (T, Hq D), both
    token-major; returns lse. ``layout`` = (batch, n_heads, n_kv_heads, max_seqlen) with
    ``cu_seqlens`` (None: ``batch`` equal sequences) gives ``views(batch, n_heads, n_kv_heads,
    cu_seqlens, max_seqlen)``: (a packed buffer's q, k, v views, a token-major buffer's view,
    Documents or None), the views attention_fwd takes.

    The views are made at a signature's first call only. Later calls key their plan on qkv, o and
    the offsets themselves, and hand the launch qkv and o where it takes q and o (the same
    addresses) and column slices of qkv for k and v: a bound launch reads only each tensor's
    address (the views' strides are bound with it), and a view's address and alignment follow from
    its buffer's."""
    offsets = () if cu_seqlens is None else (cu_seqlens,)
    key = (launch_key(_ATTN_FWD.compiled, (qkv, o, *offsets)), layout, causal, scale, tuple(window), softcap)
    packed = _PACKED_FWD_PLANS.get(key)
    if packed is None:
        return _attention_packed_fwd_planned(key, qkv, o, layout, views, causal, scale, window, softcap, cu_seqlens)
    plan = packed.plan
    lse = torch.empty(*plan.lse_shape, device=qkv.device, dtype=torch.float32)
    if plan.tma and isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
        ensure_scratch_allocator()
    plan.launch(qkv, qkv[:, packed.k_column:packed.v_column], qkv[:, packed.v_column:], o, lse,
                *(offsets * 2 or (lse, lse)))
    return lse if cu_seqlens is None else lse[0]


def _attention_packed_fwd_planned(key, qkv, o, layout, views, causal, scale, window, softcap, cu_seqlens):
    """attention_packed_fwd's first call of a signature: attention_fwd's first call on the views,
    its plan kept under the buffers' key (where it launches)."""
    batch, n_heads, n_kv_heads, max_seqlen = layout
    heads, token_major, documents = views(batch, n_heads, n_kv_heads, cu_seqlens, max_seqlen)
    q, k, v = heads(qkv)

    def keep(_, plan):
        if plan.launch is not None:
            _PACKED_FWD_PLANS.keep(key, _PackedPlan(plan, _column(k, qkv), _column(v, qkv)))

    _, lse = _attention_fwd_planned(None, q, k, v, causal, scale, tuple(window), softcap, documents, token_major(o),
                                    None, None, keep)
    return lse


def attention_packed_bwd(do, qkv, o, lse, dqkv, layout: tuple, views, causal: bool, scale: float, window,
                         softcap: float, cu_seqlens) -> None:
    """attention_bwd into dqkv (packed like qkv) from do and o (T, Hq D) token-major; the rest as
    attention_packed_fwd's, and its plans likewise keyed on the buffers."""
    offsets = () if cu_seqlens is None else (cu_seqlens,)
    key = (launch_key(_ATTN_DQ.compiled, (do, qkv, o, lse, dqkv, *offsets)), layout, causal, scale, tuple(window),
           softcap)
    packed = _PACKED_BWD_PLANS.get(key)
    if packed is None:
        return _attention_packed_bwd_planned(key, do, qkv, o, lse, dqkv, layout, views, causal, scale, window,
                                             softcap, cu_seqlens)
    plan = packed.plan
    if plan.tma and isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
        ensure_scratch_allocator()
    k_column, v_column = packed.k_column, packed.v_column
    k, v, dk, dv = qkv[:, k_column:v_column], qkv[:, v_column:], dqkv[:, k_column:v_column], dqkv[:, v_column:]
    delta, bias = torch.empty(*plan.delta_shape, device=qkv.device, dtype=torch.float32).unbind(0)
    sequences = offsets * 2 or (lse, lse)
    preprocess, dkdv, dq_launch = plan.launches
    preprocess(o, do, lse, lse, delta, bias)
    dkdv(qkv, k, v, do, bias, delta, dk, dv, *sequences)
    dq_launch(qkv, k, v, do, bias, delta, dqkv, *sequences)


def _attention_packed_bwd_planned(key, do, qkv, o, lse, dqkv, layout, views, causal, scale, window, softcap,
                                  cu_seqlens) -> None:
    """attention_packed_bwd's first call of a signature, as _attention_packed_fwd_planned's: kept
    where attention_bwd would take lse and do as given (contiguous, and with a contiguous last
    dim), else attention_bwd as usual."""
    batch, n_heads, n_kv_heads, max_seqlen = layout
    heads, token_major, documents = views(batch, n_heads, n_kv_heads, cu_seqlens, max_seqlen)
    q, k, v = heads(qkv)
    args = (token_major(do), q, k, v, token_major(o), lse, causal, scale)
    if not lse.is_contiguous() or do.stride(-1) != 1:
        attention_bwd(*args, window=window, softcap=softcap, documents=documents, out=tuple(heads(dqkv)))
        return

    def keep(_, plan):
        if plan.launches is not None:
            _PACKED_BWD_PLANS.keep(key, _PackedPlan(plan, _column(k, qkv), _column(v, qkv)))

    _attention_bwd_planned(None, *args, tuple(window), softcap, documents, None, tuple(heads(dqkv)), None, None, None,
                           keep)


def _check_warp_specialization(name: str, config: dict | None, kernel_has_it: bool) -> None:
    """Refuse a pinned configuration asking for WARP_SPECIALIZE where it cannot compile: for the
    dK/dV kernel, which has no such loop, and on a GPU other than datacenter Blackwell or a Triton
    before 3.9 (Hopper's and Triton 3.6's warp-specialization passes fail on these kernels). The
    interpreter runs the loop as written, whatever the flag."""
    if not config or not config.get("WARP_SPECIALIZE"):
        return
    if not kernel_has_it:
        raise ValueError(f"{name}: the dK/dV kernel is never warp-specialized (WARP_SPECIALIZE is dQ's and the forward's)")
    if not _INTERPRETING and (target_family() != 100 or not warp_specialization_compiles()):
        raise ValueError(f"{name}: WARP_SPECIALIZE needs a datacenter Blackwell GPU (sm_100 to 119) and Triton 3.9 "
                         f"or later; this is GPU family {target_family()}, Triton {triton.__version__}")


def _without_warp_specialization(config: dict | None) -> dict | None:
    """A pinned dQ configuration as dK/dV's, whose kernel is never warp-specialized."""
    if config is None:
        return None
    return {key: value for key, value in config.items() if key not in ("WARP_SPECIALIZE", "maxnreg")}


def _pick(plain, tuned, config):
    """(kernel, launch kwargs): a pinned config, the interpreter's fixed one, or the autotuner;
    always asking for fused multiply-adds (the autotuner hands them to every configuration)."""
    if config is not None:
        return plain, {**config, **FP_FUSION}
    if _INTERPRETING:
        return plain, _INTERPRETER_LAUNCH
    return tuned, FP_FUSION


__all__ = ["Documents", "attention_fwd", "attention_bwd", "INTERPRETER_CONFIG"]
