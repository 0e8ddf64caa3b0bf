"""The error rule of DESIGN.md: against a float64 reference, the kernel's error may be at most twice
the error of plain PyTorch computing the same thing in the input dtype, plus a tiny floor."""

from __future__ import annotations

import torch

# Absolute floor, relative to the reference's scale: enough for fp32 rounding of a few reductions,
# far below anything a wrong kernel produces.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return (value.double() - reference.double()).abs().max().item() if reference.numel() else 0.0


def assert_error_rule(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor, reference64: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.shape == reference64.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(reference64.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    scale = max(reference64.abs().max().item(), 1e-6) if reference64.numel() else 1.0
    ours_error = max_error(ours, reference64)
    torch_error = max_error(torch_same_dtype, reference64)
    bound = 2 * torch_error + FLOOR[dtype] * scale
    assert ours_error <= bound, (
        f"{name}: max error {ours_error:.3e} exceeds 2 x PyTorch's {torch_error:.3e} + floor "
        f"{FLOOR[dtype] * scale:.3e} ({dtype}, reference scale {scale:.3e})"
    )
