"""Running cases: a case compiled for a target, its kernels analyzed; the cases a run compiles."""

from __future__ import annotations

import itertools
import time

from bench.static.analysis import analyze
from bench.static.cases import VARIANTS, Case, run_case
from bench.static.driver import compiling_for
from bench.static.targets import ARCHS


def compile_case(case: Case, target: str) -> list[dict]:
    """Rows for every kernel the launcher compiled for ``case`` on ``target``; a launcher or
    compiler failure is one row with ``error``."""
    arch = ARCHS[target]
    started = time.perf_counter()
    with compiling_for(arch) as launched:
        try:
            run_case(case)
            error = None
        except Exception as exc:  # a compile failure is a fact to report, not a crash
            error = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
    seconds = time.perf_counter() - started
    rows, seen = [], set()
    for compiled in launched:
        if compiled.binary.hash in seen:
            continue
        seen.add(compiled.binary.hash)
        row = analyze(compiled, arch)
        row.update(case=case.id, dtype=case.dtype)
        rows.append(row)
    if error or not rows:
        rows.append({"case": case.id, "target": target, "kernel": case.op, "error": error or "nothing was compiled"})
    for row in rows:
        row["case_seconds"] = round(seconds, 1)
    return rows


def sweep(full: bool) -> list[tuple[Case, str]]:
    """(case, target) pairs. Default: bf16, D 64/128, causal and not, dense and every VARIANT, and
    D=256 dense (Gemma's head dim), every configuration the launchers can choose, on sm_90a, sm_80
    and sm_100a; GQA (which changes dK/dV's loop over the group) on sm_90a only; the tutorial's
    warp-specialized forward on sm_100a only (its Blackwell path). ``full``: every dtype, D
    64/128/256 with every VARIANT, MHA and GQA everywhere."""
    dtypes = ("bfloat16", "float16", "float32") if full else ("bfloat16",)
    dims = (64, 128, 256)
    targets = ("sm_90a", "sm_80", "sm_100a")
    pairs = []
    for target in targets:
        for dtype, dim, causal, variant in itertools.product(dtypes, dims, (False, True), VARIANTS):
            if dim == 256 and variant != "dense" and not full:
                continue
            pairs.append((Case("attention_fwd", dtype, dim, causal, variant=variant), target))
            for gqa in (False, True) if full or target == "sm_90a" else (False,):
                pairs.append((Case("attention_bwd", dtype, dim, causal, gqa, variant=variant), target))
        yardsticks = ("tutorial_fwd", "tutorial_tma_fwd", "tutorial_bwd") + (("tutorial_ws_fwd",) if target == "sm_100a" else ())
        for op, dim, causal in itertools.product(yardsticks, (64, 128), (False, True)):
            pairs.append((Case(op, "bfloat16", dim, causal), target))
        for dtype in dtypes:
            for op in ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd"):
                for width in (1024, 4096, 16384, 32768) if full else (1024, 4096, 32768):
                    pairs.append((Case(op, dtype, width=width), target))
            for op in ("gelu_fwd", "gelu_bwd", "swiglu_fwd", "swiglu_bwd"):
                pairs.append((Case(op, dtype, width=4096), target))
            for vocab in (50257, 128256):  # GPT-2's and Llama 3's
                pairs.append((Case("cross_entropy", dtype, width=vocab), target))
            for dim in dims:
                pairs.append((Case("rope", dtype, dim), target))
            pairs.append((Case("rope", dtype, 128, variant="varlen"), target))  # positions from document offsets
        pairs.append((Case("target_statistics", "int64", width=50257), target))  # the loss's targets, once
    return pairs


def can_compile(target: str) -> bool:
    """Whether the installed Triton and its ptxas compile for ``target`` (sm_100a needs a recent one)."""
    rows = compile_case(Case("gelu_fwd", "bfloat16", width=1024), target)
    return not any("error" in r for r in rows)
