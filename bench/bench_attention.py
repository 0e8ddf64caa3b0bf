"""Attention: forward, backward and forward+backward TFLOP/s of ``fused_remat.attention`` against
PyTorch SDPA's flash, cuDNN and memory-efficient backends. Peak memory against SDPA's math backend
(which materializes the N x N matrix) is the memory suite's (bench/bench_memory.py).

bf16, head dims 64 and 128, causal and not, N from 1k to 16k with B x N = 16k tokens and
H x D = 2048. FLOPs: ``fused_remat.flops.attention_flops`` (4 B H Nq Nk D forward, half when
causal; backward 2.5x forward).

The masks of real batches (MASKS): one row of 16k tokens packed with documents of mixed lengths
(``attention_varlen``), and a 1024-key causal sliding window (``attention(window=)``), at D = 128,
counted on useful work only (4 H D per visible (query, key) pair forward, 2.5x backward), beside
SDPA's memory-efficient backend given the same mask as an explicit boolean matrix, and
FlexAttention's document and sliding-window block masks (compiled) where the installed torch has it.

    python -m bench attention                             # GPU: the suite CLI (JSON, Markdown, plots)
    pytest bench/bench_attention.py --benchmark-only      # GPU: pytest-benchmark
On CPU, pytest runs one tiny case through the Triton interpreter so this file cannot rot.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import Case, Suite, compiled_triton, dtype_name, pytest_benchmark_case
from bench.providers import MODES, SDPA_BACKENDS, attention_inputs, attention_providers, pass_provider
from fused_remat.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, visible_pairs

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


# Document lengths of the packed row (16k tokens: a long document, mid-sized ones, short ones).
DOCUMENT_MIX = (6144, 3072, 2048, 1024, 1024, 1024, 512, 512, 512, 256, 256, 128, 128, 128, 64)
MASKS = {"documents": None, "window-1024": (1024, -1)}


def _documents(device: str) -> list[int]:
    return list(DOCUMENT_MIX) if device == "cuda" else [40, 1, 23]  # interpreter smoke size


def _mask_pairs(mask: str, device: str) -> tuple[int, torch.Tensor]:
    """(visible (query, key) pairs per head, the (N, N) boolean mask) of one packed row."""
    lengths = _documents(device)
    n = sum(lengths)
    rows = torch.arange(n, device=device)
    if mask == "documents":
        document = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
        visible = (document[:, None] == document[None, :]) & (rows[None, :] <= rows[:, None])
        return sum(visible_pairs(k, k, True) for k in lengths), visible
    left, _ = MASKS[mask]
    visible = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= rows[:, None] - left)
    return visible_pairs(n, n, True, MASKS[mask]), visible


def _ours(mask: str, lengths: list[int]):
    import fused_remat

    if mask == "documents":
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        on_device = {}  # the offsets, copied to each device once and outside the timed calls (as SDPA's mask)

        def run(q, k, v):  # (1, H, N, D) -> the packed (N, H, D) layout, as views
            cu = on_device.get(q.device)
            if cu is None:
                cu = on_device[q.device] = offsets.to(q.device)
            o = fused_remat.attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, max(lengths),
                                             max(lengths), causal=True)
            return o.transpose(0, 1)[None]
        return run
    return lambda q, k, v: fused_remat.attention(q, k, v, causal=True, window=MASKS[mask])


def _sdpa_with_mask(visible: torch.Tensor):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.EFFICIENT_ATTENTION if visible.is_cuda else SDPBackend.MATH

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    return run


def _flex(visible: torch.Tensor):
    """FlexAttention with a block mask built from the same boolean matrix (compiled), or None where
    the installed torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    n = visible.shape[0]
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: visible[q_idx, kv_idx], None, None, n, n,
                                   device=visible.device)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def mask_case(mask: str, mode: str, device: str = "cuda") -> Case:
    """One packed row under ``mask``: ours, SDPA with the explicit mask, FlexAttention's block mask."""
    lengths = _documents(device)
    n, d = sum(lengths), (128 if device == "cuda" else 32)
    heads = WIDTH // d if device == "cuda" else 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pairs, visible = _mask_pairs(mask, device)
    make_inputs = attention_inputs(1, heads, n, d, dtype, device)
    providers = {"fused_remat": pass_provider(_ours(mask, lengths), mode, make_inputs),
                 "sdpa-explicit-mask": pass_provider(_sdpa_with_mask(visible), mode, make_inputs)}
    flex = _flex(visible) if device == "cuda" else None
    if flex is not None:
        providers["flex-attention"] = pass_provider(flex, mode, make_inputs)
    forward = 4.0 * heads * d * pairs
    work = {"fwd": forward, "bwd": ATTENTION_BACKWARD_FACTOR * forward,
            "fwd+bwd": (1 + ATTENTION_BACKWARD_FACTOR) * forward}[mode]
    return Case(
        suite="attention", name=f"attention {mode} d{d} {mask} N{n}",
        params={"mode": mode, "batch": 1, "heads": heads, "n": n, "d": d, "causal": True, "mask": mask,
                "dtype": dtype_name(dtype)},
        providers=providers, unit="TFLOP/s", work=work, ceiling="matmul",
    )


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    """Speed cases: one per (mode, head dim, causal, N), then the masks of real batches per mode."""
    dense = [case(*point, device=device) for point in grid(quick, device)]
    return dense + [mask_case(mask, mode, device) for mask in MASKS for mode in MODES]


def plots(folder, results, ceilings):
    """TFLOP/s against N per (mode, head dim, causal), with the measured bf16 matmul rate."""
    from bench.report import plot

    dense = [r for r in results if "mask" not in r.params]  # the mask cases are one length each: table only
    plot(folder, "attention", "attention TFLOP/s (higher is better), bf16, B x N = 16k tokens", dense, x_key="n",
         group_keys=("mode", "d", "causal"), value=lambda r: r.metric, ylabel="TFLOP/s",
         ceiling=ceilings.get("bf16_matmul_TFLOPs"))


@pytest.mark.parametrize("mask", list(MASKS))
def test_masks_agree_with_the_explicit_mask_on_cpu(mask, triton_backend):
    """The mask cases' providers compute the same attention (so their timings compare like with like)."""
    if compiled_triton():
        pytest.skip("the GPU cases cover this")
    built = mask_case(mask, "fwd", device="cpu")
    q, k, v = (torch.randn(1, 2, sum(_documents("cpu")), 32) for _ in range(3))
    ours = _ours(mask, _documents("cpu"))(q, k, v)
    torch.testing.assert_close(ours, _sdpa_with_mask(_mask_pairs(mask, "cpu")[1])(q, k, v), rtol=1e-5, atol=1e-5)
    assert set(built.providers) == {"fused_remat", "sdpa-explicit-mask"}


def test_smoke_on_cpu(benchmark, triton_backend):
    """Our kernels through the interpreter on a tiny case (forward and backward)."""
    if compiled_triton():
        pytest.skip("the GPU cases cover this")
    fns = {built.params["mode"]: built.providers["fused_remat"]()
           for built in cases(quick=True, device="cpu") if "mask" not in built.params}
    out = benchmark(fns["fwd+bwd"])
    assert all(torch.isfinite(g).all() for g in out)
    assert torch.isfinite(fns["fwd"]()).all()


@pytest.mark.parametrize("provider", ["fused_remat", *SDPA_BACKENDS])
@pytest.mark.parametrize("point", grid(quick=True), ids=lambda point: _name(*point).removeprefix("attention "))
@pytest.mark.gpu  # conftest.py skips it without a CUDA device and compiled Triton
def test_gpu(point, provider, benchmark):
    pytest_benchmark_case(benchmark, case(*point), provider)


@pytest.mark.parametrize("provider", ["fused_remat", "sdpa-explicit-mask"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.gpu
def test_gpu_masks(mask, provider, benchmark):
    pytest_benchmark_case(benchmark, mask_case(mask, "fwd+bwd"), provider)


SUITE = Suite("attention", cases, plots)
