"""Context parallelism: one sequence split over the ranks of a process group, attention as a ring.

Layout (zigzag, for causal load balance): a sequence of length S is cut into 2W chunks of
C = S / (2W) tokens; rank r of W holds chunks r and 2W-1-r, concatenated, as its local sequence of
2C tokens. Every rank then does the same amount of causal work. ``zigzag_shard`` /
``zigzag_unshard`` move between the two layouts and ``zigzag_positions`` gives each local token's
position in the full sequence (what RoPE needs).

Ring attention: the ranks pass their k and v round the ring (rank r sends to r+1, receives from
r-1) with ``torch.distributed`` point-to-point ops; the transfer of the next block is started
before the current block is computed, so communication overlaps compute. Each block's partial
output is merged into an fp32 accumulator through the log-sum-exp the kernel returns. Only the
k/v heads travel (GQA sends Hkv heads, not Hq).

Which block of work step s does on rank r, its kv coming from rank src = (r - s) mod W (causal):
    s = 0        local q against local k/v, causal (both chunks ascend, so the plain causal mask
                 is the zigzag one)
    src < r      all local q against the source's first chunk, no mask (its second chunk is later
                 than everything here)
    src > r      the local second chunk of q against all of the source's k/v, no mask (the local
                 first chunk precedes both source chunks)
Each non-diagonal step is C x 2C: no masked-out work is done. Non-causal attention does every
block in full.

Backward: with the global o and lse the rank already has, the existing attention backward kernel on
each (q block, k/v block) pair gives that pair's exact contribution (P = exp(s - lse) is the
global probability, delta = rowsum(do * o) the global one). dQ accumulates locally; dK/dV
accumulate in an fp32 buffer that travels round the ring with the k/v block it belongs to and is
home after W shifts. Both transfers overlap compute: at each step the next k/v block and the
previous step's dK/dV buffer are in flight while this step's block gradients are computed, and the
buffer is waited for only to add them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import custom_ops
from .kernels.limits import check_attention_args

_OP = "ring_attention"


def _check_layout(name: str, seq_len: int, world: int) -> int:
    if seq_len % (2 * world):
        raise ValueError(f"{name}: the sequence length {seq_len} must be divisible by 2 x the context-parallel "
                         f"size ({2 * world}) for the zigzag layout")
    return seq_len // (2 * world)


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s local part of the full sequence ``x`` along ``dim``: chunks rank and 2W-1-rank
    of 2W equal chunks, concatenated (a new tensor)."""
    chunk = _check_layout("zigzag_shard", x.shape[dim], world)
    first, second = x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * world - 1 - rank) * chunk, chunk)
    return torch.cat((first, second), dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's local part (``parts[r]`` from rank r), along ``dim``."""
    firsts = [p.chunk(2, dim)[0] for p in parts]
    seconds = [p.chunk(2, dim)[1] for p in reversed(parts)]
    return torch.cat(firsts + seconds, dim)


def zigzag_positions(seq_len: int, rank: int, world: int) -> tuple[int, int]:
    """(first, second): the full-sequence positions of rank ``rank``'s two local chunks start at
    ``first`` (local tokens 0..C-1) and ``second`` (local tokens C..2C-1), for a full length ``seq_len``."""
    chunk = _check_layout("zigzag_positions", seq_len, world)
    return rank * chunk, (2 * world - 1 - rank) * chunk


def resolve_group(group_name: str):
    """The process group of that ``group_name`` (how custom operators, which take no process group
    objects, name one)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def check_local_sequence(op: str, local_len: int, group) -> None:
    if local_len % 2:
        raise ValueError(f"{op}: under context parallelism the local sequence length must be even (two zigzag chunks "
                         f"of the full sequence), got {local_len} on rank {dist.get_rank(group)}")


def local_chunk_starts(local_len: int, group) -> tuple[int, int]:
    """Full-sequence positions where this rank's two zigzag chunks start, for a local length 2C."""
    world = dist.get_world_size(group)
    return zigzag_positions(local_len * world, dist.get_rank(group), world)


def mean_over_group(local_mean: torch.Tensor, local_count: int | torch.Tensor, group) -> torch.Tensor:
    """The mean over every rank's counted tokens, from this rank's mean over its ``local_count`` (an
    int, or a 0-dim integer tensor on local_mean's device: then nothing is read on the host).

    The value is the group's mean (all-reduced, identical on every rank); the gradient is this
    rank's share only (local_mean x local_count / total), so that summing the parameter gradients
    over the group, as data-parallel gradient reduction does, gives the gradient of the group's mean
    once, not once per rank. The share's factor is rounded to local_mean's dtype before the product,
    as a Python number's would be; with no counted token anywhere it is 0."""
    count = torch.as_tensor(local_count, dtype=torch.float64, device=local_mean.device)
    total = count.clone()
    dist.all_reduce(total, group=group)
    factor = torch.where(total > 0, count / total, 0.0).to(local_mean.dtype)
    share = local_mean * factor
    value = share.detach().clone()
    dist.all_reduce(value, group=group)
    return share + (value - share.detach())


# Backward has two transfers in flight between the same pair of ranks (the next k/v block and the
# last block's dK/dV); they are posted in the same order on every rank, and a tag of their own keeps
# gloo from matching one with the other whatever the order (NCCL orders them per pair).
_KV_TAG, _DKV_TAG = 0, 1


class _Shift:
    """One in-flight ring transfer: ``tensor`` sent to the next rank, its like received from the previous."""

    def __init__(self, tensor: torch.Tensor, group, tag: int = _KV_TAG):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.received = torch.empty_like(tensor)
        send_to, receive_from = (dist.get_global_rank(group, (rank + step) % world) for step in (1, -1))
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, send_to, group, tag),
            dist.P2POp(dist.irecv, self.received, receive_from, group, tag),
        ])

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


def _blocks(step: int, rank: int, world: int, causal: bool, chunk: int):
    """(query rows, key rows, causal mask) of the local q and the k/v block held at ``step``."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    source = (rank - step) % world
    if source < rank:
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False


def _merge_(o_acc: torch.Tensor, lse_acc: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """Fold a partial (o, lse) over some keys into the fp32 accumulators over the others, in place."""
    lse_new = torch.logaddexp(lse_acc, lse_part)
    # A row that has seen no key yet on either side stays -inf; subtracting -inf from -inf would be nan.
    reference = torch.where(torch.isneginf(lse_new), torch.zeros_like(lse_new), lse_new)
    o_acc.mul_(torch.exp(lse_acc - reference).unsqueeze(-1))
    o_acc.add_(o_part.float() * torch.exp(lse_part - reference).unsqueeze(-1))
    lse_acc.copy_(lse_new)


def ring_attention_fwd(q, k, v, group, causal: bool, scale: float, *, out=None):
    """Forward of ring attention (no autograd) on local q (B, Hq, 2C, D), k and v (B, Hkv, 2C, D)
    in the zigzag layout. Returns (o (B, Hq, 2C, D) in q's dtype, ``out`` when given, lse (B, Hq, 2C)
    fp32, the global log-sum-exp)."""
    from .kernels.attention import attention_fwd

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunk = q.shape[2] // 2
    kv = torch.stack((k, v))
    o_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse_acc = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
    for step in range(world):
        incoming = _Shift(kv, group) if step + 1 < world else None
        rows, keys, masked = _blocks(step, rank, world, causal, chunk)
        q_block = q[:, :, rows]
        o_part = torch.empty(q_block.shape, device=q.device, dtype=torch.float32)  # unrounded, for the merge
        _, lse_part = attention_fwd(q_block, kv[0][:, :, keys], kv[1][:, :, keys], masked, scale, out=o_part)
        _merge_(o_acc[:, :, rows], lse_acc[:, :, rows], o_part, lse_part)
        if incoming is not None:
            kv = incoming.wait()
    o = o_acc.to(q.dtype) if out is None else out.copy_(o_acc)
    return o, lse_acc


def ring_attention_bwd(do, q, k, v, o, lse, group, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of ring_attention_fwd, in the dtypes and shapes of q, k, v."""
    from .kernels.attention import attention_bwd

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunk = q.shape[2] // 2
    kv = torch.stack((k, v))
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dkv_shift = None  # the dK/dV accumulator in flight to the next rank, with the k/v block it belongs to
    for step in range(world):
        incoming = _Shift(kv, group) if step + 1 < world else None
        rows, keys, masked = _blocks(step, rank, world, causal, chunk)
        k_block, v_block = kv[0][:, :, keys], kv[1][:, :, keys]
        # Each block's gradients unrounded (fp32 outputs), summed in fp32, rounded once at the end.
        parts = tuple(torch.empty(t.shape, device=q.device, dtype=torch.float32) for t in (q[:, :, rows], k_block, v_block))
        dq_part, dk_part, dv_part = attention_bwd(do[:, :, rows], q[:, :, rows], k_block, v_block, o[:, :, rows],
                                                  lse[:, :, rows], masked, scale, out=parts)
        dq[:, :, rows] += dq_part
        # The accumulator of this k/v block arrives from the previous rank while the block above is
        # computed: only now is it waited for, so the dK/dV shift overlaps compute as the k/v one does.
        dkv = torch.zeros(kv.shape, device=q.device, dtype=torch.float32) if dkv_shift is None else dkv_shift.wait()
        dkv[0][:, :, keys] += dk_part
        dkv[1][:, :, keys] += dv_part
        dkv_shift = _Shift(dkv, group, tag=_DKV_TAG)
        if incoming is not None:
            kv = incoming.wait()
    dkv = dkv_shift.wait()  # the W-th shift brings this rank's own accumulator home
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


@custom_ops.cached_forward_signature
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, group, causal: bool, scale: float):
        return ring_attention_fwd(q, k, v, group, causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, group, causal, scale = inputs
        o, lse = output
        # Everything kept for backward, in one place: the local q, k, v, o and the global lse, as the
        # single-process attention keeps. Backward runs the ring again (k/v and dK/dV round it).
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_bwd(do, q, k, v, o, lse, ctx.group, ctx.causal, ctx.scale)
        return custom_ops.first_order_only(_OP, dq, dk, dv, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                   scale: float | None = None, return_lse: bool = False):
    """Attention over a sequence split across the ranks of ``group`` (default: the world), in the
    zigzag layout of this module, with k/v passed round a ring of point-to-point transfers.

    Shapes (local, on every rank): q (B, Hq, 2C, D); k, v (B, Hkv, 2C, D) with Hq a multiple of
    Hkv, the rank's two zigzag chunks of C tokens each (``zigzag_shard`` along dim 2). Returns the
    local o (B, Hq, 2C, D), and with ``return_lse`` the global log-sum-exp (B, Hq, 2C) fp32 (not
    differentiable). Equal to ``attention`` of the full sequence, then sharded. Every rank of the
    group must call it with the same shapes, ``causal`` and ``scale``. Runs the Triton kernels
    (CUDA, or the interpreter on CPU); the transport is whatever the group's backend is (NCCL, gloo).
    """
    scale = check_attention_args(_OP, q, k, v, scale)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{_OP}: q has {q.shape[2]} local positions but k/v have {k.shape[2]}; each rank holds "
                         f"the same tokens of q, k and v")
    group = dist.group.WORLD if group is None else group
    check_local_sequence(_OP, q.shape[2], group)
    o, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale)
    return (o, lse) if return_lse else o


__all__ = ["ring_attention", "mean_over_group", "ring_attention_fwd", "ring_attention_bwd", "zigzag_shard", "zigzag_unshard",
           "zigzag_positions"]
