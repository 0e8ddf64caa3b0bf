"""What each supported architecture looks like to the fused block: which Hugging Face modules pack
into which of the block's, the block's arguments from a config (refusing what it cannot compute),
the hidden states before the first layer and RoPE's frequencies per call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .batch import _Batch
from .refusals import _refuse


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
