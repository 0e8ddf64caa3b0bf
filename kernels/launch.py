"""Host-side helpers shared by the launchers."""

from __future__ import annotations

import functools

import torch
import triton

# Every launch asks for fused multiply-adds (FFMA): Triton 3.6 to 3.9 fuse a multiply feeding an add
# by default, 3.10 will not (3.9 warns where TRITON_DEFAULT_FP_FUSION is unset), and the hot loops
# were measured and tuned fused. ``enable_fp_fusion`` is a compile option of Triton's NVIDIA and AMD
# backends (3.6 and 3.9): the autotuner passes launch keywords on to every configuration it compiles,
# and the interpreter drops them.
FP_FUSION = {"enable_fp_fusion": True}

# The row-wise kernels (norms, activations) ask for the opposite: every multiply and add rounds on
# its own. Their outputs are rebuilt by other kernels (a norm's or activation's backward rebuilds the
# forward's output for the next weight gradient), and every remat point must give the same bits;
# with fusion on, the compiler contracts the same source differently in the two kernels (on an
# H200, exact GELU's rebuilt output and dx differed from the forward's and from the no-rebuild
# backward's, and LayerNorm's dx over one column came out as w*dy's rounding error times rstd
# instead of 0). They are memory-bound, so the separate FMUL and FADD should cost instructions,
# not time (their compiled form is in bench/results/static; no GPU has timed them yet).
SEPARATE_ROUNDING = {"enable_fp_fusion": False}


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
    """The least power of two >= n (1 for n <= 1), in plain integers: ``triton.next_power_of_2`` is
    a constexpr function in Triton 3.9 whose wrapper costs microseconds a call, and a block's step
    asks about twenty times on the host."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cuda_scratch(size: int, alignment: int, stream):
    """Global scratch for a launch on the current CUDA device (Triton asks when a kernel builds
    tensor descriptors on the device: 128 bytes per descriptor and program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for kernel scratch memory unless the caller set one.

    Triton keeps it in a context variable, which every new thread (autograd's backward threads
    among them) starts without: so this runs before every launch that needs it, not once."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_cuda_scratch)
