"""Builders that more than one suite times: the pass runner, the torch.compile peer and attention.

A provider is a factory: called, it builds fresh inputs and returns the zero-argument callable to
time (harness.Case). Nothing here imports triton when imported; fused_remat is imported when a
provider runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.harness import rotating

MODES = ("fwd", "bwd", "fwd+bwd")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}


def pass_provider(fn: Callable, mode: str, make_inputs: Callable[[], tuple]) -> Callable[[], Callable[[], object]]:
    """A provider timing ``fn`` in ``mode``: the forward, the backward alone, or both.

    ``make_inputs()`` returns ``(inputs, dy)``: the tuple of tensors ``fn`` takes (those that need
    gradients) and the output gradient, both made before the timed call. The backward alone runs on
    a graph built outside the timed call and retained, so that it can run again.
    """
    if mode == "fwd":
        return lambda: rotating(make_inputs, lambda inputs, dy: fn(*inputs))
    if mode == "bwd":
        def with_forward():
            inputs, dy = make_inputs()
            return fn(*inputs), inputs, dy

        return lambda: rotating(with_forward, lambda out, inputs, dy: torch.autograd.grad(out, inputs, dy, retain_graph=True))
    if mode == "fwd+bwd":
        return lambda: rotating(make_inputs, lambda inputs, dy: torch.autograd.grad(fn(*inputs), inputs, dy))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def compiled(eager: Callable) -> Callable:
    """``torch.compile(eager)`` for one case's shapes, after dropping every earlier compilation
    (no recompile limit, no stale graphs). Call it when the provider is built, not before."""
    torch._dynamo.reset()
    return torch.compile(eager, dynamic=False)


def reduce_overhead(eager: Callable) -> Callable:
    """``torch.compile(eager, mode="reduce-overhead")``: Inductor's code replayed through CUDA
    graphs (cudagraph trees), after dropping every earlier compilation."""
    torch._dynamo.reset()
    return torch.compile(eager, mode="reduce-overhead", dynamic=False)


def graphed(step: Callable[..., tuple], static_inputs: tuple, warmup: int = 3) -> Callable[..., tuple]:
    """``step(*static_inputs)`` captured as one CUDA graph after ``warmup`` calls on a side stream; the
    returned callable copies its arguments into ``static_inputs`` and replays, returning the
    tensors the captured call returned (what a graphed training step does: static buffers in, one
    launch)."""
    from fused_remat.training.graphs import CudaGraphs

    with CudaGraphs.side_stream(static_inputs[0].device):
        for _ in range(warmup):
            step(*static_inputs)
    captured = CudaGraphs.capture(lambda: step(*static_inputs))

    def replay(*inputs):
        for static, given in zip(static_inputs, inputs):
            static.copy_(given, non_blocking=True)
        return captured()

    return replay


def fused_attention(causal: bool) -> Callable:
    """fused_remat.attention(q, k, v) with ``causal`` bound."""
    import fused_remat

    def run(q, k, v):
        return fused_remat.attention(q, k, v, causal=causal)

    return run


def sdpa(backend: str, causal: bool) -> Callable:
    """PyTorch's scaled_dot_product_attention(q, k, v) restricted to one SDPBackend, by name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def attention_inputs(batch: int, heads: int, n: int, d: int, dtype: torch.dtype, device: str) -> Callable[[], tuple]:
    """make() -> ((q, k, v), dO), all (batch, heads, n, d), fresh random values on every call."""

    def make():
        q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        return (q, k, v), torch.randn(batch, heads, n, d, device=device, dtype=dtype)

    return make


def attention_providers(peers: dict[str, str], mode: str, causal: bool, make_inputs: Callable[[], tuple]) -> dict:
    """provider name -> provider: ours ("fused_remat") and each peer, given as name -> SDPBackend name."""
    providers = {"fused_remat": pass_provider(fused_attention(causal), mode, make_inputs)}
    providers.update({name: pass_provider(sdpa(backend, causal), mode, make_inputs) for name, backend in peers.items()})
    return providers
