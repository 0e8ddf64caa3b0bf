"""Compile-target tests: the project's Triton kernels compiled for H100 (sm_90a) and A100 (sm_80)
without a GPU, through the project's own launchers (bench/static/: a stand-in driver, meta tensors).

Each case compiles in a subprocess (this process runs Triton in interpreter mode) and its facts are
cached for the session, shared by xdist workers. Per compiled kernel, separate tests check:

- ``fits``: it compiled and its shared memory is within the target's per-block limit;
- ``no_spills``: ptxas reports no spill stores or loads; fp32 attention (FFMA dots, every product
  in registers) instead ``few_spills``: within FP32_SPILL_BUDGET, and never ptxas giving up
  register allocation (its sign: at most 32 registers and a stack above 1 KiB);
- ``hgmma``: on sm_90a, every attention dot is a Hopper warpgroup MMA (HGMMA), no mma.sync (HMMA);
- ``not_serialized``: on sm_90a, ptxas does not report advisory C7515 (wgmma serialized);
- ``work_once``: the hot loop's MMAs execute exactly the multiply-adds needed (no warp or warpgroup
  repeats another's);
- ``copy_engine``: the attention kernels stream their tiles by TMA on sm_90a (tensor descriptors)
  and without it on sm_80, which has none (pointer loads, cp.async).
- ``resident_warps``: the norm and activation kernels keep MIN_RESIDENT_WARPS warps an SM resident.

Floating-point fusion: one case per launch site compiled for sm_90a with Triton's fusion default
off (Triton 3.10's) is the same SASS as with it on: the attention and RoPE launches ask for fusion
(FFMAs included), the norm and activation launches for separate rounding.

The attention goals (no spills, HGMMA, no C7515, work once, TMA) hold on sm_90a, the target the
attention kernels are tuned for; on sm_80 the attention kernels are held to the same standard but for
the two goals of warpgroup MMAs (HGMMA, C7515): they fit, do not spill, do each multiply-add once and
use no TMA. Every other kernel is checked to fit and not spill on both.

Goals today's kernels do not meet are strict xfails with the reason (``known_failure``): the day
a kernel meets one, its test fails as XPASS and the entry must go. Spills and repeated work are
not among them: the autotuner's pruning keeps, per target, only configurations without them
(``picked_configs`` asks it under the stand-in driver), and those are asserted. HMMA on sm_90a is
one, at D=256 in dK/dV only: there the one tile without spills takes mma.sync (see
test_hopper_dkdv_at_head_dim_256_spill_free).

CI runs a small subset. ``FUSED_REMAT_COMPILE_ALL=1`` adds every
configuration the attention autotuner can pick, every dtype, head dims 64/128/256, causal and not,
MHA and GQA, and every norm/activation/RoPE variant, marked ``compile_targets_full`` (select with
``-m compile_targets_full``). The expectations for the full set outside bf16 D 64/128 (fp16, fp32,
D 256) were not all verified by a run: see known_failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path

import pytest

from bench.static import (ATTENTION_KERNELS, DEFAULT_OUT, VARIANTS, Case, config_text, markdown_document,
                          overview_rows, row_shape, run_in_subprocess, spill_free, write)
from bench.static import main as static_main

FULL = os.environ.get("FUSED_REMAT_COMPILE_ALL") == "1"
PROPERTIES = ("fits", "no_spills", "few_spills", "hgmma", "not_serialized", "work_once", "copy_engine", "resident_warps")
# The row-wise kernels stream memory: at least this many warps an SM in flight (one program of 16
# warps, or the persistent norm backward's 2 programs an SM of 8).
ROW_WISE_KERNELS = ("_norm_fwd", "_norm_bwd", "_gelu", "_swiglu", "_cross_entropy_rows")
MIN_RESIDENT_WARPS = 16
# fp32 attention's spill budget per thread by head dim (bytes): room above what its tiles
# (kernels/attention_configs.py, FP32_SHAPES) spill on Triton 3.6 and 3.9, more at D=256, where no
# fwd or dQ tile is spill-free (docs/tuning.md).
FP32_SPILL_BUDGET = {64: 64, 128: 64, 256: 512}
MMA_KERNELS = ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")

# The CI subset: the forward at a configuration both targets pick, the norms held in registers and
# streamed (backward past 8192 columns, forward past 16384), one activation, RoPE, the loss's
# softmax step at GPT-2's vocabulary and its targets' statistics, on sm_90a and sm_80.
CI_CASES = [
    Case("attention_fwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3)),
    Case("attention_fwd", "bfloat16", 128, causal=False, config=(128, 64, 8, 3)),
    Case("rms_norm_bwd", "bfloat16", width=4096),
    Case("layer_norm_bwd", "bfloat16", width=16384),
    Case("layer_norm_fwd", "bfloat16", width=32768),
    Case("swiglu_bwd", "bfloat16", width=4096),
    Case("rope", "bfloat16", 128),
    Case("cross_entropy", "bfloat16", width=50257),
    Case("target_statistics", "int64", width=50257),
]
# On sm_90a only (Hopper's own picks): the backward, the largest forward tile, dK/dV with GQA at
# D=128, where the larger dK/dV tiles spill, the dK/dV tile with the fewest instructions per
# multiply-add, fp32 (FFMA dots, the small tiles of FP32_SHAPES) and D=256 with causal GQA (dK/dV's
# mma.sync tile, HOPPER_D256_DKDV), and RoPE placing packed documents' tokens by their offsets.
CI_SM90_CASES = [
    Case("rope", "bfloat16", 128, variant="varlen"),
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(32, 128, 8, 3)),
    Case("attention_fwd", "bfloat16", 128, causal=True, config=(128, 128, 8, 3)),
    Case("attention_bwd", "bfloat16", 128, causal=True, gqa=True, config=(128, 32, 8, 3), dkdv_config=(16, 128, 8, 3)),
    Case("attention_bwd", "bfloat16", 128, config=(128, 64, 8, 3), dkdv_config=(64, 128, 8, 2)),
    Case("attention_fwd", "float32", 128, causal=True, config=(16, 16, 8, 2)),
    Case("attention_bwd", "float32", 128, gqa=True, config=(16, 16, 8, 2), dkdv_config=(32, 16, 8, 2)),
    Case("attention_bwd", "bfloat16", 256, causal=True, gqa=True, config=(64, 16, 4, 3), dkdv_config=(64, 32, 8, 2)),
]
# On sm_80 only (A100's own picks): the backward at D=64 (dK/dV's warps along the head dim), with GQA
# at D=128 (dQ's 8 warps on 64 query rows, along the head dim) and at D=256 (dK/dV's one tile without
# spills with causal GQA).
CI_SM80_CASES = [
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(128, 32, 8, 2)),
    Case("attention_bwd", "bfloat16", 128, causal=True, gqa=True, config=(64, 64, 8, 3), dkdv_config=(16, 128, 8, 2)),
    Case("attention_bwd", "bfloat16", 256, causal=True, gqa=True, config=(32, 32, 4, 3), dkdv_config=(64, 16, 8, 2)),
]
# The masks of real batches (bench/static/cases.py's VARIANTS), on sm_90a, each with the tile and head dim
# of a dense case above: its twin for the instruction comparison (test_variant_hot_loop_near_dense).
VARIANT_CASES = [
    Case("attention_fwd", "bfloat16", 128, causal=True, config=(128, 128, 8, 3), variant="window"),
    Case("attention_fwd", "bfloat16", 128, causal=True, config=(128, 128, 8, 3), variant="softcap"),
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(32, 128, 8, 3),
         variant="window"),
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(32, 128, 8, 3),
         variant="softcap"),
    Case("attention_fwd", "bfloat16", 128, causal=True, config=(128, 128, 8, 3), variant="varlen"),
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(32, 128, 8, 3),
         variant="varlen"),
    Case("attention_bwd", "bfloat16", 128, causal=True, gqa=True, config=(128, 32, 8, 3), dkdv_config=(16, 128, 8, 3),
         variant="varlen"),
]
CI_PAIRS = ([(c, t) for c in CI_CASES for t in ("sm_90a", "sm_80")]
            + [(c, "sm_90a") for c in CI_SM90_CASES + VARIANT_CASES] + [(c, "sm_80") for c in CI_SM80_CASES])


def picked_configs(kernel: str, target: str, dtype: str, head_dim: int, causal: bool, gqa: bool,
                   variant: str = "dense") -> list[tuple]:
    """The configurations the attention autotuner offers for ``kernel`` ("fwd", "dq", "dkdv") when
    compiling for ``target``: its prune function, run under bench/static/driver.py's stand-in driver for
    that target (so it sees the target's compute capability), with the launch's head dim, causality
    and GQA group, and the ``variant``'s mask constexpr. (BLOCK_M, BLOCK_N, num_warps, num_stages) each."""
    import torch

    from bench.static import ARCHS, compiling_for
    from fused_remat.kernels import attention_configs

    configs = attention_configs.CONFIGS[kernel]
    prune = attention_configs.PRUNERS[kernel]
    q = torch.empty(1, 1, 1, head_dim, device="meta", dtype=getattr(torch, dtype))
    with compiling_for(ARCHS[target]):
        flags = {flag: name == variant for name, flag in attention_configs.VARIANT_FLAGS.items()}
        kept = prune(configs, {"Q": q, "GROUP": 4 if gqa else 1}, HEAD_DIM=max(16, 1 << (head_dim - 1).bit_length()),
                     CAUSAL=causal, **flags)
    return [attention_configs.config_shape(c) for c in kept]


def _full_cases() -> list[tuple[Case, str]]:
    """(case, target): every configuration the autotuner can pick on that target."""
    pairs = []
    for target in ("sm_90a", "sm_80"):
        for dtype in ("bfloat16", "float16", "float32"):
            for dim in (64, 128, 256):
                for causal in (False, True):
                    fwd = picked_configs("fwd", target, dtype, dim, causal, False)
                    pairs += [(Case("attention_fwd", dtype, dim, causal, False, config=c), target) for c in fwd]
                    for gqa in (False, True):
                        dq, dkdv = (picked_configs(k, target, dtype, dim, causal, gqa) for k in ("dq", "dkdv"))
                        # every dQ and every dK/dV configuration, paired (the shorter list repeats)
                        for i in range(max(len(dq), len(dkdv))):
                            pairs.append((Case("attention_bwd", dtype, dim, causal, gqa,
                                               config=dq[i % len(dq)], dkdv_config=dkdv[i % len(dkdv)]), target))
            for op in ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd"):
                pairs += [(Case(op, dtype, width=w), target) for w in (768, 4096, 16384, 32768)]
            for op in ("gelu_fwd", "gelu_bwd", "swiglu_fwd", "swiglu_bwd"):
                pairs.append((Case(op, dtype, width=4096), target))
            pairs += [(Case("rope", dtype, d), target) for d in (64, 128, 256)]
    return [p for p in pairs if p not in CI_PAIRS]


def _kernels(case: Case) -> tuple[str, ...]:
    """The kernels a case's launcher compiles (known before compiling, for the parametrization)."""
    return {
        "attention_fwd": ("_attn_fwd",),
        "attention_bwd": ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"),
        "layer_norm_fwd": ("_norm_fwd",), "rms_norm_fwd": ("_norm_fwd",),
        "layer_norm_bwd": ("_norm_bwd", "_sum_partials"), "rms_norm_bwd": ("_norm_bwd", "_sum_partials"),
        "gelu_fwd": ("_gelu",), "gelu_bwd": ("_gelu",), "swiglu_fwd": ("_swiglu",), "swiglu_bwd": ("_swiglu",),
        "rope": ("_rope",), "cross_entropy": ("_cross_entropy_rows",), "target_statistics": ("_target_statistics",),
    }[case.op]


def known_failure(case: Case, target: str, kernel: str, prop: str) -> str | None:
    """Why a goal is not met today, or None where it must hold. Spills and repeated matrix work
    are not here: the attention autotuner's pruning leaves out, per target, every configuration that
    shows them (kernels/attention_configs.py: SHAPES, SPILLS, mma_sync_work), so every configuration
    it can pick is asserted to have none. HMMA is, for Hopper's dK/dV at D=256: every wgmma tile
    spills there (the dK and dV accumulators alone need 256 registers a thread), so the pick is an
    mma.sync tile. fp16 is assumed to behave as bf16, and the fp32 entries (full set only) follow
    earlier measurements, not a run of these tests."""
    sm90_attention = target == "sm_90a" and kernel in MMA_KERNELS
    if prop == "hgmma" and sm90_attention and kernel == "_attn_bwd_dkdv" and case.head_dim == 256:
        return ("D=256 dK/dV: mma.sync (32 key rows), the one tile without spills; every wgmma tile spills "
                "(dK and dV need 256 registers a thread) or repeats S^T and dP^T in both warpgroups")
    return None


def _params():
    cases = [(c, t, False) for c, t in CI_PAIRS]
    cases += [(c, t, True) for c, t in _full_cases()] if FULL else []
    params = []
    for case, target, full in cases:
        for kernel in _kernels(case):
            for prop in PROPERTIES:
                # sm_80 has no warpgroup MMA: its attention kernels are held to the rest of the
                # standard (fit, no spills, each multiply-add once, no TMA).
                if kernel in MMA_KERNELS and target != "sm_90a" and prop in ("hgmma", "not_serialized"):
                    continue
                if kernel not in MMA_KERNELS and prop in ("hgmma", "not_serialized", "work_once", "copy_engine"):
                    continue
                # fp32 takes IEEE dots, FFMA loops rather than MMAs: there is no MMA to check, and
                # a spill budget instead of none.
                fp32_attention = case.dtype == "float32" and kernel in MMA_KERNELS
                if fp32_attention and prop in ("hgmma", "not_serialized", "work_once", "no_spills"):
                    continue
                if prop == "few_spills" and not fp32_attention:
                    continue
                if prop == "resident_warps" and kernel not in ROW_WISE_KERNELS:
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
    elif prop == "few_spills":
        budget = FP32_SPILL_BUDGET[case.head_dim]
        assert row["spill_stores"] <= budget and row["spill_loads"] <= budget, \
            f"{where}: {row['spill_stores']}/{row['spill_loads']} B spilled, budget {budget} B"
        assert not (row["registers"] <= 32 and row["stack"] > 1024), \
            f"{where}: ptxas gave up allocating ({row['registers']} registers, {row['stack']} B stack)"
    elif prop == "resident_warps":
        warps = row["blocks_per_sm"] * row["config"]["num_warps"]
        assert warps >= MIN_RESIDENT_WARPS, \
            f"{where}: {row['blocks_per_sm']} program(s) an SM at {row['registers']} registers, {warps} warps"
    elif prop == "hgmma":
        assert row["mma"] == "HGMMA", f"{where}: MMA {row['mma']} ({row['mma_shapes']})"
    elif prop == "not_serialized":
        assert not row["wgmma_serialized"], f"{where}: ptxas C7515, wgmma serialized"
    elif prop == "work_once":
        ratio = row["hot_loop"]["mma_work_ratio"]
        assert ratio == 1.0, f"{where}: the hot loop's MMAs execute {ratio}x the needed multiply-adds"
    elif prop == "copy_engine":
        engines = row["copy"].split("+")
        if target == "sm_90a":
            assert "TMA" in engines, f"{where}: tiles copied by {row['copy']}, not TMA"
        else:
            assert "TMA" not in engines, f"{where}: TMA on {target}, which has none"


def test_every_kernel_has_cases():
    """The sets above name every Triton kernel of the launchers (a new kernel needs a case here)."""
    named = {k for c, _ in CI_PAIRS for k in _kernels(c)} | {"_norm_fwd", "_gelu"}
    assert set(ATTENTION_KERNELS) <= named
    assert {"_attn_bwd_preprocess", "_norm_fwd", "_norm_bwd", "_sum_partials", "_gelu", "_swiglu", "_rope",
            "_cross_entropy_rows", "_target_statistics"} <= named


# Floating-point fusion: Triton 3.10 compiles without it by default (3.9 warns where
# TRITON_DEFAULT_FP_FUSION is unset), so every launch says what it wants (kernels/launch.py): the
# attention, RoPE and cross-entropy launches ask for fusion (FP_FUSION), the norms and activations for
# separate rounding (SEPARATE_ROUNDING: outputs other kernels rebuild bitwise), and so do the loss's
# target statistics (one division, nothing to fuse). One case per launch site: each kernel of the
# launchers (swiglu shares gelu's launch).
FUSION_CASES = [
    Case("attention_fwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3)),
    Case("attention_bwd", "bfloat16", 64, causal=True, config=(128, 64, 8, 3), dkdv_config=(32, 128, 8, 3)),
    Case("rope", "bfloat16", 128),
    Case("cross_entropy", "bfloat16", width=50257),
]
SEPARATE_ROUNDING_CASES = [
    Case("layer_norm_fwd", "bfloat16", width=4096),
    Case("rms_norm_bwd", "bfloat16", width=4096),
    Case("swiglu_bwd", "bfloat16", width=4096),
    Case("target_statistics", "int64", width=50257),
]


def _compiled_with_fusion_defaulted_on_and_off(facts_cache, monkeypatch, case) -> list[tuple[dict, dict]]:
    """(row with the default on, row with it off) per kernel of ``case``, compiled for sm_90a: the
    session's compile (bench/static/cli.py pins the default on) and one with TRITON_DEFAULT_FP_FUSION=0."""
    default_on = {r["kernel"]: r for r in _facts(facts_cache, case, "sm_90a")}
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    default_off = run_in_subprocess(case, "sm_90a")
    errors = [r["error"] for r in [*default_on.values(), *default_off] if "error" in r]
    assert not errors, f"{case.id}: {errors}"
    assert sorted(r["kernel"] for r in default_off) == sorted(default_on) == sorted(_kernels(case))
    for row in default_off:
        on = default_on[row["kernel"]]
        assert (row["sass_instructions"], row["fp32_ops"]) == (on["sass_instructions"], on["fp32_ops"]), \
            f"{row['kernel']}: default off {row['sass_instructions']} instructions {row['fp32_ops']}, " \
            f"default on {on['sass_instructions']} {on['fp32_ops']}"
    return [(default_on[row["kernel"]], row) for row in default_off]


@pytest.mark.parametrize("case", FUSION_CASES, ids=[c.id for c in FUSION_CASES])
def test_fused_multiply_adds_with_fusion_defaulted_off(facts_cache, monkeypatch, case):
    """Compiled for sm_90a with Triton's fusion default off (TRITON_DEFAULT_FP_FUSION=0, 3.10's
    default), each kernel is still compiled with fusion and its SASS is the session's compile of the
    same case: the same instruction count and the same FFMA, FMUL and FADD counts, in the hot loop
    too, FFMAs among them. Without the launches' request, ptxas gets --fmad=false and every FFMA
    that was no explicit tl.fma splits into FMUL + FADD."""
    for on, off in _compiled_with_fusion_defaulted_on_and_off(facts_cache, monkeypatch, case):
        kernel = off["kernel"]
        assert on["fp_fusion"] and off["fp_fusion"], f"{kernel}: compiled without fusion with the default off"
        assert off["fp32_ops"]["FFMA"] > 0, f"{kernel}: no FFMA ({off['fp32_ops']})"
        if kernel in MMA_KERNELS:
            hot, hot_on = off["hot_loop"], on["hot_loop"]
            assert hot["fp32_ops"]["FFMA"] > 0, f"{kernel}: no FFMA in the hot loop ({hot['fp32_ops']})"
            assert (hot["instructions"], hot["fp32_ops"]) == (hot_on["instructions"], hot_on["fp32_ops"]), \
                f"{kernel} hot loop: default off {hot['instructions']} instructions {hot['fp32_ops']}, " \
                f"default on {hot_on['instructions']} {hot_on['fp32_ops']}"


@pytest.mark.parametrize("case", SEPARATE_ROUNDING_CASES, ids=[c.id for c in SEPARATE_ROUNDING_CASES])
def test_row_wise_kernels_round_every_operation_whatever_the_default(facts_cache, monkeypatch, case):
    """The norm and activation kernels compile without fusion under either default, to the same
    SASS: each multiply and add rounds on its own, so a backward that rebuilds their output gets the
    forward's bits (what the remat points' bitwise equality rests on, on a GPU). The loss's target
    statistics likewise (the scales it rounds are the host's)."""
    for on, off in _compiled_with_fusion_defaulted_on_and_off(facts_cache, monkeypatch, case):
        assert not on["fp_fusion"] and not off["fp_fusion"], f"{off['kernel']}: compiled with fusion"


HOPPER_SHAPES = [(dtype, dim, causal, gqa) for dtype in ("bfloat16", "float16") for dim in (64, 128)
                 for causal in (False, True) for gqa in (False, True)]


@pytest.mark.parametrize("dtype, dim, causal, gqa", HOPPER_SHAPES,
                         ids=[f"{t}-D{d}-{'causal' if c else 'full'}-{'gqa' if g else 'mha'}" for t, d, c, g in HOPPER_SHAPES])
def test_hopper_picks_follow_the_rules(dtype, dim, causal, gqa):
    """What the autotuner can pick on sm_90a (no compile: the rules the compiled tests confirm).
    fwd/dQ: no 8-warp tile with 64 query rows (both warpgroups would repeat S and dP); dK/dV: a key
    tile of at least 64 rows (wgmma's M) and, with 8 warps, of 128 (two warpgroups of 64 rows)."""
    for kernel in ("fwd", "dq", "dkdv"):
        picked = picked_configs(kernel, "sm_90a", dtype, dim, causal, gqa)
        assert picked, f"{kernel}: pruning left nothing"
        for m, n, warps, _ in picked:
            if kernel == "dkdv":
                assert n >= 64 * max(1, warps // 4), f"dkdv M{m} N{n} w{warps}: key tile below 64 rows per warpgroup"
            else:
                assert not (m < 128 and warps == 8), f"{kernel} M{m} N{n} w{warps}: 8 warps on {m} query rows"


AMPERE_SHAPES = [(dtype, dim, causal, gqa) for dtype in ("bfloat16", "float16") for dim in (16, 32, 64, 128, 256)
                 for causal in (False, True) for gqa in (False, True)]


def test_ampere_picks_do_each_multiply_add_once():
    """What the autotuner can pick on sm_80 (no compile), at every padded head dim, dtype,
    causality and GQA: configurations whose mma.sync warps each own their rows or columns of every
    product (mma_sync_work 1.0, held to the compiled ratio by test_mma_sync_work_is_the_compiled_ratio)
    and, at D 64/128/256, none that SPILLS lists: no fallback to a spilling or repeating tile."""
    from fused_remat.kernels.attention_configs import make_configs, mma_sync_work, spills

    for dtype, dim, causal, gqa in AMPERE_SHAPES:
        for kernel in ("fwd", "dq", "dkdv"):
            picked = picked_configs(kernel, "sm_80", dtype, dim, causal, gqa)
            where = f"{kernel} {dtype} D{dim} {'causal' if causal else 'full'} {'gqa' if gqa else 'mha'}"
            assert picked, f"{where}: pruning left nothing"
            for shape in picked:
                config = make_configs([shape])[0]
                work = mma_sync_work(kernel, config, dim)
                assert work == 1.0, f"{where}: M{shape[0]} N{shape[1]} w{shape[2]} executes {work:.3f}x the multiply-adds"
                if dim >= 64:
                    assert not spills(80, kernel, config, dim, causal, gqa), f"{where}: {shape} spills"


# sm_80 configurations the autotuner leaves out because their warps repeat work, compiled only to
# hold mma_sync_work to the compiler: the forward with 8 warps on 64 query rows at D=64 (warps along
# the rows: twice everything), dQ and dK/dV with 8 warps along a 128-wide head dim over 32 keys or
# queries (S and dP, S^T and dP^T twice).
REPEATING_SM80_CASES = [
    Case("attention_fwd", "bfloat16", 64, config=(64, 64, 8, 3)),
    Case("attention_bwd", "bfloat16", 128, config=(64, 32, 8, 2), dkdv_config=(32, 64, 8, 2)),
]


def test_mma_sync_work_is_the_compiled_ratio(facts_cache):
    """mma_sync_work (the pruner's model of Triton's mma.sync warp layout) is bench/static/analysis.py's
    mma_work_ratio of every sm_80 attention kernel compiled here: the CI picks (ratio 1, warps along
    rows and along columns) and configurations that repeat work (ratio 2, 1.667, 1.5)."""
    from fused_remat.kernels.attention_configs import make_configs, mma_sync_work

    names = {"_attn_fwd": "fwd", "_attn_bwd_dq": "dq", "_attn_bwd_dkdv": "dkdv"}
    cases = [c for c, t in CI_PAIRS if t == "sm_80" and c.op.startswith("attention") and c.dtype != "float32"]
    ratios = set()
    for case in cases + REPEATING_SM80_CASES:
        rows = [r for r in _facts(facts_cache, case, "sm_80") if r["kernel"] in names]
        assert rows and not any("error" in r for r in rows), f"{case.id}: {rows}"
        for row in rows:
            (config,) = make_configs([row_shape(row)])
            model = round(mma_sync_work(names[row["kernel"]], config, row["constexprs"]["HEAD_DIM"]), 3)
            compiled = row["hot_loop"]["mma_work_ratio"]
            assert row["mma"] == "HMMA" and compiled == model, \
                f"{case.id} {row['kernel']}: compiled {row['mma']} ratio {compiled}, mma_sync_work {model}"
            ratios.add(compiled)
    assert {1.0, 2.0, 1.667, 1.5} <= ratios, ratios


# Hopper's dK/dV at D=256: no wgmma tile keeps dK and dV in registers (kernels/attention_configs.py),
# so the list there is one mma.sync tile, M64 N32 w8 s2. The bound it is held to: the hot-loop warp
# instructions per useful multiply-add of the least-spilling wgmma tile of the list, M16 N128 w8 s3
# (16 query rows a step, and still spill loads and stores in every iteration), compiled beside it
# for the same launch.
HOPPER_D256_DKDV = (64, 32, 8, 2)
HOPPER_D256_CASE = Case("attention_bwd", "bfloat16", 256, causal=True, gqa=True, config=(64, 16, 4, 3),
                        dkdv_config=HOPPER_D256_DKDV)
HOPPER_D256_SPILLING = dataclasses.replace(HOPPER_D256_CASE, dkdv_config=(16, 128, 8, 3))


def test_hopper_dkdv_at_head_dim_256_spill_free(facts_cache):
    """sm_90a, D=256: the autotuner offers dK/dV the one spill-free tile (every dtype it tunes,
    causal and not, MHA and GQA), which does each multiply-add once and issues no more warp
    instructions per useful multiply-add in its hot loop than the least-spilling wgmma tile."""
    assert (HOPPER_D256_CASE, "sm_90a") in CI_PAIRS
    for dtype in ("bfloat16", "float16"):
        for causal in (False, True):
            for gqa in (False, True):
                assert picked_configs("dkdv", "sm_90a", dtype, 256, causal, gqa) == [HOPPER_D256_DKDV], (dtype, causal, gqa)

    def dkdv(case):
        rows = [r for r in _facts(facts_cache, case, "sm_90a") if r["kernel"] == "_attn_bwd_dkdv"]
        assert len(rows) == 1 and "error" not in rows[0], rows
        return rows[0]

    ours, spilling = dkdv(HOPPER_D256_CASE), dkdv(HOPPER_D256_SPILLING)
    assert (ours["spill_stores"], ours["spill_loads"]) == (0, 0), ours
    assert spilling["spill_stores"] > 0, f"M16 N128 w8 s3 no longer spills at D=256 ({spilling['registers']} registers)"
    assert ours["hot_loop"]["mma_work_ratio"] == 1.0
    cost, bound = (r["hot_loop"]["warp_instructions_per_million_macs"] for r in (ours, spilling))
    assert cost <= bound, f"M64 N32 w8 s2: {cost} warp instructions per million useful multiply-adds, " \
                          f"the spilling M16 N128 w8 s3 {bound}"


def test_picks_depend_on_the_target():
    """The pruning reads the target's compute capability: sm_80 keeps configurations of its own."""
    for kernel in ("fwd", "dq", "dkdv"):
        hopper, ampere = (picked_configs(kernel, t, "bfloat16", 64, False, False) for t in ("sm_90a", "sm_80"))
        assert hopper and ampere and set(hopper) != set(ampere), kernel


def test_ci_cases_are_picks():
    """The attention configurations CI compiles are ones the autotuner can pick on their target."""
    for case, target in CI_PAIRS:
        if not case.op.startswith("attention"):
            continue
        kernels = ("fwd",) if case.op == "attention_fwd" else ("dq", "dkdv")
        for kernel in kernels:
            config = case.dkdv_config if kernel == "dkdv" else case.config
            assert config in picked_configs(kernel, target, case.dtype, case.head_dim, case.causal, case.gqa,
                                            case.variant), \
                f"{case.id} on {target}: {kernel} {config} is not among the autotuner's picks"


# The instruction goal: each attention hot loop issues no more warp instructions per multiply-add
# than the Triton tutorial's, compiled the same way (bench/static/tutorial.py's yardsticks: the forward by
# pointer loads and through tensor descriptors, the backward's dK/dV and dQ loops), on sm_90a with
# the installed Triton, bf16, MHA, causal and not: the best configuration our autotuner can pick
# against the yardstick's best.
YARDSTICKS = {
    "_attn_fwd": (("tutorial_fwd", "tutorial_tma_fwd"), ("_tutorial_attn_fwd", "_tutorial_tma_attn_fwd")),
    "_attn_bwd_dq": (("tutorial_bwd",), ("_tutorial_attn_bwd_dq",)),
    "_attn_bwd_dkdv": (("tutorial_bwd",), ("_tutorial_attn_bwd_dkdv",)),
}
# dK/dV may issue up to 2% more: its TMA pipeline's barrier and phase bookkeeping costs a few
# instructions an iteration that the yardstick's cp.async loads do not (docs/tuning.md); the
# forward and dQ must be at or below.
SLACK = {"_attn_fwd": 1.0, "_attn_bwd_dq": 1.0, "_attn_bwd_dkdv": 1.02}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("kernel", list(YARDSTICKS))
def test_hot_loop_at_or_below_the_tutorial(facts_cache, kernel, dim, causal):
    def best(rows, names):
        rows = [r for r in rows if r["kernel"] in names]
        assert rows and not any("error" in r for r in rows), rows
        return min((r["hot_loop"]["warp_instructions_per_million_macs"], config_text(r["config"])) for r in rows)

    op = "attention_fwd" if kernel == "_attn_fwd" else "attention_bwd"
    ours = best(_facts(facts_cache, Case(op, "bfloat16", dim, causal), "sm_90a"), (kernel,))
    yard_ops, yard_kernels = YARDSTICKS[kernel]
    tutorial = best([r for yard in yard_ops for r in _facts(facts_cache, Case(yard, "bfloat16", dim, causal), "sm_90a")],
                    yard_kernels)
    assert ours[0] <= SLACK[kernel] * tutorial[0], \
        f"{kernel} D={dim} causal={causal}: {ours[0]} warp instructions per million multiply-adds ({ours[1]}) against the tutorial's {tutorial[0]} ({tutorial[1]})"


# Within 5% of the dense twin's warp instructions per multiply-add: a window or the documents of a
# packed batch only change which tiles a program visits, not the work of a visited tile.
VARIANT_SLACK = 1.05


def _variant_params():
    params = []
    for case in VARIANT_CASES:
        for kernel in _kernels(case):
            if kernel not in MMA_KERNELS:
                continue
            marks = []
            if case.variant == "softcap":
                marks.append(pytest.mark.xfail(strict=True, reason=(
                    "softcap is work of its own: a multiply, a tanh (one MUFU op) and the 1 - tanh^2 "
                    "factor per score, on top of the dense loop's few instructions per score "
                    "(measured +18% to +63% at these tiles, Triton 3.9: dQ at D 64 the most)")))
            if case.variant == "varlen" and case.gqa and kernel == "_attn_bwd_dkdv":
                marks.append(pytest.mark.xfail(strict=True, reason=(
                    "a document's bounds are loaded from cu_seqlens, so ptxas cannot prove them warp-uniform: "
                    "the TMA pipeline's counters of the GQA loop move from uniform to vector registers "
                    "(measured 1823 against 1663 at M16 N128, +10%; MHA tiles stay within 5%)")))
            params.append(pytest.param(case, kernel, marks=marks, id=f"{case.id}-{kernel.lstrip('_')}"))
    return params


@pytest.mark.parametrize("case, kernel", _variant_params())
def test_variant_hot_loop_near_dense(facts_cache, case, kernel):
    def per_mac(c):
        rows = [r for r in _facts(facts_cache, c, "sm_90a") if r["kernel"] == kernel]
        assert len(rows) == 1 and "error" not in rows[0], rows
        return rows[0]["hot_loop"]["warp_instructions_per_million_macs"]

    dense = dataclasses.replace(case, variant="dense")
    assert (dense, "sm_90a") in CI_PAIRS, f"{case.id}: its dense twin {dense.id} must be a case too"
    ours, twin = per_mac(case), per_mac(dense)
    assert ours <= VARIANT_SLACK * twin, \
        f"{case.id} {kernel}: {ours} warp instructions per million multiply-adds against the dense {twin}"


def _recording_writes(monkeypatch) -> list:
    """Every path Path.write_text writes from now on (the writes still happen)."""
    written, write_text = [], Path.write_text

    def record(self, *args, **kwargs):
        written.append(self)
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", record)
    return written


def test_static_md_is_rendered_from_static_json():
    """The committed table is what the committed facts render to: an attention overview, the masks
    beside the dense kernels, then every row."""
    payload = json.loads((DEFAULT_OUT / "static.json").read_text())
    text = (DEFAULT_OUT / "static.md").read_text()
    assert text == markdown_document(payload), "static.md is stale: python -m bench static --markdown-only"
    head, everything = text.split("\n## Every kernel\n")
    overview, masks = head.split("\n## The masks of real batches beside the dense kernels\n")
    assert overview.count("\n| sm_") == len(overview_rows(payload["rows"])) > 0
    masked = [r for r in payload["rows"] if r["kernel"] in ATTENTION_KERNELS and r["case"].endswith(
        tuple(f"-{variant}" for variant in VARIANTS if variant != "dense"))]
    assert masks.count("\n| sm_") == len(masked) > 0
    assert everything.count("\n| sm_") == len(payload["rows"])


def test_static_writes_its_folder_and_nothing_else(tmp_path, monkeypatch):
    """`python -m bench static` writes static.json and static.md (here through ``write`` with one
    committed row), and ``--markdown-only`` rewrites static.md from static.json; never the README."""
    row = json.loads((DEFAULT_OUT / "static.json").read_text())["rows"][0]
    written = _recording_writes(monkeypatch)
    write([row], tmp_path)
    assert sorted(written) == [tmp_path / "static.json", tmp_path / "static.md"]
    (tmp_path / "static.md").unlink()
    written.clear()
    assert static_main(["--markdown-only", "--out", str(tmp_path)]) == 0
    assert written == [tmp_path / "static.md"]
    payload = json.loads((tmp_path / "static.json").read_text())
    assert payload["rows"] == [row]
    assert (tmp_path / "static.md").read_text() == markdown_document(payload)


def test_merge_keeps_the_targets_a_run_did_not_compile_with_their_commits(tmp_path):
    """--merge: a run that compiled sm_100a alone replaces the sm_100a rows of static.json and keeps
    the other targets' rows, each target's commit recorded and named in static.md."""
    committed = json.loads((DEFAULT_OUT / "static.json").read_text())
    hopper = next(r for r in committed["rows"] if r["target"] == "sm_90a")
    ampere = next(r for r in committed["rows"] if r["target"] == "sm_80")
    # a static.json from before per-target records: one commit for the whole file
    earlier = {**{k: v for k, v in committed["environment"].items() if k != "compiled"}, "commit": "0000000"}
    (tmp_path / "static.json").write_text(json.dumps({"suite": "static", "environment": earlier,
                                                      "rows": [hopper, ampere, {**hopper, "target": "sm_100a"}]}))
    blackwell = {**hopper, "target": "sm_100a", "registers": 1}
    write([blackwell], tmp_path, json.loads((tmp_path / "static.json").read_text()))
    payload = json.loads((tmp_path / "static.json").read_text())
    assert payload["rows"] == [hopper, ampere, blackwell]
    compiled = payload["environment"]["compiled"]
    assert compiled["sm_90a"]["commit"] == compiled["sm_80"]["commit"] == "0000000"
    assert compiled["sm_100a"]["commit"] == payload["environment"]["commit"] != "0000000"
    assert "sm_90a at commit 0000000" in (tmp_path / "static.md").read_text()


def test_every_spilling_configuration_of_the_triton_36_tables_is_pruned_on_triton_36(monkeypatch):
    """bench/results/static-triton3.6 is the default compile on Triton 3.6 (the GPU machines'
    version), made with the pruning of its day: every attention configuration there that spills is
    one the pruning now drops on 3.6 (the 3.6 entries of SPILLS and VARIANT_SPILLS), so a 3.6
    autotuner never times it; on 3.9 those entries do not apply."""
    import triton

    from fused_remat.kernels.attention_configs import spills, variant_spills

    payload = json.loads((DEFAULT_OUT.parent / "static-triton3.6" / "static.json").read_text())
    assert payload["environment"]["triton"].startswith("3.6.")
    family = {"sm_90a": 90, "sm_80": 80, "sm_100a": 100}
    kernels = {"_attn_fwd": "fwd", "_attn_bwd_dq": "dq", "_attn_bwd_dkdv": "dkdv"}
    spilling = [r for r in payload["rows"] if r["kernel"] in kernels and (r["spill_stores"] or r["spill_loads"])]
    assert spilling, "no spilling row: the facts this test holds the pruning to are gone"
    def dropped(row) -> bool:
        _, _, dim, mask, heads, *variants = row["case"].split("-")
        blocks = {k: row["config"][k] for k in ("BLOCK_M", "BLOCK_N")}
        config = triton.Config(blocks, num_warps=row["config"]["num_warps"], num_stages=row["config"]["num_stages"])
        args = (family[row["target"]], kernels[row["kernel"]], config, int(dim.removeprefix("D")))
        return spills(*args, mask == "causal", heads == "gqa") or variant_spills(*args, set(variants), heads == "gqa")

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kept = [f"{r['target']} {r['kernel']} {r['case']} {config_text(r['config'])}" for r in spilling if not dropped(r)]
    assert not kept, f"Triton 3.6 keeps spilling configurations: {kept}"
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert not all(map(dropped, spilling)), "the 3.6 entries apply on 3.9 too"


def test_triton_36_picks_are_spill_free_wherever_its_table_has_a_spill_free_tile(monkeypatch):
    """On Triton 3.6, for each launch of bench/results/static-triton3.6 (target, kernel, head dim,
    causality, GQA, mask) with at least one spill-free configuration compiled, the pruning offers
    none of the spilling ones it compiled (e.g. sm_90a dK/dV at D=128 under a window: the tiles
    that spill only with GQA stay offered to MHA). Where every one spills (GQA dK/dV at D=128 under
    masks on sm_90a), the pruner falls back to the tiles that do their work once."""
    import triton

    payload = json.loads((DEFAULT_OUT.parent / "static-triton3.6" / "static.json").read_text())
    kernels = {"_attn_fwd": "fwd", "_attn_bwd_dq": "dq", "_attn_bwd_dkdv": "dkdv"}
    launches: dict = {}
    for row in payload["rows"]:
        if row["kernel"] in kernels and "error" not in row:
            launches.setdefault((row["target"], row["kernel"], row["case"]), []).append(row)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    checked = 0
    for (target, kernel, case_id), rows in launches.items():
        spilling = {row_shape(r) for r in rows if r["spill_stores"] or r["spill_loads"]}
        if not spilling or len(spilling) == len(rows):
            continue
        _, dtype, dim, mask, heads, *variant = case_id.split("-")
        offered = set(picked_configs(kernels[kernel], target, dtype, int(dim.removeprefix("D")), mask == "causal",
                                     heads == "gqa", variant[0] if variant else "dense"))
        assert not offered & spilling, f"{target} {kernel} {case_id}: offers spilling {sorted(offered & spilling)}"
        checked += 1
    assert checked, "no launch of the 3.6 table mixes spilling and spill-free tiles"


def test_every_attention_kernel_in_the_committed_tables_is_spill_free_and_does_its_work_once():
    """bench/results/static holds every configuration the pruning offers on each target (bf16, D 64
    and 128, causal and not, with the masks of real batches, and D=256 dense): none spills (a
    warp-specialized one but for the registers it keeps across setmaxnreg, outside its loops:
    bench.static.spill_free), each does every multiply-add once on the target's tensor-core MMA,
    but dK/dV at D=256 on sm_90a and sm_100a, which may take mma.sync (HEAD_DIMS: the tile of 32
    key rows, where no wider one keeps its accumulators out of local memory). A pruning fact that
    went missing shows here once the tables are regenerated."""
    payload = json.loads((DEFAULT_OUT / "static.json").read_text())
    mma = {"sm_90a": "HGMMA", "sm_80": "HMMA", "sm_100a": "UTCHMMA"}
    rows = [r for r in payload["rows"] if r["kernel"] in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")]
    assert {r["target"] for r in rows} == set(mma)
    assert {r["constexprs"]["HEAD_DIM"] for r in rows} == {64, 128, 256}
    for row in rows:
        where = f"{row['target']} {row['kernel']} {row['case']} {config_text(row['config'])}"
        assert "error" not in row, where
        assert spill_free(row), f"{where}: {row['spill_stores']}/{row['spill_loads']} B spilled"
        allowed = {mma[row["target"]]}
        if row["kernel"] == "_attn_bwd_dkdv" and row["constexprs"]["HEAD_DIM"] == 256:
            allowed.add("HMMA")
        assert row["mma"] in allowed and row["hot_loop"]["mma_work_ratio"] == 1.0, where
