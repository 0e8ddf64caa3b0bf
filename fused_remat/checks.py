"""Argument checks shared by the public ops: every error names the argument and what was expected."""

from __future__ import annotations

import torch

from .backend import SUPPORTED_DTYPES

_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def check_tensor(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor ({_DTYPE_NAMES}), got {value.dtype}")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {value.dtype}; supported: {_DTYPE_NAMES}")
    return value


def check_same_device(op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, other in others.items():
        if other is not None and other.device != reference.device:
            raise ValueError(
                f"{op}: {name} is on {other.device} but {reference_name} is on {reference.device}; "
                "all tensors must be on one device"
            )


def check_same_dtype(op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, other in others.items():
        if other.dtype != reference.dtype:
            raise TypeError(f"{op}: {name} has dtype {other.dtype} but {reference_name} has {reference.dtype}; they must match")

