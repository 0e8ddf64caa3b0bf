"""``FusedDecoderLayer``, a ``fused_remat.TransformerBlock`` standing in for a Hugging Face decoder
layer, and its call paths: from the patched model, as the block over the batch's documents or, with
a KV cache, from its own modules with fused_remat's attention over the cache; on its own with the
original layer's arguments; and back to the Hugging Face layer."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import fused_remat
from fused_remat import TransformerBlock, reference
from fused_remat.reference import LowRankAdapter
from fused_remat.remat import Remat

from .architectures import _LINEAR_PARTS, _Architecture
from .batch import _LAYER_CALL, _CachedCall
from .linears import _ConvSlot, _Packed, _Slot
from .lora import _hooks, _is_lora, _lora_adapters
from .packing import _huggingface_state_dict, _huggingface_weights, _pack, _packed_state_dict
from .refusals import _describe, _refuse


class FusedDecoderLayer(TransformerBlock):
    """A ``fused_remat.TransformerBlock`` standing in for a Hugging Face decoder layer.

    The patched base model calls it with its documents and RoPE frequencies. Called on its own with
    the original layer's arguments (read from its signature), it runs the hidden states as one
    sequence per row, refuses any other argument, and returns what the original returned (a tensor,
    or a 1-tuple). ``gradient_checkpointing`` is Hugging Face's switch: True sets ``remat="full"``,
    False the remat it was built with. Built by ``apply_fused_remat``; ``to_huggingface()`` gives the
    original layer back.
    """

    def __init__(self, original: nn.Module, layer_idx: int, config, architecture: _Architecture, remat: Remat | None,
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
        self._policy, self._budget, self._checkpointing = self.remat, memory_budget, False
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
        self.memory_budget = None  # the remat setter refuses to be overruled by a budget
        self.remat = Remat.FULL if enable else self._policy
        if not enable:
            self.memory_budget = self._budget

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
