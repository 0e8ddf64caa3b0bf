"""The fused layer's packed linear layers (``_Packed``) and the Hugging Face projections that stay
under their names as views of the packed rows (``_Slot``; ``_ConvSlot`` for GPT-2's Conv1D), where
adapters such as PEFT's LoRA find them."""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


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
