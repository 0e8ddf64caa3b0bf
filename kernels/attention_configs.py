"""Launch configurations of the attention kernels (kernels/attention.py) and the facts that prune them.

The autotuner gets every configuration of either GPU family (its list is fixed when the kernel is
decorated); its ``early_config_prune`` (``pruner``) keeps the target family's shapes that fit in
shared memory and that ptxas does not spill at the launch's head dim, causality and GQA.

Every rule here was read from the compiled form, never from timing: ptxas -v and the SASS of each
configuration, as ``python -m bench static`` records them (``bench/results/static/static.json``
and ``static.md``; ``--all`` for every dtype and head dim 256). The numbers behind a rule
(registers, spill bytes, shared memory, instructions per multiply-add) live in those tables,
regenerated with the kernels, and not in the comments here.
"""

from __future__ import annotations

import triton

# The one configuration the interpreter runs (CPU; no autotuning, small blocks keep CI fast).
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

# Autotuning key: the length buckets (next powers of two of Nq, Nk), the padded head dim and
# causality. dK/dV adds GROUP (its loop runs over the query heads of a kv head).
TUNE_KEY = ["N_CTX_Q_KEY", "N_CTX_K_KEY", "HEAD_DIM", "CAUSAL", "WINDOW", "SOFTCAP", "VARLEN"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and GPU family: 90 = Hopper (sm_90) and
# newer, 80 = Ampere/Ada. Forward and dQ stream key tiles past a resident query tile; dK/dV streams
# query tiles past a resident key tile (its BLOCK_N is the resident side). Chosen from the compiled
# form at bf16, D 64/128:
# - Hopper: every dot a warpgroup MMA (HGMMA) doing each multiply-add once. Left out: 8-warp tiles
#   with 64 query rows in fwd/dQ (both warpgroups recompute S and dP), dK/dV key tiles below 64
#   rows (BLOCK_N = 32: wgmma needs M >= 64, so mma.sync instead) and 8-warp dK/dV tiles of 64 key
#   rows (M16/M32 N64 w8: repeated work across warpgroups). In: the large tiles that fit the shared
#   memory limit without spilling, such as fwd M128 N128 w8 s3 and dQ M128 N128 w8 s2, dK/dV
#   M64 N128 w8 (the fewest instructions per multiply-add; two stages leave registers and shared
#   memory to spare) and M16 N128 w8 (spill-free with GQA at D=128, where the larger tiles spill).
#   Warp specialization is not among them: tl.range(warp_specialize=True) left the forward loop
#   unchanged at 8 warps (the same SASS, no register reallocation) and failed in Triton 3.9's
#   NVGPUWarpSpecialization pass at 4 warps, on sm_90a.
# - A100: the configurations measured before the Hopper list; those that spill are in SPILLS.
SHAPES = {
    "fwd": {
        90: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2)],
        80: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3),
             (64, 64, 8, 3), (64, 128, 4, 3), (64, 32, 4, 2), (64, 32, 8, 2)],
    },
    "dq": {
        90: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
             (64, 16, 4, 3)],
        80: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 8, 3),
             (64, 64, 4, 3), (64, 32, 4, 4), (64, 128, 8, 2), (64, 32, 8, 2)],
    },
    "dkdv": {
        90: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 4)],
        80: [(32, 128, 8, 3), (64, 128, 8, 3), (16, 64, 8, 3), (32, 64, 8, 2),
             (32, 64, 4, 4), (16, 32, 4, 2), (32, 32, 8, 2), (64, 32, 4, 3)],
    },
}

# Where a configuration spills registers (ptxas -v on the compiled kernel; bf16, fp16 taken as the
# same): every configuration of SHAPES at head dims 64, 128 and 256, causal and not, MHA and GQA
# 4:1 (fwd and dQ do not depend on GQA), on Triton 3.6 and 3.9, compiled for sm_90a and sm_80
# through the launchers (bench/static.py's stand-in driver). An entry lists the cases where either
# Triton version spills: (family, kernel, (BLOCK_M, BLOCK_N, num_warps)) -> [(padded head dims,
# causal, GQA)], None = either, and a fourth element, the Triton versions, where only some spill.
# A configuration not listed spilled nowhere. How much each spills: static.json / static.md.
SPILLS = {
    # D=256: dK and dV's accumulators alone fill a thread's registers in every Hopper dK/dV tile, so
    # all of them spill and the pruning falls back to those that fit.
    (90, "dkdv", (64, 128, 8)): [((128,), None, True), ((128,), True, False), ((256,), None, None)],
    (90, "dkdv", (32, 128, 8)): [((128,), True, True), ((256,), None, None)],
    (90, "dkdv", (32, 64, 4)): [((128,), True, True), ((256,), None, None)],
    (90, "dkdv", (16, 128, 8)): [((256,), None, None)],
    (90, "dq", (128, 128, 8)): [((256,), None, None)],  # (s3 is over the shared memory limit anyway)
    (90, "dq", (128, 64, 8)): [((256,), None, None)],
    (90, "dq", (64, 64, 4)): [((256,), None, None)],
    (90, "dq", (64, 32, 4)): [((256,), None, None, "3.6")],
    (90, "dq", (128, 32, 8)): [((256,), None, None, "3.6")],
    (90, "fwd", (128, 128, 8)): [((256,), None, None)],
    (90, "fwd", (64, 128, 4)): [((256,), True, None)],
    (80, "dkdv", (64, 128, 8)): [((64, 128, 256), None, None)],
    (80, "dkdv", (32, 128, 8)): [((64,), None, True), ((128, 256), None, None)],
    (80, "dkdv", (32, 64, 4)): [((64,), None, True), ((64,), True, False), ((128, 256), None, None)],
    (80, "dkdv", (32, 64, 8)): [((64,), True, True), ((256,), None, True), ((256,), True, False)],
    (80, "dkdv", (64, 32, 4)): [((64,), True, True), ((128, 256), None, None)],
    (80, "dkdv", (16, 64, 8)): [((256,), True, True)],
    (80, "dkdv", (16, 32, 4)): [((256,), True, None)],
    (80, "dq", (128, 64, 8)): [((128, 256), None, None)],
    (80, "dq", (128, 32, 8)): [((256,), None, None)],
    (80, "dq", (64, 128, 8)): [((64, 256), None, None), ((128,), True, None)],
    (80, "dq", (64, 64, 4)): [((128, 256), None, None)],
    (80, "dq", (64, 64, 8)): [((256,), True, None)],
    (80, "dq", (64, 32, 4)): [((256,), True, None)],
    (80, "fwd", (128, 128, 8)): [((128, 256), None, None)],
    (80, "fwd", (128, 64, 8)): [((256,), None, None)],
    (80, "fwd", (128, 32, 8)): [((64,), True, None), ((256,), None, None)],
    (80, "fwd", (64, 128, 4)): [((64, 128, 256), None, None)],
    (80, "fwd", (64, 64, 4)): [((128,), True, None), ((256,), None, None)],
    (80, "fwd", (64, 32, 8)): [((64,), True, None), ((128,), False, None)],
    (80, "fwd", (64, 32, 4)): [((256,), None, None)],
}

# Configurations that spill only under a mask of real batches (the WINDOW, SOFTCAP and VARLEN
# constexprs: a window's bounds, the softcap's tanh factor, a document's bounds take registers),
# from the same compiles of bench/static.py's VARIANTS (bf16, head dims 64 and 128, causal and not,
# MHA and GQA on sm_90a, MHA on sm_80, Triton 3.9): (family, kernel, blocks) -> [(padded head dims,
# the variants that spill)]. D 64 spilled under none; D 256 was not compiled for the variants.
VARIANT_SPILLS = {
    (90, "dkdv", (64, 128, 8)): [((128,), {"window", "softcap", "varlen"})],
    (90, "dkdv", (32, 64, 4)): [((128,), {"window", "varlen"})],
    (90, "dq", (128, 128, 8)): [((128,), {"softcap"})],
    (80, "fwd", (128, 64, 8)): [((128,), {"window"})],
    (80, "dq", (64, 32, 4)): [((128,), {"varlen"})],
}
# The constexpr that turns each variant on.
VARIANT_FLAGS = {"window": "WINDOW", "softcap": "SOFTCAP", "varlen": "VARLEN"}

# fp32 inputs take IEEE dots, which compile to FFMA loops, not tensor-core MMAs: every product of a
# tile sits in registers, so fp32 gets one small tile per kernel and padded head dim (the entry of
# the smallest key at or above it), chosen from ptxas -v over D 64/128/256, causal and not, MHA and
# GQA, sm_90a and sm_80, Triton 3.6 and 3.9. Larger tiles spill heavily, and from D=128 on ptxas
# gives up allocating registers altogether (the old M64 N32 w4 did both). These stay within the
# spill budget the compile-target tests assert (tests/test_compile_targets.py, FP32_SPILL_BUDGET);
# at D=256 no fwd or dQ tile of these kernels avoids spilling, and M16 N16 w8 spills least.
FP32_SHAPES = {
    "fwd": {64: (16, 32, 4, 2), 256: (16, 16, 8, 2)},
    "dq": {64: (16, 32, 4, 2), 256: (16, 16, 8, 2)},
    "dkdv": {256: (32, 16, 8, 2)},
}

# Shared memory per block where the driver cannot say (the opt-in maximum, bytes).
SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# Tiles a kernel keeps resident for its whole loop (fwd: Q; dQ: Q and dO; dK/dV: K and V).
RESIDENT_TILES = {"fwd": 1, "dq": 2, "dkdv": 2}


def make_configs(shapes) -> list:
    """triton.Configs of (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


def config_shape(config) -> tuple:
    """A triton.Config back as (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def target_family() -> int:
    """90 when Triton compiles for Hopper or newer, 80 below: the active driver's target, which is
    the GPU's or, in bench/static.py, the stand-in's (so the compile-target tests see this choice).
    Without a CUDA driver (CPU tests) the Hopper list."""
    try:
        arch = triton.runtime.driver.active.get_current_target().arch
    except Exception:
        return 90
    return 90 if isinstance(arch, int) and arch >= 90 else 80


def smem_limit(family: int) -> int:
    """The current device's shared memory per block, or SMEM_LIMIT's where the driver cannot say."""
    try:
        driver = triton.runtime.driver.active
        return int(driver.utils.get_device_properties(driver.get_current_device())["max_shared_mem"])
    except Exception:
        return SMEM_LIMIT[family]


def smem_estimate(config, head_dim: int, elem: int, kernel: str) -> int:
    """Shared memory: the pipelined stream of two tiles plus the resident tiles, and 2 KiB for the
    rest. Close to what the compiled kernels request (the ``shared`` column of static.json)."""
    rows = config.kwargs
    streamed, resident = ("BLOCK_M", "BLOCK_N") if kernel == "dkdv" else ("BLOCK_N", "BLOCK_M")
    return (config.num_stages * 2 * rows[streamed] + RESIDENT_TILES[kernel] * rows[resident]) * head_dim * elem + 2048


def spills(family: int, kernel: str, config, head_dim: int, causal, gqa) -> bool:
    """Whether SPILLS lists ``config`` as spilling for this head dim, causality and GQA (None:
    unknown, which matches any entry) on the installed Triton version."""
    blocks = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps)
    triton_version = ".".join(triton.__version__.split(".")[:2])
    return any(head_dim in dims and (c is None or causal is None or c == causal) and (g is None or gqa is None or g == gqa)
               and (not versions or triton_version in versions)
               for dims, c, g, *versions in SPILLS.get((family, kernel, blocks), ()))


def variant_spills(family: int, kernel: str, config, head_dim: int, variants: set[str]) -> bool:
    """Whether VARIANT_SPILLS lists ``config`` as spilling under one of ``variants`` at this head dim."""
    blocks = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps)
    return any(head_dim in dims and variants & spilling
               for dims, spilling in VARIANT_SPILLS.get((family, kernel, blocks), ()))


def fp32_config(kernel: str, head_dim: int):
    """The one configuration of ``kernel`` for fp32 inputs at this padded head dim (FP32_SHAPES)."""
    shapes = FP32_SHAPES[kernel]
    return make_configs([shapes[min(d for d in shapes if d >= head_dim)]])[0]


def pruner(kernel: str):
    """The autotuner's early_config_prune for ``kernel``: the target family's list, within its
    shared memory, without the configurations SPILLS lists for this head dim, causality and GQA
    (unknown ones count as spilling) nor those VARIANT_SPILLS lists for the launch's masks. Never empty: if every configuration spills, those that fit are
    kept, and if none fits, the fp32 one (small enough for any head dim). fp32 (IEEE dots, a
    correctness path rather than a fast one) gets its one configuration of FP32_SHAPES."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head_dim = args["HEAD_DIM"]
        elem = args["Q"].element_size()
        if elem >= 4:
            return [fp32_config(kernel, head_dim)]
        family = target_family()
        wanted = set(SHAPES[kernel][family])
        limit = smem_limit(family)
        causal = args.get("CAUSAL")
        gqa = None if "GROUP" not in args else int(args["GROUP"]) > 1
        fitting = []
        for config in configs:
            if config_shape(config) not in wanted or smem_estimate(config, head_dim, elem, kernel) > limit:
                continue
            # Register budget: a 128-row fp32 accumulator of width 256 needs 8 warps.
            if head_dim >= 256 and config.kwargs["BLOCK_N" if kernel == "dkdv" else "BLOCK_M"] >= 128 and config.num_warps < 8:
                continue
            fitting.append(config)
        variants = {name for name, flag in VARIANT_FLAGS.items() if args.get(flag)}
        keep = [c for c in fitting if not spills(family, kernel, c, head_dim, causal, gqa)
                and not variant_spills(family, kernel, c, head_dim, variants)]
        return keep or fitting or [fp32_config(kernel, head_dim)]

    return prune


KERNELS = ("fwd", "dq", "dkdv")
# Per kernel: every configuration of either family, in the autotuner's fixed order (the pruner
# picks the target's), and the pruner.
CONFIGS = {k: make_configs(dict.fromkeys(SHAPES[k][90] + SHAPES[k][80])) for k in KERNELS}
PRUNERS = {k: pruner(k) for k in KERNELS}

__all__ = ["CONFIGS", "FP32_SHAPES", "INTERPRETER_CONFIG", "KERNELS", "PRUNERS", "RESIDENT_TILES", "SHAPES", "SMEM_LIMIT", "SPILLS", "TUNE_KEY", "VARIANT_FLAGS", "VARIANT_SPILLS",
           "config_shape", "fp32_config", "make_configs", "pruner", "smem_estimate", "smem_limit", "spills", "variant_spills",
           "target_family"]
