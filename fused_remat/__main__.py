"""`python -m fused_remat`: a short demo of the ops on whatever device is present.

With CUDA the kernels compile for the GPU; without it they run on the CPU in Triton's interpreter
(slow, so the demo's shapes are small there). For each op it prints the largest error against a
float64 reference, relative to the reference's largest magnitude (for the gradients: the largest
over the op's inputs), ours beside eager PyTorch's in the same dtype, and the bytes autograd keeps
for backward, ours beside eager PyTorch's; then the TransformerBlock's bytes kept per token under
each remat policy beside the reference block's.
"""

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch.nn.functional as F  # noqa: E402

import fused_remat  # noqa: E402
from fused_remat import reference  # noqa: E402
from fused_remat.memory import saved_memory  # noqa: E402


def _demo_cases(device, dtype, rows, hidden):
    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    x, gate, up = tensor(rows, hidden), tensor(rows, hidden), tensor(rows, hidden)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).requires_grad_()
    bias = torch.randn(hidden, device=device, requires_grad=True)
    cases = {
        "layer_norm": (
            lambda *a: fused_remat.layer_norm(*a),
            lambda x_, w, b: F.layer_norm(x_, (hidden,), w.to(dtype), b.to(dtype)),
            lambda x_, w, b: reference.layer_norm(x_, w, b),
            (x, weight, bias),
        ),
        "rms_norm": (
            lambda *a: fused_remat.rms_norm(*a),
            lambda x_, w: F.rms_norm(x_, (hidden,), w.to(dtype), 1e-6),
            lambda x_, w: reference.rms_norm(x_, w),
            (x, weight),
        ),
        "gelu": (fused_remat.gelu, F.gelu, F.gelu, (x,)),
        "gelu_tanh": (
            lambda x_: fused_remat.gelu(x_, "tanh"),
            lambda x_: F.gelu(x_, approximate="tanh"),
            lambda x_: F.gelu(x_, approximate="tanh"),
            (x,),
        ),
        "swiglu": (fused_remat.swiglu, lambda g, u: F.silu(g) * u, lambda g, u: F.silu(g) * u, (gate, up)),
    }
    if hasattr(fused_remat, "attention"):
        heads, head_dim = 4, 64
        seq = max(1, rows * hidden // (heads * head_dim))
        q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        cases["attention (causal)"] = (
            lambda *a: fused_remat.attention(*a, causal=True),
            lambda *a: F.scaled_dot_product_attention(*(t.float() for t in a), is_causal=True).to(dtype),
            lambda *a: reference.attention(*a, causal=True),
            (q, k, v),
        )
    return cases


def _saved_bytes(fn, inputs, parameters):
    with saved_memory(exclude=parameters) as meter:
        out = fn(*inputs)
    return out, meter.bytes


BLOCK_SHAPES = {  # name: (dim, heads, kv heads, TransformerBlock keyword arguments)
    "GPT-2 small": (768, 12, 12, dict(activation="gelu_tanh")),
    "LLaMA-style": (2048, 16, 4, dict(norm="rmsnorm", activation="swiglu", bias=False, rope_theta=10000.0)),
}


def _block_bytes_per_token(block, device, dtype, lengths=(8, 24)) -> float:
    """Bytes autograd keeps per token: the difference between two sequence lengths, so per-layer
    constants (none here, but a meter reading could include some) drop out."""
    readings = []
    for seq in lengths:
        x = torch.randn(1, seq, block.dim, device=device, dtype=dtype, requires_grad=True)
        with saved_memory() as meter:
            block(x)
        readings.append(meter.device_bytes)  # offload's inputs wait in host memory
    return (readings[1] - readings[0]) / (lengths[1] - lengths[0])


def block_memory_table(device, dtype=torch.bfloat16) -> str:
    """Markdown table: bytes kept for backward on the device per token per layer, each policy
    against eager."""
    lines = ["| block | eager reference | " + " | ".join(f"remat={p}" for p in fused_remat.Remat) + " |",
             "|---|---|" + "---|" * len(fused_remat.Remat)]
    for name, (dim, heads, kv_heads, kwargs) in BLOCK_SHAPES.items():
        ref = reference.TransformerBlock(dim, heads, n_kv_heads=kv_heads, device=device, dtype=dtype, **kwargs)
        eager = _block_bytes_per_token(ref, device, dtype)
        cells = [f"{eager:,.0f} B ({eager / dim:.1f}h)"]
        for policy in fused_remat.Remat:
            ours = fused_remat.TransformerBlock(dim, heads, n_kv_heads=kv_heads, remat=policy, device=device, dtype=dtype, **kwargs)
            ours.load_state_dict(ref.state_dict())
            kept = _block_bytes_per_token(ours, device, dtype)
            cells.append(f"{kept:,.0f} B ({kept / dim:.1f}h, {kept / eager - 1:+.0%})")
        lines.append(f"| {name} ({dim}/{heads}/{kv_heads}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _relative_error(value: torch.Tensor, reference64: torch.Tensor) -> float:
    """max |value - reference| over max |reference|: the error on the reference's scale."""
    scale = max(reference64.abs().max().item(), 1e-6)
    return (value.double() - reference64).abs().max().item() / scale


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fused_remat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the demo's random inputs (default: 0)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """The demo (the only action): --help and bad arguments end in ``parse_args``, before any work."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, hidden = (8192, 4096) if device.type == "cuda" else (64, 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    print(f"fused_remat demo on {where}: {rows} rows x {hidden}, {str(dtype).removeprefix('torch.')}\n")
    print(f"{'op':<20} {'error y':>10} {'(eager)':>10} {'error grads':>12} {'(eager)':>10} {'saved':>16} {'(eager)':>16}")
    started = time.perf_counter()
    for name, (ours_fn, eager_fn, reference_fn, inputs) in _demo_cases(device, dtype, rows, hidden).items():
        parameters = [t for t in inputs if t.dim() == 1]
        ours, ours_bytes = _saved_bytes(ours_fn, inputs, parameters)
        eager, eager_bytes = _saved_bytes(eager_fn, inputs, parameters)
        dy = torch.randn_like(ours)
        grads, eager_grads = (torch.autograd.grad(out, inputs, dy) for out in (ours, eager))
        inputs64 = [t.detach().double().requires_grad_() for t in inputs]
        ref = reference_fn(*inputs64)
        grads64 = torch.autograd.grad(ref, inputs64, dy.double())
        errors = [_relative_error(ours, ref), _relative_error(eager, ref),
                  *(max(_relative_error(g, g64) for g, g64 in zip(gs, grads64)) for gs in (grads, eager_grads))]
        print(f"{name:<20} {errors[0]:>10.2e} {errors[1]:>10.2e} {errors[2]:>12.2e} {errors[3]:>10.2e} "
              f"{ours_bytes:>14,} B {eager_bytes:>14,} B")
    print(f"\n({time.perf_counter() - started:.1f} s; error = max |value - float64 reference| / max |reference|; "
          "saved = bytes autograd keeps for backward, parameters left out)")
    print("\nTransformerBlock, bf16: bytes kept for backward per token per layer (h = model dim)\n")
    print(block_memory_table(device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
