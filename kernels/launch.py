"""Host-side helpers shared by the launchers."""

from __future__ import annotations

import functools

import torch
import triton


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_program_count(device: torch.device, work_items: int, per_sm: int = 2) -> int:
    """Programs for a grid-stride kernel: enough to fill the GPU, few in the (serial) interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        budget = _cuda_sm_count(index) * per_sm
    else:
        budget = 4
    return max(1, min(work_items, budget))


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
