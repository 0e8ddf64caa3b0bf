"""Compile-target tests: the project's Triton kernels compiled for H100 (sm_90a) and A100 (sm_80)
without a GPU, through the project's own launchers (bench/static.py: a stand-in driver, meta tensors).

Each case compiles in a subprocess (this process runs Triton in interpreter mode) and its facts are
cached for the session, shared by xdist workers. Per compiled kernel, separate tests check:

- ``fits``: it compiled and its shared memory is within the target's per-block limit;
- ``no_spills``: ptxas reports no spill stores or loads;
- ``hgmma``: on sm_90a, every attention dot is a Hopper warpgroup MMA (HGMMA), no mma.sync (HMMA);
- ``not_serialized``: on sm_90a, ptxas does not report advisory C7515 (wgmma serialized);
- ``work_once``: the hot loop's MMAs execute exactly the multiply-adds needed (no warpgroup repeats).

The attention goals (no spills, HGMMA, no C7515, work once) are issue 11's, for sm_90a; on sm_80
the attention kernels are checked to compile and fit, and every other kernel also for no spills.

Goals today's kernels do not meet are strict xfails with the reason (``KNOWN``): the day a
kernel meets one, its test fails as XPASS and the entry must go.

CI runs a small subset (a few minutes on 2 cores). ``FUSED_REMAT_COMPILE_ALL=1`` adds every
configuration the attention autotuner can pick, every dtype, head dims 64/128/256, causal and not,
MHA and GQA, and every norm/activation/RoPE variant, marked ``compile_targets_full`` (select with
``-m compile_targets_full``). The expectations for the full set outside bf16 D 64/128 (fp16, fp32,
D 256) were not all verified by a run: see KNOWN.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest

from bench.static import ATTENTION_KERNELS, Case, launcher_configs, run_in_subprocess

FULL = os.environ.get("FUSED_REMAT_COMPILE_ALL") == "1"
PROPERTIES = ("fits", "no_spills", "hgmma", "not_serialized", "work_once")
MMA_KERNELS = ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")

# The CI subset: one configuration each of the attention kernels (the autotuner's first choices),
# one norm, one activation, RoPE, on sm_90a and sm_80.
CI_CASES = [
    Case("attention_fwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3)),
    Case("attention_fwd", "bfloat16", 128, causal=False, config=(128, 64, 8, 3)),
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(32, 128, 8, 3)),
    Case("rms_norm_bwd", "bfloat16", width=4096),
    Case("swiglu_bwd", "bfloat16", width=4096),
    Case("rope", "bfloat16", 128),
]


def _full_cases() -> list[Case]:
    cases = []
    for dtype in ("bfloat16", "float16", "float32"):
        for dim in (64, 128, 256):
            fwd, dq, dkdv = (launcher_configs(k, dtype, dim) for k in ("fwd", "dq", "dkdv"))
            for causal in (False, True):
                cases += [Case("attention_fwd", dtype, dim, causal, False, config=c) for c in fwd]
                for gqa in (False, True):
                    # every dQ and every dK/dV configuration, paired (the shorter list repeats)
                    for i in range(max(len(dq), len(dkdv))):
                        cases.append(Case("attention_bwd", dtype, dim, causal, gqa,
                                          config=dq[i % len(dq)], dkdv_config=dkdv[i % len(dkdv)]))
        for op in ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd"):
            cases += [Case(op, dtype, width=w) for w in (768, 4096, 16384, 32768)]
        for op in ("gelu_fwd", "gelu_bwd", "swiglu_fwd", "swiglu_bwd"):
            cases.append(Case(op, dtype, width=4096))
        cases += [Case("rope", dtype, d) for d in (64, 128, 256)]
    return [c for c in cases if c not in CI_CASES]


def _kernels(case: Case) -> tuple[str, ...]:
    """The kernels a case's launcher compiles (known before compiling, for the parametrization)."""
    return {
        "attention_fwd": ("_attn_fwd",),
        "attention_bwd": ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"),
        "layer_norm_fwd": ("_norm_fwd",), "rms_norm_fwd": ("_norm_fwd",),
        "layer_norm_bwd": ("_norm_bwd",), "rms_norm_bwd": ("_norm_bwd",),
        "gelu_fwd": ("_gelu",), "gelu_bwd": ("_gelu",), "swiglu_fwd": ("_swiglu",), "swiglu_bwd": ("_swiglu",),
        "rope": ("_rotary_embedding",),
    }[case.op]


def _config_of(case: Case, kernel: str) -> tuple | None:
    return case.dkdv_config or case.config if kernel == "_attn_bwd_dkdv" else case.config


# Measured with Triton 3.9, bf16, sm_90a (`python -m bench static`): configurations whose hot loop
# executes more multiply-adds than needed (two warpgroups, or warps, computing the same products).
_REPEATED_WORK = {
    "_attn_fwd": {(64, 64, 8), (64, 32, 8), (64, 128, 8)},  # 1.5x
    "_attn_bwd_dq": {(64, 64, 8), (64, 32, 8), (64, 128, 8)},  # 1.67x
    "_attn_bwd_dkdv": {(16, 64, 8), (32, 64, 8), (16, 32, 4), (32, 32, 8)},  # 1.5x
}
# dK/dV configurations (BLOCK_M, BLOCK_N, num_warps) that reach 255 registers and spill, per
# (head dim, causal, GQA), sm_90a, bf16 (fp16 assumed the same).
_DKDV_SPILLS_SM90 = {
    (64, True, True): {(64, 128, 8)},
    (128, False, False): {(64, 128, 8), (32, 64, 4)},
    (128, True, False): {(64, 128, 8)},
    (128, False, True): {(32, 128, 8), (64, 128, 8), (32, 64, 4), (16, 32, 4), (64, 32, 4)},
    (128, True, True): {(32, 128, 8), (64, 128, 8), (32, 64, 8), (32, 64, 4), (16, 32, 4), (64, 32, 4)},
}


def known_failure(case: Case, target: str, kernel: str, prop: str) -> str | None:
    """Why a goal is not met today (issue 11), or None where it must hold. From compiling bf16
    D 64/128 with Triton 3.9 (`python -m bench static`); fp16 is assumed to behave as bf16, and the
    fp32 and D 256 entries (full set only) follow the issue's report, not a run of ours."""
    config = _config_of(case, kernel)
    blocks = tuple(config[:3]) if config else None
    sm90_attention = target == "sm_90a" and kernel in MMA_KERNELS
    if case.dtype == "float32" and kernel in MMA_KERNELS:
        if prop == "no_spills":
            return "fp32 attention spills (issue 11 part 4)"
        if prop in ("hgmma", "not_serialized"):
            return "fp32 (IEEE) dots are not wgmma"
    if prop == "not_serialized" and sm90_attention and kernel in ("_attn_fwd", "_attn_bwd_dq"):
        return "C7515: wgmma serialized in fwd and dQ (non-wgmma instructions define the accumulator)"
    if prop == "hgmma" and sm90_attention and kernel == "_attn_bwd_dkdv" and blocks[1] < 64:
        return "dK/dV with a 32-row key tile: wgmma needs M >= 64, falls back to mma.sync"
    if prop == "work_once" and blocks in _REPEATED_WORK.get(kernel, ()):
        return "the hot loop's MMAs repeat work across warpgroups (1.5-1.67x the needed multiply-adds)"
    if prop == "no_spills" and kernel == "_attn_bwd_dkdv":
        if blocks in _DKDV_SPILLS_SM90.get((case.head_dim, case.causal, case.gqa), ()):
            return "dK/dV reaches 255 registers and spills"
    return None


def _params():
    cases = [(c, False) for c in CI_CASES] + ([(c, True) for c in _full_cases()] if FULL else [])
    params = []
    for case, full in cases:
        for target in ("sm_90a", "sm_80"):
            for kernel in _kernels(case):
                for prop in PROPERTIES:
                    # The goals for attention are on sm_90a; on sm_80 its kernels must compile
                    # and fit (their spills and repeated work are in the static table, not asserted).
                    if kernel in MMA_KERNELS and target != "sm_90a" and prop != "fits":
                        continue
                    if kernel not in MMA_KERNELS and prop in ("hgmma", "not_serialized", "work_once"):
                        continue
                    marks = [pytest.mark.compile_targets_full] if full else []
                    reason = known_failure(case, target, kernel, prop)
                    if reason:
                        marks.append(pytest.mark.xfail(strict=True, reason=reason))
                    params.append(pytest.param(case, target, kernel, prop, marks=marks,
                                               id=f"{target}-{case.id}-{kernel.lstrip('_')}-{prop}"))
    return params


@pytest.fixture(scope="session")
def facts_cache(tmp_path_factory):
    """A folder shared by the session's xdist workers (each compile runs once per session)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _facts(cache, case: Case, target: str) -> list[dict]:
    from filelock import FileLock

    path = cache / f"compile-{target}-{zlib.crc32(case.id.encode()):08x}.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            path.write_text(json.dumps(run_in_subprocess(case, target)))
        return json.loads(path.read_text())


@pytest.mark.parametrize("case, target, kernel, prop", _params())
def test_compiled(facts_cache, case, target, kernel, prop):
    rows = [r for r in _facts(facts_cache, case, target) if r["kernel"] == kernel]
    errors = [r["error"] for r in _facts(facts_cache, case, target) if "error" in r]
    assert not errors, f"{case.id} on {target}: {errors}"
    assert len(rows) == 1, f"{case.id} on {target}: expected one {kernel}, got {len(rows)}"
    row = rows[0]
    where = f"{kernel} {row['config']} on {target}"
    if prop == "fits":
        assert row["shared"] <= row["smem_limit"], f"{where}: {row['shared']} B shared memory > {row['smem_limit']}"
        assert row["blocks_per_sm"] >= 1, f"{where}: no block fits an SM ({row['registers']} registers)"
    elif prop == "no_spills":
        assert (row["spill_stores"], row["spill_loads"]) == (0, 0), \
            f"{where}: {row['spill_stores']} B spill stores, {row['spill_loads']} B loads at {row['registers']} registers"
    elif prop == "hgmma":
        assert row["mma"] == "HGMMA", f"{where}: MMA {row['mma']} ({row['mma_shapes']})"
    elif prop == "not_serialized":
        assert not row["wgmma_serialized"], f"{where}: ptxas C7515, wgmma serialized"
    elif prop == "work_once":
        ratio = row["hot_loop"]["mma_work_ratio"]
        assert ratio == 1.0, f"{where}: the hot loop's MMAs execute {ratio}x the needed multiply-adds"


def test_every_kernel_has_cases():
    """The sets above name every Triton kernel of the launchers (a new kernel needs a case here)."""
    named = {k for c in CI_CASES for k in _kernels(c)} | {"_norm_fwd", "_gelu"}
    assert set(ATTENTION_KERNELS) <= named
    assert {"_attn_bwd_preprocess", "_norm_fwd", "_norm_bwd", "_gelu", "_swiglu", "_rotary_embedding"} <= named
