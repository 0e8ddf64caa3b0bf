"""Norms and activations: forward, backward and forward+backward GB/s, ours against eager PyTorch,
torch.compile of the same eager function, and Liger-Kernel when it is installed.

GB/s counts the bytes an ideal kernel must move (each input read once, each output written once,
per-row statistics included, weights left out as negligible) over the median time. Inputs and
the output gradient are drawn before the timed call (bench/providers.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import fused_remat
from bench.harness import Case, Suite, dtype_name, grid_suite, optional_import
from bench.providers import MODES, compiled, pass_provider

OPS = ("layer_norm", "rms_norm", "gelu", "swiglu")


def _liger(op: str):
    """Liger-Kernel's version of ``op`` with our call signature, or None when it is not installed."""
    if optional_import("liger_kernel") is None:
        return None
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    if op == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
    if op == "swiglu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply
    return None


@functools.lru_cache(maxsize=None)
def _ops() -> dict:
    """name -> (ours, eager, inputs(rows, hidden, dtype, device), bytes per element for fwd/bwd, stat bytes per row)."""

    def norm_inputs(with_bias):
        def make(rows, hidden, dtype, device):
            x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
            b = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
            return (x, w, b) if with_bias else (x, w)

        return make

    def elementwise_inputs(count):
        def make(rows, hidden, dtype, device):
            return tuple(torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(count))

        return make

    return {
        "layer_norm": (
            fused_remat.layer_norm,
            lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
            norm_inputs(True), (2, 3), 8,
        ),
        "rms_norm": (
            fused_remat.rms_norm,
            lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
            norm_inputs(False), (2, 3), 4,
        ),
        "gelu": (fused_remat.gelu, F.gelu, elementwise_inputs(1), (2, 3), 0),
        "swiglu": (fused_remat.swiglu, lambda g, u: F.silu(g) * u, elementwise_inputs(2), (3, 5), 0),
    }


def _shapes(quick: bool, device: str) -> list[tuple[int, int]]:
    """(rows, hidden) of the cases."""
    if device != "cuda":
        return [(5, 96)]
    if quick:
        return [(16384, 1024), (16384, 4096), (16384, 16384)]
    return [(rows, hidden) for hidden in (1024, 2048, 4096, 8192, 16384) for rows in (8192, 32768, 65536) if rows * hidden <= 2**28]


def grid(quick: bool, device: str = "cuda") -> list[tuple[str, str, int, int]]:
    """(op, mode, rows, hidden) of every case, in the order the suite runs them: plain values, cheap to list."""
    return [(op, mode, rows, hidden) for op in OPS for rows, hidden in _shapes(quick, device) for mode in MODES]


def _name(op: str, mode: str, rows: int, hidden: int) -> str:
    return f"{op} {mode} {rows}x{hidden}"


def case(op: str, mode: str, rows: int, hidden: int, device: str = "cuda") -> Case:
    """One op in one mode at one shape; providers ours, eager and, on a GPU, torch.compile and Liger."""
    ours, eager, make, (fwd_bytes, bwd_bytes), stat_bytes = _ops()[op]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def make_inputs():
        return make(rows, hidden, dtype, device), torch.randn(rows, hidden, device=device, dtype=dtype)

    providers = {"fused_remat": pass_provider(ours, mode, make_inputs), "eager": pass_provider(eager, mode, make_inputs)}
    if device == "cuda":
        providers["torch.compile"] = lambda: pass_provider(compiled(eager), mode, make_inputs)()
        liger = _liger(op)
        if liger is not None:
            providers["liger"] = pass_provider(liger, mode, make_inputs)
    per_element = {"fwd": fwd_bytes, "bwd": bwd_bytes, "fwd+bwd": fwd_bytes + bwd_bytes}[mode]
    stats = stat_bytes * rows * (2 if mode == "fwd+bwd" else 1)
    element = torch.finfo(dtype).bits // 8
    return Case(
        suite="norms", name=_name(op, mode, rows, hidden),
        params={"op": op, "mode": mode, "rows": rows, "hidden": hidden, "dtype": dtype_name(dtype)},
        providers=providers, unit="GB/s", work=per_element * element * rows * hidden + stats, ceiling="copy",
    )


cases, test_smoke_on_cpu, test_gpu = grid_suite(grid, case, _name)


def plots(folder, results, ceilings):
    """GB/s against hidden size per op and mode, with the measured copy bandwidth."""
    from bench.report import plot

    rows = max((r.params["rows"] for r in results), default=0)
    chosen = [r for r in results if r.params["rows"] == rows]
    dtype = chosen[0].params["dtype"] if chosen else ""
    plot(folder, "norms", f"norms and activations, {dtype}, {rows} rows: GB/s (higher is better)", chosen,
         x_key="hidden", group_keys=("op", "mode"), value=lambda r: r.metric, ylabel="GB/s", ceiling=ceilings.get("copy_GBps"))


SUITE = Suite("norms", cases, plots)
