"""Hugging Face weights into the fused block's packed parameters and back: the pieces a packed
parameter holds (``_Piece``), a layer packed after every refusal is checked, and the state-dict
hooks that give and take Hugging Face's (and PEFT's ``base_layer``) names and layouts."""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .lora import _hooks, _is_lora, _unwrapped
from .refusals import _refuse

if typing.TYPE_CHECKING:
    from .layer import FusedDecoderLayer


@dataclass(frozen=True)
class _Piece:
    """One Hugging Face parameter inside a fused one: its name in the layer, rows, and whether the
    Hugging Face tensor is stored transposed (Conv1D weights are (in, out))."""

    name: str
    rows: int
    transposed: bool


def _check_layer(layer: nn.Module, parts: dict) -> None:
    """Every refusal _pack would make, without packing anything."""
    where = type(layer).__name__
    if _hooks(layer):
        raise _refuse(f"hooks on a {where}", "the fused layer that replaces it would not run them", patched=False)
    for fused, sources in parts.items():
        modules = [_unwrapped(layer.get_submodule(source), source, fused, where) for source in sources]
        for attr in ("weight", "bias"):
            params = [getattr(module, attr, None) for module in modules]
            if all(p is None for p in params):
                continue
            if any(p is None for p in params) or len({p.requires_grad for p in params}) > 1:
                raise _refuse(f"{fused}.{attr} from {', '.join(sources)}", "some of the pieces packed into it lack a "
                              "bias or are frozen while others are not", patched=False)


def _pack(layer: nn.Module, parts: dict) -> tuple[dict, dict]:
    """The fused block's state (name -> tensor) from a Hugging Face layer, and where every piece came from."""
    _check_layer(layer, parts)
    state, layout = {}, {}
    for fused, sources in parts.items():
        modules = [_unwrapped(layer.get_submodule(source), source, fused, "") for source in sources]
        for attr in ("weight", "bias"):
            params = [getattr(module, attr, None) for module in modules]
            if all(p is None for p in params):
                continue
            name = f"{fused}.{attr}"
            transposed = [attr == "weight" and isinstance(m, Conv1D) for m in modules]
            tensors = [p.detach().t() if t else p.detach() for p, t in zip(params, transposed)]
            state[name] = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).contiguous()
            state[name].requires_grad_(params[0].requires_grad)
            layout[name] = tuple(_Piece(f"{src}.{attr}", t.shape[0], tr) for src, t, tr in zip(sources, tensors, transposed))
    return state, layout


def _state_key(layer: FusedDecoderLayer, piece: _Piece) -> str:
    """A piece's name in the state dict: under each LoRA layer wrapped around its slot, in the
    ``base_layer``, as PEFT names it."""
    path, attr = piece.name.rsplit(".", 1)
    if path not in layer._slot_paths:  # a norm: no slot
        return piece.name
    module = layer.get_submodule(path)
    while _is_lora(module):
        path, module = f"{path}.base_layer", module.base_layer
    return f"{path}.{attr}"


def _huggingface_weights(layer: FusedDecoderLayer, tensors: dict, copies: bool) -> dict:
    """``tensors`` named like the layer's packed parameters, split into the Hugging Face pieces
    (piece -> tensor); ``copies``: each piece that is a part or a transpose is copied."""
    out = {}
    for name, pieces in layer._layout.items():
        if tensors.get(name) is None:
            continue
        for piece, part in zip(pieces, tensors[name].split([p.rows for p in pieces])):
            part = part.t() if piece.transposed else part
            copy = copies and (len(pieces) > 1 or piece.transposed)
            out[piece] = part.clone(memory_format=torch.contiguous_format) if copy else part
    return out


def _huggingface_state_dict(layer: FusedDecoderLayer, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: the packed parameters split into Hugging Face's names and layouts (copies,
    so that no two entries share storage), the zero stand-in biases left out."""
    for name in layer._zero_biases:
        state_dict.pop(prefix + name, None)
    packed = {name: state_dict.pop(prefix + name, None) for name in layer._layout}
    for piece, tensor in _huggingface_weights(layer, packed, copies=True).items():
        state_dict[prefix + _state_key(layer, piece)] = tensor


def _packed_state_dict(layer: FusedDecoderLayer, state_dict: dict, prefix: str, *_) -> None:
    """load_state_dict pre-hook: Hugging Face's names and layouts packed into the block's, and the
    zero stand-in biases filled in from the layer (they are not in a Hugging Face state dict)."""
    for name, pieces in layer._layout.items():
        keys = [prefix + _state_key(layer, piece) for piece in pieces]
        if not all(key in state_dict for key in keys):
            continue
        parts = [state_dict.pop(key) for key in keys]
        parts = [part.t() if piece.transposed else part for part, piece in zip(parts, pieces)]
        state_dict[prefix + name] = parts[0] if len(parts) == 1 else torch.cat(parts)
    for name in layer._zero_biases:
        state_dict.setdefault(prefix + name, layer.get_parameter(name).detach())
