"""Memory: peak CUDA memory of one attention forward+backward against sequence length, ours
(O(N): q, k, v, o and one fp32 log-sum-exp per row) against SDPA's math backend (O(N^2): it
materializes the N x N probabilities) and SDPA's flash backend, up to the largest N that fits.
The block's memory per remat policy is in the block suite (bench_block.py).
"""

from __future__ import annotations

import pytest
import torch

from bench.bench_attention import WORK, _make_inputs, _provider, ours, sdpa
from bench.harness import Case

MEASURE_MEMORY = True
HEADS, HEAD_DIM = 16, 128


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    if device != "cuda":
        lengths, heads, head_dim, dtype, peers = (48,), 2, 32, torch.float32, {}
    else:
        lengths = (1024, 4096, 16384, 65536) if quick else (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
        heads, head_dim, dtype = HEADS, HEAD_DIM, torch.bfloat16
        peers = {"sdpa-math": sdpa("MATH"), "sdpa-flash": sdpa("FLASH_ATTENTION")}
    result = []
    for n in lengths:
        make = _make_inputs(1, heads, n, head_dim, dtype, device)
        providers = {"fused_remat": _provider(ours, "fwd+bwd", make, True)}
        providers.update({name: _provider(fn, "fwd+bwd", make, True) for name, fn in peers.items()})
        flops = 4.0 * heads * n * n * head_dim / 2 * WORK["fwd+bwd"]
        result.append(Case(
            suite="memory", name=f"attention fwd+bwd causal B1 H{heads} D{head_dim} N{n}",
            params={"what": "attention", "n": n, "heads": heads, "d": head_dim, "dtype": str(dtype).removeprefix("torch.")},
            providers=providers, unit="TFLOP/s", work=flops, ceiling="matmul",
        ))
    return result


def plots(folder, results, ceilings):
    from bench.report import plot

    plot(folder, "memory", "attention forward+backward peak memory (MiB, log scale): O(N) against O(N^2)",
         results, x_key="n", group_keys=("what", "d"), value=lambda r: r.peak_mib, ylabel="peak MiB", log_y=True)
    plot(folder, "memory-saved", "bytes autograd keeps for backward (MiB, log scale, saved-memory meter)",
         results, x_key="n", group_keys=("what", "d"), value=lambda r: r.saved_mib, ylabel="saved MiB", log_y=True)


@pytest.mark.parametrize("case", cases(quick=True, device="cpu"), ids=lambda c: c.name)
def test_smoke_on_cpu(case, triton_backend):
    grads = case.providers["fused_remat"]()()
    assert all(torch.isfinite(g).all() for g in grads)
