"""`python -m bench frontier`: torch.compile's memory/recompute frontier beside ours, for one layer.

    python -m bench frontier                         # N = 256, 1024 and 4096, budgets 1.0 0.75 0.5 0.3 0.1
    python -m bench frontier --fine                  # budgets 1.0, 0.95, ..., 0.05
    python -m bench frontier --seq-lens 64 --out DIR # a quick run (the test's)

The layer is a Llama-shaped block (``LAYER``: dim 256, 4 query heads, 2 key/value heads, RMSNorm,
SwiGLU of 688, RoPE, causal, no bias) in fp32 on x of shape (1, N, 256). Each point of a curve is
one way to train it, and says two things per token:

- kept bytes: what autograd holds for backward, measured by the saved-memory meter
  (``fused_remat.memory``: ``saved_tensors_hooks``, each storage once, parameters left out). A
  compiled region saves its tensors through its autograd function's ``save_for_backward``, so the
  hooks see exactly what the partitioner chose to save (the test checks that the budget moves it);
- recompute: the FLOPs its backward runs beyond the curve's no-replay point (compile's budget 1.0,
  our ``none``), as a multiple of the layer's forward FLOPs.

torch.compile's curve: for each budget f, ``torch._functorch.config.activation_memory_budget = f``
while the layer compiles. In the installed torch both the inductor and the aot_eager backends
partition with ``min_cut_rematerialization_partition``, which reads that budget (a knapsack over
the tensors it would rather not recompute). ``--partitioner inductor`` (default) partitions as
``torch.compile``'s default backend does: inductor's decompositions and joint-graph passes, then
its partition function; the partitioned graphs then run as FX graphs instead of inductor's
kernels. That saves the same tensors as ``backend="inductor"`` (checked at N = 256: the meter gives
identical bytes at every budget) and, unlike inductor's kernels, lets the FLOPs be counted:
``FlopCounterMode`` around a compiled call sees nothing inside it, so each partitioned graph counts
its own FLOPs under ``FlopCounterMode`` as it runs. ``--partitioner aot_eager`` skips the
decompositions (what ``backend="aot_eager"`` does).

Our curves: ``fused_remat.TransformerBlock``'s named policies ``none, cheap, selective, full``, and
the block under ``memory_budget`` matched to each of compile's points (the fraction is compile's
kept bytes over our ``none``'s, so it may keep what compile keeps and no more; the point it picks
for N is in the name). The bytes come from the meter on a short sequence (``OUR_METER_TOKENS``;
what a point keeps is per token, whatever N), through the Triton interpreter on CPU; the FLOPs
from ``FlopCounterMode`` over the block's custom operators (whose formulas count what the kernels
run) on fake tensors of the full N, where no kernel runs. Another curve joins by adding a function to ``CURVES``: the table,
the JSON and the plot take a list of ``Point`` from any source.

FLOP conventions: a matrix product is 2 FLOPs per multiply-add; element-wise ops (norms, RoPE, the
activation) count nothing, as in ``FlopCounterMode``. Attention counts the (query, key) pairs the
causal mask leaves, N (N + 1) / 2 per head (``fused_remat.flops.visible_pairs``): forward two
products of 2 D FLOPs per pair, as our operators' formulas do. PyTorch's own SDPA formula counts
all N^2 pairs and has no entry at all for the CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``,
so ``FlopCounterMode`` counts CPU attention as 0); ``ATTENTION_FLOPS`` supplies the causal count
for the CPU kernel and the CUDA ones. Backward counts differ between the curves (PyTorch's five
products, our kernels' seven) but cancel in the recompute, which subtracts the curve's own baseline.

On CPU, torch.compile's partitioner does not choose as it does on a GPU: its list of
compute-intensive ops has the CUDA attention kernels but not the CPU one, and its FLOP estimate of
the CPU kernel is 0, so below the budget where it stops protecting ops outside its allowlist it
treats recomputing attention as free. A GPU run of this command gives the GPU's choices.

Results: ``frontier.json`` (environment, layer, points), ``frontier.md`` and ``frontier.png``
under ``--out`` (default ``bench/results/frontier/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import harness
from fused_remat.flops import visible_pairs
from fused_remat.memory import saved_memory

DEFAULT_OUT = harness.REPO / "bench" / "results" / "frontier"
LAYER = dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=688, norm="rmsnorm", activation="swiglu", bias=False,
             rope_theta=10000.0, causal=True)
SEQ_LENS = (256, 1024, 4096)
BUDGETS = (1.0, 0.75, 0.5, 0.3, 0.1)
FINE_BUDGETS = tuple(round(1.0 - 0.05 * i, 2) for i in range(20))
OUR_POLICIES = ("none", "cheap", "selective", "full")
OUR_METER_TOKENS = 16  # enough to hold every kept tensor; few enough for the Triton interpreter
COMPILE = "torch.compile"
OURS = "fused_remat"
OURS_BUDGET = "fused_remat memory_budget"


@dataclasses.dataclass(frozen=True)
class Point:
    """One way to train the layer: what it keeps for backward and what its backward replays."""

    source: str  # the curve: "torch.compile", "fused_remat", ...
    name: str  # the point on its curve: a budget, a policy
    seq_len: int
    kept_bytes_per_token: float
    recompute: float  # backward FLOPs beyond the curve's no-replay point, over the forward FLOPs
    forward_flops_per_token: float
    backward_flops_per_token: float


# --------------------------------------------------------------------------------------------
# Counting attention
# --------------------------------------------------------------------------------------------

# Forward: Q K^T and P V. Backward as PyTorch's SDPA formula counts it: S again, dP, dV, dQ, dK.
ATTENTION_PRODUCTS = {False: 2, True: 5}


def _attention_formula(op: torch._ops.OpOverloadPacket, backward: bool) -> Callable[..., int]:
    """FlopCounterMode's formula for one SDPA kernel, given its arguments as called: the causal
    mask's visible pairs (square self-attention, where top-left and bottom-right alignment agree)."""
    argument_names = [argument.name for argument in op.default._schema.arguments]

    def count(*args, out_val=None, **kwargs) -> int:
        arguments = {**dict(zip(argument_names, args)), **kwargs}
        batch, heads, q_len, head_dim = arguments["query"].shape
        pairs = visible_pairs(q_len, arguments["key"].shape[-2], bool(arguments.get("is_causal", False)))
        return 2 * ATTENTION_PRODUCTS[backward] * batch * heads * head_dim * pairs

    count._get_raw = True  # FlopCounterMode passes the tensors themselves, not their shapes
    return count


def _attention_flops() -> dict:
    aten = torch.ops.aten
    kernels = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    formulas = {}
    for kernel in kernels:
        forward, backward = getattr(aten, kernel), getattr(aten, f"{kernel}_backward")
        formulas[forward] = _attention_formula(forward, backward=False)
        formulas[backward] = _attention_formula(backward, backward=True)
    return formulas


ATTENTION_FLOPS = _attention_flops()


def _flop_counter():
    """A FlopCounterMode with the causal attention counts. Imported here, not at the top: importing
    the counter imports triton, which must come after main() has set TRITON_INTERPRET."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)


# --------------------------------------------------------------------------------------------
# torch.compile's curve
# --------------------------------------------------------------------------------------------


class _CountingBackend:
    """An AOTAutograd backend that partitions as ``partitioner`` does and runs the forward and
    backward graphs as they are, each counting its FLOPs on every call (the latest call's stay)."""

    def __init__(self, partitioner: str):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.flops = {"forward": 0, "backward": 0}

        def counting(pass_: str):
            def compiler(graph: torch.fx.GraphModule, example_inputs):
                def run(*args):
                    with _flop_counter() as counter:
                        outputs = graph(*args)
                    self.flops[pass_] = counter.get_total_flops()
                    return outputs

                return make_boxed_func(run)

            return compiler

        if partitioner == "inductor":
            from torch._inductor.compile_fx import partition_fn, select_decomp_table

            partitioning = dict(partition_fn=partition_fn, decompositions=select_decomp_table())
        else:
            partitioning = dict(partition_fn=min_cut_rematerialization_partition)
        self.backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"), **partitioning)


def compile_points(seq_len: int, device: torch.device, budgets=BUDGETS, partitioner: str = "inductor") -> list[Point]:
    """torch.compile's curve: one point per activation memory budget (1 always: the baseline)."""
    import torch._dynamo
    import torch._functorch.config

    from fused_remat.reference import TransformerBlock

    layer = TransformerBlock(**LAYER, device=device)
    x = torch.randn(1, seq_len, LAYER["dim"], device=device, requires_grad=True)
    dy = torch.randn_like(x)
    measured = {}
    for budget in sorted({1.0, *budgets}, reverse=True):
        torch._dynamo.reset()  # the budget is read when the graph is partitioned, not guarded on
        counting = _CountingBackend(partitioner)
        compiled = torch.compile(layer, backend=counting.backend, fullgraph=True, dynamic=False)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            compiled(x).backward(dy)  # compiles both graphs under the budget
        with saved_memory(exclude=layer.parameters()) as meter:
            y = compiled(x)
        y.backward(dy)
        measured[budget] = (meter.bytes / seq_len, counting.flops["forward"], counting.flops["backward"])
    no_replay_backward = measured[1.0][2]
    return [_point(COMPILE, f"budget {budget:g}", seq_len, kept, forward, backward, no_replay_backward)
            for budget, (kept, forward, backward) in measured.items()]


def _point(source: str, name: str, seq_len: int, kept_bytes_per_token: float, forward: int, backward: int,
           no_replay_backward: int) -> Point:
    return Point(source, name, seq_len, kept_bytes_per_token=kept_bytes_per_token,
                 recompute=(backward - no_replay_backward) / forward, forward_flops_per_token=forward / seq_len,
                 backward_flops_per_token=backward / seq_len)


# --------------------------------------------------------------------------------------------
# Our curve
# --------------------------------------------------------------------------------------------


def _our_kernels_run(device: torch.device) -> bool:
    from fused_remat.backend import use_triton

    if use_triton("block", device):
        return True
    print(f"{OURS}: its kernels do not run on {device} here (FUSED_REMAT_BACKEND=reference, or "
          "TRITON_INTERPRET unset when triton was imported), so its curve is left out", file=sys.stderr)
    return False


def _measure_ours(seq_len: int, device: torch.device, remat: str | None, memory_budget: float | None = None):
    """(kept bytes per token, forward FLOPs, backward FLOPs) of our block at N = ``seq_len``: bytes
    from the meter on a short sequence, of the point the block runs at ``seq_len`` (a budget picks
    its point by the sequence length); FLOPs from the operators' formulas on fake tensors of the
    full length, where no kernel runs."""
    import fused_remat
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        block = fused_remat.TransformerBlock(**LAYER, remat=remat, memory_budget=memory_budget, device=device)
        x = torch.empty(1, seq_len, LAYER["dim"], device=device, requires_grad=True)
        point = block.remat if memory_budget is None else block.budget_point(seq_len, x.dtype, x.dtype)
        with _flop_counter() as forward:
            y = block(x)
        with _flop_counter() as backward:
            y.backward(torch.empty_like(y))
    block = fused_remat.TransformerBlock(**LAYER, remat=point, device=device)
    x = torch.randn(1, OUR_METER_TOKENS, LAYER["dim"], device=device, requires_grad=True)
    with saved_memory(exclude=block.parameters()) as meter:
        block(x)
    return meter.bytes / OUR_METER_TOKENS, forward.get_total_flops(), backward.get_total_flops(), point


def our_policy_points(seq_len: int, device: torch.device) -> list[Point]:
    """Our block's named policies; none where its kernels do not run here (on CPU they need
    TRITON_INTERPRET=1 before triton is imported; without them the block is the reference's)."""
    if not _our_kernels_run(device):
        return []
    measured = {policy: _measure_ours(seq_len, device, policy)[:3] for policy in OUR_POLICIES}
    no_replay_backward = measured["none"][2]
    return [_point(OURS, policy, seq_len, kept, forward, backward, no_replay_backward)
            for policy, (kept, forward, backward) in measured.items()]


def our_budget_points(seq_len: int, device: torch.device, compile_curve: list[Point]) -> list[Point]:
    """Our block under ``memory_budget`` at each of torch.compile's points but its baseline: the
    fraction is compile's kept bytes over what our ``none`` keeps, so that the block may keep as
    much as compile does and no more; each point is named by that budget and the point it runs."""
    if not _our_kernels_run(device):
        return []
    none_kept, _, no_replay_backward, _ = _measure_ours(seq_len, device, "none")
    points = []
    for theirs in compile_curve:
        if theirs.recompute == 0 and theirs.kept_bytes_per_token >= none_kept:
            continue
        fraction = min(1.0, theirs.kept_bytes_per_token / none_kept)
        kept, forward, backward, point = _measure_ours(seq_len, device, None, fraction)
        points.append(_point(OURS_BUDGET, f"{theirs.name}: memory_budget {fraction:.3f} ({point})", seq_len, kept,
                             forward, backward, no_replay_backward))
    return points


# Curves beside torch.compile's: name -> function(seq_len, device) returning its points.
CURVES: dict[str, Callable[[int, torch.device], list[Point]]] = {OURS: our_policy_points}


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def layer_text() -> str:
    return (f"one Llama-shaped layer (dim {LAYER['dim']}, {LAYER['n_heads']} heads, {LAYER['n_kv_heads']} KV heads, "
            f"SwiGLU {LAYER['ffn_dim']}, RMSNorm, RoPE, causal, no bias), fp32, batch 1")


def markdown_table(points: list[Point], environment: dict, partitioner: str) -> str:
    lines = [
        f"**frontier**: {layer_text()}, on {environment['device']} (torch {environment['torch']}, "
        f"{environment['date']}, commit {environment['commit']}); torch.compile partitioned as {partitioner}'s. "
        "Kept: bytes autograd holds for backward per token (saved-memory meter). Recompute: backward FLOPs beyond "
        "the curve's no-replay point (compile's budget 1, our `none`) over the forward's; causal attention counts "
        "its N(N+1)/2 visible pairs."
        + (" On CPU the partitioner treats recomputing attention as free (bench/frontier.py): a GPU run shows "
           "the GPU's choices." if environment["device"] == "cpu" else ""),
        "",
        "| N | curve | point | kept B/token | recompute (x forward) | forward MFLOP/token | backward MFLOP/token |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(f"| {p.seq_len} | {p.source} | {p.name} | {p.kept_bytes_per_token:,.0f} | {p.recompute:.2f} | "
                     f"{p.forward_flops_per_token / 1e6:.2f} | {p.backward_flops_per_token / 1e6:.2f} |")
    return "\n".join(lines) + "\n"


def budget_comparison(points: list[Point]) -> str:
    """Our ``memory_budget`` beside each torch.compile point it was matched to: kept bytes and
    recompute of both, and ours over theirs."""
    theirs = {(p.seq_len, p.name): p for p in points if p.source == COMPILE}
    lines = ["| N | torch.compile | kept B/token (compile / ours) | recompute (compile / ours) | ours / compile |",
             "|---:|---|---:|---:|---:|"]
    for ours in (p for p in points if p.source == OURS_BUDGET):
        match = theirs[ours.seq_len, ours.name.split(":")[0]]
        ratio = f"{ours.recompute / match.recompute:.3f}" if match.recompute else "-"
        lines.append(f"| {ours.seq_len} | {ours.name} | {match.kept_bytes_per_token:,.0f} / {ours.kept_bytes_per_token:,.0f} "
                     f"| {match.recompute:.3f} / {ours.recompute:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path) -> Path | None:
    """Recompute against kept bytes, one panel per sequence length, one line per curve, each point
    labelled; None without matplotlib (the ``plot`` extra)."""
    from fused_remat.training.reporting import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    seq_lens = sorted({p.seq_len for p in points})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(6 * len(seq_lens), 4.5), squeeze=False, layout="constrained")
    markers = ("o", "s", "^", "D", "v")
    for ax, seq_len in zip(axes.flat, seq_lens):
        sources = list(dict.fromkeys(p.source for p in points if p.seq_len == seq_len))
        for index, source in enumerate(sources):
            curve = sorted((p for p in points if p.seq_len == seq_len and p.source == source),
                           key=lambda p: p.kept_bytes_per_token)
            ax.plot([p.kept_bytes_per_token for p in curve], [p.recompute for p in curve],
                    marker=markers[index % len(markers)], label=source, linewidth=2.5 if source == OURS else 1.2)
            for p in curve:  # each curve's labels on their own side, where two points coincide
                ax.annotate(p.name, (p.kept_bytes_per_token, p.recompute), textcoords="offset points",
                            xytext=(4, 4 if index % 2 == 0 else -11), fontsize=7)
        ax.set_title(f"N = {seq_len}", fontsize=9)
        ax.set_xlabel("kept for backward (bytes per token)")
        ax.set_ylabel("recompute (x the layer's forward FLOPs)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Memory/recompute frontier: {layer_text()}", fontsize=10, wrap=True)
    return save_figure(fig, path)


def write_results(folder: Path, points: list[Point], environment: dict, partitioner: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"command": "frontier", "environment": environment, "layer": LAYER, "partitioner": partitioner,
               "points": [dataclasses.asdict(p) for p in points]}
    written = [folder / "frontier.json", folder / "frontier.md"]
    written[0].write_text(json.dumps(payload, indent=1) + "\n")
    written[1].write_text(markdown_table(points, environment, partitioner) + "\n" + budget_comparison(points))
    png = plot(points, folder / "frontier.png")
    if png is None:
        print("matplotlib is not installed (the 'plot' extra): no frontier.png", file=sys.stderr)
    return written + ([png] if png else [])


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench frontier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS), metavar="N")
    budgets = parser.add_mutually_exclusive_group()
    budgets.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), metavar="F",
                         help="activation_memory_budget values in [0, 1] (budget 1 is always measured: the baseline)")
    budgets.add_argument("--fine", action="store_const", dest="budgets", const=list(FINE_BUDGETS),
                         help="budgets 1.0, 0.95, ..., 0.05")
    parser.add_argument("--partitioner", choices=("inductor", "aot_eager"), default="inductor",
                        help="partition as this torch.compile backend does (default: inductor, compile's default)")
    parser.add_argument("--device", help="default: cuda when there is one, else cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if any(not 0.0 <= budget <= 1.0 for budget in args.budgets):
        parser.error(f"budgets must lie in [0, 1], got {args.budgets}")
    return args


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # our kernels on CPU, before anything imports triton
    started = time.perf_counter()
    points = []
    for seq_len in args.seq_lens:
        theirs = compile_points(seq_len, device, args.budgets, args.partitioner)
        points += theirs
        for curve in CURVES.values():
            points += curve(seq_len, device)
        points += our_budget_points(seq_len, device, theirs)
    # the machine's description, with the device this run used (--device cpu on a GPU machine)
    environment = {**harness.environment(),
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type}
    written = write_results(args.out, points, environment, args.partitioner)
    print(markdown_table(points, environment, args.partitioner))
    print(budget_comparison(points))
    print(f"wrote {', '.join(str(path) for path in written)} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
