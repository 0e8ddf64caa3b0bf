"""Attention: forward, backward and forward+backward TFLOP/s of ``fused_remat.attention`` against
PyTorch SDPA's flash, cuDNN and memory-efficient backends. Peak memory against SDPA's math backend
(which materializes the N x N matrix) is the memory suite's (bench/bench_memory.py).

bf16, head dims 64 and 128, causal and not, N from 1k to 16k with B x N = 16k tokens and
H x D = 2048. FLOPs: ``fused_remat.flops.attention_flops`` (4 B H Nq Nk D forward, half when
causal; backward 2.5x forward).

    python -m bench attention                             # GPU: the suite CLI (JSON, Markdown, plots)
    pytest bench/bench_attention.py --benchmark-only      # GPU: pytest-benchmark
On CPU, pytest runs one tiny case through the Triton interpreter so this file cannot rot.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import Case, Suite, compiled_triton, dtype_name, pytest_benchmark_case
from bench.providers import MODES, SDPA_BACKENDS, attention_inputs, attention_providers
from fused_remat.flops import attention_flops

TOKENS, WIDTH = 16384, 2048


def _shape(n, d, device):
    if device != "cuda":
        return 1, 2, 64, 32  # interpreter smoke size
    return max(1, TOKENS // n), WIDTH // d, n, d


def grid(quick: bool, device: str = "cuda") -> list[tuple[int, int, bool, str]]:
    """(N, head dim, causal, mode) of every case, in the order the suite runs them."""
    if device != "cuda":
        points = [(64, 32, True)]
    else:
        lengths = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384)
        points = [(n, d, causal) for d in (64, 128) for causal in (False, True) for n in lengths]
    return [(n, d, causal, mode) for n, d, causal in points for mode in MODES]


def _name(n: int, d: int, causal: bool, mode: str) -> str:
    return f"attention {mode} d{d} {'causal' if causal else 'full'} N{n}"


def case(n: int, d: int, causal: bool, mode: str, device: str = "cuda") -> Case:
    """One speed case; providers ours and the SDPA backends (on CPU, SDPA's math backend)."""
    if device != "cuda":
        dtype, peers = torch.float32, {"sdpa-math": "MATH"}
    else:
        dtype, peers = torch.bfloat16, SDPA_BACKENDS
    batch, heads, n, d = _shape(n, d, device)
    return Case(
        suite="attention", name=_name(n, d, causal, mode),
        params={"mode": mode, "batch": batch, "heads": heads, "n": n, "d": d, "causal": causal, "dtype": dtype_name(dtype)},
        providers=attention_providers(peers, mode, causal, attention_inputs(batch, heads, n, d, dtype, device)),
        unit="TFLOP/s", work=attention_flops(batch, heads, n, n, d, causal, mode), ceiling="matmul",
    )


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    """Speed cases: one per (mode, head dim, causal, N)."""
    return [case(*point, device=device) for point in grid(quick, device)]


def plots(folder, results, ceilings):
    """TFLOP/s against N per (mode, head dim, causal), with the measured bf16 matmul rate."""
    from bench.report import plot

    plot(folder, "attention", "attention TFLOP/s (higher is better), bf16, B x N = 16k tokens", results, x_key="n",
         group_keys=("mode", "d", "causal"), value=lambda r: r.metric, ylabel="TFLOP/s",
         ceiling=ceilings.get("bf16_matmul_TFLOPs"))


def test_smoke_on_cpu(benchmark, triton_backend):
    """Our kernels through the interpreter on a tiny case (forward and backward)."""
    if compiled_triton():
        pytest.skip("the GPU cases cover this")
    fns = {built.params["mode"]: built.providers["fused_remat"]() for built in cases(quick=True, device="cpu")}
    out = benchmark(fns["fwd+bwd"])
    assert all(torch.isfinite(g).all() for g in out)
    assert torch.isfinite(fns["fwd"]()).all()


@pytest.mark.parametrize("provider", ["fused_remat", *SDPA_BACKENDS])
@pytest.mark.parametrize("point", grid(quick=True), ids=lambda point: _name(*point).removeprefix("attention "))
@pytest.mark.gpu  # conftest.py skips it without a CUDA device and compiled Triton
def test_gpu(point, provider, benchmark):
    pytest_benchmark_case(benchmark, case(*point), provider)


SUITE = Suite("attention", cases, plots)
