"""Plain-PyTorch twins of every fused_remat op: the test oracle and the CPU fallback.

Same math and argument conventions as the Triton path: statistics in fp32, outputs in the input
dtype. Call them with float64 tensors to get the high-precision reference the tests compare with.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import backend
from .kernels.limits import (
    MAX_HEAD_DIM,
    check_attention_scale,
    check_documents,
    check_eps,
    check_position_ids,
    check_rope_inv_freq,
    check_softcap,
    check_window,
)
from .remat import Remat


def _statistics_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    compute = _statistics_dtype(x)
    xf = x.to(compute)
    mean = xf.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).square().mean(dim=-1, keepdim=True) + eps)
    y = (xf - mean) * rstd * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    compute = _statistics_dtype(x)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(compute)).to(x.dtype)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x.to(_statistics_dtype(x)), approximate=approximate).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    compute = _statistics_dtype(gate)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              return_lse: bool = False):
    """Materialized softmax(mask(cap(q k^T * scale))) v with FlashAttention 2's semantics.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq a multiple of Hkv. Masks are aligned to the
    bottom-right (offset = Nk - Nq): with ``window=(left, right)`` query i sees keys j with
    i + offset - left <= j <= i + offset + right, -1 leaving a side unbounded; ``causal`` sets
    right to 0, whatever ``window`` says. ``softcap`` > 0 turns the scaled scores s into
    softcap * tanh(s / softcap) before the mask. Rows that see no key give zeros, and their
    log-sum-exp is -inf. Scores and softmax in fp32 (fp64 for fp64 inputs); output in q's dtype.
    """
    compute = _statistics_dtype(q)
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k = k.repeat_interleave(group, dim=1).to(compute)
    v = v.repeat_interleave(group, dim=1).to(compute)
    scores = torch.matmul(q.to(compute), k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        diagonal = torch.arange(q_len, device=q.device).unsqueeze(1) + (k_len - q_len)
        cols = torch.arange(k_len, device=q.device).unsqueeze(0)
        hidden = torch.zeros(q_len, k_len, dtype=torch.bool, device=q.device)
        if left >= 0:
            hidden |= cols < diagonal - left
        if right >= 0:
            hidden |= cols > diagonal + right
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0).unsqueeze(-1))
    out = torch.matmul(probs, v).to(q.dtype)
    if return_lse:
        return out, lse.to(compute)
    return out


def _document(packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows start:end of a packed (total, H, D) tensor as a (1, H, end - start, D) view."""
    return packed[start:end].transpose(0, 1).unsqueeze(0)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     return_lse: bool = False):
    """``attention`` over documents packed along dim 0, in FlashAttention 2's varlen layout.

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D). Document i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q attending to rows cu_seqlens_k[i]:cu_seqlens_k[i + 1]
    of k and v, computed by ``attention`` on that document alone, so masks are aligned to each
    document's bottom-right. A document without keys gives zeros and lse -inf. Returns o
    (total_q, Hq, D) in q's dtype and, with ``return_lse``, lse (Hq, total_q) in fp32 (fp64 for fp64
    inputs). ``max_seqlen_q``/``max_seqlen_k`` are taken for FlashAttention 2's signature; the math
    does not need them.
    """
    q_offsets, k_offsets = torch.stack([cu_seqlens_q, cu_seqlens_k]).tolist()
    outs, lses = [], []
    # Empty documents go through attention too (as empty rows), so torch.cat never gets an empty list.
    for q_start, q_end, k_start, k_end in zip(q_offsets, q_offsets[1:], k_offsets, k_offsets[1:]):
        out, lse = attention(_document(q, q_start, q_end), _document(k, k_start, k_end), _document(v, k_start, k_end),
                             causal=causal, scale=scale, window=window, softcap=softcap, return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, dim=0)
    if return_lse:
        return out, torch.cat(lses, dim=1)
    return out


def rope_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/D) for i < D/2, computed in float64 and rounded once to fp32 (what the kernel reads)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return (1.0 / theta**exponents).to(torch.float32)


def rope(x: torch.Tensor, theta: float, *, inverse: bool = False, positions: torch.Tensor | None = None,
         inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of x (B, N, H, D), positions 0..N-1 along dim 1, or token (b, n)
    at ``positions[b, n]`` for integer ``positions`` of shape (B, N) (packed documents, position_ids).

    Half-split pairing (element i rotates with element i + D/2), as Hugging Face's LLaMA: per pair,
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with angle = position * theta^(-2i/D).
    ``inverse=True`` rotates by the opposite angle (the transpose, which is the backward).
    ``inv_freq`` ((D/2,) fp32) replaces theta^(-2i/D) (scaled RoPE: Llama 3, YaRN, dynamic ...).
    Angles in fp32 (fp64 for fp64 x), as the kernel; output in x's dtype.
    """
    if positions is not None and positions.shape != x.shape[:2]:
        raise ValueError(f"rope: positions must have shape (B, N) = {tuple(x.shape[:2])}, got {tuple(positions.shape)}")
    compute = _statistics_dtype(x)
    head_dim = x.shape[-1]
    if inv_freq is None:
        inv_freq = rope_inverse_frequencies(head_dim, theta, x.device)
    inv_freq = inv_freq.to(compute)
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device)[None, :]
    angles = positions.to(compute)[:, :, None] * inv_freq
    cos = torch.cos(angles)[:, :, None, :]
    sin = torch.sin(angles)[:, :, None, :]
    if inverse:
        sin = -sin
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def document_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each token's position inside its document (int32, (tokens,)), for documents packed by the
    int32 offsets ``cu_seqlens``: 0, 1, ... restarting at every offset."""
    lengths = torch.diff(cu_seqlens)
    document = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                       output_size=tokens)
    return torch.arange(tokens, device=cu_seqlens.device, dtype=torch.int32) - cu_seqlens[document]


LINEARS = ("qkv", "out_proj", "fc1", "fc2")


@dataclass(frozen=True)
class LowRankAdapter:
    """A low-rank adapter (LoRA) on one of the block's linear layers: rows ``first_row`` to
    ``first_row + B.shape[0]`` of ``linear``'s output (the whole output by default; a part of the
    packed qkv or [gate | up] for an adapter of one of the projections packed there) get
    ``scale * (x A^T) B^T``, where x is the layer's input. A: (r, in_features), B: (rows, r), float
    tensors on the layer's device (computed in the layer's dtype, as PEFT keeps fp32 adapters on a
    16-bit model); both get gradients."""

    linear: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    first_row: int = 0
    dropout: float = 0.0  # LoRA dropout on x, as PEFT's lora_dropout in training mode
    seed: int = 0  # the dropout mask's; check_adapters draws one when dropout > 0 and it is 0

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.b.shape[0])


def lora_dropout_scale(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Inverted dropout's factor for x (0 or 1 / (1 - p) per element, in x's dtype), drawn from
    ``seed``: the same for the same shape, device and seed, so a backward redraws the forward's."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return keep.to(x.dtype) / (1 - p)


def _dropped(x: torch.Tensor, adapter: LowRankAdapter) -> torch.Tensor:
    """The adapter's input after its dropout, the mask drawn per token row as the fused block draws it."""
    if not adapter.dropout:
        return x
    flat = x.reshape(-1, x.shape[-1])
    return (flat * lora_dropout_scale(flat, adapter.dropout, adapter.seed)).view(x.shape)


def _real(value) -> bool:
    """A real number that is not a bool (callers ask ``type(value) is float`` first: no call for a float)."""
    return type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Real))


def check_adapters(op: str, adapters, block: nn.Module) -> tuple:
    """``adapters`` as a tuple of LowRankAdapter that fit ``block``'s linear layers (LINEARS)."""
    adapters = tuple(adapters or ())
    for i, adapter in enumerate(adapters):
        where = f"{op}: adapters[{i}]"
        if not isinstance(adapter, LowRankAdapter):
            raise TypeError(f"{where} must be a LowRankAdapter, got {type(adapter).__name__}")
        if adapter.linear not in LINEARS:
            raise ValueError(f"{where}.linear must be one of {LINEARS}, got {adapter.linear!r}")
        weight = block._modules[adapter.linear].weight
        a, b = adapter.a, adapter.b
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2
                and a.shape[1] == weight.shape[1] and b.shape[1] == a.shape[0]):
            raise ValueError(f"{where}: A must be (r, {weight.shape[1]}) and B (rows, r) for {adapter.linear}, got "
                             f"{tuple(getattr(a, 'shape', ()))} and {tuple(getattr(b, 'shape', ()))}")
        if isinstance(adapter.first_row, bool) or not isinstance(adapter.first_row, int) or adapter.first_row < 0 \
                or adapter.first_row + b.shape[0] > weight.shape[0]:
            raise ValueError(f"{where}: rows {adapter.first_row}..{adapter.first_row + b.shape[0]} are outside "
                             f"{adapter.linear}'s {weight.shape[0]} outputs")
        if not (a.is_floating_point() and b.is_floating_point()) or a.device != weight.device or b.device != weight.device:
            raise TypeError(f"{where}: A and B must be float tensors on {adapter.linear}.weight's device "
                            f"{weight.device}, got {a.dtype}/{b.dtype} on {a.device}/{b.device}")
        if not (type(adapter.scale) is float or _real(adapter.scale)) or not math.isfinite(adapter.scale):
            raise ValueError(f"{where}.scale must be a finite real number, got {adapter.scale!r}")
        if not (type(adapter.dropout) is float or _real(adapter.dropout)) or not 0 <= adapter.dropout < 1:
            raise ValueError(f"{where}.dropout must be a probability in [0, 1), got {adapter.dropout!r}")
        if adapter.dropout and not adapter.seed and backend.graph_capturing():
            raise RuntimeError(f"{where}: LoRA dropout draws a new mask for every call, which a CUDA graph would "
                               "freeze into the same mask on every replay; set the dropout to 0 (or a fixed seed) "
                               "to capture, or train without CUDA graphs")
    # a mask seed per call where none is given, from the global generator (as nn.Dropout draws from it)
    return tuple([dataclasses.replace(a, seed=int(torch.randint(1, 2**62, ()))) if a.dropout and not a.seed else a
                  for a in adapters])


NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


def llama_ffn_dim(dim: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4*dim, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * -(-hidden // multiple_of)


def default_ffn_dim(dim: int, activation: str) -> int:
    """The MLP width when none is given: 4 x dim for GELU, LLaMA's rounded 8/3 x dim for SwiGLU."""
    return llama_ffn_dim(dim) if activation == "swiglu" else 4 * dim


class TransformerBlock(nn.Module):
    """Pre-norm Transformer block in plain PyTorch: the twin of ``fused_remat.TransformerBlock``.

        h = x + out_proj(attention(norm1(x)))
        y = h + fc2(act(fc1(norm2(h))))

    x: (B, N, dim) -> (B, N, dim). Attention has ``n_heads`` query heads of dim // n_heads and
    ``n_kv_heads`` key/value heads (GQA when fewer), through F.scaled_dot_product_attention; the
    qkv projection packs [q heads | k heads | v heads] along its output. With ``rope_theta`` set,
    q and k get rotary embeddings (``rope``). ``window`` and ``softcap`` are attention's
    (``fused_remat.attention``; a model alternating local and global layers sets them per layer);
    ``attention_scale`` its softmax scale (None: head_dim ** -0.5); ``qk_norm`` adds Qwen3's RMSNorm
    of each q and k head (weights ``q_norm.weight``, ``k_norm.weight`` of head_dim) before RoPE.
    ``activation="swiglu"`` makes fc1 the
    packed [gate | up] projection of width 2 * ffn_dim and computes silu(gate) * up; fc2 is the down
    projection. ffn_dim defaults to 4 * dim (GELU) or LLaMA's rounded 8/3 * dim (SwiGLU). ``bias``
    switches the linear and LayerNorm biases (RMSNorm has none).

    Parameter names and shapes are those of the fused block, so ``load_state_dict`` moves weights
    between the two either way. ``remat``: ``"none"`` (eager) or ``"full"`` (torch.utils.checkpoint
    around the block, which keeps only x), settable between steps like the fused block's.
    """

    SUPPORTED_REMAT = (Remat.NONE, Remat.FULL)

    def __init__(self, dim: int, n_heads: int, *, n_kv_heads: int | None = None, ffn_dim: int | None = None,
                 norm: str = "layernorm", activation: str = "gelu", bias: bool = True, causal: bool = True,
                 eps: float = 1e-5, rope_theta: float | None = None, window: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, attention_scale: float | None = None, qk_norm: bool = False,
                 head_dim: int | None = None, remat: Remat | str = Remat.NONE, device=None, dtype=None):
        super().__init__()
        self.remat = remat
        self.window = check_window("TransformerBlock", window)
        self.softcap = check_softcap("TransformerBlock", softcap)
        self.attention_scale = check_attention_scale("TransformerBlock", attention_scale)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = _check_block_config(dim, n_heads, n_kv_heads, ffn_dim, norm, activation, eps, rope_theta,
                                            head_dim)
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.norm, self.activation, self.causal, self.eps = norm, activation, bool(causal), float(eps)
        self.rope_theta = None if rope_theta is None else float(rope_theta)
        self.has_bias = bool(bias)
        self.ffn_dim = default_ffn_dim(dim, activation) if ffn_dim is None else ffn_dim
        factory = dict(device=device, dtype=dtype)
        self.norm1 = self._make_norm(bias, factory)
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias, **factory)
        self.norm2 = self._make_norm(bias, factory)
        self.fc1 = nn.Linear(dim, 2 * self.ffn_dim if activation == "swiglu" else self.ffn_dim, bias=bias, **factory)
        self.fc2 = nn.Linear(self.ffn_dim, dim, bias=bias, **factory)
        # Qwen3's per-head RMSNorm of q and of k, over head_dim, before RoPE (weights, no bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps, **factory) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps, **factory) if qk_norm else None

    @property
    def remat(self) -> Remat:
        return self._remat

    @remat.setter
    def remat(self, policy: Remat | str) -> None:
        self._remat = Remat.parse(policy, self.SUPPORTED_REMAT, owner=f"{type(self).__name__}: remat")

    def _call_remat(self, x: torch.Tensor, max_seqlen: int) -> Remat:
        """The point this call of the block runs (the fused block may choose one per call)."""
        return self.remat

    def _make_norm(self, bias: bool, factory: dict) -> nn.Module:
        if self.norm == "rmsnorm":
            return nn.RMSNorm(self.dim, eps=self.eps, **factory)
        return nn.LayerNorm(self.dim, eps=self.eps, bias=bias, **factory)

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                position_ids: torch.Tensor | None = None, rope_inv_freq: torch.Tensor | None = None,
                adapters=None) -> torch.Tensor:
        """x (B, N, dim). ``cu_seqlens``: documents packed in the B N tokens (int32 offsets, as
        ``attention_varlen``'s; each attends only within itself, and RoPE restarts at each);
        ``max_seqlen`` their longest length (read from the offsets when None); ``position_ids``
        (B, N) ints: RoPE's positions instead; ``rope_inv_freq`` ((head_dim / 2,) fp32): RoPE's
        inverse frequencies instead of rope_theta's, for scaled RoPE (the block must have RoPE);
        ``adapters``: LowRankAdapter (LoRA) terms added to the linear layers' outputs."""
        max_seqlen = self._check_sequences(x, cu_seqlens, max_seqlen, position_ids, rope_inv_freq)
        adapters = check_adapters("TransformerBlock", adapters, self)
        if self._call_remat(x, max_seqlen).replays and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._eager, x, cu_seqlens, max_seqlen, position_ids,
                                                     rope_inv_freq, adapters, use_reentrant=False)
        return self._eager(x, cu_seqlens, max_seqlen, position_ids, rope_inv_freq, adapters)

    def _check_sequences(self, x, cu_seqlens, max_seqlen, position_ids, rope_inv_freq) -> int:
        """The longest document (0 without documents), after checking the documents' and RoPE's arguments."""
        if rope_inv_freq is not None:
            if self.rope_theta is None:
                raise ValueError("TransformerBlock: rope_inv_freq is given to a block without RoPE (rope_theta=None)")
            check_rope_inv_freq("TransformerBlock", rope_inv_freq, self.head_dim, x.device)
        if position_ids is not None:
            check_position_ids("TransformerBlock", position_ids, x.shape[:2], x.device)
        if cu_seqlens is None:
            if max_seqlen is not None:
                raise ValueError("TransformerBlock: max_seqlen is given without cu_seqlens")
            return 0
        return check_documents("TransformerBlock", cu_seqlens, x.shape[0] * x.shape[1], x.device, max_seqlen)

    def _eager(self, x: torch.Tensor, cu_seqlens=None, max_seqlen: int = 0, position_ids=None,
               rope_inv_freq=None, adapters=()) -> torch.Tensor:
        h = x + self._attention(self.norm1(x), cu_seqlens, max_seqlen, position_ids, rope_inv_freq, adapters)
        u = self._linear("fc1", self.norm2(h), adapters)
        return h + self._linear("fc2", self._activate(u), adapters)

    def _linear(self, name: str, x: torch.Tensor, adapters) -> torch.Tensor:
        """Linear layer ``name`` on x, plus its adapters' terms."""
        out = getattr(self, name)(x)
        terms = [(a, F.linear(F.linear(_dropped(x, a), a.a.to(x.dtype)), a.b.to(x.dtype)) * a.scale)
                 for a in adapters if a.linear == name]
        if not terms:
            return out
        delta = torch.zeros_like(out)
        for adapter, term in terms:
            delta = delta + F.pad(term, (adapter.first_row, out.shape[-1] - adapter.rows.stop))
        return out + delta

    def _attention(self, y: torch.Tensor, cu_seqlens, max_seqlen: int, position_ids, rope_inv_freq,
                   adapters=()) -> torch.Tensor:
        batch, seq, _ = y.shape
        heads = self._linear("qkv", y, adapters).view(batch, seq, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = heads.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            if position_ids is None and cu_seqlens is not None:
                position_ids = document_positions(cu_seqlens, batch * seq).view(batch, seq)
            q = rope(q, self.rope_theta, positions=position_ids, inv_freq=rope_inv_freq)
            k = rope(k, self.rope_theta, positions=position_ids, inv_freq=rope_inv_freq)
        mask = dict(causal=self.causal, scale=self.attention_scale, window=self.window, softcap=self.softcap)
        if cu_seqlens is not None:
            o = attention_varlen(*(t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v)), cu_seqlens, cu_seqlens,
                                 max_seqlen, max_seqlen, **mask)
        elif self.window != (-1, -1) or self.softcap:
            o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **mask).transpose(1, 2)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=self.causal, scale=self.attention_scale, enable_gqa=self.n_kv_heads != self.n_heads,
            ).transpose(1, 2)
        return self._linear("out_proj", o.reshape(batch, seq, self.n_heads * self.head_dim), adapters)

    def _activate(self, u: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = u.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(u, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def config(self) -> dict:
        """The constructor's keyword arguments that rebuild this block (any block class of either twin)."""
        return dict(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim,
                    norm=self.norm, activation=self.activation, bias=self.has_bias, causal=self.causal,
                    eps=self.eps, rope_theta=self.rope_theta, window=self.window, softcap=self.softcap,
                    attention_scale=self.attention_scale, qk_norm=self.q_norm is not None, head_dim=self.head_dim)

    def extra_repr(self) -> str:
        rope_text = "" if self.rope_theta is None else f", rope_theta={self.rope_theta:g}"
        mask_text = ("" if self.window == (-1, -1) else f", window={self.window}") + (
            f", softcap={self.softcap:g}" if self.softcap else "") + (
            "" if self.attention_scale is None else f", attention_scale={self.attention_scale:g}") + (
            ", qk_norm=True" if self.q_norm is not None else "")
        return (f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, ffn_dim={self.ffn_dim}, "
                f"norm={self.norm!r}, activation={self.activation!r}, causal={self.causal}{rope_text}{mask_text}")


def _check_block_config(dim, n_heads, n_kv_heads, ffn_dim, norm, activation, eps, rope_theta, head_dim) -> int:
    """The head dim, after checking the configuration."""
    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"TransformerBlock: {name} must be a positive int, got {value!r}")

    positive_int("dim", dim)
    positive_int("n_heads", n_heads)
    positive_int("n_kv_heads", n_kv_heads)
    if ffn_dim is not None:
        positive_int("ffn_dim", ffn_dim)
    if head_dim is None:
        if dim % n_heads:
            raise ValueError(f"TransformerBlock: dim={dim} is not divisible by n_heads={n_heads} (or give head_dim)")
        head_dim = dim // n_heads
    positive_int("head_dim", head_dim)
    if n_heads % n_kv_heads:
        raise ValueError(f"TransformerBlock: n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"TransformerBlock: the head dim, head_dim={head_dim}, exceeds {MAX_HEAD_DIM}")
    if norm not in NORMS:
        raise ValueError(f"TransformerBlock: norm must be one of {NORMS}, got {norm!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"TransformerBlock: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_eps("TransformerBlock", eps)
    if rope_theta is not None:
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 1:
            raise ValueError(f"TransformerBlock: rope_theta must be a number > 1 or None, got {rope_theta!r}")
        if head_dim % 2:
            raise ValueError(f"TransformerBlock: rope_theta needs an even head dim, got {head_dim}")
    return head_dim

