"""The fused, rematerializing pre-norm Transformer block.

    h = x + out_proj(attention(norm1(x)))
    y = h + fc2(act(fc1(norm2(h))))

One autograd Function runs the whole block on Triton kernels (norms, RoPE, attention, activations)
and cuBLAS matrix products; its forward and backward are each one custom operator, so that
torch.compile cannot change what is kept. What is kept for backward is the ``Remat`` point's
business (``fused_remat.remat``): the forward keeps ``remat.kept()``; the backward first replays
what is missing among qkv, attention's results, h, u and the norm statistics (``_replay``, only
that), and rebuilds the norm and activation outputs it did not keep inside their backward kernels.
Nothing of size N x N is ever kept.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from . import backend, context_parallel, custom_ops, offload, reference
from . import context_parallel_documents as cp_documents
from .backend import autocast_dtype, requested_backend, use_triton
from .flops import attention_op_flops, document_pairs, flop_formula, matmul_flops, visible_pairs
from .kernels.limits import SUPPORTED_DTYPES
from .remat import (COMPUTE, FP32, KEPT_FOR_BACKWARD, RESIDUAL, Kept, Remat, budget_points, check_memory_budget,
                    point_for_call)

_OP = "TransformerBlock"


@dataclass(frozen=True)
class _BlockCall:
    """What one call of the block Function needs besides tensors: the sizes, the block's settings,
    the policy, the compute dtype and the context-parallel process group's name."""

    batch: int
    seq: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms: bool
    activation: str
    causal: bool
    eps: float
    rope_theta: float | None
    remat: Remat
    compute_dtype: torch.dtype
    context_parallel: str = ""  # the context-parallel process group's name; "" for one process
    window: tuple[int, int] = (-1, -1)  # attention's sliding window (left, right), -1 unbounded
    softcap: float = 0.0  # attention's softcap, 0 off
    max_seqlen: int = 0  # the longest document when the tokens are packed documents, else 0
    scale: float = 0.0  # attention's softmax scale; 0 for head_dim ** -0.5
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)
    # documents under context parallelism (_Sequences.key_rows): the longest piece's keys, and where
    # the keys of the second pieces start in the key layout; 0 otherwise
    max_seqlen_k: int = 0
    first_keys: int = 0
    # low-rank adapters (LoRA), one (linear layer's index in _LINEARS, first output row, rows, dropout
    # seed, scale, dropout probability) each
    adapters: tuple[tuple[int, int, int, int, float, float], ...] = ()

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def norm(self) -> str:
        return "rmsnorm" if self.rms else "layernorm"

    @functools.cached_property  # asked by each pass that attends
    def attention_mask(self) -> tuple:
        """(causal, scale, window, softcap) as the attention operators take them."""
        return self.causal, self.softmax_scale, list(self.window), self.softcap

    @property
    def softmax_scale(self) -> float:
        return self.scale or self.head_dim**-0.5

    def op_args(self) -> tuple[list[int], list[float], str]:
        """The call as the block operators take it (``from_op_args`` reverses it), each field by its
        annotation (``_CALL_FIELDS``; an operator's schema has no type for a dataclass): sizes,
        flags and the window in one list of integers, the floats in another (None as NaN), the names
        in one string (``remat`` by its name, the dtype by torch's), and the adapters last in both
        lists, their integers and their floats."""
        ints, floats, names = [], [], []
        for name, kind in _CALL_FIELDS:
            value = getattr(self, name)
            if kind == "int":
                ints.append(value)
            elif kind == "bool":
                ints.append(int(value))
            elif kind == "tuple[int, int]":
                ints.extend(value)
            elif kind == "float":
                floats.append(value)
            elif kind == "float | None":
                floats.append(math.nan if value is None else value)
            elif kind == "str":
                names.append(value)
            elif kind == "Remat":
                names.append(value.value)
            elif kind == "torch.dtype":
                names.append(str(value).removeprefix("torch."))
            elif name == "adapters":
                for adapter in value:
                    ints.extend(adapter[:_ADAPTER_INTS])
                    floats.extend(adapter[_ADAPTER_INTS:])
            else:
                raise TypeError(f"_BlockCall.{name}: {kind} has no form in the block operators' schema")
        return ints, floats, _NAME_SEPARATOR.join(names)

    @classmethod
    def from_op_args(cls, ints: list[int], floats: list[float], names: str) -> _BlockCall:
        ints, floats, names = iter(ints), iter(floats), iter(names.split(_NAME_SEPARATOR))
        values = {}
        for name, kind in _CALL_FIELDS:
            if kind == "int":
                values[name] = next(ints)
            elif kind == "bool":
                values[name] = bool(next(ints))
            elif kind == "tuple[int, int]":
                values[name] = (next(ints), next(ints))
            elif kind == "float":
                values[name] = next(floats)
            elif kind == "float | None":
                number = next(floats)
                values[name] = None if math.isnan(number) else number
            elif kind == "str":
                values[name] = next(names)
            elif kind == "Remat":
                values[name] = Remat(next(names))
            elif kind == "torch.dtype":
                values[name] = getattr(torch, next(names))
            elif name == "adapters":  # what is left of both lists: four integers, then two floats, each
                values[name] = tuple((*itertools.islice(ints, _ADAPTER_INTS), *adapter_floats)
                                     for adapter_floats in zip(floats, floats))
            else:
                raise TypeError(f"_BlockCall.{name}: {kind} has no form in the block operators' schema")
        return cls(**values)

    @functools.cached_property  # asked by each pass that attends, once a call
    def context_parallel_group(self):
        """The process group the sequence is split over, or None."""
        return context_parallel.resolve_group(self.context_parallel) if self.context_parallel else None


# _BlockCall's fields and their annotations, which say how each travels through the operators'
# schema (op_args); each adapter's tuple holds its four integers, then its two floats.
_CALL_FIELDS = tuple((field.name, field.type) for field in fields(_BlockCall))
_ADAPTER_INTS = 4
_NAME_SEPARATOR = "\x1f"  # ASCII's unit separator, which no name holds


# Parameter order of the Function's inputs after x.
_PARAMETERS = (
    "norm1.weight", "norm1.bias", "qkv.weight", "qkv.bias", "out_proj.weight", "out_proj.bias",
    "norm2.weight", "norm2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "q_norm.weight", "k_norm.weight",
)


_PARAMETER_PATHS = tuple(tuple(name.split(".")) for name in _PARAMETERS)  # (module, attribute)


_LINEARS = reference.LINEARS
# The parameters a pass casts to the compute dtype (the linear layers'), in _Weights' order.
_MATMUL_OPERANDS = ("qkv.weight", "qkv.bias", "out_proj.weight", "out_proj.bias", "fc1.weight", "fc1.bias",
                    "fc2.weight", "fc2.bias")


@dataclass(frozen=True)
class _LowRank:
    """One adapter of a linear layer in a pass: ``rows`` of its output get scale * (drop(x) A^T) B^T,
    where drop is inverted dropout with probability ``dropout``, its mask drawn from ``seed``:
    the same mask in forward, replay and backward, and never stored."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (rows, r)
    scale: float
    rows: slice
    index: int  # its place in _BlockCall.adapters
    dtype: torch.dtype  # the adapter's own dtype, its gradients'
    dropout: float
    seed: int

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """x times the dropout mask; callers ask ``self.dropout`` first (no call without dropout)."""
        return x * reference.lora_dropout_scale(x, self.dropout, self.seed)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out[:, self.rows] += ((self._dropped(x) if self.dropout else x) @ self.a.t()) @ (self.scale * self.b).t()

    def add_input_grad(self, dx: torch.Tensor, dy: torch.Tensor) -> None:
        dx_low = ((dy[:, self.rows] @ self.b) * self.scale) @ self.a
        dx += self._dropped(dx_low) if self.dropout else dx_low

    def grads(self, dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dA, dB) from the output's gradient and the input, in the adapter's dtype."""
        if self.dropout:
            x = self._dropped(x)
        d_low = (dy[:, self.rows] @ self.b) * self.scale  # (T, r)
        da = d_low.t() @ x
        db = (dy[:, self.rows] * self.scale).t() @ (x @ self.a.t())
        return da.to(self.dtype), db.to(self.dtype)


_NO_ADAPTERS = dict.fromkeys(_LINEARS, ())  # _Weights.adapters of a call without adapters (never added to)


class _Weights:
    """The block's parameters for one pass: matmul operands in the compute dtype (a cast under
    autocast, never kept across forward and backward), norm weights as they are (fp32 is fine);
    each linear layer's low-rank adapters, likewise cast."""

    def __init__(self, params, compute_dtype: torch.dtype, adapters=(), lora=()):
        named = dict(zip(_PARAMETERS, params))
        self.norm1 = (named["norm1.weight"], named["norm1.bias"])
        self.norm2 = (named["norm2.weight"], named["norm2.bias"])
        (self.qkv, self.qkv_bias, self.out, self.out_bias, self.fc1, self.fc1_bias, self.fc2,
         self.fc2_bias) = [t if t is None or t.dtype == compute_dtype else t.to(compute_dtype)
                           for t in map(named.get, _MATMUL_OPERANDS)]
        self.q_norm, self.k_norm = named["q_norm.weight"], named["k_norm.weight"]
        self.rope_inv_freq = None  # RoPE's inverse frequencies, once the pass has found them (_rope_qk_)
        self.adapters = {name: [] for name in _LINEARS} if adapters else _NO_ADAPTERS
        for index, ((linear, first, rows, seed, scale, dropout), a, b) in enumerate(zip(adapters, lora[0::2], lora[1::2])):
            self.adapters[_LINEARS[linear]].append(
                _LowRank(a.to(compute_dtype), b.to(compute_dtype), scale, slice(first, first + rows),
                         index, a.dtype, dropout, seed))

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        """x W^T + b, plus the layer's adapters."""
        out = F.linear(x, weight, bias)
        for adapter in self.adapters[name]:
            adapter.add_to(out, x)
        return out

    def adapter_grads(self, name: str, dy: torch.Tensor, x: torch.Tensor) -> list:
        """[(index, (dA, dB))] of the layer's adapters."""
        return [(adapter.index, adapter.grads(dy, x)) for adapter in self.adapters[name]]

    def input_grad(self, name: str, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dy W, plus the adapters' share of the input's gradient."""
        dx = dy @ weight
        for adapter in self.adapters[name]:
            adapter.add_input_grad(dx, dy)
        return dx


@dataclass
class _Activations:
    """What the forward produces on the way; each policy keeps a different subset."""

    qkv: torch.Tensor  # (T, (Hq + 2 Hkv) D), q and k already rotated
    o: torch.Tensor  # (T, Hq D): attention output, token-major
    lse: torch.Tensor  # (B, Hq, N) fp32; (Hq, T) for packed documents
    h: torch.Tensor  # (T, dim): residual stream after attention
    u: torch.Tensor  # (T, F): fc1 output, the activation's input
    mean1: torch.Tensor  # fp32 statistics per token (mean is empty for RMSNorm)
    rstd1: torch.Tensor
    mean2: torch.Tensor
    rstd2: torch.Tensor
    y1: torch.Tensor | None = None  # norm1 output
    y2: torch.Tensor | None = None  # norm2 output
    a: torch.Tensor | None = None  # activation output
    # the names whose storage is the backward's to free or overwrite past its last use: what the
    # replay made, and what the forward kept where nothing but this backward will read it again
    owned: frozenset[str] = frozenset()

    def drop(self, *names: str) -> None:
        """Let go of activations after their last use; an owned one's memory is freed at once (a
        kept tensor is also held by autograd, until the whole backward returns)."""
        for name in names:
            tensor = getattr(self, name)
            setattr(self, name, None)
            if tensor is not None and name in self.owned:
                tensor.untyped_storage().resize_(0)  # _free, inline: this runs for every activation

    def take(self, name: str) -> torch.Tensor | None:
        """The activation ``name`` as a buffer to write over (the caller frees it when done), or
        None where it is not owned; either way it is gone from here after this."""
        tensor = getattr(self, name)
        if name not in self.owned:
            return None
        setattr(self, name, None)
        return tensor


def _free(tensor: torch.Tensor) -> None:
    """Frees the memory of a tensor nothing will read again, however many references hold it."""
    tensor.untyped_storage().resize_(0)


def block_widths(dim: int, n_heads: int, n_kv_heads: int | None, ffn_dim: int | None, norm: str,
                 activation: str, head_dim: int | None = None) -> dict[str, int]:
    """Elements per token of each kind of tensor the block keeps (``Kept.width_key``), for one block
    configuration (``head_dim`` None: dim // n_heads)."""
    head_dim = dim // n_heads if head_dim is None else head_dim
    ffn = reference.default_ffn_dim(dim, activation) if ffn_dim is None else ffn_dim
    return dict(
        dim=dim, qkv=(n_heads + 2 * (n_kv_heads or n_heads)) * head_dim, attention=n_heads * head_dim, heads=n_heads, ffn=ffn,
        pre_activation=2 * ffn if activation == "swiglu" else ffn, mean=int(norm == "layernorm"), rstd=1,
    )


@dataclass(frozen=True)
class _Sequences:
    """Where the tokens' sequences and positions come from, besides the (B, N) shape: the documents
    packed in the B N tokens (int32 offsets, None: one sequence per row) and the RoPE positions
    ((B, N) ints, None: each row's or each document's own 0, 1, ...), and RoPE's inverse frequencies
    ((head_dim / 2,) fp32, None: those of the block's rope_theta). Under context parallelism over
    documents (``DocumentShards``), cu_seqlens holds this rank's pieces, position_ids their tokens'
    positions, and ``cu_seqlens_k`` and ``key_rows`` the pieces' keys in every rank's k and v
    gathered (``DocumentKeys``)."""

    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    key_rows: torch.Tensor | None = None

    def document_keys(self, g: _BlockCall, group) -> cp_documents.DocumentKeys:
        return cp_documents.DocumentKeys(group.size(), g.causal, g.window, self.cu_seqlens, self.cu_seqlens_k,
                                         self.key_rows, g.first_keys, g.max_seqlen, g.max_seqlen_k)


def _rope_qk_(qkv: torch.Tensor, g: _BlockCall, seqs: _Sequences, w: _Weights, inverse: bool) -> None:
    """RoPE on the q and k heads of a packed qkv (or, inverse, dqkv) buffer, in place."""
    inv_freq = w.rope_inv_freq
    if inv_freq is None:  # the given frequencies, else rope_theta's: found once a pass
        inv_freq = seqs.rope_inv_freq
        if inv_freq is None:
            inv_freq = _inverse_frequencies(g.head_dim, g.rope_theta, qkv.device)
        w.rope_inv_freq = inv_freq
    group = g.context_parallel_group
    chunk_starts = None
    if group is not None and seqs.key_rows is None:  # the dense ring's zigzag rows; documents have positions
        chunk_starts = list(context_parallel.local_chunk_starts(g.seq, group))
    positions = seqs.position_ids
    # packed documents without positions: the kernel finds each token's place in its document
    custom_ops.direct.rope_qk_(qkv, inv_freq, g.batch, g.n_heads, g.n_kv_heads, inverse, chunk_starts, positions,
                               seqs.cu_seqlens if positions is None else None)


def _inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's D/2 inverse frequencies for ``theta``: kept per (head_dim, theta, device); made in the
    call while a CUDA graph is being captured (its kernels run only at replay, so a tensor kept from
    the capture would hold nothing for the eager calls after it, and a graph must not read a kept
    tensor that the table may drop). Only the block's passes ask, which torch.compile never traces:
    it sees each as one custom operator."""
    if backend.graph_capturing():
        return reference.rope_inverse_frequencies(head_dim, theta, device)
    return _kept_inverse_frequencies(head_dim, theta, device)


@functools.lru_cache(maxsize=64)
def _kept_inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return reference.rope_inverse_frequencies(head_dim, theta, device)


def _qk_pieces(g: _BlockCall) -> list[tuple[slice, str]]:
    """The q and the k columns of a packed qkv buffer, with the name of each one's norm weight."""
    q_width, k_width = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    return [(slice(0, q_width), "q_norm"), (slice(q_width, q_width + k_width), "k_norm")]


def _attention_input(qkv: torch.Tensor, w: _Weights, g: _BlockCall, seqs: _Sequences) -> torch.Tensor:
    """The packed qkv attention reads: q and k rotated by RoPE, in place in ``qkv`` itself; with
    qk_norm, in a copy whose q and k heads are normalized first (each head a row of head_dim), so
    that ``qkv`` stays the projection's output, which is what is kept, and backward rebuilds this."""
    if g.qk_norm:
        qkv = qkv.clone()
        for columns, weight in _qk_pieces(g):
            heads = qkv[:, columns].reshape(-1, g.head_dim)
            y, _, _, _ = custom_ops.direct.norm_fwd(heads, getattr(w, weight), None, None, g.eps, True, g.compute_dtype)
            qkv[:, columns] = y.view(g.tokens, -1)
    if g.rope_theta is not None:
        _rope_qk_(qkv, g, seqs, w, inverse=False)
    return qkv


def _qk_norm_backward(dqkv: torch.Tensor, qkv: torch.Tensor, w: _Weights, g: _BlockCall, needs: dict) -> dict:
    """The q and k heads' norm backward, in place in ``dqkv`` (the gradient of the normalized heads
    becomes that of the projection's output); the statistics are recomputed from the kept ``qkv``.
    Returns the norm weights' gradients."""
    grads = {}
    for columns, weight in _qk_pieces(g):
        heads, norm_weight = qkv[:, columns].reshape(-1, g.head_dim), getattr(w, weight)
        _, mean, rstd, _ = custom_ops.direct.norm_fwd(heads, norm_weight, None, None, g.eps, True, g.compute_dtype)
        dx, dw, _, _ = custom_ops.direct.norm_bwd(dqkv[:, columns].reshape(-1, g.head_dim), heads, norm_weight, None,
                                                  mean, rstd, None, True, False, False, g.compute_dtype)
        dqkv[:, columns] = dx.view(g.tokens, -1)
        if needs[f"{weight}.weight"]:
            grads[f"{weight}.weight"] = dw
    return grads


def _norm_forward(x, weights, g: _BlockCall, residual=None):
    """(y in the compute dtype, mean, rstd, h = x + residual or None)."""
    weight, bias = weights
    return custom_ops.direct.norm_fwd(x, weight, bias, residual, g.eps, g.rms, g.compute_dtype)


def _activation_forward(u: torch.Tensor, g: _BlockCall) -> torch.Tensor:
    if g.activation == "swiglu":
        return custom_ops.direct.swiglu_fwd(u[:, :g.ffn_dim], u[:, g.ffn_dim:])
    return custom_ops.direct.gelu_fwd(u, _approximation(g))


def _approximation(g: _BlockCall) -> str:
    return "tanh" if g.activation == "gelu_tanh" else "none"


def _attend(attended: torch.Tensor, g: _BlockCall, seqs: _Sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's forward on the packed, rotated qkv: (o (T, Hq D) token-major, lse)."""
    group = g.context_parallel_group
    if group is None:
        return custom_ops.direct.attention_packed_fwd(attended, g.batch, g.n_heads, g.n_kv_heads, *g.attention_mask,
                                                      seqs.cu_seqlens, g.max_seqlen)
    o = attended.new_empty(g.tokens, g.n_heads * g.head_dim)
    if seqs.key_rows is not None:
        q, k, v = custom_ops.split_token_heads(attended, g.n_heads, g.n_kv_heads)
        _, lse = cp_documents.document_attention_fwd(q, k, v, seqs.document_keys(g, group), group, g.softmax_scale,
                                                     g.softcap, out=o.view(g.tokens, g.n_heads, g.head_dim))
        return o, lse
    _, lse = context_parallel.ring_attention_fwd(*custom_ops.split_heads(attended, g.batch, g.n_heads, g.n_kv_heads),
                                                 group, g.causal, g.softmax_scale,
                                                 out=custom_ops.token_major_heads(o, g.batch, g.n_heads))
    return o, lse


def _forward_pass(x: torch.Tensor, w: _Weights, g: _BlockCall, seqs: _Sequences) -> tuple[_Activations, torch.Tensor]:
    """Runs the block on x (T, dim). Returns (activations, y (T, dim)); a norm or activation output
    is let go after the product that reads it unless the point keeps it, and y is written over
    fc2's output where their dtypes agree."""
    keeps, kept_outputs = g.remat.keeps, {}
    y1, mean1, rstd1, _ = _norm_forward(x, w.norm1, g)
    qkv = w.linear("qkv", y1, w.qkv, w.qkv_bias)
    if "y1" in keeps:
        kept_outputs["y1"] = y1
    del y1
    o, lse = _attend(_attention_input(qkv, w, g, seqs), g, seqs)
    y2, mean2, rstd2, h = _norm_forward(x, w.norm2, g, residual=w.linear("out_proj", o, w.out, w.out_bias))
    u = w.linear("fc1", y2, w.fc1, w.fc1_bias)
    if "y2" in keeps:
        kept_outputs["y2"] = y2
    del y2
    a = _activation_forward(u, g)
    mlp = w.linear("fc2", a, w.fc2, w.fc2_bias)
    if "a" in keeps:
        kept_outputs["a"] = a
    del a
    y = mlp.add_(h) if mlp.dtype == h.dtype else h + mlp  # a sum is the same either way round
    return _Activations(qkv, o, lse, h, u, mean1, rstd1, mean2, rstd2, **kept_outputs), y


def _replay(x: torch.Tensor, kept: dict, w: _Weights, g: _BlockCall, seqs: _Sequences,
            owned: frozenset[str] = frozenset()) -> _Activations:
    """The activations backward needs, from x and what the point ``kept`` (by name): what is
    missing is computed again as the forward computed it, with the same kernels on the same inputs,
    hence bitwise the same, and nothing more (qkv and its norm only if qkv or norm 1's statistics
    are missing, attention only if its results are, and so on). The norm and activation outputs
    stay as kept (or None: their backward kernels rebuild them). ``owned``: the kept names the
    backward may free; everything replayed is owned too."""
    acts = dict(kept)
    keeps = g.remat.keeps  # by membership: the replay's tests run on every backward
    if "qkv" not in keeps or "rstd1" not in keeps:
        y1, acts["mean1"], acts["rstd1"], _ = _norm_forward(x, w.norm1, g)
        if "qkv" not in keeps:
            acts["qkv"] = w.linear("qkv", y1, w.qkv, w.qkv_bias)
            if not g.qk_norm:
                _attention_input(acts["qkv"], w, g, seqs)  # RoPE in place: the forward kept qkv rotated
        del y1
    if "o" not in keeps:
        attended = _attention_input(acts["qkv"], w, g, seqs) if g.qk_norm else acts["qkv"]
        acts["o"], acts["lse"] = _attend(attended, g, seqs)
        del attended
    if "h" not in keeps or "u" not in keeps or "rstd2" not in keeps:
        if "h" not in keeps:
            y2, acts["mean2"], acts["rstd2"], acts["h"] = _norm_forward(
                x, w.norm2, g, residual=w.linear("out_proj", acts["o"], w.out, w.out_bias))
        else:
            # norm 2 normalizes the rounded sum, which is what h holds: its statistics and output
            # from h alone are bitwise the forward's
            y2, acts["mean2"], acts["rstd2"], _ = _norm_forward(acts["h"], w.norm2, g)
        if "u" not in keeps:
            acts["u"] = w.linear("fc1", y2, w.fc1, w.fc1_bias)
    return _Activations(**acts, owned=owned | (acts.keys() - kept.keys()))


def _weight_grad(needed: bool, grad_out: torch.Tensor, inputs: torch.Tensor, param: torch.Tensor | None):
    if not needed:
        return None
    grad = grad_out.t() @ inputs
    return grad if grad.dtype == param.dtype else grad.to(param.dtype)


def _bias_grad(grad_out: torch.Tensor, param: torch.Tensor):
    grad = grad_out.sum(dim=0, dtype=torch.float32)
    return grad if grad.dtype == param.dtype else grad.to(param.dtype)


# The block as two custom operators, so that torch.compile sees each as one opaque node: traced
# through, its partitioner would be free to save what it likes between forward and backward (it
# merges the ``full`` replay with the forward and keeps cheap's tensors), and the policy would be lost.
# Outputs a policy does not keep come back as empty tensors, so both ops have fixed signatures.
_SLOTS = tuple(k for k in KEPT_FOR_BACKWARD if k.name != "x")


@torch.library.custom_op("fused_remat::block_fwd", mutates_args=())
def _block_fwd(x: torch.Tensor, sequences: list[torch.Tensor | None], params: list[torch.Tensor],
               has_param: list[bool], lora: list[torch.Tensor], ints: list[int], floats: list[float],
               names: str) -> list[torch.Tensor]:
    """[y (T, dim), then each of _SLOTS: the activation if the call's point keeps it, else empty]
    for x (T, dim).

    ``sequences``: the _Sequences fields; ``params`` the block's parameters that exist
    (``has_param`` says which of _PARAMETERS); ``lora`` the adapters' (A, B) pairs in the order of
    ``_BlockCall.adapters``; ``ints``, ``floats`` and ``names``: the _BlockCall (``op_args``)."""
    g = _BlockCall.from_op_args(ints, floats, names)
    return _filled(_block_forward(x, g, _Sequences(*sequences), _with_absent(params, has_param), lora), x)


def _block_forward(x: torch.Tensor, g: _BlockCall, seqs: _Sequences, params: list, lora: list) -> list:
    """block_fwd's implementation, for the operator and for eager calls, which come straight here:
    None for each slot the point does not keep (the operator fills those in). Runs with autocast off
    (the compute dtype is chosen already)."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return _block_forward(x, g, seqs, params, lora)
    weights = _Weights(params, g.compute_dtype, g.adapters, lora)
    acts, y = _forward_pass(x, weights, g, seqs)
    return [y, *[getattr(acts, k.name) if keeps else None for k, keeps in zip(_SLOTS, g.remat.keeps_each)]]


def _filled(tensors: list, like: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` with each None replaced by an empty tensor: a custom operator's list output (or
    input) holds tensors only."""
    return [like.new_empty(0) if t is None else t for t in tensors]


@_block_fwd.register_fake
def _(x, sequences, params, has_param, lora, *call):
    g = _BlockCall.from_op_args(*call)
    return [torch.empty_like(x),
            *(_kept_like(k, g, x) if keeps else x.new_empty(0) for k, keeps in zip(_SLOTS, g.remat.keeps_each))]


def _kept_like(kept: Kept, g: _BlockCall, x: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of the shape and dtype the forward gives the kept activation."""
    width = block_widths(g.dim, g.n_heads, g.n_kv_heads, g.ffn_dim, g.norm, g.activation, g.head_dim)[kept.width_key]
    dtype = {RESIDUAL: x.dtype, COMPUTE: g.compute_dtype, FP32: torch.float32}[kept.dtype]
    if kept.width_key == "heads":
        shape = (g.n_heads, g.tokens) if g.max_seqlen else (g.batch, g.n_heads, g.seq)
    elif kept.width_key in ("mean", "rstd"):
        shape = (g.tokens * width,)
    else:
        shape = (g.tokens, width)
    return x.new_empty(shape, dtype=dtype)


@torch.library.custom_op("fused_remat::block_bwd", mutates_args=())
def _block_bwd(dy: torch.Tensor, x: torch.Tensor, sequences: list[torch.Tensor | None], kept: list[torch.Tensor],
               params: list[torch.Tensor], has_param: list[bool], needs: list[bool], lora: list[torch.Tensor],
               ints: list[int], floats: list[float], names: str) -> list[torch.Tensor]:
    """[dx, then the gradient of each of ``params`` (empty where ``needs`` is False), then of each of
    ``lora``] from dy (T, dim), x and the ``_SLOTS`` the forward returned; the rest as block_fwd's."""
    g = _BlockCall.from_op_args(ints, floats, names)
    return _filled(_block_backward(dy, x, g, _Sequences(*sequences), kept, _with_absent(params, has_param),
                                   _needed(has_param, needs), lora), x)


def _block_backward(dy: torch.Tensor, x: torch.Tensor, g: _BlockCall, seqs: _Sequences, kept: list, params: list,
                    needed: dict, lora: list, owned: frozenset[str] = frozenset()) -> list:
    """block_bwd's implementation, for the operator and for eager calls, which come straight here.
    ``params``: all of _PARAMETERS, None where absent; ``needed``: whether each present one needs
    its gradient, by name; ``owned``: the names of the kept activations it may free or overwrite
    (``_BlockFunction.backward``; an operator's inputs never are). A parameter's gradient is None
    where not needed (the operator fills those in). Runs with autocast off, as the forward."""
    if torch.is_autocast_enabled(dy.device.type):
        with torch.autocast(dy.device.type, enabled=False):
            return _block_backward(dy, x, g, seqs, kept, params, needed, lora, owned)
    named = dict(zip(_PARAMETERS, params))
    w = _Weights(params, g.compute_dtype, g.adapters, lora)
    kept_acts = {k.name: t for k, t, keeps in zip(_SLOTS, kept, g.remat.keeps_each) if keeps}
    acts = _replay(x, kept_acts, w, g, seqs, owned)
    needs = {name: needed.get(name, False) for name in _PARAMETERS}
    grads = _backward_pass(dy.contiguous(), x, acts, w, g, seqs, needs, named)
    return [grads["x"], *[grads.get(name) for name in needed], *grads["lora"]]


@_block_bwd.register_fake
def _(dy, x, sequences, kept, params, has_param, needs, lora, *call):
    return [torch.empty_like(x), *(torch.empty_like(p) if need else x.new_empty(0) for p, need in zip(params, needs)),
            *(torch.empty_like(t) for t in lora)]


# What the block operators run, for FlopCounterMode (which does not see inside a custom operator):
# the four linear layers and attention; norms, activations and RoPE are element-wise, not counted.
def _linear_shapes(g: _BlockCall) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer."""
    widths = block_widths(g.dim, g.n_heads, g.n_kv_heads, g.ffn_dim, g.norm, g.activation, g.head_dim)
    return {"qkv": (g.dim, widths["qkv"]), "out_proj": (g.n_heads * g.head_dim, g.dim),
            "fc1": (g.dim, widths["pre_activation"]), "fc2": (widths["ffn"], g.dim)}


def _attention_pairs(g: _BlockCall, seqs: _Sequences) -> int:
    """(query, key) pairs per head this process computes, over all its sequences or documents: under
    context parallelism its share of the whole sequences', which the zigzag layout makes equal on
    every rank (over documents: its pieces against their keys, ``cu_seqlens_k``)."""
    if seqs.cu_seqlens is not None:
        keys = seqs.cu_seqlens if seqs.cu_seqlens_k is None else seqs.cu_seqlens_k
        return document_pairs(seqs.cu_seqlens, keys, g.causal, g.window)
    group = g.context_parallel_group
    world = 1 if group is None else group.size()
    return g.batch * (visible_pairs(g.seq * world, g.seq * world, g.causal, g.window) // world)


def _adapter_flops(g: _BlockCall, lora, layers, backward: bool = False) -> int:
    """The low-rank products of the adapters on ``layers``: x A^T, then times B^T, forward; in
    backward dy B, times A (the input's gradient), dA, x A^T again and dB."""
    total = 0
    for (linear, _, rows, *_), a in zip(g.adapters, lora[0::2]):
        if _LINEARS[linear] in layers:
            rank, inputs = a.shape
            total += matmul_flops(g.tokens, rank, 3 * inputs + 2 * rows if backward else inputs + rows)
    return total


# The linear layer whose output each replayable tensor is (attention's results are attention's)
_REPLAYED_BY = {"qkv": "qkv", "h": "out_proj", "u": "fc1"}


def _forward_flops(g: _BlockCall, seqs: _Sequences, lora=(),
                   replay: bool = False) -> int:
    """The forward's products; ``replay``: those of backward's replay, which runs a linear layer
    only for the tensor the point did not keep, and attention only where it kept neither its output
    nor its log-sum-exp (``_replay``)."""
    if replay:
        layers = tuple(layer for name, layer in _REPLAYED_BY.items() if g.remat.rebuilds(name))
    else:
        layers = _LINEARS
    linear = sum(matmul_flops(g.tokens, *_linear_shapes(g)[name]) for name in layers) + _adapter_flops(g, lora, layers)
    if replay and not g.remat.rebuilds("o"):
        return linear
    return linear + attention_op_flops(1, g.n_heads, g.head_dim, _attention_pairs(g, seqs))


@flop_formula("block_fwd", get_raw=True)
def _(x, sequences, params, has_param, lora, *call, **_) -> int:
    return _forward_flops(_BlockCall.from_op_args(*call), _Sequences(*sequences), lora=lora)


@flop_formula("block_bwd", get_raw=True)
def _(dy, x, sequences, kept, params, has_param, needs, lora, *call, **_) -> int:
    g = _BlockCall.from_op_args(*call)
    seqs = _Sequences(*sequences)
    needed = _needed(has_param, needs)
    # Each linear layer's input gradient always (it carries dx), its weight gradient where asked.
    linear = sum(matmul_flops(g.tokens, *shape) * (1 + needed.get(f"{name}.weight", False))
                 for name, shape in _linear_shapes(g).items())
    linear += _adapter_flops(g, lora, _LINEARS, backward=True)
    attention = attention_op_flops(1, g.n_heads, g.head_dim, _attention_pairs(g, seqs), backward=True)
    return linear + attention + _forward_flops(g, seqs, lora=lora, replay=True)


def _needed(has_param, needs) -> dict[str, bool]:
    """Whether each parameter the block has needs its gradient, by name."""
    return dict(zip([name for name, has in zip(_PARAMETERS, has_param) if has], needs))


def _with_absent(params, has_param) -> list[torch.Tensor | None]:
    """All of _PARAMETERS in order, None for those the block does not have (no bias)."""
    given = iter(params)
    return [next(given) if has else None for has in has_param]


_SEQUENCE_FIELDS = len(fields(_Sequences))


def _split_inputs(inputs) -> tuple[list, list, list]:
    """(the _Sequences fields, the _PARAMETERS, the adapters' factors) of the Function's inputs after x and the call."""
    params_end = _SEQUENCE_FIELDS + len(_PARAMETERS)
    return list(inputs[:_SEQUENCE_FIELDS]), list(inputs[_SEQUENCE_FIELDS:params_end]), list(inputs[params_end:])


@custom_ops.cached_forward_signature
class _BlockFunction(torch.autograd.Function):
    """The block's autograd: the two custom operators above, and what is kept between them."""

    @staticmethod
    def forward(x, g: _BlockCall, *inputs):
        """``inputs``: the _Sequences fields, the block's _PARAMETERS (None where absent), each
        adapter's A and B, then ``custom_ops.apply``'s untraced."""
        *inputs, untraced = inputs
        sequences, params, lora = _split_inputs(inputs)
        if untraced or not custom_ops.through_operators(x.device):
            return tuple(_block_forward(x, g, _Sequences(*sequences), list(params), lora))
        has_param = [p is not None for p in params]
        return tuple(_block_fwd(x, sequences, [p for p in params if p is not None], has_param, lora, *g.op_args()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, g, *rest, untraced = inputs
        _keep_for_backward(ctx, x, g, *_split_inputs(rest), output[1:], untraced)
        ctx.mark_non_differentiable(*[t for t in output[1:] if t is not None])

    @staticmethod
    def backward(ctx, dy, *_):
        g: _BlockCall = ctx.call
        x, *saved = ctx.saved_tensors
        if ctx.host_copy is not None:
            x = ctx.host_copy.fetch()
        shape = x.shape  # (B, N, dim) where _EagerBlockFunction took x as given, else (T, dim)
        if len(shape) == 3:
            x, dy = x.view(g.tokens, g.dim), dy.reshape(g.tokens, g.dim)
        saved = iter(saved)
        sequences = [next(saved) if given else None for given in ctx.sequences]
        saved = list(saved)
        slots_kept = g.remat.keeps_each
        n_lora = 2 * len(g.adapters)
        kept_tensors = iter(saved[:sum(slots_kept)])
        params, lora = saved[sum(slots_kept):len(saved) - n_lora], saved[len(saved) - n_lora:]
        kept = [next(kept_tensors) if keeps else None for keeps in slots_kept]
        first_param = 2 + _SEQUENCE_FIELDS
        needs_params = ctx.needs_input_grad[first_param:first_param + len(_PARAMETERS)]
        needs = [need for need, has in zip(needs_params, ctx.has_param) if has]
        if custom_ops.through_operators(dy.device):
            dx, *grads = _block_bwd(dy, x, sequences, _filled(kept, x), params, ctx.has_param, needs, lora,
                                    *g.op_args())
        else:
            dx, *grads = _block_backward(dy, x, g, _Sequences(*sequences), kept,
                                         _with_absent(params, ctx.has_param), _needed(ctx.has_param, needs), lora,
                                         _owned_kept(ctx.kept_addresses, kept))
        dparams = iter([d if need else None for d, need in zip(grads[:len(needs)], needs)])
        dlora = [d if need else None for d, need in zip(grads[len(needs):], ctx.needs_input_grad[first_param + len(_PARAMETERS):])]
        return custom_ops.first_order_only(_OP, dx.view(shape), None, *[None] * _SEQUENCE_FIELDS,
                                           *[next(dparams) if has else None for has in ctx.has_param], *dlora, None)


def _keep_for_backward(ctx, x, g: _BlockCall, sequences: list, params: list, lora: list, kept: list,
                       untraced: bool) -> None:
    """Everything kept for backward, in one place: x (or, offloaded, its host copy), the policy's
    activations (``remat.kept()``; ``kept`` holds one per _SLOTS entry), the parameters as themselves
    (no copies; under autocast backward casts them again), the adapters' factors likewise, and the
    documents' offsets and positions where given (the model's inputs, shared by every layer), and
    RoPE's frequencies where given. ``untraced``: the call is known not to be traced (else asked)."""
    ctx.host_copy = offload.HostCopy(x) if g.remat.host_resident else None
    ctx.sequences = [t is not None for t in sequences]
    ctx.save_for_backward(x if ctx.host_copy is None else ctx.host_copy.host,
                          *[t for t in sequences if t is not None],
                          *[t for t, keeps in zip(kept, g.remat.keeps_each) if keeps],
                          *[p for p in params if p is not None], *lora)
    ctx.call, ctx.has_param = g, [p is not None for p in params]
    # Where autograd alone will hold the kept activations (no saved-tensor hook, which may keep or
    # pool what it packs), their addresses, so that backward can tell they are still these and free
    # each at its last use
    ctx.kept_addresses = None
    if (untraced or not custom_ops.traced(x.device)) and _SAVED_TENSOR_HOOKS is not None \
            and _SAVED_TENSOR_HOOKS(True) is None:
        ctx.kept_addresses = [t.data_ptr() for t in kept if t is not None]
    ctx.set_materialize_grads(False)  # the kept activations' gradients come as None, not zeros


@custom_ops.cached_forward_signature
class _EagerBlockFunction(torch.autograd.Function):
    """The block's Function where nothing traces the call (``custom_ops.traced`` False): the same
    forward, keeps and backward as _BlockFunction, with x (B, N, dim) and y as the module's, and the
    kept activations held as the forward's own tensors instead of returned as outputs. Autograd
    wraps, marks and routes each output of a Function, and its views into and out of (T, dim) are
    nodes of their own: this way the call makes one node with one output. Its forward takes a ctx
    (there is no output to set up from), which functorch transforms refuse; they are traced, so
    they take _BlockFunction."""

    @staticmethod
    def forward(ctx, x, g: _BlockCall, *inputs):
        """``inputs`` as _BlockFunction.forward's; x contiguous."""
        sequences, params, lora = _split_inputs(inputs[:-1])
        y, *kept = _block_forward(x.view(g.tokens, g.dim), g, _Sequences(*sequences), list(params), lora)
        _keep_for_backward(ctx, x, g, sequences, params, lora, kept, True)
        # y is the product's own (T, dim) tensor, reshaped in place: a view returned from a Function
        # would forbid in-place ops on the block's output
        return y.resize_(x.shape)

    backward = staticmethod(_BlockFunction.backward)


# Whether saved-tensor hooks are active, and whether this backward may run again (None where this
# torch lacks them: then nothing kept is freed early)
_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _owned_kept(kept_addresses: list[int] | None, kept: list) -> frozenset[str]:
    """The kept activations (``_SLOTS`` entries, None where not kept) an eager backward may free at
    their last use: none if a saved-tensor hook packed them, if this backward may run again
    (retain_graph) or if a CUDA graph is being captured; else those whose memory is still the one
    the forward kept."""
    if kept_addresses is None or _KEEP_GRAPH is None or _KEEP_GRAPH() or backend.graph_capturing():
        return frozenset()
    names = [slot.name for slot, t in zip(_SLOTS, kept) if t is not None]
    tensors = [t for t in kept if t is not None]
    still = map(operator.eq, map(operator.methodcaller("data_ptr"), tensors), kept_addresses)  # no frame per tensor
    return frozenset(itertools.compress(names, still))


def _backward_pass(dy, x, acts: _Activations, w: _Weights, g: _BlockCall, seqs: _Sequences, needs: dict,
                   named: dict) -> dict:
    """Gradients of the block from dy (T, dim), in the order the forward ran, reversed.

    Each activation is let go at its last use (``acts.drop``), and the activation's backward writes
    over buffers that are done: its input gradient over the incoming one, and, where ``u`` is owned,
    its outputs into u's memory. Where the point kept a norm or activation output, the weight
    gradient that reads it runs first, so that it is gone before the input gradients allocate;
    where it did not (``acts.y1``, ``y2`` or ``a`` is None), the backward kernel that computes the
    op's input gradient also writes it, and it lives only until the weight gradient that needs it."""
    grads = {}
    adapter_grads = []  # (index, (dA, dB)) of each adapter

    def weight_grads(linear: str, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
        grads[f"{linear}.weight"] = _weight_grad(needs[f"{linear}.weight"], grad_out, inputs, named[f"{linear}.weight"])
        if w.adapters[linear]:
            adapter_grads.extend(w.adapter_grads(linear, grad_out, inputs))

    def linear_and_norm_backward(linear: str, weight: torch.Tensor, grad_out: torch.Tensor, n: int,
                                 norm_input: torch.Tensor, residual_grad: torch.Tensor) -> torch.Tensor:
        """Back through a linear layer and norm ``n`` (1 or 2), whose output y{n} it reads: the
        layer's weight gradients, and the norm's input gradient plus ``residual_grad``, returned.
        ``grad_out``, the layer's output gradient, is freed after its last use; so are the norm's
        statistics."""
        output, norm = f"y{n}", f"norm{n}"
        kept = getattr(acts, output) is not None
        if kept:
            weight_grads(linear, grad_out, getattr(acts, output))
            acts.drop(output)
        d_output = w.input_grad(linear, grad_out, weight)
        dx_norm, grads[f"{norm}.weight"], grads[f"{norm}.bias"], rebuilt = _norm_backward(
            d_output, norm_input, getattr(w, norm), getattr(acts, f"mean{n}"), getattr(acts, f"rstd{n}"),
            residual_grad, not kept, g)
        del d_output
        acts.drop(f"mean{n}", f"rstd{n}")
        if not kept:
            weight_grads(linear, grad_out, rebuilt)
        _free(grad_out)
        return dx_norm

    dz = dy.to(g.compute_dtype)
    grads["fc2.bias"] = _bias_grad(dz, named["fc2.bias"]) if needs["fc2.bias"] else None
    kept_a = acts.a is not None
    if kept_a:
        weight_grads("fc2", dz, acts.a)
        acts.drop("a")
    du, a = _activation_backward(w.input_grad("fc2", dz, w.fc2), acts, g, rebuild=not kept_a)
    if not kept_a:
        weight_grads("fc2", dz, a)
        _free(a)  # in the input gradient's memory, u's or its own
    del a, dz

    grads["fc1.bias"] = _bias_grad(du, named["fc1.bias"]) if needs["fc1.bias"] else None
    dh = linear_and_norm_backward("fc1", w.fc1, du, 2, acts.h, dy)
    acts.drop("h")
    del du

    d_attn = dh.to(g.compute_dtype)
    grads["out_proj.bias"] = _bias_grad(d_attn, named["out_proj.bias"]) if needs["out_proj.bias"] else None
    weight_grads("out_proj", d_attn, acts.o)
    group = g.context_parallel_group
    attended = _attention_input(acts.qkv, w, g, seqs) if g.qk_norm else acts.qkv
    if group is None:
        dqkv = custom_ops.direct.attention_packed_bwd(w.input_grad("out_proj", d_attn, w.out), attended, acts.o, acts.lse,
                                                      g.batch, g.n_heads, g.n_kv_heads, *g.attention_mask,
                                                      seqs.cu_seqlens, g.max_seqlen)
    elif seqs.key_rows is not None:
        dqkv = torch.empty_like(acts.qkv)
        heads = (g.tokens, g.n_heads, g.head_dim)
        cp_documents.document_attention_bwd(
            w.input_grad("out_proj", d_attn, w.out).view(heads),
            *custom_ops.split_token_heads(attended, g.n_heads, g.n_kv_heads), acts.o.view(heads), acts.lse,
            seqs.document_keys(g, group), group, g.softmax_scale, g.softcap,
            out=custom_ops.split_token_heads(dqkv, g.n_heads, g.n_kv_heads))
    else:
        dqkv = torch.empty_like(acts.qkv)
        grads_qkv = context_parallel.ring_attention_bwd(
            custom_ops.token_major_heads(w.input_grad("out_proj", d_attn, w.out), g.batch, g.n_heads),
            *custom_ops.split_heads(attended, g.batch, g.n_heads, g.n_kv_heads),
            custom_ops.token_major_heads(acts.o, g.batch, g.n_heads), acts.lse, group, g.causal, g.softmax_scale)
        for packed, grad in zip(custom_ops.split_heads(dqkv, g.batch, g.n_heads, g.n_kv_heads), grads_qkv):
            packed.copy_(grad)
        del grads_qkv
    del d_attn, attended
    acts.drop("o", "lse")
    if g.rope_theta is not None:
        _rope_qk_(dqkv, g, seqs, w, inverse=True)
    if g.qk_norm:
        grads.update(_qk_norm_backward(dqkv, acts.qkv, w, g, needs))
    acts.drop("qkv")

    grads["qkv.bias"] = _bias_grad(dqkv, named["qkv.bias"]) if needs["qkv.bias"] else None
    grads["x"] = linear_and_norm_backward("qkv", w.qkv, dqkv, 1, x, dh)
    del dqkv
    grads = {name: grad for name, grad in grads.items() if name == "x" or needs[name]}
    grads["lora"] = [grad for _, pair in sorted(adapter_grads, key=lambda item: item[0]) for grad in pair]
    return grads


def _activation_backward(da: torch.Tensor, acts: _Activations, g: _BlockCall, rebuild: bool):
    """(du, the rebuilt activation output or None) from da, the gradient of the activation's
    output, and the kept or replayed ``acts.u``, which is let go. GELU writes du over da, and the
    output it rebuilds into u's memory where u is owned; SwiGLU writes du into u's memory where
    owned, and the output it rebuilds over da."""
    u = acts.u
    if g.activation == "swiglu":
        du, a = custom_ops.direct.swiglu_packed_bwd_(da, u, rebuild, du=acts.take("u"))
    else:
        du, a = custom_ops.direct.gelu_bwd_(da, u, _approximation(g), rebuild, y=acts.take("u") if rebuild else None)
    acts.drop("u")  # where it was not taken
    return du, a


def _norm_backward(dy, x, weights, mean, rstd, residual_grad, rebuild: bool, g: _BlockCall):
    """(dx + residual_grad, dweight, dbias or None, the rebuilt norm output or None)."""
    weight, bias = weights
    return custom_ops.direct.norm_bwd(dy, x, weight, bias, mean, rstd, residual_grad, g.rms, bias is not None, rebuild,
                                      g.compute_dtype)


def _budget_point(budget: float, configuration: tuple, residual_dtype: torch.dtype, compute_dtype: torch.dtype,
                  seq_len: int, causal: bool, window: tuple[int, int]) -> Remat:
    """``remat.point_for_call`` for a block of ``configuration`` (``block_widths``' arguments)."""
    return point_for_call(budget, block_widths(*configuration), residual_dtype.itemsize, compute_dtype.itemsize, seq_len,
                          causal, window)


_kept_budget_point = functools.lru_cache(maxsize=1024)(_budget_point)


_eager_apply = None


def _eager_block_function():
    """The block Function, never traced by torch.compile (a graph break, not an error): with x
    offloaded, the copies to and from host memory run on a side stream with events, which
    torch.compile does not trace. Made on first use: torch.compiler.disable imports the compiler
    (slow), which a model without offloaded layers should not pay at import."""
    global _eager_apply
    if _eager_apply is None:
        _eager_apply = torch.compiler.disable(_BlockFunction.apply)
    return _eager_apply


class TransformerBlock(reference.TransformerBlock):
    """Pre-norm Transformer block on fused Triton kernels that keeps little for backward.

        h = x + out_proj(attention(norm1(x)))
        y = h + fc2(act(fc1(norm2(h))))

    Same constructor, parameters and function as ``fused_remat.reference.TransformerBlock`` (load
    either's state dict into the other), plus ``remat``, a ``Remat`` or its name (settable between
    steps): ``"cheap"`` (default) keeps x, qkv, the attention output and log-sum-exp, h, the fc1
    output and the norm statistics, and rebuilds norm and activation outputs inside the backward
    kernels; ``"none"`` also keeps those (what an eager block keeps); ``"selective"`` keeps x and
    attention's output and log-sum-exp and replays the rest of the forward up to fc1 in backward;
    ``"full"`` keeps only x and replays the forward, attention included; ``"offload"`` is ``full``
    with x in pinned host memory, copied there and back on a side stream (``fused_remat.offload``;
    under torch.compile the block then runs eagerly, a graph break); ``"keep:o,lse,h"`` and the like
    keep x and the tensors named, and replay only what is missing. ``fused_remat.remat`` tells each
    point's bytes.

    ``memory_budget`` (settable; default None), instead of ``remat``: a fraction f in [0, 1],
    torch.compile's ``activation_memory_budget`` in our terms: each call keeps at most f times what
    ``"none"`` keeps per token, choosing the point with the least replay for the call's sequence
    length (attention's replay grows with it, the projections' do not; ``remat.point_for_call``).
    1 gives ``cheap``; below x's share of ``none`` (every point on the device keeps x), ``offload``.
    Every point gives bitwise the same gradients. Given both, the constructor refuses them; under a
    budget, setting ``remat`` is refused until ``memory_budget`` is None again.

    x: (B, N, dim) in fp16, bf16 or fp32, the parameters' dtype — or any float parameters under
    ``torch.autocast``, which runs the matmuls and attention in the autocast dtype while x, h and y
    stay in x's dtype. CUDA runs compiled Triton; CPU runs the Triton interpreter under
    ``TRITON_INTERPRET=1`` and otherwise the reference block (the policies that replay through
    torch.utils.checkpoint).

    ``context_parallel`` (attribute, default None): a process group over which every sequence is
    split (``fused_remat.context_parallel``): x is then this rank's two zigzag chunks (B, 2C, dim),
    RoPE uses their true positions and attention runs as a ring over the group. Every policy keeps
    what it keeps without it, for the local tokens; ``full``'s replay re-runs the ring in backward.
    """

    SUPPORTED_REMAT = None  # any point: the named policies and every "keep:..." subset

    def __init__(self, dim: int, n_heads: int, *, n_kv_heads: int | None = None, ffn_dim: int | None = None,
                 norm: str = "layernorm", activation: str = "gelu", bias: bool = True, causal: bool = True,
                 eps: float = 1e-5, rope_theta: float | None = None, window: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, attention_scale: float | None = None, qk_norm: bool = False,
                 head_dim: int | None = None, remat: Remat | str | None = None, memory_budget: float | None = None,
                 device=None, dtype=None):
        if remat is not None and memory_budget is not None:
            raise ValueError(f"{_OP}: remat={remat!r} and memory_budget={memory_budget!r} are two ways to say what to "
                             "keep; give one (memory_budget chooses each call's point itself)")
        self._memory_budget = None
        super().__init__(dim, n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, norm=norm, activation=activation,
                         bias=bias, causal=causal, eps=eps, rope_theta=rope_theta, window=window, softcap=softcap,
                         attention_scale=attention_scale, qk_norm=qk_norm, head_dim=head_dim,
                         remat=Remat.CHEAP if remat is None else remat, device=device, dtype=dtype)
        self.memory_budget = memory_budget
        self.context_parallel = None

    @property
    def remat(self) -> Remat:
        return self._remat

    @remat.setter
    def remat(self, policy: Remat | str) -> None:
        if self._memory_budget is not None:
            raise ValueError(f"{type(self).__name__}: remat={policy!r} would not be used: memory_budget "
                             f"{self._memory_budget:g} chooses each call's point; set memory_budget = None first")
        self._remat = Remat.parse(policy, owner=f"{type(self).__name__}: remat")

    @property
    def memory_budget(self) -> float | None:
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, fraction: float | None) -> None:
        self._memory_budget = check_memory_budget(fraction, owner=f"{_OP}: memory_budget")
        budget_points()  # made here, eagerly: torch.compile cannot trace making them in forward

    def budget_point(self, seq_len: int, residual_dtype: torch.dtype, compute_dtype: torch.dtype) -> Remat:
        """The point this block runs under its ``memory_budget`` for a call whose attention spans
        ``seq_len`` tokens (the longest packed document, or the whole sequence), with x in
        ``residual_dtype`` and the matmuls in ``compute_dtype`` (``remat.point_for_call``)."""
        return _budget_point(self._memory_budget, (self.dim, self.n_heads, self.n_kv_heads, self.ffn_dim, self.norm,
                                                   self.activation, self.head_dim),
                             residual_dtype, compute_dtype, seq_len, self.causal, self.window)

    def _call_remat(self, x: torch.Tensor, max_seqlen: int, compute_dtype: torch.dtype | None = None) -> Remat:
        """``remat``, or under ``memory_budget`` this call's ``budget_point``: priced at the longest
        document, the whole sequence under context parallelism."""
        budget = self._memory_budget
        if budget is None:
            return self._remat
        seq = max_seqlen or x.shape[1]
        if self.context_parallel is not None:
            seq *= self.context_parallel.size()
        # the point kept per configuration and call, looked up without a Python call; searched while
        # torch.compile traces, which cannot trace the table
        choose = _budget_point if torch.compiler.is_dynamo_compiling() else _kept_budget_point
        return choose(budget, (self.dim, self.n_heads, self.n_kv_heads, self.ffn_dim, self.norm, self.activation,
                               self.head_dim), x.dtype, compute_dtype or autocast_dtype(x.device.type) or x.dtype, seq,
                      self.causal, tuple(self.window))

    @classmethod
    def from_reference(cls, block: reference.TransformerBlock, remat: Remat | str = Remat.CHEAP) -> TransformerBlock:
        """The fused twin of ``block``: same configuration, and the same parameter storage (no copy;
        build the optimizer after swapping)."""
        config = block.config()
        fused = cls(config.pop("dim"), config.pop("n_heads"), remat=remat, device="meta", **config)
        fused.load_state_dict(block.state_dict(), assign=True)
        for ours, theirs in zip(fused.parameters(), block.parameters()):
            ours.requires_grad_(theirs.requires_grad)
        return fused

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                position_ids: torch.Tensor | None = None, rope_inv_freq: torch.Tensor | None = None,
                adapters=None, documents: cp_documents.DocumentShards | None = None) -> torch.Tensor:
        """x (B, N, dim) -> (B, N, dim); ``cu_seqlens``, ``max_seqlen``, ``position_ids``,
        ``rope_inv_freq`` and ``adapters`` as the reference block's (documents packed in the B N
        tokens, RoPE's positions and frequencies, LoRA terms). An adapter's input (the norm or
        activation output a policy does not keep) is the one its layer's weight gradient uses, so
        adapters keep nothing more: their products are recomputed in backward (rank r: a few
        percent of the layer's).

        Under context parallelism (``context_parallel`` set), x is this rank's share of the
        sequences: its two zigzag chunks of each row (``fused_remat.context_parallel``), or with
        ``documents`` (``shard_documents`` of the whole batch's ``cu_seqlens``, made for this block's
        causal and window) its pieces of every packed document, B x N of them in local order; the
        documents then give the positions and masks, so ``cu_seqlens``, ``max_seqlen`` and
        ``position_ids`` are not given."""
        self._check_input(x)
        keys = None
        if documents is not None:
            keys = self._document_keys(x, documents, cu_seqlens, max_seqlen, position_ids)
            cu_seqlens, position_ids = keys.cu_seqlens_q, documents.positions.view(x.shape[:2])
            max_seqlen = self._check_sequences(x, None, None, None, rope_inv_freq) or keys.max_seqlen_q
        else:
            max_seqlen = self._check_sequences(x, cu_seqlens, max_seqlen, position_ids, rope_inv_freq)
        if adapters:
            adapters = reference.check_adapters(_OP, adapters, self)
        else:
            adapters = ()
        if self.context_parallel is not None and keys is None and (
                cu_seqlens is not None or position_ids is not None or rope_inv_freq is not None
                or self.window != (-1, -1) or self.softcap):
            raise ValueError(f"{_OP}: context parallelism over whole rows runs the causal ring only: position_ids, "
                             "rope_inv_freq, a window and a softcap are not supported with it, and documents are "
                             "given as documents=shard_documents(...) (fused_remat.context_parallel_documents), "
                             "not cu_seqlens")
        if self.context_parallel is not None:
            if backend.graph_capturing():
                raise RuntimeError(f"{_OP}: context parallelism's ring communication cannot be captured in a CUDA "
                                   "graph; run this block without graphs")
            if keys is None:
                context_parallel.check_local_sequence(_OP, x.shape[1], self.context_parallel)
            if not use_triton(_OP, x.device):
                raise RuntimeError(f"{_OP}: context parallelism runs the Triton kernels only (CUDA, or the interpreter "
                                   f"with TRITON_INTERPRET=1 on CPU); this call would use the reference block")
        # Each parameter as a call sees it now (None for an absent module or bias): from its module's
        # table, where torch.func.functional_call and FSDP also put the tensors they swap in, else by
        # attribute lookup (a parametrization's property); not get_parameter, which stops at the table.
        # An attribute that neither the tables, the module's class nor the module itself has (an RMSNorm's
        # bias) is None without a getattr, which would raise and catch an AttributeError.
        params = []
        for module_name, attr in _PARAMETER_PATHS:
            module = self._modules.get(module_name)
            params.append(None if module is None else module._parameters[attr] if attr in module._parameters
                          else getattr(module, attr, None) if (hasattr(type(module), attr) or attr in module.__dict__
                                                               or attr in module._buffers)
                          else None)
        compute_dtype = self._compute_dtype(x, params)  # the same dtype check on both paths
        # Meta tensors (a model sized before it is allocated) take the custom operators too: their fake
        # kernels give the fused block's shapes, their FLOP formulas its counts.
        on_meta = x.device.type == "meta" and requested_backend() != "reference"
        if not (on_meta or use_triton(_OP, x.device)):  # the reference math; a replaying point through torch.utils.checkpoint
            return super().forward(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen or None, position_ids=position_ids,
                                   rope_inv_freq=rope_inv_freq, adapters=adapters)
        call = _BlockCall(
            batch=x.shape[0], seq=x.shape[1], dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, ffn_dim=self.ffn_dim, rms=self.norm == "rmsnorm",
            activation=self.activation, causal=self.causal, eps=self.eps, rope_theta=self.rope_theta,
            remat=self._call_remat(x, max_seqlen, compute_dtype), compute_dtype=compute_dtype,
            context_parallel="" if self.context_parallel is None else self.context_parallel.group_name,
            window=self.window, softcap=self.softcap, max_seqlen=max_seqlen, scale=self.attention_scale or 0.0,
            qk_norm=self.q_norm is not None, max_seqlen_k=0 if keys is None else keys.max_seqlen_k,
            first_keys=0 if keys is None else keys.first_keys,
            adapters=tuple([(_LINEARS.index(a.linear), a.first_row, a.b.shape[0], a.seed, float(a.scale),
                             float(a.dropout)) for a in adapters]),
        )
        key_layout = (None, None) if keys is None else (keys.cu_seqlens_k, keys.key_rows)
        inputs = (call, cu_seqlens, position_ids, rope_inv_freq, *key_layout, *params,
                  *[t for a in adapters for t in (a.a, a.b)])
        if not x.is_contiguous():
            x = x.contiguous()
        if call.remat.host_resident:
            if backend.graph_capturing():
                raise RuntimeError(f"{_OP}: remat 'offload' copies x to host memory and back on a side stream, which "
                                   "a CUDA graph cannot hold; choose a policy that keeps x on the device (or a "
                                   "memory_budget above x's share of 'none')")
            y, *_ = _eager_block_function()(x.view(call.tokens, self.dim), *inputs, False)
        elif custom_ops.traced(x.device):
            y, *_ = _BlockFunction.apply(x.view(call.tokens, self.dim), *inputs, False)
        else:
            return _EagerBlockFunction.apply_untraced(x, *inputs, True)
        return y.view(x.shape)

    def _document_keys(self, x, documents, cu_seqlens, max_seqlen, position_ids) -> cp_documents.DocumentKeys:
        """``documents.keys`` after checking that they fit this call: context parallelism on, this
        rank's share of x's size, made for this block's mask, and no other word on the sequences."""
        if not isinstance(documents, cp_documents.DocumentShards):
            raise TypeError(f"{_OP}: documents must be a DocumentShards (shard_documents), got {type(documents).__name__}")
        if self.context_parallel is None:
            raise ValueError(f"{_OP}: documents (a DocumentShards) split documents over context-parallel ranks; set "
                             "the block's context_parallel group, or pass cu_seqlens for one process")
        if cu_seqlens is not None or max_seqlen is not None or position_ids is not None:
            raise ValueError(f"{_OP}: documents gives the sequences and positions; cu_seqlens, max_seqlen and "
                             "position_ids are not given with it")
        cp_documents.check_group(_OP, documents, self.context_parallel)
        if x.shape[0] * x.shape[1] != documents.local:
            raise ValueError(f"{_OP}: x holds {x.shape[0] * x.shape[1]} tokens, but this rank's documents hold "
                             f"{documents.local}")
        keys = documents.keys
        if (keys.causal, keys.window) != (self.causal, tuple(self.window)):
            raise ValueError(f"{_OP}: documents were sharded for causal={keys.causal}, window={keys.window}, but the "
                             f"block attends with causal={self.causal}, window={tuple(self.window)}; pass the block's "
                             "to shard_documents")
        return keys

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_OP}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{_OP}: x must have shape (B, N, dim={self.dim}), got {tuple(x.shape)}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"{_OP}: x must have at least one sequence and one position, got {tuple(x.shape)}")
        weight = self._modules["qkv"].weight
        if x.device != weight.device:
            raise ValueError(f"{_OP}: x is on {x.device} but the block's parameters are on {weight.device}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{_OP}: x must be fp16, bf16 or fp32, got {x.dtype}")

    @staticmethod
    def _compute_dtype(x: torch.Tensor, params) -> torch.dtype:
        autocast = autocast_dtype(x.device.type)
        if autocast is not None:
            return autocast
        for name, param in zip(_PARAMETERS, params):
            if param is not None and param.dtype != x.dtype:
                raise TypeError(
                    f"{_OP}: x has dtype {x.dtype} but parameter {name} has {param.dtype}; convert the block "
                    f"(block.to(dtype)) or run under torch.autocast"
                )
        return x.dtype
