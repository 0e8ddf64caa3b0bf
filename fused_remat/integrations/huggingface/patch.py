"""``apply_fused_remat`` and its undo, ``revert_fused_remat``: every refusal checked on every layer
before anything changes, then the layers swapped and the forwards patched, in place."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fused_remat.remat import Remat, check_memory_budget

from .architectures import _ARCHITECTURES
from .forwards import _FusedBaseForward, _LabelsCheckedForward
from .layer import FusedDecoderLayer
from .packing import _check_layer
from .refusals import _refuse


@dataclass
class _Patch:
    base: nn.Module
    layers: nn.ModuleList
    own_forward: object  # the base model's instance-level forward before patching, or None
    model_forward: object  # the model's instance-level forward before patching, or None (the base model patched itself)


def apply_fused_remat(model: nn.Module, remat: Remat | str | None = None, *, memory_budget: float | None = None) -> nn.Module:
    """Swaps every decoder layer of a Hugging Face causal LM, in place, for a ``FusedDecoderLayer``
    (a ``fused_remat.TransformerBlock`` with ``remat``, default ``cheap``, or instead with ``memory_budget``: a fraction
    of what ``remat="none"`` keeps, each layer choosing its point per call) holding the same weights, packed, and the base
    model's forward for fused_remat's. Returns ``model``. Raises ``UnsupportedByFusedBlock`` for
    configurations the block cannot compute exactly (see the package docstring), leaving the model as
    it was: every layer is checked before any changes. The causal LM's forward refuses labels read
    from a padding position (_check_labels). Build the optimizer afterwards."""
    memory_budget = check_memory_budget(memory_budget, owner="apply_fused_remat: memory_budget")
    if remat is not None and memory_budget is not None:
        raise ValueError(f"apply_fused_remat: remat={remat!r} and memory_budget={memory_budget!r} are two ways to say "
                         "what each layer keeps; give one (memory_budget lets each layer choose its point per call)")
    if memory_budget is None:
        remat = Remat.parse(Remat.CHEAP if remat is None else remat, owner="apply_fused_remat: remat")
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
