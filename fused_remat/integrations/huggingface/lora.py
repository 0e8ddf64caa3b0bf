"""What others wrap around a layer's modules: PEFT LoRA layers (told by their attributes: peft is
optional) and hooks. The plain module under a LoRA layer, the active LoRA adapters as the block's
``LowRankAdapter``s, and a refusal for anything the block would bypass by reading the weights."""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from fused_remat.reference import LowRankAdapter

from .architectures import _LINEAR_PARTS
from .linears import _ConvSlot, _Slot
from .refusals import _refuse


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
