"""`python -m bench traffic`: the bytes each row-wise kernel's pick moves through global memory,
against the bytes it must move, per element of a row, at widths 1k-32k, bf16 and fp32. No GPU.

Must move: every input element read once and every output element written once, the fp32 row
statistics included. Moves: every element a load or store touches, each time it touches it.

Method. Each launcher (`kernels/norm.py`, `kernels/activations.py`) runs as a user's call runs it,
its kernels in Triton's interpreter, with every `tl.load` and `tl.store` tallied by the addresses
its mask lets through, and every aten operation the launcher runs on the host beside its kernels
(the streamed residual add) tallied by the tensors it reads and
writes. Must-move is what those accesses touch at least once (distinct addresses read, plus
distinct addresses written); moved is every access. The interpreter runs the program the compiler
compiles, tile for tile; a compiled kernel can only move fewer bytes (the compiler may merge loads)
or more through spills, which `python -m bench static` and the compile-target tests hold at zero.

Two row counts, ROWS: the per-row cost is the difference, so what a launch pays once per program
(its dW/dB partial sums, written once) or once per call (their sum, `_sum_partials`) cancels, and what it pays per
row (a partial sum read and written back for every row) does not. Weight and bias are vectors of
one row's width (at most 32k fp32, 128 KiB): a GPU's L2 (40-60 MB) serves their re-reads, so they
are counted apart ("L2") and not in the ratio.

Results: ``bench/results/traffic/traffic.json`` and ``traffic.md`` (or ``--out``), the machine named.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "traffic"
WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DTYPES = ("bfloat16", "float32")
ROWS = (8, 16)  # each at least 4 row blocks: the interpreter's persistent grids have 4 programs
NORMS = ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd")
ACTIVATIONS = ("gelu_fwd", "gelu_bwd", "swiglu_fwd", "swiglu_bwd")
# What the fused form adds: the forward norms' residual add, the backward norms' residual gradient
# and rebuilt output, the backward activations' rebuilt output. The forward activations have none.
FUSED = {"layer_norm_fwd": "residual add", "rms_norm_fwd": "residual add",
         "layer_norm_bwd": "residual grad + output", "rms_norm_bwd": "residual grad + output",
         "gelu_bwd": "output", "swiglu_bwd": "output"}


@dataclasses.dataclass(frozen=True)
class TrafficCase:
    op: str  # one of NORMS or ACTIVATIONS
    dtype: str
    width: int
    fused: bool = False  # with what FUSED names for the op

    @property
    def id(self) -> str:
        return f"{self.op}-{self.dtype}-N{self.width}" + ("-fused" if self.fused else "")


def cases(widths=WIDTHS, dtypes=DTYPES) -> list[TrafficCase]:
    return [TrafficCase(op, dtype, width, fused)
            for op in NORMS + ACTIVATIONS for dtype in dtypes for width in widths
            for fused in ((False, True) if op in FUSED else (False,))]


# --------------------------------------------------------------------------------------------
# The tally
# --------------------------------------------------------------------------------------------


class Tally:
    """Global-memory accesses: element addresses read and written, kept apart for the ranges in
    ``cached`` (weight and bias). ``own``: the ranges the call allocated, whose reads read back what
    the call wrote and so are never must-move. ``outputs``: the ranges of what the call returns, the
    only writes that must move (a scratch's are not)."""

    def __init__(self):
        self.cached: list[tuple[int, int]] = []
        self.own: list[tuple[int, int]] = []
        self.outputs: list[tuple[int, int]] | None = None  # None: every write
        self._accesses = {"read": [], "written": []}  # (addresses, itemsize)
        self.cached_bytes = 0

    def access(self, kind: str, addresses, itemsize: int) -> None:
        import numpy as np

        addresses = np.asarray(addresses, dtype=np.uint64).ravel()
        for start, end in self.cached:
            inside = (addresses >= start) & (addresses < end)
            if inside.any():
                self.cached_bytes += int(inside.sum()) * itemsize
                addresses = addresses[~inside]
        if addresses.size:
            self._accesses[kind].append((addresses, itemsize))

    def access_tensor(self, kind: str, t) -> None:
        """Every element of tensor ``t`` (any strides)."""
        import numpy as np

        if t.numel() == 0:
            return
        offsets = np.zeros((), dtype=np.int64)
        for size, stride in zip(t.shape, t.stride()):
            offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
        self.access(kind, t.data_ptr() + offsets * t.element_size(), t.element_size())

    def bytes(self) -> dict:
        """moved: every access's bytes; must: distinct addresses read plus distinct addresses written."""
        import numpy as np

        moved = must = 0
        for kind, accesses in self._accesses.items():
            moved += sum(a.size * size for a, size in accesses)
            by_size = {}
            for a, size in accesses:
                if kind == "read":
                    for start, end in self.own:
                        a = a[(a < start) | (a >= end)]
                elif self.outputs is not None:
                    a = a[np.any([(a >= start) & (a < end) for start, end in self.outputs], axis=0)]
                by_size.setdefault(size, []).append(a)
            must += sum(np.unique(np.concatenate(parts)).size * size for size, parts in by_size.items())
        return {"moved": moved, "must": must, "cached": self.cached_bytes}


@contextlib.contextmanager
def tallied(tally: Tally):
    """Within: every interpreted tl.load/tl.store and every aten operation outside a kernel goes into
    ``tally``. Needs Triton in interpreter mode."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from triton.runtime import interpreter

    builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
    load, store, run_kernel = builder.create_masked_load, builder.create_masked_store, executor.__call__
    in_kernel = [False]
    aten = torch.ops.aten
    no_traffic = (aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided)
    allocations = no_traffic + (aten.zeros, aten.zeros_like, aten.new_zeros)

    def counted_load(ptrs, mask, other, cache_policy, is_volatile):
        tally.access("read", ptrs.data[mask.data], ptrs.get_element_ty().primitive_bitwidth // 8)
        return load(ptrs, mask, other, cache_policy, is_volatile)

    def counted_store(ptrs, value, mask, cache_policy):
        tally.access("written", ptrs.data[mask.data], ptrs.get_element_ty().primitive_bitwidth // 8)
        return store(ptrs, value, mask, cache_policy)

    def kernel_call(self, *args, **kwargs):
        in_kernel[0] = True  # the interpreter's own copies of the arguments are not the kernel's traffic
        try:
            return run_kernel(self, *args, **kwargs)
        finally:
            in_kernel[0] = False

    class HostOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if in_kernel[0] or func.is_view:
                return out
            if func.overloadpacket in allocations:
                tally.own.append((out.data_ptr(), out.data_ptr() + out.untyped_storage().nbytes()))
            if func.overloadpacket in no_traffic:
                return out
            schema = func._schema.arguments
            written = {id(kwargs.get(a.name, args[i] if i < len(args) else None))
                       for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write}
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and id(t) not in written:
                    tally.access_tensor("read", t)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    tally.access_tensor("written", t)
            return out

    builder.create_masked_load, builder.create_masked_store, executor.__call__ = counted_load, counted_store, kernel_call
    try:
        with HostOps():
            yield tally
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, run_kernel


# --------------------------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------------------------


def _launch(case: TrafficCase, rows: int, tally: Tally) -> None:
    """The launcher's call for ``case`` on ``rows`` rows of fresh random data, tallied; what it
    returns are its outputs."""
    import torch
    from torch.utils._pytree import tree_leaves

    from fused_remat.kernels import activations, norm

    dtype = getattr(torch, case.dtype)
    x = torch.randn(rows, case.width, dtype=dtype)
    like_x = lambda: torch.randn_like(x)  # noqa: E731
    if case.op in NORMS:
        rms = case.op.startswith("rms")
        weight = torch.randn(case.width, dtype=dtype)
        bias = None if rms else torch.randn(case.width, dtype=dtype)
        tally.cached = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in (weight, bias) if t is not None]
        if case.op.endswith("fwd"):
            residual = like_x() if case.fused else None
            with tallied(tally):
                out = norm.norm_fwd(x, weight, bias, residual, 1e-5, rms)
        else:
            _, mean, rstd, _ = norm.norm_fwd(x, weight, bias, None, 1e-5, rms)
            dy, residual_grad = like_x(), like_x() if case.fused else None
            with tallied(tally):
                out = norm.norm_bwd(dy, x, weight, bias, mean, rstd, residual_grad, rms, has_bias=not rms,
                                    rebuild_output=case.fused)
    else:
        other, dy = like_x(), like_x()
        with tallied(tally):
            if case.op == "gelu_fwd":
                out = activations.gelu_fwd(x, "tanh")
            elif case.op == "gelu_bwd":
                out = activations.gelu_bwd(dy, x, "tanh", rebuild_output=case.fused)
            elif case.op == "swiglu_fwd":
                out = activations.swiglu_fwd(x, other)
            elif case.op == "swiglu_bwd":
                out = activations.swiglu_bwd(dy, x, other, rebuild_output=case.fused)
            else:
                raise ValueError(f"unknown op {case.op!r}")
    tally.outputs = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes())
                     for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def pick(case: TrafficCase) -> str:
    """The launcher's tiling for the case at a training batch's rows (16384)."""
    from fused_remat.kernels import activations, norm

    if case.op in NORMS:
        single, block_m, block_n, warps = norm._tiling(case.width, "backward" if case.op.endswith("bwd") else "forward")
        return f"{'one pass' if single else 'streamed'} M{block_m} N{block_n} w{warps}"
    block_m, block_n, warps, _ = activations._tiling(16384, case.width)
    return f"M{block_m} N{block_n} w{warps}"


def measure(case: TrafficCase) -> dict:
    """Per element of a row: bytes moved, bytes that must move, their ratio, and the L2 bytes."""
    totals = []
    for rows in ROWS:
        tally = Tally()
        _launch(case, rows, tally)
        totals.append(tally.bytes())
    elements = (ROWS[1] - ROWS[0]) * case.width
    per = {k: (totals[1][k] - totals[0][k]) / elements for k in ("moved", "must", "cached")}
    return {"case": case.id, **dataclasses.asdict(case), "pick": pick(case), "moved": per["moved"],
            "must": per["must"], "ratio": per["moved"] / per["must"], "l2": per["cached"]}


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def environment() -> dict:
    from bench.host import machine

    return {**machine(), "target": "Triton interpreter", "dtype": "bfloat16 and float32", "rows": list(ROWS)}


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        "# Global-memory traffic of the row-wise kernels",
        "",
        f"{env['cpu']}, {env['cores']} cores; Python {env['python']}, torch {env['torch']}, Triton {env['triton']} "
        f"({env['target']}); commit {env['commit']}, {env['date']}.",
        "",
        "Bytes per element of a row (`python -m bench traffic`, bench/traffic.py): moved by every load and store "
        "of the launcher's pick, and what must move (each input read once, each output written once). Counted, "
        "not timed. Fused: " + "; ".join(f"{op} {what}" for op, what in FUSED.items()) + ". L2: the weight "
        "and bias re-reads, apart.",
        "",
        "| op | dtype | width | fused | pick (16384 rows) | moved B | must B | moved / must | L2 B |",
        "|---|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['op']} | {r['dtype']} | {r['width']} | {'yes' if r['fused'] else 'no'} | {r['pick']} | "
                     f"{r['moved']:.2f} | {r['must']:.2f} | {r['ratio']:.2f} | {r['l2']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    parser = argparse.ArgumentParser(prog="python -m bench traffic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="only cases whose id contains this text (e.g. layer_norm_bwd-bfloat16)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results/traffic)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from bench.report import write_facts
    from fused_remat.kernels.limits import triton_interpreting

    if not triton_interpreting():
        print("python -m bench traffic runs the kernels in Triton's interpreter: unset TRITON_INTERPRET or set it to 1",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = [measure(c) for c in cases() if not args.only or args.only in c.id]
    env = environment()
    write_facts(args.out, "traffic", {"environment": env, "rows": rows}, markdown(rows, env))
    print(f"results in {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
