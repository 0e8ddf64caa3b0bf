"""The kernels' launchers as PyTorch custom operators: ``torch.ops.fused_remat.*``.

torch.compile treats a custom operator as one opaque node: it never traces into the Triton
launch (which it cannot do through the interpreter) and learns output shapes from the fake
implementation registered beside each op. The autograd Functions of the ops and the block call
only these where anything traces (``traced``), so ``torch.compile(..., fullgraph=True)`` traces
them without a graph break; eager calls run the same implementations without the dispatcher. (Ring
attention, ``fused_remat.context_parallel``, calls the attention launchers directly: it runs inside
the block's own custom operators or under its own Function; see docs/design.md.)

A custom operator returns tensors only, never None and never a view of an input: an output that
a call does not produce (the mean of an RMSNorm, a bias gradient without bias, an output not asked
for) comes back as an empty tensor, where its launcher (which ``direct`` may call itself) gives None;
the callers know which outputs a call produces.

Launchers are reached through ``kernels``, which imports each module at its first use: importing
fused_remat must not import triton.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import Tensor

from .backend import launches_kernels
from .flops import attention_op_flops, document_pairs, flop_formula, visible_pairs


class _Kernels:
    """The modules of fused_remat.kernels, each imported at its first use: importing fused_remat
    must not import triton, and an import statement in a launching function costs every call."""

    _MODULES = ("activations", "attention", "cross_entropy", "norm", "rope")

    def __getattr__(self, module: str):
        if module not in self._MODULES:
            raise AttributeError(f"fused_remat.kernels has no launcher module {module!r}")
        from .kernels import activations, attention, cross_entropy, norm, rope

        self.activations, self.attention, self.cross_entropy = activations, attention, cross_entropy
        self.norm, self.rope = norm, rope
        return getattr(self, module)


kernels = _Kernels()


# Each operator twice: its implementation as a plain function (``direct``), and the custom operator
# (``dispatched``). An eager call on tensors that launch goes straight to the implementation: the
# dispatcher would run the same function after its own host work (schema checks, dispatch keys,
# the Python wrapper), on every call and for nothing. A call that
# something records or transforms goes through the operator (``traced``). Inside an operator's
# implementation (the block's) calls always take ``direct``: only the outer operator is seen.
class _Direct(types.SimpleNamespace):
    """The implementations. Where an operator only adapts its launcher to the operator rules (an
    output not produced comes as None, not empty), ``direct`` holds the launcher itself, taken at
    its first use: one call less on every launch."""

    def __getattr__(self, name: str):
        if name not in _LAUNCHERS:
            raise AttributeError(f"no fused_remat operator {name!r}")
        module, launcher = _LAUNCHERS[name]
        fn = getattr(getattr(kernels, module), launcher)
        setattr(self, name, fn)
        return fn


direct = _Direct()
dispatched = types.SimpleNamespace()
_LAUNCHERS: dict[str, tuple[str, str]] = {}  # direct's launchers by name: (module in kernels, function)


def _op(name: str, mutates_args=(), launcher: str | None = None):
    """Registers an operator; ``launcher`` ("module:function" in kernels) where its implementation
    calls that launcher with its own arguments and only adapts its None outputs, so that ``direct``
    may call the launcher itself."""

    def register(fn):
        op = torch.library.custom_op(f"fused_remat::{name}", mutates_args=mutates_args)(fn)
        if launcher is None:
            setattr(direct, name, fn)
        else:
            _LAUNCHERS[name] = tuple(launcher.split(":"))
        setattr(dispatched, name, op)
        return op

    return register


def traced(device: torch.device) -> bool:
    """Whether a call on ``device`` must go through the custom operators: while torch.compile
    traces (it must see one opaque node), under a dispatch or function mode (FlopCounterMode,
    FakeTensorMode, a user's) or a functorch transform, and on meta tensors (whose fake kernels
    give shapes and FLOP counts). Elsewhere calls go straight to the implementations."""
    # is_dynamo_compiling first: torch.compile traces this function, and sees a constant there
    return (torch.compiler.is_dynamo_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active()
            or (device.type == "meta" and not launches_kernels(device)))


def through_operators(device: torch.device) -> bool:
    """Whether a Function's forward or backward on ``device`` calls the custom operators: where it
    is ``traced``, or records a graph (a backward under create_graph=True: the operators' outputs
    carry the node that refuses a second derivative). A forward runs with grad off."""
    return torch.is_grad_enabled() or traced(device)


def ops(device: torch.device) -> types.SimpleNamespace:
    """The operators a Function's backward runs on ``device`` (``through_operators``)."""
    return dispatched if torch.is_grad_enabled() or traced(device) else direct


def apply(function: type[torch.autograd.Function], device: torch.device, *args):
    """``function.apply(*args, untraced)``, every argument given. ``untraced`` (True where the call
    is not ``traced``) tells the forward to call ``direct``: it runs within this call, with grad
    off, so nothing can have changed since. Untraced, without ``Function.apply``'s Python layer: it
    binds the arguments to forward's signature for their defaults (there are none to fill) and
    handles functorch transforms (``traced`` sends those, and torch.compile, the usual way)."""
    if traced(device):
        return function.apply(*args, False)
    return function.apply_untraced(*args, True)


def apply_first(function: type[torch.autograd.Function], device: torch.device, *args):
    """``apply(function, device, *args)[0]``, for a caller that wants the first output only: an
    untraced call runs ``first_output_twin(function)``, which makes one output where ``function``
    makes several."""
    if traced(device):
        return function.apply(*args, False)[0]
    return first_output_twin(function).apply_untraced(*args, True)


@functools.cache
def first_output_twin(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """A Function that runs ``function``'s forward, setup_context and backward (a Function with
    ``setup_context`` whose forward returns a tuple, and whose backward takes the first output's
    gradient alone: ``backward(ctx, grad, *_)``) but gives only the first output.

    Autograd wraps and routes every output of a Function, differentiable or not; the rest here
    (statistics, gradients made in the forward) are kept for backward as the forward's own tensors.
    Its forward takes a ctx (it has no output to set up from), which functorch transforms refuse:
    untraced calls only (``apply_first``)."""

    def forward(ctx, *args):
        output = function.forward(*args)
        function.setup_context(ctx, args, output)
        return output[0]

    return cached_forward_signature(type(
        f"{function.__name__}FirstOutput", (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(function.backward), "__module__": function.__module__,
         "__doc__": f"{function.__name__}'s first output (custom_ops.first_output_twin)."}))


def _absent(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _or_absent(t: Tensor | None, like: Tensor) -> Tensor:
    return _absent(like) if t is None else t


def _like(t: Tensor) -> Tensor:
    """A new contiguous tensor of t's shape and dtype, as the launchers allocate their outputs."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def cached_forward_signature(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Class decorator for a Function: ``apply_untraced``, autograd's own apply beneath
    ``Function.apply``'s Python layer, for ``apply``. For a Function with ``setup_context``,
    ``Function.apply`` binds each call's arguments to ``forward``'s signature (for its defaults), and
    ``inspect.signature`` rebuilds that on every call unless the function carries one; it is built
    once here (a forward that takes a ctx is never bound: there it goes unused)."""
    function.forward.__signature__ = inspect.signature(function.forward)
    function.apply_untraced = super(torch.autograd.Function, function).apply
    return function


@cached_forward_signature
class _FirstOrderOnly(torch.autograd.Function):
    """Identity on gradients, whose own backward refuses: a second derivative (create_graph=True
    and a gradient penalty, torch.func.hessian) would treat what the backward kernels kept as
    constants and be silently wrong. First-order torch.func.grad and torch.compile are unaffected."""

    @staticmethod
    def forward(op: str, *grads):
        return tuple(None if g is None else g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[0]

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"{ctx.op}: second derivatives (double backward through create_graph=True, e.g. a "
                           "gradient penalty) are not supported: its backward runs fused kernels that have no "
                           "derivative of their own")


def first_order_only(op: str, *grads):
    """``grads`` as a backward returns them, marked so that differentiating them again raises."""
    if not torch.is_grad_enabled():  # a plain backward: nothing records, nothing to mark
        return grads
    return _FirstOrderOnly.apply(op, *grads)


# ------------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm over the rows of x (M, N), unit column stride
# ------------------------------------------------------------------------------------------------


@_op("norm_fwd", launcher="norm:norm_fwd")
def norm_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float, rms: bool,
             out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, mean (empty for RMSNorm), rstd, h = x + residual (empty without residual))."""
    launch = kernels.norm.norm_fwd

    y, mean, rstd, h = launch(x, weight, bias, residual, eps, rms, out_dtype)
    return y, mean, rstd, _or_absent(h, x)


@norm_fwd.register_fake
def _(x, weight, bias, residual, eps, rms, out_dtype):
    rows = x.shape[0]
    stat = dict(device=x.device, dtype=torch.float32)
    h = _absent(x) if residual is None else _like(x)
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype), torch.empty(0 if rms else rows, **stat),
            torch.empty(rows, **stat), h)


@_op("norm_bwd", launcher="norm:norm_bwd")
def norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, mean: Tensor, rstd: Tensor,
             residual_grad: Tensor | None, rms: bool, has_bias: bool, rebuild_output: bool,
             out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias (empty without bias), rebuilt y (empty unless rebuild_output))."""
    launch = kernels.norm.norm_bwd

    dx, dw, db, y = launch(dy, x, weight, bias, mean, rstd, residual_grad, rms, has_bias, rebuild_output, out_dtype)
    return dx, dw, _or_absent(db, dw), _or_absent(y, x)


@norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, residual_grad, rms, has_bias, rebuild_output, out_dtype):
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype) if rebuild_output else _absent(x)
    db = torch.empty_like(weight) if has_bias else _absent(weight)
    return _like(x), torch.empty_like(weight), db, y


# ------------------------------------------------------------------------------------------------
# Attention: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D); or one packed (T, (Hq + 2 Hkv) D) qkv
# ------------------------------------------------------------------------------------------------


@_op("attention_fwd", launcher="attention:attention_fwd")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window: list[int],
                  softcap: float) -> tuple[Tensor, Tensor]:
    """(o (B, Hq, Nq, D) contiguous, lse (B, Hq, Nq) fp32). window: (left, right)."""
    return kernels.attention.attention_fwd(q, k, v, causal, scale, window, softcap)


@attention_fwd.register_fake
def _(q, k, v, causal, scale, window, softcap):
    return _like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@flop_formula("attention_fwd")
def _(q_shape, k_shape, v_shape, causal, scale, window, *_, **__) -> int:
    batch, q_heads, q_len, head_dim = q_shape
    return attention_op_flops(batch, q_heads, head_dim, visible_pairs(q_len, k_shape[2], causal, window))


@_op("attention_bwd")
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor | None,
                  causal: bool, scale: float, window: list[int], softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous, in the shapes and dtypes of q, k, v."""
    launch = kernels.attention.attention_bwd

    return launch(do, q, k, v, o, lse, causal, scale, window=tuple(window), softcap=softcap, dlse=dlse)


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, window, softcap):
    return (_like(q), _like(k), _like(v))


@flop_formula("attention_bwd")
def _(do_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, dlse_shape, causal, scale, window, *_, **__) -> int:
    batch, q_heads, q_len, head_dim = q_shape
    return attention_op_flops(batch, q_heads, head_dim, visible_pairs(q_len, k_shape[2], causal, window),
                              backward=True)


@_op("attention_varlen_fwd")
def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float, window: list[int],
                         softcap: float) -> tuple[Tensor, Tensor]:
    """Packed documents: (o (total_q, Hq, D) contiguous, lse (Hq, total_q) fp32)."""
    launch = kernels.attention.attention_fwd

    return launch(q, k, v, causal, scale, window=tuple(window), softcap=softcap,
                  documents=kernels.attention.Documents((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)))


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap):
    return _like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_flops(q, cu_seqlens_q, cu_seqlens_k, causal, window, backward: bool) -> int:
    """Sum over documents of what visible_pairs counts for each alone."""
    return attention_op_flops(1, q.shape[1], q.shape[2], document_pairs(cu_seqlens_q, cu_seqlens_k, causal, window),
                              backward)


@flop_formula("attention_varlen_fwd", get_raw=True)
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, *_, **__) -> int:
    return _varlen_flops(q, cu_seqlens_q, cu_seqlens_k, causal, window, backward=False)


@_op("attention_varlen_bwd")
def attention_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor | None,
                         cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool, scale: float, window: list[int], softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_varlen_fwd, contiguous, in the shapes and dtypes of q, k, v."""
    launch = kernels.attention.attention_bwd

    return launch(do, q, k, v, o, lse, causal, scale, window=tuple(window), softcap=softcap, dlse=dlse,
                  documents=kernels.attention.Documents((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)))


@attention_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
      softcap):
    return (_like(q), _like(k), _like(v))


@flop_formula("attention_varlen_bwd", get_raw=True)
def _(do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
      *_, **__) -> int:
    return _varlen_flops(q, cu_seqlens_q, cu_seqlens_k, causal, window, backward=True)


def packed_attention_flops(qkv: Tensor, batch: int, n_heads: int, n_kv_heads: int, causal: bool, window,
                           cu_seqlens: Tensor | None, backward: bool = False) -> int:
    """FLOPs of attention on a packed (T, (Hq + 2 Hkv) D) qkv: ``batch`` equal sequences, or the
    documents ``cu_seqlens`` marks in the T tokens."""
    tokens, width = qkv.shape
    head_dim = width // (n_heads + 2 * n_kv_heads)
    if cu_seqlens is None:
        seq = tokens // batch
        pairs = batch * visible_pairs(seq, seq, causal, window)
    else:
        pairs = document_pairs(cu_seqlens, cu_seqlens, causal, window)
    return attention_op_flops(1, n_heads, head_dim, pairs, backward)


def split_heads(qkv: Tensor, batch: int, n_heads: int, n_kv_heads: int):
    """q (B, Hq, N, D), k and v (B, Hkv, N, D) as views of a packed (T, (Hq + 2 Hkv) D) buffer."""
    head_dim = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    heads = qkv.view(batch, qkv.shape[0] // batch, n_heads + 2 * n_kv_heads, head_dim).transpose(1, 2)
    return heads.split_with_sizes((n_heads, n_kv_heads, n_kv_heads), 1)  # one op for the three views


def split_token_heads(qkv: Tensor, n_heads: int, n_kv_heads: int):
    """q (T, Hq, D), k and v (T, Hkv, D), the packed-documents layout, as views of a packed
    (T, (Hq + 2 Hkv) D) buffer."""
    heads = qkv.view(qkv.shape[0], n_heads + 2 * n_kv_heads, qkv.shape[1] // (n_heads + 2 * n_kv_heads))
    return heads.split_with_sizes((n_heads, n_kv_heads, n_kv_heads), 1)


def token_major_heads(t: Tensor, batch: int, n_heads: int) -> Tensor:
    """A (T, H D) token-major buffer seen as (B, H, N, D)."""
    return t.view(batch, t.shape[0] // batch, n_heads, t.shape[1] // n_heads).transpose(1, 2)


def token_heads(t: Tensor, n_heads: int) -> Tensor:
    """A (T, H D) token-major buffer seen as (T, H, D), the packed-documents layout."""
    return t.view(t.shape[0], n_heads, t.shape[1] // n_heads)


def _packed_layout(batch: int, n_heads: int, n_kv_heads: int, cu_seqlens: Tensor | None, max_seqlen: int):
    """(q/k/v views of a packed buffer, the token-major view of o and dO, the launchers' documents)
    for ``batch`` equal sequences, or for the documents of ``cu_seqlens``: the views as partial
    functions of the buffer (no frame of their own per call)."""
    if cu_seqlens is None:
        return (functools.partial(split_heads, batch=batch, n_heads=n_heads, n_kv_heads=n_kv_heads),
                functools.partial(token_major_heads, batch=batch, n_heads=n_heads), None)
    return (functools.partial(split_token_heads, n_heads=n_heads, n_kv_heads=n_kv_heads),
            functools.partial(token_heads, n_heads=n_heads),
            kernels.attention.Documents((cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)))


@_op("attention_packed_fwd")
def attention_packed_fwd(qkv: Tensor, batch: int, n_heads: int, n_kv_heads: int, causal: bool, scale: float,
                         window: list[int], softcap: float, cu_seqlens: Tensor | None,
                         max_seqlen: int) -> tuple[Tensor, Tensor]:
    """Attention of a packed qkv: (o (T, Hq D) token-major, ready for the output projection, lse).
    ``batch`` equal sequences (lse (B, Hq, N)), or the documents ``cu_seqlens`` marks in the T
    tokens (lse (Hq, T))."""
    launch = kernels.attention.attention_packed_fwd

    o = qkv.new_empty(qkv.shape[0], n_heads * (qkv.shape[1] // (n_heads + 2 * n_kv_heads)))
    lse = launch(qkv, o, (batch, n_heads, n_kv_heads, max_seqlen), _packed_layout, causal, scale, window, softcap,
                 cu_seqlens)
    return o, lse


@attention_packed_fwd.register_fake
def _(qkv, batch, n_heads, n_kv_heads, causal, scale, window, softcap, cu_seqlens, max_seqlen):
    head_dim = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    tokens = qkv.shape[0]
    lse_shape = (batch, n_heads, tokens // batch) if cu_seqlens is None else (n_heads, tokens)
    return qkv.new_empty(tokens, n_heads * head_dim), qkv.new_empty(lse_shape, dtype=torch.float32)


@flop_formula("attention_packed_fwd", get_raw=True)
def _(qkv, batch, n_heads, n_kv_heads, causal, scale, window, softcap, cu_seqlens, *_, **__) -> int:
    return packed_attention_flops(qkv, batch, n_heads, n_kv_heads, causal, window, cu_seqlens)


@_op("attention_packed_bwd")
def attention_packed_bwd(do: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, batch: int, n_heads: int,
                         n_kv_heads: int, causal: bool, scale: float, window: list[int], softcap: float,
                         cu_seqlens: Tensor | None, max_seqlen: int) -> Tensor:
    """dqkv (T, (Hq + 2 Hkv) D), packed like qkv, from do and o (T, Hq D) token-major."""
    launch = kernels.attention.attention_packed_bwd

    dqkv = torch.empty_like(qkv)
    launch(do, qkv, o, lse, dqkv, (batch, n_heads, n_kv_heads, max_seqlen), _packed_layout, causal, scale, window,
           softcap, cu_seqlens)
    return dqkv


@attention_packed_bwd.register_fake
def _(do, qkv, o, lse, batch, n_heads, n_kv_heads, causal, scale, window, softcap, cu_seqlens, max_seqlen):
    return torch.empty_like(qkv)


@flop_formula("attention_packed_bwd", get_raw=True)
def _(do, qkv, o, lse, batch, n_heads, n_kv_heads, causal, scale, window, softcap, cu_seqlens, *_, **__) -> int:
    return packed_attention_flops(qkv, batch, n_heads, n_kv_heads, causal, window, cu_seqlens, backward=True)


@_op("rope_qk_", mutates_args=("qkv",))
def rope_qk_(qkv: Tensor, inv_freq: Tensor, batch: int, n_heads: int, n_kv_heads: int, inverse: bool,
             chunk_starts: list[int] | None = None, positions: Tensor | None = None,
             cu_seqlens: Tensor | None = None) -> None:
    """Rotary embedding (positions 0..N-1, two chunks from ``chunk_starts``, per-token ``positions``
    of shape (batch, N), or each token's place in its document for documents packed by
    ``cu_seqlens``; see kernels.rope.rope_) of the q and k heads of a packed qkv or dqkv, in place."""
    head_dim = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    heads = qkv.view(batch, qkv.shape[0] // batch, n_heads + 2 * n_kv_heads, head_dim)
    kernels.rope.rope_(heads[:, :, :n_heads + n_kv_heads], inv_freq, inverse=inverse,
                       chunk_starts=None if chunk_starts is None else tuple(chunk_starts), positions=positions,
                       cu_seqlens=cu_seqlens)


@rope_qk_.register_fake
def _(qkv, inv_freq, batch, n_heads, n_kv_heads, inverse, chunk_starts=None, positions=None, cu_seqlens=None):
    return None


# ------------------------------------------------------------------------------------------------
# Activations
# ------------------------------------------------------------------------------------------------


@_op("gelu_fwd", launcher="activations:gelu_fwd")
def gelu_fwd(x: Tensor, approximate: str) -> Tensor:
    launch = kernels.activations.gelu_fwd

    return launch(x, approximate)


@gelu_fwd.register_fake
def _(x, approximate):
    return _like(x)


@_op("gelu_bwd", launcher="activations:gelu_bwd")
def gelu_bwd(dy: Tensor, x: Tensor, approximate: str, rebuild_output: bool) -> tuple[Tensor, Tensor]:
    """(dx, rebuilt y (empty unless rebuild_output))."""
    launch = kernels.activations.gelu_bwd

    dx, y = launch(dy, x, approximate, rebuild_output=rebuild_output)
    return dx, _or_absent(y, x)


@gelu_bwd.register_fake
def _(dy, x, approximate, rebuild_output):
    return _like(x), _like(x) if rebuild_output else _absent(x)


@_op("swiglu_fwd", launcher="activations:swiglu_fwd")
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    launch = kernels.activations.swiglu_fwd

    return launch(gate, up)


@swiglu_fwd.register_fake
def _(gate, up):
    return _like(gate)


@_op("swiglu_bwd", launcher="activations:swiglu_bwd")
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, rebuild_output: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dgate, dup, rebuilt y (empty unless rebuild_output))."""
    launch = kernels.activations.swiglu_bwd

    dgate, dup, y = launch(dy, gate, up, rebuild_output=rebuild_output)
    return dgate, dup, _or_absent(y, gate)


@swiglu_bwd.register_fake
def _(dy, gate, up, rebuild_output):
    return _like(gate), _like(gate), _like(gate) if rebuild_output else _absent(gate)


# In-place forms, plain functions in ``direct`` only: the block's backward (inside its own
# operator, or eager) writes a gradient over a buffer it owns and no longer needs, which an
# operator's outputs may not do. Each element is read before it is written.


def _in_place(fn):
    setattr(direct, fn.__name__, fn)
    return fn


@_in_place
def gelu_bwd_(dy: Tensor, x: Tensor, approximate: str, rebuild_output: bool,
              y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """gelu_bwd with dx written over dy; the rebuilt output into ``y`` where given (x itself may
    be), else a new tensor. Returns (dx, y or None)."""
    launch = kernels.activations.gelu_bwd

    return launch(dy, x, approximate, rebuild_output=rebuild_output, dx=dy, y=y if rebuild_output else None)


@_in_place
def swiglu_packed_bwd_(dy: Tensor, u: Tensor, rebuild_output: bool,
                       du: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """For u = [gate | up] (M, 2F) and dy (M, F): du = [dgate | dup] written into ``du`` where given
    (u itself may be), else a new tensor, and the rebuilt output over dy. Returns (du, y or None)."""
    launch = kernels.activations.swiglu_bwd

    half = u.shape[1] // 2
    du = torch.empty_like(u) if du is None else du
    _, _, y = launch(dy, u[:, :half], u[:, half:], rebuild_output=rebuild_output, dgate=du[:, :half],
                     dup=du[:, half:], y=dy if rebuild_output else None)
    return du, y

