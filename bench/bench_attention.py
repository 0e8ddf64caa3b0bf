"""Attention: forward, backward and forward+backward TFLOP/s of ``fused_remat.attention`` against
PyTorch SDPA's flash, cuDNN and memory-efficient backends, and peak memory against SDPA's math
backend (which materializes the N x N matrix).

bf16, head dims 64 and 128, causal and not, N from 1k to 16k with B x N = 16k tokens and
H x D = 2048. FLOPs: 4 B H Nq Nk D forward (half when causal), backward 2.5x forward. The peak
memory cases are the memory suite's (bench/bench_memory.py) up to N = 16k.

    python -m bench attention                             # GPU: the suite CLI (JSON, Markdown, plots)
    pytest bench/bench_attention.py --benchmark-only      # GPU: pytest-benchmark
On CPU, pytest runs one tiny case through the Triton interpreter so this file cannot rot.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fused_remat
from bench.harness import Case, peak_memory_mib, pytest_benchmark_case, rotating

MODES = ("fwd", "bwd", "fwd+bwd")
WORK = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}
TOKENS, WIDTH = 16384, 2048
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device with compiled Triton")


def ours(q, k, v, causal):
    return fused_remat.attention(q, k, v, causal=causal)


def sdpa(backend: str):
    def run(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _provider(fn, mode, make_inputs, causal):
    """A factory of the zero-argument callable to time; backward runs on a retained graph."""
    if mode == "fwd":
        return lambda: rotating(make_inputs, lambda q, k, v, do: fn(q, k, v, causal))
    if mode == "bwd":
        def prepare():
            q, k, v, do = make_inputs()
            return fn(q, k, v, causal), (q, k, v), do

        return lambda: rotating(prepare, lambda o, inputs, do: torch.autograd.grad(o, inputs, do, retain_graph=True))
    return lambda: rotating(make_inputs, lambda q, k, v, do: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do))


def _shape(n, d, device):
    if device != "cuda":
        return 1, 2, 64, 32  # interpreter smoke size
    return max(1, TOKENS // n), WIDTH // d, n, d


def _make_inputs(batch, heads, n, d, dtype, device):
    def make():
        q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        return q, k, v, torch.randn(batch, heads, n, d, device=device, dtype=dtype)

    return make


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    """Speed cases: one per (mode, head dim, causal, N); providers ours and the SDPA backends."""
    if device != "cuda":
        grid, dtype, peers = [(64, 32, True)], torch.float32, {"sdpa-math": sdpa("MATH")}
    else:
        lengths = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384)
        grid = [(n, d, causal) for d in (64, 128) for causal in (False, True) for n in lengths]
        dtype, peers = torch.bfloat16, {name: sdpa(backend) for name, backend in SDPA_BACKENDS.items()}
    result = []
    for n, d, causal in grid:
        batch, heads, n, d = _shape(n, d, device)
        make = _make_inputs(batch, heads, n, d, dtype, device)
        flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
        for mode in MODES:
            providers = {"fused_remat": _provider(ours, mode, make, causal)}
            providers.update({name: _provider(fn, mode, make, causal) for name, fn in peers.items()})
            result.append(Case(
                suite="attention", name=f"attention {mode} d{d} {'causal' if causal else 'full'} N{n}",
                params={"mode": mode, "batch": batch, "heads": heads, "n": n, "d": d, "causal": causal,
                        "dtype": str(dtype).removeprefix("torch.")},
                providers=providers, unit="TFLOP/s", work=flops * WORK[mode], ceiling="matmul",
            ))
    return result


def plots(folder, results, ceilings):
    """TFLOP/s against N per (mode, head dim, causal), with the measured bf16 matmul rate."""
    from bench.report import plot

    plot(folder, "attention", "attention TFLOP/s (higher is better), bf16, B x N = 16k tokens", results, x_key="n",
         group_keys=("mode", "d", "causal"), value=lambda r: r.metric, ylabel="TFLOP/s",
         ceiling=ceilings.get("bf16_matmul_TFLOPs"))


def test_smoke_on_cpu(benchmark, triton_backend):
    """Our kernels through the interpreter on a tiny case (forward and backward)."""
    if GPU:
        pytest.skip("the GPU cases cover this")
    fns = {case.params["mode"]: case.providers["fused_remat"]() for case in cases(quick=True, device="cpu")}
    out = benchmark(fns["fwd+bwd"])
    assert all(torch.isfinite(g).all() for g in out)
    assert torch.isfinite(fns["fwd"]()).all()


@pytest.mark.parametrize(
    "case,provider",
    [(c, p) for c in cases(quick=True) for p in c.providers],
    ids=lambda value: value.name.removeprefix("attention ") if isinstance(value, Case) else value,
)
@pytest.mark.gpu
@needs_gpu
def test_gpu(case, provider, benchmark):
    pytest_benchmark_case(benchmark, case, provider)


def _memory_cases(quick: bool) -> list[Case]:
    """The memory suite's cases up to N = 16k: ours against SDPA's math backend."""
    from bench import bench_memory

    return [c for c in bench_memory.cases(quick) if c.params["n"] <= 16384]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [1024, 4096, 16384])
def test_gpu_peak_memory_below_math_backend(n):
    (case,) = [c for c in _memory_cases(quick=True) if c.params["n"] == n]
    peaks = {}
    for provider in ("fused_remat", "sdpa-math"):
        try:
            peaks[provider] = peak_memory_mib(case.providers[provider]())
        except torch.cuda.OutOfMemoryError:
            peaks[provider] = float("inf")
        torch.cuda.empty_cache()
    assert peaks["fused_remat"] < peaks["sdpa-math"], peaks
