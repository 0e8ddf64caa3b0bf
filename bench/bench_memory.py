"""Memory: peak CUDA memory of one attention forward+backward against sequence length, ours
(O(N): q, k, v, o and one fp32 log-sum-exp per row) against SDPA's math backend (O(N^2): it
materializes the N x N probabilities) and SDPA's flash backend, up to the largest N that fits.
The block's memory per remat policy is in the block suite (bench_block.py).

On a GPU, pytest checks that ours peaks below the math backend up to N = 16k; on CPU it runs one
tiny case through the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import Case, Suite, dtype_name, peak_memory_mib
from bench.providers import attention_inputs, attention_providers
from fused_remat.flops import attention_flops

HEADS, HEAD_DIM = 16, 128


def lengths(quick: bool, device: str = "cuda") -> tuple[int, ...]:
    """N of every case, in the order the suite runs them."""
    if device != "cuda":
        return (48,)
    return (1024, 4096, 16384, 65536) if quick else (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def case(n: int, device: str = "cuda") -> Case:
    """Causal forward+backward at batch 1 and length ``n``: ours, SDPA's math and flash backends (GPU only)."""
    if device != "cuda":
        heads, head_dim, dtype, peers = 2, 32, torch.float32, {}
    else:
        heads, head_dim, dtype = HEADS, HEAD_DIM, torch.bfloat16
        peers = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION"}
    return Case(
        suite="memory", name=f"attention fwd+bwd causal B1 H{heads} D{head_dim} N{n}",
        params={"what": "attention", "n": n, "heads": heads, "d": head_dim, "dtype": dtype_name(dtype)},
        providers=attention_providers(peers, "fwd+bwd", True, attention_inputs(1, heads, n, head_dim, dtype, device)),
        unit="TFLOP/s", work=attention_flops(1, heads, n, n, head_dim, True, "fwd+bwd"), ceiling="matmul",
    )


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    return [case(n, device) for n in lengths(quick, device)]


def plots(folder, results, ceilings):
    from bench.report import plot

    plot(folder, "memory", "attention forward+backward peak memory (MiB, log scale): O(N) against O(N^2)",
         results, x_key="n", group_keys=("what", "d"), value=lambda r: r.peak_mib, ylabel="peak MiB", log_y=True)
    plot(folder, "memory-saved", "bytes autograd keeps for backward (MiB, log scale, saved-memory meter)",
         results, x_key="n", group_keys=("what", "d"), value=lambda r: r.saved_mib, ylabel="saved MiB", log_y=True)


@pytest.mark.parametrize("n", lengths(quick=True, device="cpu"))
def test_smoke_on_cpu(n, triton_backend):
    grads = case(n, device="cpu").providers["fused_remat"]()()
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu  # conftest.py skips it without a CUDA device and compiled Triton
@pytest.mark.parametrize("n", [1024, 4096, 16384])
def test_gpu_peak_memory_below_math_backend(n):
    built = case(n)
    peaks = {}
    for provider in ("fused_remat", "sdpa-math"):
        try:
            peaks[provider] = peak_memory_mib(built.providers[provider]())
        except torch.cuda.OutOfMemoryError:
            peaks[provider] = float("inf")
        torch.cuda.empty_cache()
    assert peaks["fused_remat"] < peaks["sdpa-math"], peaks


SUITE = Suite("memory", cases, plots, measure_memory=True)
