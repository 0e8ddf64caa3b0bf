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

Bytes per token (the difference between the two lengths over the token difference) are fitted for
peak and saved. The peers: ``eager`` (``fused_remat.reference.TransformerBlock``) and
``checkpoint`` (the same block under ``torch.utils.checkpoint``, its ``remat="full"``). Byte counts
on the CPU are the allocator's request sizes; a GPU's caching allocator rounds each up to 512 B.

Results: ``bench/results/peak/peak.json`` and ``peak.md`` (or ``--out``), the machine named.
"""

from __future__ import annotations

import argparse
import json
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


def build_block(config: dict, variant: str):
    """The block of one variant, on DEVICE in DTYPE."""
    import torch

    from fused_remat import TransformerBlock, reference

    block = reference.TransformerBlock(**config, device=DEVICE, dtype=getattr(torch, DTYPE))
    if variant in POLICIES:
        return TransformerBlock.from_reference(block, remat=variant)
    block.remat = "full" if variant == "checkpoint" else "none"
    return block


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


def bytes_per_token(rows: list[dict]) -> list[dict]:
    """Per block and variant, the slope of peak and saved bytes between the shortest and longest length."""
    fits = []
    for name in dict.fromkeys(r["block"] for r in rows):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            case = sorted((r for r in rows if r["block"] == name and r["variant"] == variant), key=lambda r: r["tokens"])
            if len(case) < 2 or case[0]["tokens"] == case[-1]["tokens"]:
                continue
            short, long = case[0], case[-1]
            tokens = long["tokens"] - short["tokens"]
            fits.append({"block": name, "variant": variant, "tokens": [short["tokens"], long["tokens"]],
                         "peak_per_token": (long["peak_bytes"] - short["peak_bytes"]) / tokens,
                         "saved_per_token": (long["saved_bytes"] - short["saved_bytes"]) / tokens})
    return fits


def environment() -> dict:
    from bench.host import machine

    return {**machine(), "target": "Triton interpreter", "dtype": DTYPE}


def markdown(rows: list[dict], fits: list[dict], env: dict) -> str:
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
        lines += ["", "Bytes per token, from the difference between the two lengths:", "",
                  "| block | variant | saved B/token | peak B/token |", "|---|---|---:|---:|"]
        for fit in fits:
            lines.append(f"| {fit['block']} | {fit['variant']} | {fit['saved_per_token']:,.1f} | "
                         f"{fit['peak_per_token']:,.1f} |")
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
    args = parser.parse_args(argv)
    return args, {name: BLOCKS[name] for name in (args.block or BLOCKS)}


def main(argv=None) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # our kernels on CPU tensors, before anything imports triton
    os.environ.setdefault("FUSED_REMAT_BACKEND", "triton")
    args, blocks = _parse(sys.argv[1:] if argv is None else argv)
    from fused_remat.kernels.limits import triton_interpreting

    if not triton_interpreting():
        print("python -m bench peak runs our kernels in Triton's interpreter: unset TRITON_INTERPRET or set it to 1",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = run(blocks, tuple(args.lengths), tuple(args.variants))
    fits = bytes_per_token(rows)
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peak.json").write_text(json.dumps({"environment": env, "rows": rows, "per_token": fits}, indent=1) + "\n")
    table = markdown(rows, fits, env)
    (args.out / "peak.md").write_text(table)
    print(table)
    print(f"results in {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
