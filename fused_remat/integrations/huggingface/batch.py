"""A base-model call's arguments as the fused layers run them: what is read and what is refused;
padding masks, restarting ``position_ids`` and ``cu_seq_lens`` as documents (``_Batch``); and what
each layer is handed (``_LayerCall``, or ``_CachedCall`` with a KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .refusals import _describe, _refuse


@dataclass
class _Batch:
    """A base-model call's tokens, and the documents the fused layers attend within.

    ``positions`` (B, N): each token's position (the given ``position_ids``, else 0..N-1 per row).
    ``kept``: flat indices of the tokens that run, where an ``attention_mask`` masks some, else None.
    ``cu_seqlens`` (int32) and ``max_seqlen``: the documents the running tokens are packed into, or
    None when every row is one sequence."""

    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    token_type_ids: torch.Tensor | None
    positions: torch.Tensor
    position_ids_given: bool
    kept: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)

    def pack(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> the tensor the layers run: (1, T, dim) over documents, else as it is."""
        if self.cu_seqlens is None:
            return hidden
        flat = hidden.reshape(-1, hidden.shape[-1])
        return (flat if self.kept is None else flat[self.kept]).unsqueeze(0)

    def layer_positions(self) -> torch.Tensor | None:
        """RoPE's positions for the running tokens; None where they are 0..N-1 in every row."""
        if self.cu_seqlens is not None:
            flat = self.positions.reshape(-1)
            return (flat if self.kept is None else flat[self.kept]).unsqueeze(0)
        return self.positions if self.position_ids_given else None

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layers' output back to (B, N, dim), zeros where the attention_mask masked a token."""
        batch, seq = self.shape
        if self.kept is None:
            return hidden.view(batch, seq, hidden.shape[-1])
        flat = hidden.new_zeros(batch * seq, hidden.shape[-1]).index_copy(0, self.kept, hidden[0])
        return flat.view(batch, seq, hidden.shape[-1])


@dataclass(frozen=True)
class _LayerCall:
    """What the base forward hands every fused layer besides the hidden states."""

    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None
    position_ids: torch.Tensor | None
    rope_inv_freq: torch.Tensor | None


@dataclass(frozen=True)
class _CachedCall:
    """What the base forward hands every fused layer when it runs with a KV cache (generation):
    RoPE's positions (B, N) and frequencies, the cache, and the padding mask over every cached
    and new position (B, past + N), or None without padding."""

    positions: torch.Tensor
    rope_inv_freq: torch.Tensor | None
    cache: object
    mask: torch.Tensor | None


# The keyword under which the patched base forward hands a fused layer its _LayerCall: through the
# module call, so that hooks others put on the layer (accelerate's device placement) still run.
_LAYER_CALL = "fused_remat_layer_call"

# transformers 5.2x names the cache argument ``cache``; earlier versions ``past_key_values``.
_CACHE_ARGUMENTS = ("cache", "past_key_values")
# Read by the model's loss, which the causal-LM forward hands the base model too (Trainer passes it).
_LOSS_ONLY = frozenset({"num_items_in_batch"})
# Arguments _batch_of reads; everything else must be absent, None or False.
_READ = frozenset({"input_ids", "inputs_embeds", "token_type_ids", "attention_mask", "position_ids", "cache_position",
                   "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "return_dict", "use_cache",
                   *_CACHE_ARGUMENTS})


def _check_unread(arguments: dict, config) -> None:
    for name, value in arguments.items():
        if name in _READ or name in _LOSS_ONLY or value is None or value is False:
            continue
        if name == "is_causal" and value is True:
            continue
        raise _refuse(f"{name}={_describe(value)}", "the fused decoder layers cannot honour it")
    for flag in ("output_attentions", "output_hidden_states"):
        if arguments.get(flag) is None and getattr(config, flag, False):
            raise _refuse(f"config.{flag}=True", "the fused layers do not record per-layer outputs")


def _packed_offsets(arguments: dict, tokens: int) -> torch.Tensor:
    """FlashAttention's packed-batch offsets (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)."""
    cu_q, cu_k = arguments.get("cu_seq_lens_q"), arguments.get("cu_seq_lens_k")
    if cu_q is None or (cu_k is not None and (cu_k.shape != cu_q.shape or not bool((cu_k == cu_q).all()))):
        raise _refuse("cu_seq_lens_k without equal cu_seq_lens_q", "the block runs self-attention within each document")
    if cu_q.dim() != 1 or cu_q.numel() < 2 or int(cu_q[0]) != 0 or int(cu_q[-1]) != tokens:
        raise _refuse(f"cu_seq_lens_q={_describe(cu_q)}", f"offsets from 0 to the {tokens} tokens of a batch of one row")
    return cu_q.to(torch.int32)


def _tokens_of(arguments: dict, past: int = 0) -> _Batch:
    """The tokens of one base-model call and their positions (the given ``position_ids``, else
    ``past`` + 0..N-1 in every row, as Hugging Face's), without documents."""
    input_ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    if (input_ids is None) == (embeds is None):
        raise ValueError("fused_remat: give exactly one of input_ids and inputs_embeds")
    shape = tuple(input_ids.shape if embeds is None else embeds.shape[:-1])
    if len(shape) != 2:
        raise _refuse(f"inputs of shape {shape}", "the fused model takes (batch, sequence) inputs")
    device = (input_ids if embeds is None else embeds).device
    position_ids = arguments.get("position_ids")
    if position_ids is not None and position_ids.shape[-1] != shape[1]:
        raise _refuse(f"position_ids of shape {tuple(position_ids.shape)}", f"inputs are {shape}")
    positions = (past + torch.arange(shape[1], device=device) if position_ids is None else position_ids).expand(shape)
    token_type_ids = arguments.get("token_type_ids")
    return _Batch(input_ids, embeds, None if token_type_ids is None else token_type_ids.view(shape), positions,
                  position_ids is not None)


def _check_sequence_index(seq_idx, starts: torch.Tensor, rows: torch.Tensor, batch: _Batch) -> None:
    """``seq_idx`` (TRL's padding-free batches: each token's example) must mark the examples the
    restarting positions mark, which are the ones Hugging Face's attention honours."""
    if seq_idx is None:
        return
    if tuple(seq_idx.shape) != batch.shape:
        raise _refuse(f"seq_idx of shape {tuple(seq_idx.shape)}", f"inputs are {batch.shape}")
    flat = seq_idx.reshape(-1) if batch.kept is None else seq_idx.reshape(-1)[batch.kept]
    marked = torch.ones_like(starts)
    marked[1:] = (flat[1:] != flat[:-1]) | (rows[1:] != rows[:-1])
    if not torch.equal(marked, starts):
        raise _refuse("seq_idx whose examples differ from where position_ids restart",
                      "the examples a batch packs are where its positions restart")


def _batch_of(arguments: dict, config) -> _Batch:
    """The documents of one base-model call without a cache, after refusing what the block cannot honour."""
    _check_unread(arguments, config)
    batch = _tokens_of(arguments)
    shape, position_ids, device = batch.shape, arguments.get("position_ids"), batch.positions.device
    cache_position = arguments.get("cache_position")
    if cache_position is not None and not torch.equal(cache_position.cpu(), torch.arange(shape[1])):
        raise _refuse(f"cache_position other than 0..{shape[1] - 1} without a cache", "pass the cache it continues")

    mask = arguments.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or tuple(mask.shape) != shape:
            raise _refuse(f"a {mask.dim()}-D attention_mask of shape {tuple(mask.shape)}",
                          f"the fused model takes a 2-D (batch, sequence) = {shape} padding mask")
        if not bool(mask.all()):
            batch.kept = mask.reshape(-1).nonzero().squeeze(1)
            if batch.kept.numel() == 0:
                raise _refuse("an attention_mask that masks every token", "there is nothing to run")
    if arguments.get("cu_seq_lens_q") is not None or arguments.get("cu_seq_lens_k") is not None:
        if batch.kept is not None or shape[0] != 1:
            raise _refuse("cu_seq_lens_q with padding or more than one row", "packed batches are one row without padding")
        batch.cu_seqlens = _packed_offsets(arguments, shape[1])
        batch.max_seqlen = arguments.get("max_length_q")
        return batch
    if batch.kept is None and position_ids is None and arguments.get("seq_idx") is None:
        return batch  # one sequence per row at positions 0..N-1: nothing to read from the device
    rows = torch.arange(shape[0], device=device).repeat_interleave(shape[1])
    flat_positions = batch.positions.reshape(-1)
    if batch.kept is not None:
        rows, flat_positions = rows[batch.kept], flat_positions[batch.kept]
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[1:] = (rows[1:] != rows[:-1]) | (flat_positions[1:] <= flat_positions[:-1])
    _check_sequence_index(arguments.get("seq_idx"), starts, rows, batch)
    first_tokens = starts.nonzero().squeeze(1)
    if batch.kept is None and first_tokens.numel() == shape[0]:
        return batch  # the given positions restart nowhere inside a row
    batch.cu_seqlens = torch.cat([first_tokens, first_tokens.new_tensor([rows.numel()])]).to(torch.int32)
    return batch
