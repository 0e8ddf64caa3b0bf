"""Run a Hugging Face ``transformers`` causal LM on fused_remat's block.

    from fused_remat.integrations.huggingface import apply_fused_remat, revert_fused_remat

    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    apply_fused_remat(model, remat="cheap")   # in place; build the optimizer after this
    ...train with model(input_ids, labels=labels).loss...
    revert_fused_remat(model)                 # Hugging Face layers again, with the trained weights
    model.save_pretrained(...)

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (any
``config.model_type`` of llama, mistral, qwen2) and ``GPT2LMHeadModel`` (gpt2). Every decoder layer
becomes a ``FusedDecoderLayer``, a ``fused_remat.TransformerBlock`` that takes the layer's call.

Weights. The block keeps one packed qkv projection ([q heads | k heads | v heads]) and, for SwiGLU,
one packed fc1 ([gate | up]); separate Hugging Face tensors cannot be views of one packed tensor, so
``apply_fused_remat`` copies q/k/v and gate/up once, layer by layer, into packed tensors that become
the layer's parameters, and drops the Hugging Face layer, which frees the originals unless something
else (an optimizer built earlier) still holds them. GPT-2's Conv1D weights are stored (in, out) and
are copied transposed (c_attn is already packed qkv). Norm weights, o_proj and down_proj are taken
over without a copy. Memory: while it runs, one layer's copied weights exist twice (Llama-style:
dim x (Hq + 2 Hkv) x head_dim + 2 x dim x ffn elements); afterwards the model holds what it held
before. ``revert_fused_remat`` splits (and for GPT-2 transposes) them back the same way.

Biases. The block's ``bias`` switches all its biases together. Where the Hugging Face layer lacks
some (Qwen2: biases on q, k, v only; Llama with ``attention_bias=True``: on q, k, v, o), the block is
built with ``bias=True`` and the missing ones are zero tensors with ``requires_grad=False`` (2 x dim
+ 2 x ffn elements per layer for Qwen2): the function is exactly the Hugging Face layer's and the
real parameters get the same gradients. A forward refuses to run if one of them was made trainable
(``model.requires_grad_(True)``), and revert refuses if one is no longer zero.

Refused with ``UnsupportedByFusedBlock`` (a ValueError naming the input), never silently wrong:
an ``attention_mask`` with padding (all-ones masks are fine) or of 4 dimensions; ``position_ids`` or
``cache_position`` other than 0..N-1 in every row (also packed sequences); a KV cache:
``past_key_values`` (``cache`` in recent transformers), ``use_cache=True`` (``use_cache`` left unset means False on a patched model,
so ``model.generate()`` needs ``use_cache=False`` and then gives the unpatched model's tokens);
``output_attentions`` and ``output_hidden_states``; a sliding window shorter than the sequence;
dropout > 0 in training mode (attention or residual dropout; GPT-2's embedding dropout is outside the
layers and still applies); RoPE types other than default, partial rotary, a head_dim other than
hidden_size / num_attention_heads, activations other than SiLU (Llama family) or gelu / gelu_new /
gelu_pytorch_tanh (GPT-2), GPT-2 cross-attention, ``scale_attn_by_inverse_layer_idx`` or unscaled
attention; any other keyword the layer is handed that it does not know (flash-attention varlen
arguments, for example).

Checkpointing. ``model.gradient_checkpointing_enable()`` (or ``activation_checkpointing_enable``)
sets every fused layer to ``remat="full"`` (keeps only the layer input; ``every_n_layers`` is not
honoured: every layer goes full), and disabling sets them back to the ``remat`` given here. The
Hugging Face checkpoint wrapper never runs around a fused layer.

Version: the layer's call signature and return value (a tensor, or a 1-tuple on older GPT-2) are read
from the installed ``transformers`` when patching; plain attributes of the layer that the model reads
(Qwen2's ``attention_type`` in 4.x) are carried over. Tested with transformers 4.57.6 and 5.23.0. ``save_pretrained`` of a patched model writes the packed layout: revert first.
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass

import torch
import transformers  # noqa: F401  (the integration needs it; importing fails early without it)
from torch import nn

from fused_remat import TransformerBlock
from fused_remat.remat import Remat

__all__ = ["FusedDecoderLayer", "UnsupportedByFusedBlock", "apply_fused_remat", "revert_fused_remat"]


class UnsupportedByFusedBlock(ValueError):
    """The fused block cannot compute what the Hugging Face model would for this model or input."""


def _refuse(what: str, why: str) -> UnsupportedByFusedBlock:
    return UnsupportedByFusedBlock(f"fused_remat: {what}: {why} (revert_fused_remat(model) to run it on Hugging Face's layers)")


# --- what each architecture looks like ---------------------------------------------------------

_LLAMA_PARTS = {
    "norm1": ("input_layernorm",),
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "out_proj": ("self_attn.o_proj",),
    "norm2": ("post_attention_layernorm",),
    "fc1": ("mlp.gate_proj", "mlp.up_proj"),
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


def _config_value(config, name, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def _rope_theta(config) -> float:
    """The default-RoPE base, from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (4.x); anything but plain RoPE over the whole head is refused."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise _refuse(f"RoPE type {rope_type!r}", "the block applies default RoPE only (no scaling)")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise _refuse(f"partial_rotary_factor={partial}", "the block rotates the whole head")
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)):
        raise _refuse(f"RoPE parameters {params!r}", "no single rope_theta found")
    return float(theta)


def _llama_block(config, layer_idx: int) -> tuple[dict, float, int | None]:
    """Block kwargs (bias decided later from the modules), dropout, sliding window of one layer."""
    heads = config.num_attention_heads
    head_dim = _config_value(config, "head_dim", config.hidden_size // heads)
    if head_dim * heads != config.hidden_size:
        raise _refuse(f"head_dim={head_dim}", f"the block needs hidden_size / num_attention_heads = {config.hidden_size // heads}")
    if config.hidden_act != "silu":
        raise _refuse(f"hidden_act={config.hidden_act!r}", "the block's gated MLP is SwiGLU (silu)")
    window = _config_value(config, "sliding_window")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        window = None
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    kwargs = dict(dim=config.hidden_size, n_heads=heads, n_kv_heads=_config_value(config, "num_key_value_heads", heads),
                  ffn_dim=config.intermediate_size, norm="rmsnorm", activation="swiglu", eps=config.rms_norm_eps,
                  rope_theta=_rope_theta(config))
    return kwargs, float(_config_value(config, "attention_dropout", 0.0)), window


def _gpt2_block(config, layer_idx: int) -> tuple[dict, float, int | None]:
    activation = _GPT2_ACTIVATIONS.get(config.activation_function)
    if activation is None:
        raise _refuse(f"activation_function={config.activation_function!r}", f"the block supports {sorted(_GPT2_ACTIVATIONS)}")
    for name, wanted in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
        if bool(getattr(config, name, wanted)) != wanted:
            raise _refuse(f"{name}={not wanted}", "the block's attention is causal self-attention scaled by 1/sqrt(head_dim)")
    kwargs = dict(dim=config.hidden_size, n_heads=config.num_attention_heads, ffn_dim=_config_value(config, "n_inner", 4 * config.hidden_size),
                  norm="layernorm", activation=activation, eps=config.layer_norm_epsilon, rope_theta=None)
    return kwargs, float(max(config.attn_pdrop, config.resid_pdrop)), None


@dataclass(frozen=True)
class _Architecture:
    layers: str  # attribute of the base model holding the decoder layers
    parts: dict  # fused block module -> Hugging Face modules packed into it, in order
    block: object  # (config, layer_idx) -> (block kwargs, dropout, sliding window)


_ARCHITECTURES = {
    "llama": _Architecture("layers", _LLAMA_PARTS, _llama_block),
    "mistral": _Architecture("layers", _LLAMA_PARTS, _llama_block),
    "qwen2": _Architecture("layers", _LLAMA_PARTS, _llama_block),
    "gpt2": _Architecture("h", _GPT2_PARTS, _gpt2_block),
}


# --- packing ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """One Hugging Face parameter inside a fused one: its name in the layer, rows, and whether the
    Hugging Face tensor is stored transposed (Conv1D weights are (in, out))."""

    name: str
    rows: int
    transposed: bool


def _pack(layer: nn.Module, parts: dict) -> tuple[dict, dict]:
    """The fused block's state (name -> tensor) from a Hugging Face layer, and where every piece came from."""
    state, layout = {}, {}
    for fused, sources in parts.items():
        modules = [layer.get_submodule(source) for source in sources]
        for attr in ("weight", "bias"):
            params = [getattr(module, attr, None) for module in modules]
            if all(p is None for p in params):
                continue
            name = f"{fused}.{attr}"
            if any(p is None for p in params) or len({p.requires_grad for p in params}) > 1:
                raise _refuse(f"{name} from {', '.join(sources)}", "some of the pieces packed into it lack a bias or are frozen while others are not")
            transposed = [attr == "weight" and type(m).__name__ == "Conv1D" for m in modules]
            tensors = [p.detach().t() if t else p.detach() for p, t in zip(params, transposed)]
            state[name] = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).contiguous()
            state[name].requires_grad_(params[0].requires_grad)
            layout[name] = tuple(_Piece(f"{src}.{attr}", t.shape[0], tr) for src, t, tr in zip(sources, tensors, transposed))
    return state, layout


# --- the layer ----------------------------------------------------------------------------------

# True while a patched model's base forward runs, after it checked the model-level inputs.
_CHECKED_CALL = contextvars.ContextVar("fused_remat_hf_checked_call", default=False)
# Layer arguments that the model-level check vouches for; outside a checked call they must be None.
_VOUCHED = frozenset({"attention_mask", "position_ids", "position_embeddings", "cache_position"})


class FusedDecoderLayer(TransformerBlock):
    """A ``fused_remat.TransformerBlock`` that takes a Hugging Face decoder layer's call.

    It accepts the original layer's arguments (read from its signature), refuses any it cannot
    honour, and returns what the original returned (a tensor, or a 1-tuple). ``gradient_checkpointing``
    is Hugging Face's switch: True sets ``remat="full"``, False the remat it was built with.
    Built by ``apply_fused_remat``; ``to_huggingface()`` gives the original layer back.
    """

    def __init__(self, original: nn.Module, layer_idx: int, config, architecture: _Architecture, remat: Remat):
        kwargs, dropout, window = architecture.block(config, layer_idx)
        state, layout = _pack(original, architecture.parts)
        param = state["qkv.weight"]
        super().__init__(kwargs.pop("dim"), kwargs.pop("n_heads"), bias=any(n.endswith(".bias") for n in state),
                         remat=remat, device="meta", dtype=param.dtype, **kwargs)
        zero = {n: torch.zeros(p.shape, device=param.device, dtype=p.dtype) for n, p in self.named_parameters() if n not in state}
        missing = [n for n in zero if not n.endswith(".bias")]
        if missing:
            raise _refuse(f"{type(original).__name__} without {missing}", "the layer does not have the modules the block needs")
        self.load_state_dict({**state, **zero}, assign=True)
        for name, tensor in {**state, **zero}.items():
            self.get_parameter(name).requires_grad_(tensor.requires_grad)
        self._zero_biases = tuple(zero)
        self._layout = layout
        self._original_class = type(original)
        self._config, self._layer_idx = config, layer_idx
        self._dropout, self._window = dropout, window
        self._signature = inspect.signature(type(original).forward)
        self._returns_tuple = _returns_tuple(self._signature, type(original))
        self._policy, self._checkpointing = remat, False
        self.train(original.training)
        for name, value in vars(original).items():  # plain attributes the model reads (Qwen2's attention_type)
            if not name.startswith("_") and isinstance(value, (str, int, float)) and not hasattr(self, name):
                setattr(self, name, value)

    @property
    def gradient_checkpointing(self) -> bool:
        return self._checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enable: bool) -> None:
        self._checkpointing = bool(enable)
        self.remat = Remat.FULL if enable else self._policy

    def forward(self, hidden_states, *args, **kwargs):
        arguments = self._signature.bind(self, hidden_states, *args, **kwargs).arguments
        for name, value in list(arguments.items())[2:]:
            if self._signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                extra = value.items()
            elif self._signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
                extra = ((f"{name}[{i}]", v) for i, v in enumerate(value))
            else:
                extra = ((name, value),)
            for key, value in extra:
                if value is None or value is False or (key in _VOUCHED and _CHECKED_CALL.get()):
                    continue
                raise _refuse(f"{key}={_describe(value)} given to a fused decoder layer",
                              "the block runs causal self-attention over positions 0..N-1 without a cache")
        self._check_call(hidden_states)
        y = super().forward(hidden_states)
        return (y,) if self._returns_tuple else y

    def _check_call(self, x: torch.Tensor) -> None:
        if self.training and self._dropout > 0:
            raise _refuse(f"dropout {self._dropout} in training mode", "the block has no dropout; set the config's attention/residual dropout to 0")
        if self._window is not None and x.shape[1] > self._window:
            raise _refuse(f"sliding_window={self._window} with a sequence of {x.shape[1]}", "the block attends to every earlier position")
        trainable = [name for name in self._zero_biases if self.get_parameter(name).requires_grad]
        if trainable:
            raise _refuse(f"requires_grad on {trainable}", f"these biases stand for ones {self._original_class.__name__} does not have and must stay zero and frozen")

    def huggingface_tensors(self, tensors: dict) -> dict:
        """``tensors`` named like this layer's parameters (the parameters, their gradients, ...) split
        into the Hugging Face layer's names and layouts; the zero stand-in biases are left out."""
        out = {}
        for name, pieces in self._layout.items():
            if tensors.get(name) is None:
                continue
            for piece, part in zip(pieces, tensors[name].split([p.rows for p in pieces])):
                out[piece.name] = part.t() if piece.transposed else part
        return out

    def check_revertible(self) -> None:
        """Raises if the Hugging Face layer cannot hold this layer's weights (a stand-in bias became nonzero)."""
        nonzero = [name for name in self._zero_biases if self.get_parameter(name).detach().count_nonzero()]
        if nonzero:
            raise _refuse(f"nonzero {nonzero}", f"{self._original_class.__name__} has no such biases")

    def to_huggingface(self) -> nn.Module:
        """The original Hugging Face layer class with this layer's weights (copied where they were
        packed or transposed, so no two parameters share storage), requires_grad and mode."""
        self.check_revertible()
        with torch.device(self.qkv.weight.device):
            layer = self._original_class(self._config, layer_idx=self._layer_idx)
        state, trainable = {}, {}
        for name, pieces in self._layout.items():
            param = self.get_parameter(name)
            for piece, part in zip(pieces, param.detach().split([p.rows for p in pieces])):
                part = part.t() if piece.transposed else part
                copy = len(pieces) > 1 or piece.transposed  # else the same storage goes back
                state[piece.name] = part.clone(memory_format=torch.contiguous_format) if copy else part
                trainable[piece.name] = param.requires_grad
        layer.load_state_dict(state, assign=True)
        for name, requires_grad in trainable.items():
            layer.get_parameter(name).requires_grad_(requires_grad)
        if self._checkpointing and hasattr(self, "_gradient_checkpointing_func"):
            layer._gradient_checkpointing_func = self._gradient_checkpointing_func
            layer.gradient_checkpointing = True
        return layer.train(self.training)


def _returns_tuple(signature: inspect.Signature, cls: type) -> bool:
    """Whether the installed transformers' layer returns a tuple (GPT-2 before 5.0) or a tensor."""
    annotation = signature.return_annotation
    if annotation in (torch.Tensor, torch.FloatTensor, "torch.Tensor", "torch.FloatTensor"):
        return False
    text = annotation if isinstance(annotation, str) else repr(annotation)
    if "tuple" in text.lower():
        return True
    raise _refuse(f"{cls.__name__}.forward returning {text}", "cannot tell whether this transformers version's layers return a tensor or a tuple")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) < 60 else f"<{type(value).__name__}>"


# --- model-level checks -----------------------------------------------------------------------

_NO_CACHE = "the block keeps no KV cache; pass use_cache=False (to generate() too)"
# transformers 5.2x names the cache argument ``cache``; earlier versions ``past_key_values``.
_CACHE_ARGUMENTS = {"use_cache": "use_cache=True", "past_key_values": "past_key_values",
                    "cache": "cache (past_key_values)"}
# Base-model arguments that need no check (what they change happens outside the decoder layers).
_HARMLESS = frozenset({"input_ids", "inputs_embeds", "token_type_ids", "return_dict"})


def _check_positions(name: str, value, seq: int) -> None:
    if value is None:
        return
    expected = torch.arange(seq, device=value.device)
    if value.shape[-1] != seq or not bool((value == expected).all()):
        raise _refuse(f"{name} other than 0..{seq - 1} in every row", "the block's RoPE and causal mask use positions 0..N-1")


def _check_model_inputs(arguments: dict, config) -> None:
    embeds = arguments.get("inputs_embeds")
    tokens = arguments.get("input_ids")
    seq = embeds.shape[1] if embeds is not None else tokens.shape[-1] if tokens is not None else None
    for name, value in arguments.items():
        if name in _HARMLESS or value is None or value is False:
            continue
        if name == "attention_mask":
            if value.dim() != 2:
                raise _refuse(f"a {value.dim()}-D attention_mask", "only 2-D masks without padding are supported")
            if not bool(value.all()):
                raise _refuse("attention_mask with padding (zeros)", "the block attends to every earlier token; use unpadded batches")
        elif name in ("position_ids", "cache_position") and seq is not None:
            _check_positions(name, value, seq)
        elif name in _CACHE_ARGUMENTS:
            raise _refuse(_CACHE_ARGUMENTS[name], _NO_CACHE)
        else:
            raise _refuse(f"{name}={_describe(value)}", "the fused decoder layers cannot honour it")
    for flag in ("output_attentions", "output_hidden_states"):
        if arguments.get(flag) is None and getattr(config, flag, False):
            raise _refuse(f"config.{flag}=True", "the fused layers do not record per-layer outputs")


def _checked_forward(base: nn.Module, forward):
    signature = inspect.signature(forward)
    keywords = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def checked(*args, **kwargs):
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        arguments.update(arguments.pop(keywords, {}) if keywords else {})
        _check_model_inputs(arguments, base.config)
        arguments["use_cache"] = False  # a patched model keeps no cache: unset means False
        token = _CHECKED_CALL.set(True)
        try:  # all by keyword: Hugging Face's forward decorators fill in config defaults for missing keywords
            return forward(**arguments)
        finally:
            _CHECKED_CALL.reset(token)

    return checked


# --- patch and revert -------------------------------------------------------------------------

@dataclass
class _Patch:
    base: nn.Module
    layers: nn.ModuleList
    own_forward: object  # the base model's instance-level forward before patching, or None


def apply_fused_remat(model: nn.Module, remat: Remat | str = Remat.CHEAP) -> nn.Module:
    """Swaps every decoder layer of a Hugging Face causal LM, in place, for a ``FusedDecoderLayer``
    (a ``fused_remat.TransformerBlock`` with ``remat``) holding the same weights, packed. Returns
    ``model``. Raises ``UnsupportedByFusedBlock`` for configurations the block cannot compute
    exactly (see the module docstring), leaving the model as it was: the config is checked before
    any layer changes, and a layer refused on its weights puts the layers swapped before it back.
    Build the optimizer afterwards."""
    remat = Remat.parse(remat, owner="apply_fused_remat: remat")
    if getattr(model, "_fused_remat_patch", None) is not None:
        raise ValueError("apply_fused_remat: the model is already patched")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    architecture = _ARCHITECTURES.get(model_type)
    if architecture is None:
        raise _refuse(f"model_type {model_type!r} ({type(model).__name__})", f"supported: {', '.join(sorted(_ARCHITECTURES))}")
    base = model.base_model
    layers = getattr(base, architecture.layers)
    for index in range(len(layers)):
        architecture.block(config, index)  # every configuration refusal before anything changes
    checkpointing = bool(getattr(base, "gradient_checkpointing", False))
    swapped = 0
    try:
        for index in range(len(layers)):
            fused = FusedDecoderLayer(layers[index], index, config, architecture, remat)
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
    base.forward = _checked_forward(base, base.forward)
    model._fused_remat_patch = _Patch(base, layers, own_forward)
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
    if patch.own_forward is None:
        del patch.base.forward
    else:
        patch.base.forward = patch.own_forward
    del model._fused_remat_patch
    return model
