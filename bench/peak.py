"""`python -m bench peak`: peak memory of one block's forward + backward beside what autograd keeps,
for each of our policies and the eager peers. Runs on the CPU, our kernels in Triton's interpreter.

Per case (a GPT-2-small-like and a Llama-like block at tiny widths, ``bench.host.BLOCKS``; one
sequence of each length; float32), one warm call of ``torch.autograd.grad`` of the output against
a random gradient, with respect to x and every parameter:

- saved_bytes: what autograd keeps for backward after the forward (``fused_remat.memory.saved_memory``,
  parameters left out);
- peak_bytes: the high-water mark of live storage above entry during forward + backward
  (``fused_remat.memory.peak_memory``), the returned gradients included;
- transient_bytes: peak minus saved, what the call needs beyond what it keeps;
- peak / eager: each peak over the eager reference block's for the same block and length.

Bytes per token: the same step at the longest length with the parameters frozen (no weight
gradients, nothing else that does not grow with the tokens), its peak over the tokens, beside
``fused_remat.remat.peak_bytes_per_token`` for our points (tests/test_peak_memory.py holds the two
equal to the byte). A step at T tokens peaks at about T times that plus what all variants share
(the weights' gradients), so the per-token ratio is the ratio at long sequences. The peers: ``eager`` (``fused_remat.reference.TransformerBlock``) and
``checkpoint`` (the same block under ``torch.utils.checkpoint``, its ``remat="full"``). Byte counts
on the CPU are the allocator's request sizes; a GPU's caching allocator rounds each up to 512 B.

A model's training step: a ``LanguageModel`` of ``--model-layers`` such blocks (default 12), one
warm forward + backward of the loss at ``--model-tokens`` tokens with every parameter's gradient
already allocated (zeroed, not None), so that its peak is what lives above the weights, their
gradients and the optimizer's state; ours per policy beside the reference blocks eager and under
``torch.utils.checkpoint``.

Results: ``bench/results/peak/peak.json`` and ``peak.md`` (or ``--out``), the machine named.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "peak"
DEVICE = "cpu"
DTYPE = "float32"
LENGTHS = (32, 64)
POLICIES = ("none", "cheap", "selective", "full")
PEERS = ("eager", "checkpoint")
VARIANTS = POLICIES + PEERS
TOP_ENTRIES = 8  # live_at_peak entries kept per case in the JSON
MODEL_LAYERS, MODEL_TOKENS, MODEL_VOCAB = 12, 64, 64


def build_block(config: dict, variant: str):
    """The block of one variant, on DEVICE in DTYPE."""
    import torch

    from fused_remat import TransformerBlock, reference

    block = reference.TransformerBlock(**config, device=DEVICE, dtype=getattr(torch, DTYPE))
    if variant in POLICIES:
        return TransformerBlock.from_reference(block, remat=variant)
    block.remat = "full" if variant == "checkpoint" else "none"
    return block


def frozen_peak(config: dict, variant: str, seq: int) -> int:
    """The peak of one warm forward + backward with frozen parameters (the gradient of x only)."""
    import torch

    from fused_remat.memory import peak_memory

    block = build_block(config, variant).requires_grad_(False)
    x = torch.randn(1, seq, config["dim"], device=DEVICE, dtype=getattr(torch, DTYPE), requires_grad=True)
    dy = torch.randn_like(x)
    torch.autograd.grad(block(x), x, dy)
    with peak_memory(DEVICE) as peak:
        torch.autograd.grad(block(x), x, dy)
    return peak.peak_bytes


def measure_case(config: dict, variant: str, seq: int) -> dict:
    """Saved bytes of one forward, then the peak of one warm forward + backward."""
    import torch

    from fused_remat.memory import peak_memory, saved_memory

    block = build_block(config, variant)
    params = list(block.parameters())
    x = torch.randn(1, seq, config["dim"], device=DEVICE, dtype=getattr(torch, DTYPE), requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        return torch.autograd.grad(block(x), [x, *params], dy)

    step()  # compiles and autotunes outside the measurement
    with saved_memory(params) as saved:
        block(x)
    with peak_memory(DEVICE) as peak:
        grads = step()
    # a norm's weight and bias gradients share one storage: each storage once
    gradient_bytes = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}.values())
    return {"saved_bytes": saved.bytes, "peak_bytes": peak.peak_bytes, "end_bytes": peak.end_bytes,
            "gradient_bytes": gradient_bytes, "transient_bytes": peak.peak_bytes - saved.bytes,
            "allocations": len(peak.allocations), "excluded_allocations": len(peak.excluded),
            "live_at_peak": [{"bytes": a.bytes, "where": a.where} for a in peak.live_at_peak[:TOP_ENTRIES]]}


def model_step_peak(config: dict, variant: str, layers: int, tokens: int) -> int:
    """The peak above the weights, gradients and optimizer state of one warm training step (loss
    forward + backward) of a ``layers``-deep model of ``config``'s blocks."""
    import torch

    from fused_remat.memory import peak_memory
    from fused_remat.model import LanguageModel, ModelConfig

    model_config = ModelConfig(vocab_size=MODEL_VOCAB, n_layers=layers, rope_theta=config.get("rope_theta"),
                               **{k: v for k, v in config.items() if k != "rope_theta"})
    reference_remat = {"eager": "none", "checkpoint": "full"}
    model = LanguageModel(model_config, reference_remat.get(variant, variant),
                          block_impl="reference" if variant in reference_remat else "fused",
                          device=DEVICE, dtype=getattr(torch, DTYPE))
    ids = torch.randint(0, MODEL_VOCAB, (1, tokens + 1), device=DEVICE)
    model(ids[:, :-1], ids[:, 1:]).backward()
    for parameter in model.parameters():
        parameter.grad.zero_()
    with peak_memory(DEVICE) as peak:
        model(ids[:, :-1], ids[:, 1:]).backward()
    return peak.peak_bytes


def model_steps(blocks: dict[str, dict], variants: tuple[str, ...], layers: int, tokens: int) -> list[dict]:
    rows = [{"block": name, "layers": layers, "tokens": tokens, "variant": variant,
             "peak_bytes": model_step_peak(config, variant, layers, tokens)}
            for name, config in blocks.items() for variant in variants]
    for row in rows:
        eager = next((r for r in rows if r["block"] == row["block"] and r["variant"] == "eager"), None)
        row["peak_over_eager"] = row["peak_bytes"] / eager["peak_bytes"] if eager else None
        print(f"model of {layers} {row['block']} blocks, {tokens} tokens, {row['variant']}: peak {row['peak_bytes']:,d} B",
              flush=True)
    return rows


def run(blocks: dict[str, dict], lengths: tuple[int, ...], variants: tuple[str, ...]) -> list[dict]:
    rows = []
    for name, config in blocks.items():
        for seq in lengths:
            for variant in variants:
                row = {"block": name, "tokens": seq, "variant": variant, **measure_case(config, variant, seq)}
                rows.append(row)
                print(f"{name} {seq} {variant}: saved {row['saved_bytes']:,d} B, peak {row['peak_bytes']:,d} B",
                      flush=True)
    for row in rows:
        eager = next((r for r in rows if r["block"] == row["block"] and r["tokens"] == row["tokens"]
                      and r["variant"] == "eager"), None)
        row["peak_over_eager"] = row["peak_bytes"] / eager["peak_bytes"] if eager else None
    return rows


def bytes_per_token(blocks: dict[str, dict], seq: int, variants: tuple[str, ...]) -> list[dict]:
    """Per block and variant at ``seq`` tokens: saved bytes and the frozen-parameter peak per token,
    and the formula's peak for our points."""
    import torch

    from fused_remat.block import TransformerBlock, block_widths
    from fused_remat.memory import saved_memory
    from fused_remat.remat import peak_bytes_per_token

    fits = []
    for name, config in blocks.items():
        block = TransformerBlock(**config, device="meta")
        widths = block_widths(block.dim, block.n_heads, block.n_kv_heads, block.ffn_dim, block.norm, block.activation,
                              block.head_dim)
        for variant in variants:
            module = build_block(config, variant)
            with saved_memory(list(module.parameters())) as saved:
                module(torch.randn(1, seq, config["dim"], device=DEVICE, dtype=getattr(torch, DTYPE), requires_grad=True))
            fits.append({"block": name, "variant": variant, "tokens": seq, "saved_per_token": saved.bytes / seq,
                         "peak_per_token": frozen_peak(config, variant, seq) / seq,
                         "formula": peak_bytes_per_token(variant, widths, 4, 4, qk_norm=block.q_norm is not None)
                         if variant in POLICIES else None})
    for fit in fits:
        eager = next((f for f in fits if f["block"] == fit["block"] and f["variant"] == "eager"), None)
        fit["peak_over_eager"] = fit["peak_per_token"] / eager["peak_per_token"] if eager else None
    return fits


def environment() -> dict:
    from bench.host import machine

    return {**machine(), "target": "Triton interpreter", "dtype": DTYPE}


def markdown(rows: list[dict], fits: list[dict], models: list[dict], env: dict) -> str:
    lines = [
        "# Peak memory of one block's forward + backward",
        "",
        f"{env['cpu']}, {env['cores']} cores; Python {env['python']}, torch {env['torch']}, Triton {env['triton']} "
        f"({env['target']}), {env['dtype']}; commit {env['commit']}, {env['date']}.",
        "",
        f"One warm `torch.autograd.grad` of the block's output (batch 1, {DEVICE}) against x and every parameter "
        "(`python -m bench peak`, bench/peak.py). Saved: what autograd keeps after the forward, parameters left "
        "out (`saved_memory`); peak: the high-water mark of live storage above entry (`peak_memory`), the "
        "returned gradients included; transient: peak minus saved. CPU request sizes, not a GPU's 512 B blocks.",
        "",
        "| block | tokens | variant | saved B | peak B | transient B | peak / eager |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = f"{row['peak_over_eager']:.2f}" if row["peak_over_eager"] is not None else "-"
        lines.append(f"| {row['block']} | {row['tokens']} | {row['variant']} | {row['saved_bytes']:,d} | "
                     f"{row['peak_bytes']:,d} | {row['transient_bytes']:,d} | {ratio} |")
    if fits:
        lines += ["", f"Bytes per token at {fits[0]['tokens']} tokens, parameters frozen (no weight gradients): "
                  "saved, the meter's peak, our formula (`remat.peak_bytes_per_token`), the peak over eager's:", "",
                  "| block | variant | saved B/token | peak B/token | formula B/token | peak / eager |",
                  "|---|---|---:|---:|---:|---:|"]
        for fit in fits:
            formula = "-" if fit["formula"] is None else f"{fit['formula']:,d}"
            ratio = "-" if fit["peak_over_eager"] is None else f"{fit['peak_over_eager']:.2f}"
            lines.append(f"| {fit['block']} | {fit['variant']} | {fit['saved_per_token']:,.1f} | "
                         f"{fit['peak_per_token']:,.1f} | {formula} | {ratio} |")
    if models:
        lines += ["", f"A {models[0]['layers']}-layer model's training step at {models[0]['tokens']} tokens (the loss's "
                  "forward + backward, gradients already allocated): its peak above the weights, gradients and "
                  "optimizer state:", "", "| blocks | variant | peak B | peak / eager |", "|---|---|---:|---:|"]
        for row in models:
            ratio = "-" if row["peak_over_eager"] is None else f"{row['peak_over_eager']:.2f}"
            lines.append(f"| {row['block']} | {row['variant']} | {row['peak_bytes']:,d} | {ratio} |")
    lines += ["", "Peers: eager is `fused_remat.reference.TransformerBlock`; checkpoint is the same block under "
              "`torch.utils.checkpoint` (its `remat=\"full\"`). Their attention is PyTorch's CPU SDPA here, whose "
              "temporaries are not CUDA's. Our kernels run in Triton's interpreter, which holds each launch's "
              "tensors in a reference cycle; the meter collects it after each launch, so a tensor is freed where "
              "a GPU run frees it."]
    return "\n".join(lines) + "\n"


def _parse(argv):
    from bench.host import BLOCKS

    parser = argparse.ArgumentParser(prog="python -m bench peak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--block", action="append", choices=sorted(BLOCKS), help="this block only (repeatable)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="what to measure")
    parser.add_argument("--model-layers", type=int, default=MODEL_LAYERS,
                        help=f"layers of the model step (default {MODEL_LAYERS}; 0: no model step)")
    parser.add_argument("--model-tokens", type=int, default=MODEL_TOKENS,
                        help=f"tokens of the model step (default {MODEL_TOKENS})")
    args = parser.parse_args(argv)
    return args, {name: BLOCKS[name] for name in (args.block or BLOCKS)}


def main(argv=None) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # our kernels on CPU tensors, before anything imports triton
    os.environ.setdefault("FUSED_REMAT_BACKEND", "triton")
    args, blocks = _parse(sys.argv[1:] if argv is None else argv)
    from bench.report import write_facts
    from fused_remat.kernels.limits import triton_interpreting

    if not triton_interpreting():
        print("python -m bench peak runs our kernels in Triton's interpreter: unset TRITON_INTERPRET or set it to 1",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = run(blocks, tuple(args.lengths), tuple(args.variants))
    fits = bytes_per_token(blocks, max(args.lengths), tuple(args.variants))
    models = model_steps(blocks, tuple(args.variants), args.model_layers, args.model_tokens) if args.model_layers else []
    env = environment()
    write_facts(args.out, "peak", {"environment": env, "rows": rows, "per_token": fits, "model_steps": models},
                markdown(rows, fits, models, env))
    print(f"results in {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
