"""Run a Hugging Face ``transformers`` causal LM on fused_remat's block.

    from fused_remat.integrations.huggingface import apply_fused_remat, revert_fused_remat

    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    apply_fused_remat(model, remat="cheap")   # in place; build the optimizer after this
    ...train with model(input_ids, attention_mask=mask, labels=labels).loss, or transformers.Trainer...
    model.save_pretrained(...)                # Hugging Face's own layout, patched or not

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
(with its per-head q/k RMSNorm: the block's ``qk_norm``), ``Phi3ForCausalLM`` (any ``config.model_type``
of llama, mistral, qwen2, qwen3, phi3) and ``GPT2LMHeadModel`` (gpt2). Every decoder layer
becomes a ``FusedDecoderLayer``, a ``fused_remat.TransformerBlock``, and the base model's forward
becomes fused_remat's (``_FusedBaseForward``): embeddings, the layers, the final norm.

Batches. The base model's forward turns what Hugging Face hands it into documents for the block's
variable-length attention, so each example attends only to itself, exactly:
- ``attention_mask`` (B, N) with padding (left, right, or holes): the masked tokens are dropped
  before the first layer and the outputs put back (zeros at the masked places: what the model
  computes there is nobody's prediction). Positions are the ``position_ids`` given, else 0..N-1 per
  row, as Hugging Face's.
- packed examples (``DataCollatorWithFlattening``, TRL's ``packing=True``): ``position_ids`` that
  restart (a position not above the one before it starts a new example), or FlashAttention's
  ``cu_seq_lens_q``/``cu_seq_lens_k`` (equal; batch 1); a ``seq_idx`` must mark the same examples.
- RoPE comes from the model's own rotary embedding, called as the model calls it (so dynamic and
  LongRoPE frequencies follow the sequence length): its ``inv_freq`` goes to the block per call and
  its ``attention_scaling`` s (YaRN, LongRoPE) becomes the block's softmax scale s^2 / sqrt(head_dim).
  Every ``rope_type`` the installed transformers has is therefore the model's own; RoPE over part of
  the head is refused.
- sliding windows (Mistral, Qwen2 ``use_sliding_window``, per-layer ``layer_types``) run as the
  block's window, ``sliding_window - 1`` keys back.
- ``num_items_in_batch`` (Hugging Face's ``Trainer``) and other loss-only keywords pass through to
  the loss.

Generation. ``generate()`` with its default cache (a ``DynamicCache``, with sliding-window layers
where the config has windows), or any call with ``use_cache=True`` or a cache: each fused layer
appends its keys and values to the cache and attends over all of them through fused_remat's
attention, the new tokens aligned to the bottom right; a left-padded batch attends as documents of
each row's real tokens (``attention_varlen``). The rest of the layer runs from the block's own
modules. Other caches (``StaticCache``: its preallocated slots are not keys) are refused. Without
a cache and without ``use_cache=True`` (left unset means False on a patched model) the model keeps
no cache.

Weights. The block keeps one packed qkv projection ([q heads | k heads | v heads]) and, for SwiGLU,
one packed fc1 ([gate | up]); separate Hugging Face tensors cannot be views of one packed tensor, so
``apply_fused_remat`` copies q/k/v and gate/up once, layer by layer, into packed tensors that become
the layer's parameters, and drops the Hugging Face layer, which frees the originals unless something
else (an optimizer built earlier) still holds them. GPT-2's Conv1D weights are stored (in, out) and
are copied transposed (c_attn is already packed qkv). Norm weights, o_proj and down_proj are taken
over without a copy. ``revert_fused_remat`` splits (and for GPT-2 transposes) them back the same way.
``state_dict()`` (hence ``save_pretrained`` and ``torch.save(model.state_dict())``) gives Hugging
Face's names and layouts, split into copies, and ``load_state_dict`` takes them back: a patched
model saves what ``from_pretrained`` of the unpatched class loads.

Biases. The block's ``bias`` switches all its biases together. Where the Hugging Face layer lacks
some (Qwen2: biases on q, k, v only; Llama with ``attention_bias=True``: on q, k, v, o), the block is
built with ``bias=True`` and the missing ones are zero tensors with ``requires_grad=False`` (2 x dim
+ 2 x ffn elements per layer for Qwen2): the function is exactly the Hugging Face layer's and the
real parameters get the same gradients. A forward refuses to run if one of them was made trainable
(``model.requires_grad_(True)``), and revert refuses if one is no longer zero.

Adapters. Each Hugging Face projection stays under its name as a ``_Slot`` whose weight is a view
of its packed rows, so PEFT finds it. PEFT LoRA (applied before patching: its LoRA layers move
around the slots; or after) runs inside the fused block as ``LowRankAdapter``s, ``lora_dropout``
included (training mode); ``merge_and_unload`` merges into the packed weights and the state dict
has PEFT's names. Anything else the block would bypass by reading the weights directly (a LoRA
variant such as DoRA or a LoRA bias, another wrapper, a quantized linear layer, hooks of any kind
on a projection, a norm or the layer) is refused when patching, or at the next forward when added
afterwards.

Refused with ``UnsupportedByFusedBlock`` (a ValueError naming the input), never silently wrong:
a cache other than a ``DynamicCache``; a 4-D ``attention_mask``;
``output_attentions`` and ``output_hidden_states``; dropout > 0 in training mode (attention or
residual dropout; GPT-2's embedding dropout is outside the layers and still applies); partial
rotary, a head dim above 256, activations other than SiLU (Llama family) or gelu / gelu_new / gelu_pytorch_tanh (GPT-2), GPT-2 cross-attention,
``scale_attn_by_inverse_layer_idx`` or unscaled attention; any other keyword the model is handed
that it does not know. A fused layer called on its own (not through the model) takes no arguments
but the hidden states, and only without RoPE (GPT-2): RoPE's frequencies come from the model.

Checkpointing. ``model.gradient_checkpointing_enable()`` (or ``activation_checkpointing_enable``)
sets every fused layer to ``remat="full"`` (keeps only the layer input; ``every_n_layers`` is not
honoured: every layer goes full, and a ``memory_budget`` is set aside), and disabling sets them back
to the ``remat`` and ``memory_budget`` given here. The
Hugging Face checkpoint wrapper never runs around a fused layer.

Whole-model operations: ``copy.deepcopy`` gives an independent patched model, ``torch.save(model)``
and pickle work (nothing patched is a closure), ``model.to()`` moves the fused layers with the rest.

Version: the layer's call signature and return value (a tensor, or a 1-tuple on older GPT-2) are read
from the installed ``transformers`` when patching; plain attributes of the layer that the model reads
(Qwen2's ``attention_type`` in 4.x) are carried over. Tested with transformers 4.57.6 and 5.24.0.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass

import torch
import transformers  # noqa: F401  (the integration needs it; importing fails early without it)
from torch import nn
from transformers.pytorch_utils import Conv1D

import fused_remat
from fused_remat import TransformerBlock, reference
from fused_remat.reference import LowRankAdapter
from fused_remat.remat import Remat, check_memory_budget

__all__ = ["FusedDecoderLayer", "UnsupportedByFusedBlock", "apply_fused_remat", "revert_fused_remat"]


class UnsupportedByFusedBlock(ValueError):
    """The fused block cannot compute what the Hugging Face model would for this model or input."""


def _refuse(what: str, why: str, patched: bool = True) -> UnsupportedByFusedBlock:
    advice = " (revert_fused_remat(model) to run it on Hugging Face's layers)" if patched else ""
    return UnsupportedByFusedBlock(f"fused_remat: {what}: {why}{advice}")


# --- what each architecture looks like ---------------------------------------------------------

_LLAMA_PARTS = {
    "norm1": ("input_layernorm",),
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "out_proj": ("self_attn.o_proj",),
    "norm2": ("post_attention_layernorm",),
    "fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "fc2": ("mlp.down_proj",),
}
# Qwen3: Llama's layout plus an RMSNorm of each q and k head before RoPE.
_QWEN3_PARTS = {**_LLAMA_PARTS, "q_norm": ("self_attn.q_norm",), "k_norm": ("self_attn.k_norm",)}
# Phi-3 already packs [q | k | v] and [gate | up], in the block's order.
_PHI3_PARTS = {
    "norm1": ("input_layernorm",),
    "qkv": ("self_attn.qkv_proj",),
    "out_proj": ("self_attn.o_proj",),
    "norm2": ("post_attention_layernorm",),
    "fc1": ("mlp.gate_up_proj",),
    "fc2": ("mlp.down_proj",),
}
_GPT2_PARTS = {
    "norm1": ("ln_1",),
    "qkv": ("attn.c_attn",),
    "out_proj": ("attn.c_proj",),
    "norm2": ("ln_2",),
    "fc1": ("mlp.c_fc",),
    "fc2": ("mlp.c_proj",),
}
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_LINEAR_PARTS = ("qkv", "out_proj", "fc1", "fc2")


def _config_value(config, name, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def _rope_theta(config) -> float:
    """The RoPE base the config names (``rope_parameters`` in transformers 5, ``rope_theta`` in 4.x),
    for the block's repr and its own RoPE switch; the frequencies themselves come from the model."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta) if isinstance(theta, (int, float)) and theta > 1 else 10000.0


def _rotary_attention_scale(base: nn.Module, head_dim: int) -> float | None:
    """The block's softmax scale for the model's rotary embedding: its cos/sin factor s (YaRN,
    LongRoPE) scales q and k, so the scores by s^2. Refuses RoPE over part of the head."""
    rotary = getattr(base, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise _refuse(f"{type(base).__name__} without a rotary_emb.inv_freq", "the block takes RoPE's frequencies from it",
                      patched=False)
    if 2 * inv_freq.numel() != head_dim:
        raise _refuse(f"RoPE over {2 * inv_freq.numel()} of the head's {head_dim} dims (partial_rotary_factor)",
                      "the block rotates the whole head", patched=False)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    return None if scaling == 1.0 else scaling**2 * head_dim**-0.5


def _llama_block(config, layer_idx: int, base: nn.Module) -> tuple[dict, float]:
    """Block kwargs (bias decided later from the modules) and dropout of one layer."""
    heads = config.num_attention_heads
    head_dim = _config_value(config, "head_dim", config.hidden_size // heads)
    if config.hidden_act != "silu":
        raise _refuse(f"hidden_act={config.hidden_act!r}", "the block's gated MLP is SwiGLU (silu)", patched=False)
    window = _config_value(config, "sliding_window")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        window = None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    kwargs = dict(dim=config.hidden_size, n_heads=heads, n_kv_heads=_config_value(config, "num_key_value_heads", heads),
                  ffn_dim=config.intermediate_size, norm="rmsnorm", activation="swiglu", eps=config.rms_norm_eps,
                  rope_theta=_rope_theta(config), attention_scale=_rotary_attention_scale(base, head_dim),
                  window=(-1, -1) if window is None else (window - 1, 0),  # Hugging Face: key > query - window
                  qk_norm=config.model_type == "qwen3", head_dim=head_dim)
    dropout = max(_config_value(config, "attention_dropout", 0.0), _config_value(config, "resid_pdrop", 0.0))  # Phi-3
    return kwargs, float(dropout)


def _gpt2_block(config, layer_idx: int, base: nn.Module) -> tuple[dict, float]:
    activation = _GPT2_ACTIVATIONS.get(config.activation_function)
    if activation is None:
        raise _refuse(f"activation_function={config.activation_function!r}", f"the block supports {sorted(_GPT2_ACTIVATIONS)}",
                      patched=False)
    for name, wanted in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
        if bool(getattr(config, name, wanted)) != wanted:
            raise _refuse(f"{name}={not wanted}", "the block's attention is causal self-attention scaled by 1/sqrt(head_dim)",
                          patched=False)
    kwargs = dict(dim=config.hidden_size, n_heads=config.num_attention_heads, ffn_dim=_config_value(config, "n_inner", 4 * config.hidden_size),
                  norm="layernorm", activation=activation, eps=config.layer_norm_epsilon, rope_theta=None)
    return kwargs, float(max(config.attn_pdrop, config.resid_pdrop))


def _llama_embed(base: nn.Module, batch: _Batch) -> torch.Tensor:
    return base.embed_tokens(batch.input_ids) if batch.inputs_embeds is None else batch.inputs_embeds


def _gpt2_embed(base: nn.Module, batch: _Batch) -> torch.Tensor:
    tokens = base.wte(batch.input_ids) if batch.inputs_embeds is None else batch.inputs_embeds
    hidden = tokens + base.wpe(batch.positions)
    if batch.token_type_ids is not None:
        hidden = hidden + base.wte(batch.token_type_ids)
    return base.drop(hidden)


def _llama_rope(base: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE's inverse frequencies for this call: the rotary embedding runs as the model runs it
    (which updates dynamic and LongRoPE frequencies for the positions), then its ``inv_freq`` is
    read as it reads it, in fp32."""
    base.rotary_emb(hidden, positions)
    return base.rotary_emb.inv_freq.to(device=hidden.device, dtype=torch.float32)


def _no_rope(base: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> None:
    return None


@dataclass(frozen=True)
class _Architecture:
    layers: str  # attribute of the base model holding the decoder layers
    final_norm: str  # attribute of the base model holding the norm after the layers
    parts: dict  # fused block module -> Hugging Face modules packed into it, in order
    block: object  # (config, layer_idx, base) -> (block kwargs, dropout)
    embed: object  # (base, _Batch) -> hidden states (B, N, dim) before the first layer
    rope: object  # (base, hidden, positions) -> RoPE's inverse frequencies, or None without RoPE


_LLAMA = _Architecture("layers", "norm", _LLAMA_PARTS, _llama_block, _llama_embed, _llama_rope)
_ARCHITECTURES = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _Architecture("layers", "norm", _QWEN3_PARTS, _llama_block, _llama_embed, _llama_rope),
    "phi3": _Architecture("layers", "norm", _PHI3_PARTS, _llama_block, _llama_embed, _llama_rope),
    "gpt2": _Architecture("h", "ln_f", _GPT2_PARTS, _gpt2_block, _gpt2_embed, _no_rope),
}


# --- packing ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """One Hugging Face parameter inside a fused one: its name in the layer, rows, and whether the
    Hugging Face tensor is stored transposed (Conv1D weights are (in, out))."""

    name: str
    rows: int
    transposed: bool


def _is_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer (``peft.tuners.lora.LoraLayer``), told by its attributes: peft is optional."""
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters"))


def _hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _unwrapped(module: nn.Module, source: str, fused: str, where: str) -> nn.Module:
    """The plain module under ``module`` (a PEFT LoRA layer's base layer), after refusing what the
    block would bypass by reading the weights: any other wrapper or quantized layer, a module
    with children, hooks."""
    plain = module.base_layer if fused in _LINEAR_PARTS and _is_lora(module) else module
    wrapped = type(plain) not in (nn.Linear, Conv1D) if fused in _LINEAR_PARTS else any(True for _ in plain.children())
    if wrapped or _hooks(plain) or _hooks(module):
        what = f"hooks on {source}" if not wrapped else f"{source} is a {type(plain).__module__}.{type(plain).__name__}"
        raise _refuse(f"{where}: {what}", "the fused block reads the weights directly and would bypass it; apply it "
                      "to the unpatched model, or merge adapters other than LoRA first", patched=False)
    return plain


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


class _Packed(nn.Module):
    """A fused layer's linear layer: its packed weight and bias, applied as F.linear. Not an
    nn.Linear, so that adapters looking for linear layers (PEFT's ``all-linear``) find the Hugging
    Face projections (_Slot) instead."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"))
        self.bias = nn.Parameter(torch.empty(out_features, device="meta")) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class _Slot(nn.Linear):
    """A Hugging Face projection packed into a fused parameter, under its Hugging Face name, where
    adapters (PEFT's LoRA, before or after patching) find and wrap it. Its weight and bias are views
    of the packed rows (transposed for GPT-2's Conv1D, see _ConvSlot): a LoRA merge writes into the
    packed parameter. Holds no parameter of its own."""

    def __init__(self, packed: _Packed, first: int, rows: int, has_bias: bool):
        nn.Module.__init__(self)
        self.in_features, self.out_features = packed.in_features, rows
        self.__dict__["_packed"] = packed  # not a submodule: it is the fused layer's
        self._rows, self._has_bias = slice(first, first + rows), has_bias

    @property
    def weight(self) -> torch.Tensor:
        return self._packed.weight[self._rows]

    @property
    def bias(self) -> torch.Tensor | None:
        return self._packed.bias[self._rows] if self._has_bias else None


class _ConvSlot(Conv1D):
    """_Slot for GPT-2's Conv1D projections: the weight viewed (in, out), as Conv1D stores it."""

    def __init__(self, packed: _Packed, first: int, rows: int, has_bias: bool):
        nn.Module.__init__(self)
        self.nx, self.nf = packed.in_features, rows
        self.__dict__["_packed"] = packed
        self._rows, self._has_bias = slice(first, first + rows), has_bias

    @property
    def weight(self) -> torch.Tensor:
        return self._packed.weight[self._rows].t()

    @property
    def bias(self) -> torch.Tensor | None:
        return self._packed.bias[self._rows] if self._has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.t(), self.bias)


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


# --- the batch, as the fused layers run it ------------------------------------------------------

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


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) < 60 else f"<{type(value).__name__}>"


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


# --- the layer ----------------------------------------------------------------------------------

class FusedDecoderLayer(TransformerBlock):
    """A ``fused_remat.TransformerBlock`` standing in for a Hugging Face decoder layer.

    The patched base model calls it with its documents and RoPE frequencies. Called on its own with
    the original layer's arguments (read from its signature), it runs the hidden states as one
    sequence per row, refuses any other argument, and returns what the original returned (a tensor,
    or a 1-tuple). ``gradient_checkpointing`` is Hugging Face's switch: True sets ``remat="full"``,
    False the remat it was built with. Built by ``apply_fused_remat``; ``to_huggingface()`` gives the
    original layer back.
    """

    def __init__(self, original: nn.Module, layer_idx: int, config, architecture: _Architecture, remat: Remat,
                 base: nn.Module, memory_budget: float | None = None):
        kwargs, dropout = architecture.block(config, layer_idx, base)
        state, layout = _pack(original, architecture.parts)
        param = state["qkv.weight"]
        bias = any(n.endswith(".bias") for n in state)
        super().__init__(kwargs.pop("dim"), kwargs.pop("n_heads"), bias=bias, remat=remat, memory_budget=memory_budget,
                         device="meta", dtype=param.dtype, **kwargs)
        for name in _LINEAR_PARTS:
            linear = getattr(self, name)
            setattr(self, name, _Packed(linear.in_features, linear.out_features, bias))
        zero = {n: torch.zeros(p.shape, device=param.device, dtype=p.dtype) for n, p in self.named_parameters() if n not in state}
        missing = [n for n in zero if not n.endswith(".bias")]
        if missing:
            raise _refuse(f"{type(original).__name__} without {missing}", "the layer does not have the modules the block needs",
                          patched=False)
        self.load_state_dict({**state, **zero}, assign=True)
        for name, tensor in {**state, **zero}.items():
            self.get_parameter(name).requires_grad_(tensor.requires_grad)
        self._zero_biases = tuple(zero)
        self._layout = layout
        self._original_class = type(original)
        self._config, self._layer_idx = config, layer_idx
        self._dropout = dropout
        self._signature = inspect.signature(type(original).forward)
        self._returns_tuple = _returns_tuple(self._signature, type(original))
        self._policy, self._budget, self._checkpointing = remat, memory_budget, False
        self.train(original.training)
        for name, value in vars(original).items():  # plain attributes the model reads (Qwen2's attention_type)
            if not name.startswith("_") and isinstance(value, (str, int, float)) and not hasattr(self, name):
                setattr(self, name, value)
        self._install_slots(original)
        self._register_state_dict_hook(_huggingface_state_dict)
        self.register_load_state_dict_pre_hook(_packed_state_dict)

    def _install_slots(self, original: nn.Module) -> None:
        """A _Slot under each Hugging Face projection's name, viewing its rows of the packed weight;
        a LoRA layer that wrapped the projection in ``original`` moves here, around the slot."""
        self._slot_paths = set()
        for fused, path, first, piece in self._projections():
            slot_class = _ConvSlot if piece.transposed else _Slot
            slot = slot_class(getattr(self, fused), first, piece.rows, f"{fused}.bias" in self._layout)
            module = original.get_submodule(path)
            if _is_lora(module):
                module.base_layer = slot
                slot = module
            parent, child = path.rsplit(".", 1)
            container = self
            for part in parent.split("."):
                if not hasattr(container, part):
                    container.add_module(part, nn.Module())
                container = getattr(container, part)
            container.add_module(child, slot)
            self._slot_paths.add(path)

    def _projections(self):
        """(packed linear layer, Hugging Face projection's path, its first row there, its _Piece)
        for each projection packed into the linear layers."""
        for fused in _LINEAR_PARTS:
            first = 0
            for piece in self._layout[f"{fused}.weight"]:
                yield fused, piece.name.rsplit(".", 1)[0], first, piece
                first += piece.rows

    @property
    def gradient_checkpointing(self) -> bool:
        return self._checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enable: bool) -> None:
        self._checkpointing = bool(enable)
        self.remat = Remat.FULL if enable else self._policy
        self.memory_budget = None if enable else self._budget

    def forward(self, hidden_states, *args, **kwargs):
        call = kwargs.pop(_LAYER_CALL, None)
        if call is None:
            return self._forward_alone(hidden_states, *args, **kwargs)
        adapters = self._check_call()
        if isinstance(call, _CachedCall):
            return self._forward_cached(hidden_states, call, adapters)
        return super().forward(hidden_states, cu_seqlens=call.cu_seqlens, max_seqlen=call.max_seqlen,
                               position_ids=call.position_ids, rope_inv_freq=call.rope_inv_freq, adapters=adapters)

    def _forward_alone(self, hidden_states, *args, **kwargs):
        """A call from outside the patched model, with the original layer's arguments."""
        arguments = self._signature.bind(self, hidden_states, *args, **kwargs).arguments
        for name, value in list(arguments.items())[2:]:
            if self._signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                extra = value.items()
            elif self._signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
                extra = ((f"{name}[{i}]", v) for i, v in enumerate(value))
            else:
                extra = ((name, value),)
            for key, value in extra:
                if value is not None and value is not False:
                    raise _refuse(f"{key}={_describe(value)} given to a fused decoder layer on its own",
                                  "call the patched model, which hands its layers the documents and positions")
        if self.rope_theta is not None:
            raise _refuse("a fused decoder layer with RoPE called on its own",
                          "RoPE's frequencies come from the patched model's rotary embedding; call the model")
        y = super().forward(hidden_states, adapters=self._check_call())
        return (y,) if self._returns_tuple else y

    def _forward_cached(self, x: torch.Tensor, call: _CachedCall, adapters) -> torch.Tensor:
        """The layer with a KV cache (generation): the same function as the block, from its own
        modules, with attention through fused_remat's kernels over the cached and new keys, aligned
        to the bottom right (the new tokens are the last); padding runs as documents of the real
        tokens of each row."""
        batch, seq, _ = x.shape
        heads = self._linear("qkv", self.norm1(x), adapters).view(batch, seq, -1, self.head_dim)
        q, k, v = heads.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            q, k = (reference.rope(t, self.rope_theta, positions=call.positions, inv_freq=call.rope_inv_freq) for t in (q, k))
        keys, values = call.cache.update(k.transpose(1, 2), v.transpose(1, 2), self._layer_idx)
        o = _cached_attention(q.transpose(1, 2), keys, values, call.mask, self.causal, self.attention_scale, self.window)
        h = x + self._linear("out_proj", o.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim), adapters)
        return h + self._linear("fc2", self._activate(self._linear("fc1", self.norm2(h), adapters)), adapters)

    def _check_call(self) -> list[LowRankAdapter]:
        """Refuses a call the layer would compute wrongly; returns the LoRA adapters to apply."""
        if self.training and self._dropout > 0:
            raise _refuse(f"dropout {self._dropout} in training mode", "the block has no dropout; set the config's attention/residual dropout to 0")
        trainable = [name for name in self._zero_biases if self.get_parameter(name).requires_grad]
        if trainable:
            raise _refuse(f"requires_grad on {trainable}", f"these biases stand for ones {self._original_class.__name__} does not have and must stay zero and frozen")
        head_norms = ("q_norm", "k_norm") if self.q_norm is not None else ()
        for name in (*_LINEAR_PARTS, "norm1", "norm2", *head_norms):
            module = getattr(self, name)
            expected = _Packed if name in _LINEAR_PARTS else (
                nn.RMSNorm if self.norm == "rmsnorm" or name in head_norms else nn.LayerNorm)
            if type(module) is not expected or _hooks(module):
                raise _refuse(f"{name} of a fused decoder layer is now a {type(module).__module__}.{type(module).__name__}"
                              f"{' with hooks' if type(module) is expected else ''}",
                              "the fused block reads its weights directly and would bypass it; wrap the Hugging "
                              "Face projections (q_proj, ..., c_attn, ...) instead, which the block honours for LoRA")
        return [adapter for fused, path, first, _ in self._projections()
                for adapter in _lora_adapters(self.get_submodule(path), path, fused, first)]

    def huggingface_tensors(self, tensors: dict) -> dict:
        """``tensors`` named like this layer's parameters (the parameters, their gradients, ...) split
        into the Hugging Face layer's names and layouts; the zero stand-in biases are left out."""
        return {piece.name: t for piece, t in _huggingface_weights(self, tensors, copies=False).items()}

    def check_revertible(self) -> None:
        """Raises if the Hugging Face layer cannot hold this layer's weights (a stand-in bias became nonzero)."""
        nonzero = [name for name in self._zero_biases if self.get_parameter(name).detach().count_nonzero()]
        if nonzero:
            raise _refuse(f"nonzero {nonzero}", f"{self._original_class.__name__} has no such biases", patched=False)

    def to_huggingface(self) -> nn.Module:
        """The original Hugging Face layer class with this layer's weights (copied where they were
        packed or transposed, so no two parameters share storage), requires_grad and mode."""
        self.check_revertible()
        with torch.device(self.qkv.weight.device):
            layer = self._original_class(self._config, layer_idx=self._layer_idx)
        params = {name: self.get_parameter(name).detach() for name in self._layout}
        state = {piece.name: t for piece, t in _huggingface_weights(self, params, copies=True).items()}
        trainable = {piece.name: self.get_parameter(name).requires_grad
                     for name, pieces in self._layout.items() for piece in pieces}
        layer.load_state_dict(state, assign=True)
        for name, requires_grad in trainable.items():
            layer.get_parameter(name).requires_grad_(requires_grad)
        for _, path, _, _ in self._projections():
            wrapper = self.get_submodule(path)
            if _is_lora(wrapper):  # the LoRA layers go back around the Hugging Face projection
                innermost = wrapper
                while _is_lora(innermost.base_layer):
                    innermost = innermost.base_layer
                innermost.base_layer = layer.get_submodule(path)
                parent, child = path.rsplit(".", 1)
                layer.get_submodule(parent).add_module(child, wrapper)
        if self._checkpointing and hasattr(self, "_gradient_checkpointing_func"):
            layer._gradient_checkpointing_func = self._gradient_checkpointing_func
            layer.gradient_checkpointing = True
        return layer.train(self.training)


def _lora_adapters(module: nn.Module, path: str, fused: str, first: int) -> list[LowRankAdapter]:
    """The active LoRA adapters of the module at ``path`` (a _Slot, or PEFT LoRA layers around one),
    as the block's adapters of ``fused`` at its rows from ``first``, with their dropout where it is
    in training mode; refuses what the block cannot apply exactly (a variant such as DoRA, a LoRA
    bias, another wrapper)."""
    adapters = []
    while _is_lora(module):
        if _hooks(module):
            raise _refuse(f"hooks on {path}", "the fused block would not run them")
        if module.disable_adapters:
            if module.merged:  # as PEFT does: a disabled adapter is not in the weights
                module.unmerge()
        elif not module.merged:
            for name in module.active_adapters:
                if name not in module.lora_A:
                    continue
                a, b, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
                if name in getattr(module, "lora_variant", {}) or getattr(b, "bias", None) is not None:
                    raise _refuse(f"LoRA adapter {name!r} on {path} with a variant (DoRA, ...) or a bias",
                                  "the fused block applies plain LoRA (x A^T B^T times the scale)")
                if type(dropout) not in (nn.Dropout, nn.Identity):
                    raise _refuse(f"lora_dropout of adapter {name!r} on {path} is a {type(dropout).__name__}",
                                  "the fused block applies nn.Dropout's inverted dropout")
                p = dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
                adapters.append(LowRankAdapter(fused, a.weight, b.weight, float(module.scaling[name]), first, p))
        module = module.base_layer
    if not isinstance(module, (_Slot, _ConvSlot)) or _hooks(module):
        raise _refuse(f"{path} is a {type(module).__module__}.{type(module).__name__}"
                      f"{' with hooks' if isinstance(module, (_Slot, _ConvSlot)) else ''}",
                      "the fused block reads the packed weights directly and would bypass it")
    return adapters


def _cached_attention(q, keys, values, mask, causal: bool, scale: float | None, window: tuple[int, int]) -> torch.Tensor:
    """Attention of q (B, Hq, N, D) over a cache's keys and values (B, Hkv, K, D), the last N of
    which are q's own positions. ``mask`` (B, >= K) marks the real tokens, its last K columns the
    cached keys' (a sliding-window cache returns only the newest keys); masked queries give 0."""
    options = dict(causal=causal, scale=scale, window=window)
    if mask is None:
        return fused_remat.attention(q, keys, values, **options)
    batch, _, seq, _ = q.shape
    key_mask, query_mask = mask[:, -keys.shape[2]:].bool(), mask[:, -seq:].bool()
    counts = [query_mask.sum(1), key_mask.sum(1)]
    offsets = [torch.nn.functional.pad(c.cumsum(0), (1, 0)).to(torch.int32) for c in counts]
    packed = fused_remat.attention_varlen(q.transpose(1, 2)[query_mask], keys.transpose(1, 2)[key_mask],
                                          values.transpose(1, 2)[key_mask], *offsets,
                                          *(int(c.max()) for c in counts), **options)
    o = q.new_zeros(batch, seq, *q.shape[1:2], q.shape[3])
    o[query_mask] = packed
    return o.transpose(1, 2)


def _returns_tuple(signature: inspect.Signature, cls: type) -> bool:
    """Whether the installed transformers' layer returns a tuple (GPT-2 before 5.0) or a tensor."""
    annotation = signature.return_annotation
    if annotation in (torch.Tensor, torch.FloatTensor, "torch.Tensor", "torch.FloatTensor"):
        return False
    text = annotation if isinstance(annotation, str) else repr(annotation)
    if "tuple" in text.lower():
        return True
    raise _refuse(f"{cls.__name__}.forward returning {text}", "cannot tell whether this transformers version's layers "
                  "return a tensor or a tuple", patched=False)


# --- the base model's forward -----------------------------------------------------------------

def _output_class(annotation, cls: type) -> type:
    """The ModelOutput class the base model's forward returns: the annotation itself (transformers 5,
    4.x Llama family) or the ModelOutput inside ``Union[tuple, ...]`` (4.x GPT-2, whose LM head reads
    ``cross_attentions`` from it)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, transformers.utils.ModelOutput):
            return candidate
    raise _refuse(f"{cls.__name__}.forward returning {annotation!r}", "cannot tell which output class this "
                  "transformers version's base model returns", patched=False)


def _bound_signature(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=list(signature.parameters.values())[1:])


class _FusedBaseForward:
    """The patched base model's forward: embeddings, the fused layers over the batch's documents,
    the final norm. An object rather than a closure, holding its base model as an attribute, so
    that ``copy.deepcopy`` binds the copy's to the copy and pickle can write it."""

    def __init__(self, base: nn.Module, architecture: _Architecture):
        self.base, self.architecture = base, architecture
        self.signature = inspect.signature(type(base).forward)
        self.keywords = next((n for n, p in self.signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        self.output_class = _output_class(self.signature.return_annotation, type(base))
        fields = getattr(self.output_class, "__dataclass_fields__", {})
        self.cache_field = "cache" if "cache" in fields else "past_key_values"

    @property
    def __signature__(self) -> inspect.Signature:
        return _bound_signature(self.signature)

    def __call__(self, *args, **kwargs):
        base, architecture = self.base, self.architecture
        arguments = dict(self.signature.bind(base, *args, **kwargs).arguments)
        arguments.pop("self", None)
        arguments.update(arguments.pop(self.keywords, {}) if self.keywords else {})
        if arguments.get("use_cache") or any(arguments.get(name) is not None for name in _CACHE_ARGUMENTS):
            return self._call_cached(arguments)
        batch = _batch_of(arguments, base.config)
        hidden = batch.pack(architecture.embed(base, batch))
        positions = batch.layer_positions()
        rope_positions = positions if positions is not None else batch.positions[:1]
        call = _LayerCall(batch.cu_seqlens, batch.max_seqlen, positions, architecture.rope(base, hidden, rope_positions))
        for layer in getattr(base, architecture.layers):
            hidden = layer(hidden, **{_LAYER_CALL: call})
        hidden = batch.unpack(getattr(base, architecture.final_norm)(hidden))
        output = self.output_class(last_hidden_state=hidden)
        return output.to_tuple() if arguments.get("return_dict") is False else output

    def _call_cached(self, arguments: dict):
        """With a KV cache (``generate()``: prefill, then one token a step): every layer appends its
        keys and values to the cache and attends over all of them. Returns the cache with the output."""
        base, architecture = self.base, self.architecture
        cache = next((arguments.pop(name) for name in _CACHE_ARGUMENTS if arguments.get(name) is not None), None)
        if cache is None:
            cache = transformers.DynamicCache(config=base.config)
        if not isinstance(cache, transformers.DynamicCache):
            raise _refuse(f"a {type(cache).__name__}", "the fused layers append to a DynamicCache (generate()'s default, "
                          "sliding windows included); generate without cache_implementation, or with 'dynamic'")
        for name in ("use_cache", *_CACHE_ARGUMENTS, "cache_position"):
            arguments.pop(name, None)
        _check_unread({k: v for k, v in arguments.items() if not k.startswith(("cu_seq_lens", "max_length"))}, base.config)
        if any(arguments.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
            raise _refuse("packed examples (cu_seq_lens) with a KV cache", "a cache holds one sequence per row")
        past = cache.get_seq_length()
        batch = _tokens_of(arguments, past)
        mask = arguments.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != batch.shape[0] or mask.shape[1] != past + batch.shape[1]:
                raise _refuse(f"an attention_mask of shape {tuple(mask.shape)} with {past} cached tokens",
                              f"it covers the cached and the new tokens: ({batch.shape[0]}, {past + batch.shape[1]})")
            mask = None if bool(mask.all()) else mask
        hidden = architecture.embed(base, batch)
        call = _CachedCall(batch.positions, architecture.rope(base, hidden, batch.positions), cache, mask)
        for layer in getattr(base, architecture.layers):
            hidden = layer(hidden, **{_LAYER_CALL: call})
        hidden = getattr(base, architecture.final_norm)(hidden)
        if mask is not None:  # as without a cache: a padding position predicts nothing
            hidden = hidden * mask[:, -batch.shape[1]:, None].to(hidden.dtype)
        output = self.output_class(last_hidden_state=hidden, **{self.cache_field: cache})
        return output.to_tuple() if arguments.get("return_dict") is False else output


def _check_labels(mask, labels, shift_labels) -> None:
    """Refuses labels that read a prediction made at a padding position: the patched model outputs
    zeros there and the unpatched one attends from a token that is not there, so the two losses
    would differ, silently. (Left padding with labels = input_ids reads one: mask the first real
    token's label, -100, as no example run alone predicts it.)"""
    if mask is None or mask.dim() != 2:
        return
    padding = mask == 0
    if labels is not None and labels.shape == mask.shape:  # logits at i predict labels at i + 1
        read = (labels[:, 1:] != -100) & padding[:, :-1]
    elif shift_labels is not None and shift_labels.shape == mask.shape:
        read = (shift_labels != -100) & padding
    else:
        return
    if bool(read.any()):
        row, position = (int(i) for i in read.nonzero()[0])
        raise _refuse(f"labels read the prediction at padding position {position} of row {row} (attention_mask 0)",
                      "a padding position predicts nothing; set the labels it would predict to -100", patched=False)


class _LabelsCheckedForward:
    """The patched causal LM's own forward, after _check_labels. An object holding its model, like
    _FusedBaseForward, so that copies and pickles follow it."""

    def __init__(self, model: nn.Module, own_forward):
        self.model, self.own_forward = model, own_forward
        self.signature = inspect.signature(type(model).forward)

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's forward's, as a bound method shows it: transformers reads it (generate() to
        choose the inputs it passes, Trainer to keep a dataset's columns)."""
        return _bound_signature(self.signature)

    def __call__(self, *args, **kwargs):
        arguments = self.signature.bind(self.model, *args, **kwargs).arguments
        keywords = {**arguments, **next((v for k, v in arguments.items()
                                         if self.signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD), {})}
        _check_labels(keywords.get("attention_mask"), keywords.get("labels"), keywords.get("shift_labels"))
        if self.own_forward is not None:
            return self.own_forward(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)


# --- patch and revert -------------------------------------------------------------------------

@dataclass
class _Patch:
    base: nn.Module
    layers: nn.ModuleList
    own_forward: object  # the base model's instance-level forward before patching, or None
    model_forward: object  # the model's instance-level forward before patching, or None (the base model patched itself)


def apply_fused_remat(model: nn.Module, remat: Remat | str = Remat.CHEAP, *, memory_budget: float | None = None) -> nn.Module:
    """Swaps every decoder layer of a Hugging Face causal LM, in place, for a ``FusedDecoderLayer``
    (a ``fused_remat.TransformerBlock`` with ``remat``, or with ``memory_budget``: a fraction of what
    ``remat="none"`` keeps, each layer choosing its point per call) holding the same weights, packed, and the base
    model's forward for fused_remat's. Returns ``model``. Raises ``UnsupportedByFusedBlock`` for
    configurations the block cannot compute exactly (see the module docstring), leaving the model as
    it was: every layer is checked before any changes. The causal LM's forward refuses labels read
    from a padding position (_check_labels). Build the optimizer afterwards."""
    remat = Remat.parse(remat, owner="apply_fused_remat: remat")
    memory_budget = check_memory_budget(memory_budget, owner="apply_fused_remat: memory_budget")
    if type(model).__module__.startswith("peft") and hasattr(model, "get_base_model"):
        # a PeftModel: its LoRA layers move into the fused ones
        apply_fused_remat(model.get_base_model(), remat, memory_budget=memory_budget)
        return model
    if getattr(model, "_fused_remat_patch", None) is not None:
        raise ValueError("apply_fused_remat: the model is already patched")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    architecture = _ARCHITECTURES.get(model_type)
    if architecture is None:
        raise _refuse(f"model_type {model_type!r} ({type(model).__name__})", f"supported: {', '.join(sorted(_ARCHITECTURES))}",
                      patched=False)
    base = model.base_model
    layers = getattr(base, architecture.layers)
    for index in range(len(layers)):  # every refusal before anything changes
        architecture.block(config, index, base)
        _check_layer(layers[index], architecture.parts)
    fused_forward = _FusedBaseForward(base, architecture)  # refuses an unknown output class before anything changes
    checkpointing = bool(getattr(base, "gradient_checkpointing", False))
    swapped = 0
    try:
        for index in range(len(layers)):
            fused = FusedDecoderLayer(layers[index], index, config, architecture, remat, base, memory_budget)
            layers[index] = fused  # drops the Hugging Face layer: its unpacked weights go with it
            fused.gradient_checkpointing = checkpointing
            swapped += 1
    except Exception:
        # A layer refused on its weights (a packed piece frozen or without a bias while another is
        # not) after earlier layers were swapped: put those back, so a refused model is unchanged.
        for index in range(swapped):
            layers[index] = layers[index].to_huggingface()
        raise
    own_forward = base.__dict__.get("forward")
    base.forward = fused_forward
    model_forward = None
    if model is not base:
        model_forward = model.__dict__.get("forward")
        model.forward = _LabelsCheckedForward(model, model_forward)
    model._fused_remat_patch = _Patch(base, layers, own_forward, model_forward)
    return model


def revert_fused_remat(model: nn.Module) -> nn.Module:
    """Undoes ``apply_fused_remat``: Hugging Face layers again, holding the fused layers' (trained)
    weights unpacked, with their requires_grad, mode and gradient-checkpointing state. In place;
    returns ``model``. Build a new optimizer afterwards (the packed parameters are gone)."""
    patch = getattr(model, "_fused_remat_patch", None)
    if patch is None:
        raise ValueError("revert_fused_remat: the model was not patched by apply_fused_remat")
    for layer in patch.layers:
        layer.check_revertible()  # before any change
    for index in range(len(patch.layers)):
        patch.layers[index] = patch.layers[index].to_huggingface()  # one layer's copies at a time
    for module, own in ((patch.base, patch.own_forward), (model, patch.model_forward)):
        if isinstance(module.__dict__.get("forward"), (_FusedBaseForward, _LabelsCheckedForward)):
            if own is None:
                del module.forward
            else:
                module.forward = own
    del model._fused_remat_patch
    return model
