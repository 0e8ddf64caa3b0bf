"""The LM head and its loss: ``linear_cross_entropy`` forward+backward against eager PyTorch, the
same eager function under torch.compile, and Liger-Kernel's fused linear cross-entropy when it is
installed; time and peak memory.

TFLOP/s counts the three products every provider runs (the logits, dhidden and dweight: 6 T V dim
FLOPs) over the median time. The peak is the memory a call allocates above its inputs: eager
PyTorch holds the (tokens x vocab) logits, in bf16 and in fp32, and their gradient; ours one chunk
of them. Inputs, targets and the incoming gradient are drawn before the timed call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fused_remat
from bench.harness import Case, Suite, dtype_name, grid_suite, optional_import, rotating
from bench.providers import compiled

# (name, vocabulary, model width): GPT-2's head and Llama 3 8B's
HEADS = {"gpt2": (50257, 768), "llama3-8b": (128256, 4096)}


def _eager(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


def _liger():
    """Liger-Kernel's fused linear cross-entropy with our call signature, or None when it is not installed."""
    if optional_import("liger_kernel") is None:
        return None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, targets: loss(weight, hidden, targets)


def grid(quick: bool, device: str = "cuda") -> list[tuple[str, int]]:
    """(head, tokens) of every case: plain values, cheap to list."""
    if device != "cuda":
        return [("tiny", 37)]
    if quick:
        return [("gpt2", 8192), ("llama3-8b", 4096)]
    return [(head, tokens) for head in HEADS for tokens in (2048, 8192, 32768) if HEADS[head][0] * tokens <= 2**30]


def _name(head: str, tokens: int) -> str:
    return f"{head} {tokens} tokens"


def case(head: str, tokens: int, device: str = "cuda") -> Case:
    """One head at one length, forward+backward; providers ours, eager and, on a GPU, torch.compile and Liger."""
    vocab, dim = HEADS.get(head, (300, 24))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def make_inputs():
        hidden = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(vocab, dim, device=device, dtype=dtype) * dim ** -0.5).requires_grad_()
        return hidden, weight, torch.randint(0, vocab, (tokens,), device=device), torch.ones((), device=device)

    def provider(fn):
        def step(hidden, weight, targets, grad):
            return torch.autograd.grad(fn(hidden, weight, targets), (hidden, weight), grad)

        return lambda: rotating(make_inputs, step)

    providers = {"fused_remat": provider(fused_remat.linear_cross_entropy), "eager": provider(_eager)}
    if device == "cuda":
        providers["torch.compile"] = lambda: provider(compiled(_eager))()
        liger = _liger()
        if liger is not None:
            providers["liger"] = provider(liger)
    return Case(
        suite="loss", name=_name(head, tokens),
        params={"head": head, "tokens": tokens, "vocab": vocab, "dim": dim, "dtype": dtype_name(dtype)},
        providers=providers, unit="TFLOP/s", work=6 * tokens * vocab * dim, ceiling="matmul",
    )


cases, test_smoke_on_cpu, test_gpu = grid_suite(grid, case, _name)


def plots(folder, results, ceilings):
    """TFLOP/s per head and length."""
    from bench.report import plot

    dtype = results[0].params["dtype"] if results else ""
    plot(folder, "loss", f"LM head + cross-entropy, {dtype}, forward+backward: TFLOP/s (higher is better)", results,
         x_key="tokens", group_keys=("head",), value=lambda r: r.metric, ylabel="TFLOP/s",
         ceiling=ceilings.get("bf16_matmul_TFLOPs"))


SUITE = Suite("loss", cases, plots, measure_memory=True)
