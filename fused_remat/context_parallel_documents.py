"""Context parallelism over packed documents: every document split over the ranks, attention within documents.

Layout (per-document zigzag, as TransformerEngine's THD layout): the B x S tokens of a batch are one
stream of documents (``cu_seqlens``, FlashAttention 2's offsets). Each document of n tokens is cut
into 2W pieces, and rank r of W holds pieces r and 2W-1-r of every document: piece r of each
document in document order, then piece 2W-1-r of each (one document is the dense zigzag layout).
Causal work is then balanced per document, not only per row: the two pieces' prefixes add up to the
same length on every rank. A document's n = 2W q + e tokens give each piece q, and e of them one
more: the extra tokens go round the piece numbers from document to document (a running offset), so
that every rank holds exactly (B x S) / W tokens (B x S divisible by 2W) whatever the lengths.
Documents shorter than 2W tokens leave some pieces empty.

Attention (the all-gather scheme Llama 3 trained its long-context stage with): each rank gathers
every rank's k and v, then attends its own queries with ``attention_varlen``. Each local piece is
one varlen sequence whose keys are its document's prefix up to the piece's end (from the window's
left edge, with one); the kernel's bottom-right causal alignment then puts every query at its true
position, masked tiles are skipped, and no key outside the query's document is seen. The prefixes
of all local pieces are copied out of the gathered k and v once per call (``DocumentKeys.key_rows``).

Backward gathers k and v again (only the local q, k, v, o and lse are kept, as one process keeps),
computes every piece's gradients with the varlen kernel (dK and dV unrounded, fp32), adds them into
a buffer laid out as the gather was, and reduce-scatters it: each rank receives the sum for its own
keys, rounded once.

Costs, per rank and layer, for a batch of T = B x S tokens and Hkv key/value heads of width D: the
gathered k and v (T x Hkv x D each) and their prefix copy (about T (1 + 1/(2W)) rows without a
window) live during the attention call, and in backward the copy's fp32 gradients and an fp32
buffer of the gather's size (``attention_transient_bytes``); forward receives (W-1)/W of 2 T Hkv D
elements, backward that again plus the fp32 reduce-scatter. The ring (``context_parallel``), for
dense rows, holds two k/v blocks in flight instead.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import custom_ops
from .flops import document_pairs
from .kernels.limits import check_attention_args, check_window

_OP = "document_attention"


def _all_gather(output: torch.Tensor, local: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, local, group=group)


def _reduce_scatter(output: torch.Tensor, full: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, full, group=group)


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentKeys:
    """What one rank's attention over its pieces needs (``DocumentShards.keys``): the varlen layout
    of its pieces and of their keys in the gathered k and v. Index tensors are on the batch's
    device; sizes are plain ints."""

    world: int
    causal: bool
    window: tuple[int, int]
    cu_seqlens_q: torch.Tensor  # (2 x documents + 1,) int32: the local pieces, in local order
    cu_seqlens_k: torch.Tensor  # (2 x documents + 1,) int32: each piece's keys in the prefix layout
    # (2 x keys,) int64: the gathered buffer's rows that make the prefix layout, all of k's, then v's
    key_rows: torch.Tensor
    first_keys: int  # the first pieces' keys: among each of k's and v's, these hold no row twice, nor do the rest
    max_seqlen_q: int
    max_seqlen_k: int

    def pairs(self) -> int:
        """(query, key) pairs this rank's attention computes per head."""
        return document_pairs(self.cu_seqlens_q, self.cu_seqlens_k, self.causal, self.window)

    def to(self, device) -> DocumentKeys:
        return dataclasses.replace(self, cu_seqlens_q=self.cu_seqlens_q.to(device),
                                   cu_seqlens_k=self.cu_seqlens_k.to(device), key_rows=self.key_rows.to(device))

    @property
    def keys(self) -> int:
        """Rows of k (and of v) in the prefix layout."""
        return self.key_rows.numel() // 2


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentShards:
    """One rank's share of a batch of packed documents (``shard_documents``): which tokens it holds,
    their positions in their documents (RoPE's), and its attention's layout (``keys``)."""

    rank: int
    world: int
    total: int  # tokens in the whole batch
    global_index: torch.Tensor  # (total / world,) int64: the batch token each local token is
    positions: torch.Tensor  # (total / world,) int64: each local token's position in its document
    keys: DocumentKeys

    @property
    def local(self) -> int:
        return self.total // self.world

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of the whole batch ``x`` (``total`` along ``dim``), in local order."""
        if x.shape[dim] != self.total:
            raise ValueError(f"{_OP}: shard takes the whole batch ({self.total} tokens along dim {dim}), "
                             f"got {x.shape[dim]}")
        return x.index_select(dim, self.global_index.to(x.device))

    def to(self, device) -> DocumentShards:
        return dataclasses.replace(self, global_index=self.global_index.to(device),
                                   positions=self.positions.to(device), keys=self.keys.to(device))


def _piece_sizes(lengths: torch.Tensor, pieces: int) -> torch.Tensor:
    """(documents, pieces) int64: each document's tokens over ``pieces`` pieces, the remainders
    going round the piece numbers from one document to the next."""
    base, extra = lengths // pieces, lengths % pieces
    offset = (torch.cumsum(extra, 0) - extra) % pieces  # where each document's extra tokens start
    k = torch.arange(pieces)
    return base[:, None] + (((k[None, :] - offset[:, None]) % pieces) < extra[:, None]).long()


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(s, s + n) for each (s, n), int64."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    ends = torch.cumsum(lengths, 0)
    return torch.arange(total) - torch.repeat_interleave(ends - lengths - starts, lengths)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0))).to(torch.int32)


def shard_documents(cu_seqlens: torch.Tensor, world: int, rank: int, *, causal: bool = True,
                    window: tuple[int, int] = (-1, -1)) -> DocumentShards:
    """Rank ``rank``'s share of the documents that ``cu_seqlens`` packs (int32 offsets over the
    batch's B x S tokens, FlashAttention 2's layout; the total divisible by 2 x ``world``), for
    attention with ``causal`` and ``window`` (a causal window's left edge bounds the keys each piece
    needs; a window to the right is not supported: the pieces' keys end where their queries do).
    Reads the offsets on the host, once per batch."""
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{_OP}: rank must be in 0..world-1 for world >= 1, got rank {rank!r}, world {world!r}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{_OP}: cu_seqlens must be a 1-D int32 tensor of documents + 1 offsets, got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else (cu_seqlens.dtype, tuple(cu_seqlens.shape))}")
    left, right = check_window(_OP, window)
    if right >= 0 and not (causal and right == 0):
        raise ValueError(f"{_OP}: context parallelism over documents takes a window with no right edge "
                         f"(causal, or right = -1 without causal), got window {window} with causal={causal}")
    if not causal and left >= 0:
        raise ValueError(f"{_OP}: context parallelism over documents takes a left window edge only with causal "
                         f"attention, got window {window} with causal=False")
    offsets = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = torch.diff(offsets)
    total = int(offsets[-1])
    if int(offsets[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"{_OP}: cu_seqlens must start at 0 and not decrease, got {offsets.tolist()[:8]}...")
    pieces = 2 * world
    if total % pieces:
        raise ValueError(f"{_OP}: the batch's {total} tokens must be divisible by 2 x the context-parallel size "
                         f"({pieces}) so that every rank holds as many")
    sizes = _piece_sizes(lengths, pieces)  # (documents, 2W)
    piece_starts = torch.cumsum(sizes, 1) - sizes  # within each document
    document_starts = offsets[:-1]

    def held(r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank r's pieces in local order, piece r of every document then piece 2W-1-r of every
        document (one document: the dense zigzag layout): (document, start within it, size) each."""
        chosen = torch.tensor([r, pieces - 1 - r])
        return (document_starts.repeat(2), piece_starts[:, chosen].T.flatten(), sizes[:, chosen].T.flatten())

    def batch_tokens(r: int) -> torch.Tensor:
        documents, starts, counts = held(r)
        return _ranges(documents + starts, counts)

    # Where each batch token sits in the gathered buffer: rank r's k rows at r x 2L .. r x 2L + L - 1,
    # its v rows the next L (all_gather of each rank's stacked (k, v), L local tokens).
    local = total // world
    gathered_row = torch.empty(total, dtype=torch.int64)
    for r in range(world):
        gathered_row[batch_tokens(r)] = torch.arange(local) + r * 2 * local
    documents, starts, counts = held(rank)
    full_lengths = lengths.repeat(2)
    ends = starts + counts if causal else full_lengths
    key_starts = torch.zeros_like(starts) if left < 0 else (starts - left).clamp(min=0)
    key_starts = torch.where(counts > 0, key_starts, ends)  # an empty piece needs no keys
    key_counts = ends - key_starts
    device = cu_seqlens.device
    key_index = gathered_row[_ranges(documents + key_starts, key_counts)]
    keys = DocumentKeys(
        world=world, causal=bool(causal), window=(left, right), cu_seqlens_q=_offsets(counts).to(device),
        cu_seqlens_k=_offsets(key_counts).to(device),
        key_rows=torch.cat((key_index, key_index + local)).to(device),
        first_keys=int(key_counts[:key_counts.numel() // 2].sum()), max_seqlen_q=int(counts.max()),
        max_seqlen_k=int(key_counts.max()))
    return DocumentShards(rank=rank, world=world, total=total, global_index=batch_tokens(rank).to(device),
                          positions=_ranges(starts, counts).to(device), keys=keys)


def unshard_documents(parts: list[torch.Tensor], shards: list[DocumentShards], dim: int = 0) -> torch.Tensor:
    """The whole batch from every rank's local part (``parts[r]`` and ``shards[r]`` from rank r)."""
    full = parts[0].new_empty((*parts[0].shape[:dim], shards[0].total, *parts[0].shape[dim + 1:]))
    for part, shard in zip(parts, shards):
        full.index_copy_(dim, shard.global_index.to(part.device), part)
    return full


def attention_transient_bytes(world: int, local: int, keys: int, kv_width: int, compute_bytes: int) -> int:
    """The most one rank's attention call holds above its inputs and outputs, for ``local`` tokens
    whose pieces have ``keys`` keys in all (``DocumentKeys.keys``) and k/v rows of ``kv_width``
    elements in ``compute_bytes`` each: forward, the gathered k and v with, first, the local rows
    sent, then their prefix copy; backward, the same, then the prefix copy with its fp32 gradients while the kernel runs, then those gradients
    and the fp32 buffer laid out as the gather, then that buffer and this rank's part of its
    reduce-scatter (what the collective itself allocates is its backend's: gloo copies the buffer,
    NCCL does not)."""
    row, row32 = 2 * kv_width * compute_bytes, 2 * kv_width * 4  # a k and a v row; their fp32 gradients
    gather = world * local * row + max(local, keys) * row  # with the local rows sent, then with the copy
    backward_kernel = keys * (row + row32)
    backward_gather = keys * row32 + world * local * row32
    backward_scatter = world * local * row32 + local * row32
    return max(gather, backward_kernel, backward_gather, backward_scatter)


def attention_transient_bytes_per_token(world: int, kv_width: int, compute_bytes: int) -> int:
    """``attention_transient_bytes`` per local token where the pieces' keys are at most W + 1 per
    local token: causal attention without a window (each document's two pieces end, together, 2W+1
    pieces in; a window only shortens the keys), documents of at least 2W tokens."""
    return attention_transient_bytes(world, 1, world + 1, kv_width, compute_bytes)


def _prefix_keys(k: torch.Tensor, v: torch.Tensor, keys: DocumentKeys, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's k and v gathered (one collective), then laid out as the local pieces' key prefixes."""
    gathered = k.new_empty((2 * keys.world * k.shape[0], *k.shape[1:]))
    _all_gather(gathered, torch.cat((k, v)), group)
    return gathered.index_select(0, keys.key_rows).split(keys.keys)


def _documents(keys: DocumentKeys):
    from .kernels.attention import Documents

    return Documents((keys.cu_seqlens_q, keys.cu_seqlens_k, keys.max_seqlen_q, keys.max_seqlen_k))


def document_attention_fwd(q, k, v, keys: DocumentKeys, group, scale: float, softcap: float = 0.0, *, out=None):
    """Forward (no autograd) on a rank's local tokens q (L, Hq, D), k and v (L, Hkv, D) (``keys``: its
    ``DocumentShards.keys``).
    Returns (o (L, Hq, D) in q's dtype, ``out`` when given; lse (Hq, L) fp32)."""
    from .kernels.attention import attention_fwd

    k_prefix, v_prefix = _prefix_keys(k, v, keys, group)
    return attention_fwd(q, k_prefix, v_prefix, keys.causal, scale, window=keys.window, softcap=softcap,
                         documents=_documents(keys), out=out)


def document_attention_bwd(do, q, k, v, o, lse, keys: DocumentKeys, group, scale: float, softcap: float = 0.0, *,
                           out=None):
    """Gradients (dq, dk, dv) of document_attention_fwd, in the dtypes and shapes of q, k, v."""
    from .kernels.attention import attention_bwd

    k_prefix, v_prefix = _prefix_keys(k, v, keys, group)
    dq, dk, dv = out or (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    d_prefix = torch.empty((2 * keys.keys, *k.shape[1:]), device=k.device, dtype=torch.float32)
    attention_bwd(do, q, k_prefix, v_prefix, o, lse, keys.causal, scale, window=keys.window, softcap=softcap,
                  documents=_documents(keys), out=(dq, *d_prefix.split(keys.keys)))
    del k_prefix, v_prefix
    # Back to the gathered layout. Within the first pieces' keys of k, and within the rest, no row
    # repeats (likewise v's), so each index_add_ writes a row once: the sum's order is fixed, run after run.
    local = k.shape[0]
    full = torch.zeros((2 * keys.world * local, *k.shape[1:]), device=k.device, dtype=torch.float32)
    bounds = (0, keys.first_keys, keys.keys, keys.keys + keys.first_keys, 2 * keys.keys)
    for start, end in zip(bounds, bounds[1:]):
        full.index_add_(0, keys.key_rows[start:end], d_prefix[start:end])
    del d_prefix
    mine = full.new_empty((2 * local, *k.shape[1:]))
    _reduce_scatter(mine, full, group)
    dk.copy_(mine[:local])
    dv.copy_(mine[local:])
    return dq, dk, dv


@custom_ops.cached_forward_signature
class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, shards, group, scale: float, softcap: float):
        return document_attention_fwd(q, k, v, shards.keys, group, scale, softcap)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, shards, group, scale, softcap = inputs
        o, lse = output
        # Everything kept for backward, in one place: the local q, k, v, o and lse, as one process's
        # attention keeps. Backward gathers k and v again.
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.shards, ctx.group, ctx.scale, ctx.softcap = shards, group, scale, softcap
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = document_attention_bwd(do, q, k, v, o, lse, ctx.shards.keys, ctx.group, ctx.scale, ctx.softcap)
        return custom_ops.first_order_only(_OP, dq, dk, dv, None, None, None, None)


def check_group(op: str, shards: DocumentShards, group) -> None:
    """``shards`` must be this rank's share for ``group``'s size."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (shards.rank, shards.world) != (rank, world):
        raise ValueError(f"{op}: the document shards are rank {shards.rank} of {shards.world}, but this process is "
                         f"rank {rank} of the context-parallel group's {world}")


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: DocumentShards, group=None, *,
                       scale: float | None = None, softcap: float = 0.0, return_lse: bool = False):
    """Attention within documents over a batch split across the ranks of ``group`` (default: the
    world) by ``shard_documents``, causal and window as the shards were made for.

    Shapes (local, on every rank): q (L, Hq, D); k, v (L, Hkv, D), L = shards.local, the rank's
    tokens in local order (``shards.shard`` of the whole batch). Returns the local o (L, Hq, D), and
    with ``return_lse`` the log-sum-exp (Hq, L) fp32 (not differentiable). Equal to
    ``attention_varlen`` of the whole batch with its ``cu_seqlens``, then sharded. Every rank of the
    group calls it with its own shards of the same batch."""
    if not isinstance(shards, DocumentShards):
        raise TypeError(f"{_OP}: shards must be a DocumentShards (shard_documents), got {type(shards).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != shards.local:
            raise ValueError(f"{_OP}: {name} must be (local tokens = {shards.local}, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    scale = check_attention_args(_OP, *(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), scale)
    group = dist.group.WORLD if group is None else group
    check_group(_OP, shards, group)
    o, lse = _DocumentAttention.apply(q, k, v, shards, group, scale, float(softcap))
    return (o, lse) if return_lse else o


__all__ = ["DocumentKeys", "DocumentShards", "attention_transient_bytes", "attention_transient_bytes_per_token", "document_attention", "document_attention_bwd", "document_attention_fwd",
           "shard_documents", "unshard_documents"]
