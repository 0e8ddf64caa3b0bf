"""The error rule of docs/design.md: against a float64 reference, the kernel's error may be at most twice
the error of plain PyTorch computing the same thing in the input dtype, plus a tiny floor."""

from __future__ import annotations

import functools

import numpy as np
import torch

# Absolute floor, relative to the reference's scale: enough for fp32 rounding of a few reductions,
# far below anything a wrong kernel produces.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def error(value: torch.Tensor, reference: torch.Tensor, metric: str = "max") -> float:
    """Largest absolute error ("max"), or its root mean square over all elements ("rms")."""
    if not reference.numel():
        return 0.0
    diff = value.double() - reference.double()
    return diff.abs().max().item() if metric == "max" else diff.square().mean().sqrt().item()


def assert_error_rule(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor, reference64: torch.Tensor,
                      dtype: torch.dtype, metric: str = "max") -> None:
    """``metric="rms"`` is for whole-block comparisons in 16-bit dtypes: there both sides sum many
    independent roundings in different orders, and the maximum over a few dozen elements (a norm
    weight's gradient) swings widely between seeds, while the RMS error measures the same precision
    stably."""
    assert ours.shape == reference64.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(reference64.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    scale = max(reference64.abs().max().item(), 1e-6) if reference64.numel() else 1.0
    ours_error = error(ours, reference64, metric)
    torch_error = error(torch_same_dtype, reference64, metric)
    bound = 2 * torch_error + FLOOR[dtype] * scale
    assert ours_error <= bound, (
        f"{name}: {metric} error {ours_error:.3e} exceeds 2 x PyTorch's {torch_error:.3e} + floor "
        f"{FLOOR[dtype] * scale:.3e} ({dtype}, reference scale {scale:.3e})"
    )


@functools.lru_cache(maxsize=None)
def interpreter_dots_by_row() -> bool:
    """Whether this machine's numpy float32 matmul, which Triton's interpreter runs ``tl.dot`` on, gives
    a row of a product the same bits wherever the row sits in its tile, as a GPU's matrix
    instructions do. Some CPUs' BLAS kernels sum a row in another order by its place in the tile;
    there a claim that a row's bits do not depend on its tile holds on the GPU but cannot be
    checked through the interpreter."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16), dtype=np.float32), rng.standard_normal((16, 16), dtype=np.float32)
    product = a @ b
    return all(np.array_equal(np.roll(np.roll(a, shift, axis=0) @ b, -shift, axis=0), product) for shift in range(1, 16))
