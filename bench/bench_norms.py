"""Norms and activations: forward, backward and forward+backward GB/s, ours against eager PyTorch,
torch.compile of the same eager function, and Liger-Kernel when it is installed.

GB/s counts the bytes an ideal kernel must move (each input read once, each output written once,
per-row statistics included, weights left out as negligible) over the median time.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import fused_remat
from bench.harness import Case, optional_import, pytest_benchmark_case, rotating

MODES = ("fwd", "bwd", "fwd+bwd")


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


def _runner(fn, mode):
    """(make-inputs wrapper, run) for one mode: backward is timed on a retained graph."""
    if mode == "fwd":
        return (lambda inputs: inputs), (lambda *inputs: fn(*inputs))

    def with_forward(inputs):
        out = fn(*inputs)
        return out, inputs, torch.randn_like(out)

    if mode == "bwd":
        return with_forward, (lambda out, inputs, dy: torch.autograd.grad(out, inputs, dy, retain_graph=True))

    def forward_backward(*inputs):
        out = fn(*inputs)
        return torch.autograd.grad(out, inputs, torch.randn_like(out))

    return (lambda inputs: inputs), forward_backward


def _provider(fn, mode, make_inputs):
    prepare, run = _runner(fn, mode)
    return lambda: rotating(lambda: prepare(make_inputs()), run)


def _compiled(eager):
    def build():
        torch._dynamo.reset()  # each case compiles its own shapes: no recompile limit, no stale graphs
        return torch.compile(eager, dynamic=False)

    return build


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device != "cuda":
        shapes = [(5, 96)]
    elif quick:
        shapes = [(16384, 1024), (16384, 4096), (16384, 16384)]
    else:
        shapes = [(rows, hidden) for hidden in (1024, 2048, 4096, 8192, 16384) for rows in (8192, 32768, 65536) if rows * hidden <= 2**28]
    element = torch.finfo(dtype).bits // 8
    result = []
    for op, (ours, eager, make, (fwd_bytes, bwd_bytes), stat_bytes) in _ops().items():
        liger = _liger(op) if device == "cuda" else None
        for rows, hidden in shapes:
            def make_inputs(make=make, rows=rows, hidden=hidden):
                return make(rows, hidden, dtype, device)

            for mode in MODES:
                per_element = {"fwd": fwd_bytes, "bwd": bwd_bytes, "fwd+bwd": fwd_bytes + bwd_bytes}[mode]
                stats = stat_bytes * rows * (2 if mode == "fwd+bwd" else 1)
                providers = {"fused_remat": _provider(ours, mode, make_inputs), "eager": _provider(eager, mode, make_inputs)}
                if device == "cuda":
                    providers["torch.compile"] = lambda eager=eager, mode=mode, make_inputs=make_inputs: _provider(
                        _compiled(eager)(), mode, make_inputs
                    )()
                    if liger is not None:
                        providers["liger"] = _provider(liger, mode, make_inputs)
                result.append(Case(
                    suite="norms", name=f"{op} {mode} {rows}x{hidden}",
                    params={"op": op, "mode": mode, "rows": rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch.")},
                    providers=providers, unit="GB/s", work=per_element * element * rows * hidden + stats, ceiling="copy",
                ))
    return result


@pytest.mark.parametrize("case", cases(quick=True, device="cpu"), ids=lambda c: c.name)
def test_smoke_on_cpu(case, triton_backend):
    """Every provider runs through the interpreter, so this suite cannot rot without CI noticing."""
    outputs = {name: factory()() for name, factory in case.providers.items()}
    ours, eager = outputs["fused_remat"], outputs["eager"]
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), eager if isinstance(eager, tuple) else (eager,)):
        assert a.shape == b.shape and torch.isfinite(a).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case,provider",
    [(c, p) for c in cases(quick=True) for p in ("fused_remat", "eager", "torch.compile")],
    ids=lambda value: value.name if isinstance(value, Case) else value,
)
def test_gpu(case, provider, benchmark):
    pytest_benchmark_case(benchmark, case, provider)


def plots(folder, results, ceilings):
    """GB/s against hidden size per op and mode, with the measured copy bandwidth."""
    from bench.report import plot

    rows = max((r.params["rows"] for r in results), default=0)
    chosen = [r for r in results if r.params["rows"] == rows]
    dtype = chosen[0].params["dtype"] if chosen else ""
    plot(folder, "norms", f"norms and activations, {dtype}, {rows} rows: GB/s (higher is better)", chosen,
         x_key="hidden", group_keys=("op", "mode"), value=lambda r: r.metric, ylabel="GB/s", ceiling=ceilings.get("copy_GBps"))
