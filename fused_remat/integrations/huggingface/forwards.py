"""The patched model's forwards: the base model's (``_FusedBaseForward``: embeddings, the fused
layers, the final norm, with or without a KV cache) and the causal LM's, which first refuses labels
read at a padding position (``_LabelsCheckedForward``). Objects rather than closures, so that
deepcopy and pickle follow them."""

from __future__ import annotations

import inspect
import typing

import transformers
from torch import nn

from .architectures import _Architecture
from .batch import _CACHE_ARGUMENTS, _LAYER_CALL, _CachedCall, _LayerCall, _batch_of, _check_unread, _tokens_of
from .refusals import _refuse


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
