"""What the fused block refuses: ``UnsupportedByFusedBlock``, the one error of the integration for
what it cannot compute exactly, and how a refusal names the input."""

from __future__ import annotations

import torch


class UnsupportedByFusedBlock(ValueError):
    """The fused block cannot compute what the Hugging Face model would for this model or input."""


def _refuse(what: str, why: str, patched: bool = True) -> UnsupportedByFusedBlock:
    advice = " (revert_fused_remat(model) to run it on Hugging Face's layers)" if patched else ""
    return UnsupportedByFusedBlock(f"fused_remat: {what}: {why}{advice}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) < 60 else f"<{type(value).__name__}>"
