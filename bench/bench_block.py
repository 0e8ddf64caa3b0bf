"""Block: one forward+backward training step of one Transformer block, per remat policy of ours
against the plain-PyTorch reference block run eagerly, under torch.utils.checkpoint and under
torch.compile. Median time, TFLOP/s, peak memory and the bytes autograd keeps for backward.

Providers (all with the same weights, loaded from one reference block, and the same inputs):

    fused_remat          ours, remat="cheap" (the default policy)
    fused_remat-none     ours, remat="none" (keeps what an eager block keeps)
    fused_remat-full     ours, remat="full" (keeps only x, replays the forward in backward)
    eager                fused_remat.reference.TransformerBlock (nn.Linear, SDPA)
    checkpoint           torch.utils.checkpoint.checkpoint(reference, x, use_reentrant=False)
    compile              torch.compile(reference, dynamic=False), compiled per case
    fused_remat-graphed  ours, "cheap", the whole step (zeroing, forward, backward) one CUDA graph
    eager-graphed        the reference block's whole step as one CUDA graph
    compile-reduce-overhead          torch.compile(reference, mode="reduce-overhead") (CUDA graphs)
    fused_remat-reduce-overhead      torch.compile(ours, mode="reduce-overhead")

A graphed provider copies each call's x and dy into the graph's static buffers and replays it: the
copies are timed, as a graphed training step pays them.

Configurations, bf16 parameters and inputs, batch 1, causal, N from 2k to 32k (quick: fewer):
GPT-2 small (dim 768, 12 heads, tanh GELU as in GPT-2, LayerNorm, biases), GPT-2 medium (1024,
16 heads) and LLaMA-style (2048, 16 heads, 4 KV heads, SwiGLU with ffn_dim 5632, RMSNorm, RoPE
theta 10000, no biases).

One step: zero the gradient buffers in place, y = block(x), torch.autograd.backward(y, dy); x and
dy are fresh random tensors (harness.rotating). Every parameter and every x has a gradient buffer
allocated once when the provider is built, so steps never accumulate and never allocate gradients
that outlive them.

TFLOP/s counts the step's model FLOPs, the same for every provider (what ``full`` and
``checkpoint`` recompute is not counted): matmuls 6 x T x P, with T = B x N tokens and P the
matmul weights (qkv, out_proj, fc1, fc2; no biases or norm weights), plus causal attention's
forward and backward (``fused_remat.flops.attention_flops``: 4 x B x H x N^2 x D / 2 forward,
times 3.5 for forward and backward, docs/design.md's convention).
The ceiling is the measured bf16 matmul rate.

Memory, per step:
- peak MiB: ``torch.cuda.max_memory_allocated()`` during the step minus what was allocated just
  before it (harness.peak_memory_mib), which holds the weights, their gradient buffers and the
  rotating x, dy and dx sets. So it is what the step adds on top of resident state: activations
  kept for backward, forward and backward temporaries, the output y, and weight gradients before
  they are added into their buffers. For one block this includes backward's transients (and, for
  ``checkpoint`` and ``full``, the recomputed forward), so policies differ less in peak than in
  saved bytes; in a deep model the saved bytes are paid per layer, the transients once.
- saved MiB: the saved-memory meter (harness.saved_memory_mib): what autograd keeps for backward
  after the forward, each storage once, parameters excluded. For ``checkpoint`` that is x alone.
The Markdown table gives each provider's time and peak memory as ratios to eager's.

    python -m bench block                             # GPU: the suite CLI (JSON, Markdown, plots)
    pytest bench/bench_block.py --benchmark-only      # GPU: pytest-benchmark
On CPU, pytest runs tiny fp32 blocks through the Triton interpreter (every provider but compile)
and checks that every provider computes the same gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import fused_remat
from bench.harness import Case, Suite, compiled_triton, dtype_name, pytest_benchmark_case, rotating
from bench.providers import compiled, graphed, reduce_overhead
from fused_remat import reference
from fused_remat.flops import attention_flops

CONFIGS = {
    "gpt2-small": dict(dim=768, n_heads=12, norm="layernorm", activation="gelu_tanh"),
    "gpt2-medium": dict(dim=1024, n_heads=16, norm="layernorm", activation="gelu_tanh"),
    "llama": dict(dim=2048, n_heads=16, n_kv_heads=4, norm="rmsnorm", activation="swiglu", rope_theta=10000.0, bias=False),
}
SMOKE_CONFIGS = {
    "gpt2-tiny": dict(dim=32, n_heads=2, norm="layernorm", activation="gelu_tanh"),
    "llama-tiny": dict(dim=32, n_heads=2, n_kv_heads=1, norm="rmsnorm", activation="swiglu", rope_theta=10000.0, bias=False),
}
LENGTHS = (2048, 4096, 8192, 16384, 32768)
QUICK = (("gpt2-small", 2048), ("gpt2-small", 8192), ("llama", 4096))
SMOKE = (("gpt2-tiny", 16), ("gpt2-tiny", 24), ("llama-tiny", 16))
POLICIES = {"fused_remat": "cheap", "fused_remat-none": "none", "fused_remat-full": "full"}
WEIGHT_SEED, INPUT_SEED = 0, 1


def _reference(config: dict, device: str, dtype: torch.dtype) -> reference.TransformerBlock:
    """The reference block with weights from a fixed seed (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(WEIGHT_SEED)
        return reference.TransformerBlock(**config, device=device, dtype=dtype)


def _ours(config: dict, remat: str, device: str, dtype: torch.dtype) -> fused_remat.TransformerBlock:
    block = fused_remat.TransformerBlock(**config, remat=remat, device=device, dtype=dtype)
    block.load_state_dict(_reference(config, device, dtype).state_dict())
    return block


def _forwards(config: dict, device: str, dtype: torch.dtype, compile_peer: bool) -> dict:
    """provider -> build() returning (forward callable, the parameters it trains)."""

    def ours(remat, wrap=lambda block: block):
        def build():
            block = _ours(config, remat, device, dtype)
            return wrap(block), list(block.parameters())

        return build

    def peer(wrap):
        def build():
            block = _reference(config, device, dtype)
            return wrap(block), list(block.parameters())

        return build

    builds = {name: ours(remat) for name, remat in POLICIES.items()}
    builds["eager"] = peer(lambda block: block)
    builds["checkpoint"] = peer(lambda block: lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
    if compile_peer:
        builds["compile"] = peer(compiled)
        builds["compile-reduce-overhead"] = peer(reduce_overhead)
        builds["fused_remat-reduce-overhead"] = ours("cheap", reduce_overhead)
    return builds


# provider -> the provider whose step it captures as one CUDA graph (on a GPU only)
GRAPHED = {"fused_remat-graphed": "fused_remat", "eager-graphed": "eager"}


def _inputs(batch: int, n: int, dim: int, dtype: torch.dtype, device: str):
    """make() -> (x with a zeroed gradient buffer, dy); every provider draws the same sequence."""
    generator = torch.Generator(device).manual_seed(INPUT_SEED)

    def make():
        x, dy = (torch.randn(batch, n, dim, generator=generator, device=device, dtype=dtype) for _ in range(2))
        x.requires_grad_(True)
        x.grad = torch.zeros_like(x)
        return x, dy

    return make


def _provider(build, batch: int, n: int, dim: int, dtype: torch.dtype, device: str, graph: bool = False):
    """A factory of the zero-argument step to time; the step returns (dx, *parameter gradients).
    With ``graph`` the step is captured once as a CUDA graph and replayed (providers.graphed)."""

    def factory():
        forward, params = build()
        for p in params:
            p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]

        def step(x, dy):
            torch._foreach_zero_([x.grad, *grads])
            torch.autograd.backward(forward(x), dy)
            return (x.grad, *grads)

        make = _inputs(batch, n, dim, dtype, device)
        return rotating(make, graphed(step, make()) if graph else step)

    return factory


def matmul_parameters(config: dict) -> int:
    """Weights that take part in matrix products (2-D parameters), counted on the meta device."""
    block = reference.TransformerBlock(**config, device="meta")
    return sum(p.numel() for p in block.parameters() if p.dim() == 2)


def step_flops(config: dict, batch: int, n: int) -> float:
    """Model FLOPs of one causal forward+backward step (module docstring)."""
    heads = config["n_heads"]
    attention = attention_flops(batch, heads, n, n, config["dim"] // heads, True, "fwd+bwd")
    return 6.0 * batch * n * matmul_parameters(config) + attention


def grid(quick: bool, device: str = "cuda") -> tuple[tuple[str, int], ...]:
    """(configuration, N) of every case, in the order the suite runs them."""
    if device != "cuda":
        return SMOKE
    return QUICK if quick else tuple((name, n) for name in CONFIGS for n in LENGTHS)


def case(name: str, n: int, device: str = "cuda") -> Case:
    """One configuration at one N: every remat policy of ours and the reference's peers."""
    configs, dtype = (CONFIGS, torch.bfloat16) if device == "cuda" else (SMOKE_CONFIGS, torch.float32)
    config = configs[name]
    batch = 1
    builds = _forwards(config, device, dtype, compile_peer=device == "cuda")
    return Case(
        suite="block", name=f"block fwd+bwd {name} B{batch} N{n}",
        params={"config": name, "batch": batch, "n": n, "dim": config["dim"], "heads": config["n_heads"],
                "kv_heads": config.get("n_kv_heads", config["n_heads"]), "dtype": dtype_name(dtype),
                "baseline": "eager"},
        providers={**{provider: _provider(build, batch, n, config["dim"], dtype, device) for provider, build in builds.items()},
                   **({provider: _provider(builds[source], batch, n, config["dim"], dtype, device, graph=True)
                       for provider, source in GRAPHED.items()} if device == "cuda" else {})},
        unit="TFLOP/s", work=step_flops(config, batch, n), ceiling="matmul",
    )


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    return [case(name, n, device) for name, n in grid(quick, device)]


def plots(folder, results, ceilings):
    """Step time, peak memory and saved bytes against N, one panel per configuration."""
    from bench.report import plot

    dtype = results[0].params["dtype"] if results else ""
    for name, title, value, ylabel in (
        ("block", "step time (ms, log scale; lower is better)", lambda r: r.ms, "ms"),
        ("block-peak", "peak memory above weights and inputs (MiB, log scale)", lambda r: r.peak_mib, "peak MiB"),
        ("block-saved", "bytes autograd keeps for backward (MiB, log scale, saved-memory meter)", lambda r: r.saved_mib, "saved MiB"),
    ):
        plot(folder, name, f"block forward+backward, {dtype}, B=1: {title}", results, x_key="n",
             group_keys=("config",), value=value, ylabel=ylabel, log_y=True)


def test_flops_count_the_matmul_weights():
    llama = CONFIGS["llama"]
    dim, kv, ffn = 2048, 4 * 128, reference.llama_ffn_dim(2048)
    assert matmul_parameters(llama) == dim * (dim + 2 * kv) + dim * dim + dim * 2 * ffn + ffn * dim
    assert step_flops(CONFIGS["gpt2-small"], 1, 1024) == 6 * 1024 * 12 * 768**2 + 4 * 12 * 1024**2 * 64 / 2 * 3.5


def test_smoke_on_cpu(triton_backend):
    """Every provider runs one step through the interpreter and computes eager's gradients."""
    if compiled_triton():
        pytest.skip("the GPU cases cover this")
    for built in cases(quick=True, device="cpu"):
        grads = {provider: factory()() for provider, factory in built.providers.items()}
        expected = grads.pop("eager")
        assert len(expected) > 1 and all(torch.isfinite(g).all() for g in expected)
        for provider, got in grads.items():
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=lambda m, p=provider: f"{built.name} {p}: {m}")


@pytest.mark.gpu  # conftest.py skips it without a CUDA device and compiled Triton
@pytest.mark.parametrize("provider", [*POLICIES, "eager", "checkpoint", "compile", "compile-reduce-overhead",
                                      "fused_remat-reduce-overhead", *GRAPHED])
@pytest.mark.parametrize("point", grid(quick=True), ids=lambda point: f"{point[0]}-N{point[1]}")
def test_gpu(point, provider, benchmark):
    pytest_benchmark_case(benchmark, case(*point), provider)


SUITE = Suite("block", cases, plots, measure_memory=True)
