"""Launch configurations of the attention kernels (kernels/attention_kernels.py) and the facts that prune them.

The autotuner gets every configuration of every GPU family (its list is fixed when the kernel is
decorated); its ``early_config_prune`` (``pruner``) keeps the target family's shapes that fit in
shared memory (on Blackwell also in tensor memory) and that ptxas does not spill at the launch's
head dim, causality and GQA.

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

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and GPU family: 100 = Blackwell (sm_100a) and
# newer, 90 = Hopper (sm_90), 80 = Ampere/Ada. Forward and dQ stream key tiles past a resident query
# tile; dK/dV streams query tiles past a resident key tile (its BLOCK_N is the resident side). A fifth
# element is a register cap (maxnreg) and asks for the warp-specialized loop (make_configs). Chosen
# from the compiled form at bf16, D 64/128 (and 256 where HEAD_DIMS says): each list holds the tiles
# that do each multiply-add once, fit shared memory and do not spill at the head dims they are
# offered, among them those with the fewest hot-loop warp instructions per useful multiply-add. The
# figures behind each choice: docs/tuning.md and bench/results/static/static.md.
# - Hopper: every dot a warpgroup MMA (HGMMA). Left out: 8-warp tiles whose two warpgroups would
#   both compute the same S and dP (64 query rows in fwd/dQ, 64 key rows in dK/dV) and dK/dV key
#   tiles below 64 rows (wgmma needs M >= 64, so mma.sync instead). No warp specialization: on sm_90a
#   it leaves the forward loop unchanged at 8 warps and fails to compile at 4. dK/dV at D=256: a
#   warpgroup's wgmma covers 64 key rows, so a tile without repeated work keeps dK and dV in more
#   registers than a thread has and spills in its hot loop; the D=256 list is an mma.sync tile of 32
#   key rows (M64 N32 w8 s2, its 8 warps along the query rows and the head dim), which does not.
# - Ampere (mma.sync, HMMA): Triton lays out the warps of all the chained products of a hot loop like
#   the accumulator's (mma_sync_work), so a product narrower than the warps' span is computed by
#   several warps at once; the pruner drops those tiles per head dim, and the list leaves out the
#   tiles that repeat work at every head dim or spill at most of those where they fit.
# - Blackwell (tcgen05.mma: issued by one thread for the whole CTA, its accumulator in tensor
#   memory): within shared memory (smem_estimate's Blackwell terms) and the SM's tensor memory
#   (tmem_columns). The forward and dQ lists start with warp-specialized tiles at D 64 and 128, on
#   Triton 3.9 and later (warp_specialization_compiles): the fewest instructions per multiply-add
#   (at D=256 they exceed shared memory). Specialized, the loop's products are double-buffered, so
#   128-key dQ tiles need more tensor memory than an SM has. dK/dV accumulates dK and dV in tensor
#   memory, not registers, so 4 warps hold a 128-key tile. It is not warp-specialized: specialized,
#   its 128-key tiles exceed tensor memory or spill, and a 64-key tile issues no fewer instructions
#   than the unspecialized 128-key one. With GQA the 128-key dK/dV tiles spill at D=128 (M64 N64 w8
#   s2 does not); at D=256 the 128-key ones exceed tensor memory and every tcgen05 tile spills with
#   GQA, so D=256 also has Hopper's mma.sync M64 N32 w8 s2.
SHAPES = {
    "fwd": {
        90: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2)],
        80: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 64, 8, 2),
             (32, 64, 8, 2)],
        100: [(128, 128, 4, 2, 168), (128, 128, 4, 3, 168), (128, 64, 4, 3, 168),
              (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2)],
    },
    "dq": {
        90: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
             (64, 16, 4, 3)],
        80: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 4), (64, 64, 8, 3), (32, 64, 8, 2), (32, 32, 4, 3)],
        100: [(128, 64, 4, 2, 168), (128, 64, 4, 3, 168),
              (128, 128, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (64, 16, 4, 3),
              (128, 32, 8, 2), (64, 64, 4, 2)],
    },
    "dkdv": {
        90: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 4), (64, 32, 8, 2)],
        80: [(16, 128, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2)],
        100: [(64, 128, 4, 2), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 8, 2)],
    },
}

# Configurations offered only at some padded head dims: (family, kernel, shape) -> head dims.
HEAD_DIMS = {
    (90, "dkdv", (64, 32, 8, 2)): (256,),  # mma.sync: the one spill-free D=256 dK/dV tile (above)
    # Blackwell, D=256 only (above): dQ's two tiles beside the Hopper list's, dK/dV's MHA tile and
    # its mma.sync tile (the one without spills with GQA).
    (100, "dq", (128, 32, 8, 2)): (256,),
    (100, "dq", (64, 64, 4, 2)): (256,),
    (100, "dkdv", (32, 64, 4, 2)): (256,),
    (100, "dkdv", (64, 32, 8, 2)): (256,),
    # Blackwell's warp-specialized forward and dQ tiles, compiled at D 64 and 128 (at 256 they exceed
    # shared memory).
    (100, "fwd", (128, 128, 4, 2, 168)): (64, 128),
    (100, "fwd", (128, 128, 4, 3, 168)): (64, 128),
    (100, "fwd", (128, 64, 4, 3, 168)): (64, 128),
    (100, "dq", (128, 64, 4, 2, 168)): (64, 128),
    (100, "dq", (128, 64, 4, 3, 168)): (64, 128),
}

# Where a configuration spills registers (ptxas -v on the compiled kernel; bf16, fp16 taken as the
# same): every configuration of SHAPES at head dims 64, 128 and 256 where it fits the shared memory
# estimate (and, on sm_80, does each multiply-add once), causal and not, MHA and GQA 4:1 (fwd and dQ
# do not depend on GQA), on Triton 3.6 and 3.9, compiled for sm_90a and sm_80 through the launchers
# (bench/static/driver.py's stand-in driver). An entry lists the cases where either Triton version spills:
# (family, kernel, (BLOCK_M, BLOCK_N, num_warps)) -> [(padded head dims, causal, GQA)], None =
# either, and a fourth element, the Triton versions, where only some spill. A configuration not
# listed spilled nowhere. How much each spills: static.json / static.md.
SPILLS = {
    # D=256: dK and dV's accumulators alone fill a thread's registers in every Hopper wgmma dK/dV
    # tile, so all of them spill; the pruning keeps the mma.sync tile of HEAD_DIMS.
    (90, "dkdv", (64, 128, 8)): [((128,), None, True), ((128,), True, False, "3.6"), ((256,), None, None)],
    (90, "dkdv", (32, 128, 8)): [((128,), True, True), ((256,), None, None)],
    (90, "dkdv", (32, 64, 4)): [((128,), True, True), ((256,), None, None)],
    (90, "dkdv", (16, 128, 8)): [((256,), None, None), ((128,), True, True, "3.6")],
    # (s3 is over the shared memory limit anyway)
    (90, "dq", (128, 128, 8)): [((256,), None, None), ((128,), None, None, "3.6")],
    (90, "dq", (128, 64, 8)): [((256,), None, None)],
    (90, "dq", (64, 64, 4)): [((256,), None, None)],
    (90, "dq", (64, 32, 4)): [((256,), None, None, "3.6")],
    (90, "dq", (128, 32, 8)): [((256,), None, None, "3.6")],
    (90, "fwd", (128, 128, 8)): [((256,), None, None)],
    (90, "fwd", (64, 128, 4)): [((256,), True, None)],
    (80, "dkdv", (128, 32, 8)): [((128,), True, True)],
    (80, "dkdv", (64, 32, 8)): [((256,), True, True)],
    (80, "dq", (128, 64, 8)): [((128,), None, None)],
    (80, "dq", (32, 64, 8)): [((256,), False, None, "3.6")],
    (80, "fwd", (128, 128, 8)): [((64,), True, None, "3.6")],
    (80, "fwd", (64, 64, 4)): [((128,), True, None, "3.9")],
    (80, "fwd", (64, 32, 4)): [((256,), None, None)],
    (80, "fwd", (32, 64, 8)): [((128,), True, None, "3.6")],
    # Blackwell (sm_100a, Triton 3.9 only; every configuration of SHAPES[...][100] at the head dims
    # where HEAD_DIMS offers it and it fits shared and tensor memory). dK/dV spills with GQA (its
    # loop over the group's query heads): the 4-warp 128-key tiles from D=64, every 128-key tile at
    # D=128, M32 N64 w4 at D=256.
    (100, "dkdv", (64, 128, 4)): [((64, 128), None, True)],
    (100, "dkdv", (64, 128, 8)): [((128,), None, True)],
    (100, "dkdv", (32, 128, 4)): [((64,), True, True), ((128,), None, True)],
    (100, "dkdv", (32, 64, 4)): [((256,), None, True)],
    (100, "fwd", (64, 64, 4)): [((256,), False, None)],
    # Triton 3.6 on sm_100a (bench/results/static-triton3.6: its default compile).
    (100, "fwd", (128, 64, 8)): [((64,), True, None, "3.6")],
}

# Configurations that spill only under a mask of real batches (the WINDOW, SOFTCAP and VARLEN
# constexprs: a window's bounds, the softcap's tanh factor, a document's bounds take registers),
# from the same compiles of bench/static/cases.py's VARIANTS (bf16, head dims 64 and 128, causal and not,
# MHA and GQA on sm_90a, MHA on sm_80): (family, kernel, blocks) -> [(padded head dims, the variants
# that spill, GQA (True: only with it; None: either))], and a fourth element, the Triton versions,
# where only some spill. On Triton 3.9 D 64 spilled under none; Triton 3.6's entries are from
# bench/results/static-triton3.6 (its bundled ptxas 12.8 allocates the masked dK/dV loops worse).
# D 256 was not compiled for the variants.
VARIANT_SPILLS = {
    (90, "dkdv", (64, 128, 8)): [((128,), {"window", "softcap", "varlen"}, None),
                                 ((64,), {"window", "varlen"}, None, "3.6")],
    # With GQA only: dK/dV's loop over the group's heads (M32 N64 w4 at D=128 under a window or
    # documents, and M32/M16 N128 w8 on 3.6); MHA compiled spill-free on 3.6 and 3.9. M16
    # N128 w8 spills under documents only when causal too, which SPILLS' causal GQA entry covers.
    (90, "dkdv", (32, 64, 4)): [((128,), {"window", "varlen"}, True),
                                ((64,), {"window", "softcap", "varlen"}, None, "3.6")],
    (90, "dkdv", (32, 128, 8)): [((64,), {"varlen"}, None, "3.6"), ((128,), {"window", "varlen"}, True, "3.6"),
                                 ((128,), {"softcap"}, None, "3.6")],
    (90, "dkdv", (16, 128, 8)): [((128,), {"window"}, True, "3.6"), ((128,), {"softcap"}, None, "3.6")],
    (90, "dq", (128, 128, 8)): [((128,), {"softcap"}, None)],
    (80, "fwd", (128, 64, 8)): [((128,), {"window"}, None)],
    (80, "fwd", (64, 64, 4)): [((128,), {"softcap"}, None)],
    (80, "dq", (64, 32, 4)): [((128,), {"varlen"}, None)],
    (80, "dkdv", (128, 32, 8)): [((128,), {"softcap"}, None), ((128,), {"varlen"}, None, "3.6")],
    (80, "dkdv", (64, 32, 8)): [((64,), {"softcap"}, None, "3.6")],
    # Blackwell (sm_100a, Triton 3.9): the D=128 picks compiled under each mask, causal (dK/dV's
    # M64 N64 w8 with GQA, its launch), and every configuration the pruning offered at D 64 and 128,
    # MHA, causal and not (bench/results/static): the forward spilled under none.
    (100, "dkdv", (64, 128, 4)): [((64, 128), {"softcap"}, None)],
    (100, "dkdv", (32, 128, 4)): [((64,), {"window", "varlen"}, None)],
    (100, "dkdv", (64, 64, 8)): [((128,), {"window", "varlen"}, None)],
    (100, "dq", (128, 128, 8)): [((64, 128), {"softcap"}, None)],
    (100, "dq", (128, 64, 8)): [((128,), {"window", "softcap"}, None)],
    (100, "dq", (64, 64, 4)): [((128,), {"varlen"}, None)],
    (100, "fwd", (128, 32, 8)): [((64,), {"varlen"}, None, "3.6")],
    (100, "fwd", (64, 64, 4)): [((128,), {"window"}, None, "3.6")],
}
# The constexpr that turns each variant on.
VARIANT_FLAGS = {"window": "WINDOW", "softcap": "SOFTCAP", "varlen": "VARLEN"}

# fp32 inputs take IEEE dots, which compile to FFMA loops, not tensor-core MMAs: every product of a
# tile sits in registers, so fp32 gets one small tile per kernel and padded head dim (the entry of
# the smallest key at or above it), chosen from ptxas -v over D 64/128/256, causal and not, MHA and
# GQA, sm_90a and sm_80, Triton 3.6 and 3.9. Larger tiles spill heavily, and from D=128 on ptxas
# gives up allocating registers altogether. These stay within the spill budget the compile-target
# tests assert (tests/test_compile_targets.py, FP32_SPILL_BUDGET); at D=256 no fwd or dQ tile of
# these kernels avoids spilling, and M16 N16 w8 spills least.
FP32_SHAPES = {
    "fwd": {64: (16, 32, 4, 2), 256: (16, 16, 8, 2)},
    "dq": {64: (16, 32, 4, 2), 256: (16, 16, 8, 2)},
    "dkdv": {256: (32, 16, 8, 2)},
}

# Shared memory per block where the driver cannot say (the opt-in maximum, bytes; B200 as H100).
SMEM_LIMIT = {100: 227 * 1024, 90: 227 * 1024, 80: 163 * 1024}
# Blackwell's tensor memory: 512 columns (of 128 lanes x 32 bits) an SM. A kernel whose buffers need
# more compiles to a trap that Triton refuses to launch (OutOfResources).
TMEM_COLUMNS = 512
# Tiles a kernel keeps resident for its whole loop (fwd: Q; dQ: Q and dO; dK/dV: K and V).
RESIDENT_TILES = {"fwd": 1, "dq": 2, "dkdv": 2}


def make_configs(shapes) -> list:
    """triton.Configs of (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples, and of
    (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg) for a warp-specialized forward or dQ (WARP_SPECIALIZE
    under that register cap)."""
    configs = []
    for m, n, w, s, *cap in shapes:
        specialized = {"WARP_SPECIALIZE": True} if cap else {}
        configs.append(triton.Config({"BLOCK_M": m, "BLOCK_N": n, **specialized}, num_warps=w, num_stages=s,
                                     maxnreg=cap[0] if cap else None))
    return configs


def config_shape(config) -> tuple:
    """A triton.Config back as the tuple make_configs took."""
    shape = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages
    return shape + (config.maxnreg,) if config.kwargs.get("WARP_SPECIALIZE") else shape


def warp_specialization_compiles() -> bool:
    """Whether the installed Triton compiles the warp-specialized forward and dQ: 3.9 does; 3.6's
    warp-specialization pass fails on the forward (PartitionScheduling: "mma must be assigned a
    partition"), and 3.7 and 3.8 were not compiled."""
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


def target_family() -> int:
    """100 when Triton compiles for datacenter Blackwell (sm_100 up to 119: tcgen05, tensor memory),
    90 for Hopper (sm_90 up to 99), 80 for Ampere and Ada and for the GeForce and workstation
    Blackwell parts (sm_120 and up: mma.sync, as Ampere, with neither wgmma nor tensor memory): the
    active driver's target, which is the GPU's or, in bench/static/driver.py, the stand-in's (so the
    compile-target tests see this choice). Without a CUDA driver (CPU tests) the Hopper list."""
    try:
        arch = triton.runtime.driver.active.get_current_target().arch
    except Exception:
        return 90
    if not isinstance(arch, int) or arch >= 120:
        return 80
    return 100 if arch >= 100 else 90 if arch >= 90 else 80


def smem_limit(family: int) -> int:
    """The current device's shared memory per block, or SMEM_LIMIT's where the driver cannot say."""
    try:
        driver = triton.runtime.driver.active
        return int(driver.utils.get_device_properties(driver.get_current_device())["max_shared_mem"])
    except Exception:
        return SMEM_LIMIT[family]


def smem_estimate(config, head_dim: int, elem: int, kernel: str, family: int = 90) -> int:
    """Shared memory: the pipelined stream of two tiles plus the resident tiles, and 2 KiB for the
    rest. Close to what the compiled kernels request (the ``shared`` column of static.json) on sm_90a
    and sm_80. On Blackwell (family 100) the tcgen05 backward keeps more in shared memory: dQ up to
    one BLOCK_N x head-dim tile more, dK/dV up to two BLOCK_M x head-dim tiles more (the operands of
    its tensor-memory MMAs), which this adds: without them the estimate lets through tiles that no
    SM can hold. And 1 KiB for a warp-specialized kernel's barriers between partitions."""
    rows = config.kwargs
    streamed, resident = ("BLOCK_M", "BLOCK_N") if kernel == "dkdv" else ("BLOCK_N", "BLOCK_M")
    estimate = (config.num_stages * 2 * rows[streamed] + RESIDENT_TILES[kernel] * rows[resident]) * head_dim * elem + 2048
    if family >= 100:
        estimate += {"fwd": 0, "dq": rows["BLOCK_N"], "dkdv": 2 * rows["BLOCK_M"]}[kernel] * head_dim * elem
    if rows.get("WARP_SPECIALIZE"):  # the barriers between partitions
        estimate += 1024
    return estimate


def tmem_columns(kernel: str, config, head_dim: int) -> int:
    """The tensor-memory columns (of Blackwell's 512 an SM) the hot loop's fp32 accumulators take on
    sm_100a: one column per accumulator column, at least 32 each (TMEM's allocation granule); fwd S
    (BLOCK_N wide) and O (head dim), dQ S and dP (BLOCK_N) and dQ (head dim), dK/dV S^T and dP^T
    (BLOCK_M) and dK and dV (head dim). Their rows are the resident tile (tcgen05's M): at 64 rows
    an accumulator takes 64 of the 128 lanes (Triton allocates 64 rows for it), so two can share
    columns (half the count); below 64 rows Triton takes mma.sync, no tensor memory (0). A model,
    not Triton's allocator: it agrees with the sm_100a compiles on which fit the 512 columns and
    which Triton refuses (tests/test_compile_blackwell.py, TMEM_FACTS); the kernels also keep bf16
    operands (P, dS) in tensor memory, within what a model of at most 512 leaves. Warp-specialized,
    the products of an iteration (S, dP) are double-buffered, so that the MMA partition computes the
    next while the others read this one: counted twice."""
    rows = config.kwargs
    resident, streamed = (rows["BLOCK_N"], rows["BLOCK_M"]) if kernel == "dkdv" else (rows["BLOCK_M"], rows["BLOCK_N"])
    if resident < 64:
        return 0
    products, accumulators = {"fwd": ((streamed,), (head_dim,)), "dq": ((streamed, streamed), (head_dim,)),
                              "dkdv": ((streamed, streamed), (head_dim, head_dim))}[kernel]
    buffers = 2 if rows.get("WARP_SPECIALIZE") else 1
    columns = sum(max(32, width) for width in products) * buffers + sum(max(32, width) for width in accumulators)
    return (columns + 1) // 2 if resident == 64 else columns


def _on_installed_triton(versions) -> bool:
    """Whether an entry's Triton versions (none: every version) include the installed one."""
    return not versions or ".".join(triton.__version__.split(".")[:2]) in versions


def spills(family: int, kernel: str, config, head_dim: int, causal, gqa) -> bool:
    """Whether SPILLS lists ``config`` as spilling for this head dim, causality and GQA (None:
    unknown, which matches any entry) on the installed Triton version."""
    blocks = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps)
    return any(head_dim in dims and (c is None or causal is None or c == causal) and (g is None or gqa is None or g == gqa)
               and _on_installed_triton(versions)
               for dims, c, g, *versions in SPILLS.get((family, kernel, blocks), ()))


def variant_spills(family: int, kernel: str, config, head_dim: int, variants: set[str], gqa) -> bool:
    """Whether VARIANT_SPILLS lists ``config`` as spilling under one of ``variants`` at this head dim
    and GQA (None: unknown, which matches any entry) on the installed Triton version."""
    blocks = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps)
    return any(head_dim in dims and variants & spilling and (g is None or gqa is None or g == gqa)
               and _on_installed_triton(versions)
               for dims, spilling, g, *versions in VARIANT_SPILLS.get((family, kernel, blocks), ()))


def offered_at(family: int, kernel: str, config, head_dim: int) -> bool:
    """Whether HEAD_DIMS leaves ``config`` in ``family``'s list at this padded head dim."""
    dims = HEAD_DIMS.get((family, kernel, config_shape(config)))
    return dims is None or head_dim in dims


def mma_sync_work(kernel: str, config, head_dim: int) -> float:
    """The multiply-adds the hot loop's mma.sync (HMMA) instructions execute over those it needs
    (1.0: each once) at this padded head dim, as Triton lays out their warps: every chained product
    of the loop like the accumulator's (rows: the resident tile, BLOCK_M in fwd/dQ and BLOCK_N in
    dK/dV; columns: the head dim), all warps along its rows (16 rows a warp) where it has at least
    as many rows as columns, else all along its columns (8 columns a warp). Where a product is
    narrower than the warps' span, the warps beyond it compute the same multiply-adds again. This is
    bench/static/analysis.py's mma_work_ratio of every sm_80 attention kernel compiled while choosing SHAPES
    (docs/tuning.md), and tests/test_compile_targets.py holds it to the compiled ratio. Hopper's
    wgmma is not modelled."""
    m, n, warps = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps
    resident, streamed = (n, m) if kernel == "dkdv" else (m, n)
    if resident >= head_dim:
        return max(1.0, 16 * warps / resident)
    # the products' columns: fwd S (keys), PV (head dim); dQ S, dP (keys), dS K (head dim);
    # dK/dV S^T, dP^T (queries), P^T dO, dS^T Q (head dim)
    widths = {"fwd": (streamed, head_dim), "dq": (streamed, streamed, head_dim),
              "dkdv": (streamed, streamed, head_dim, head_dim)}[kernel]
    return sum(max(1.0, 8 * warps / width) for width in widths) / len(widths)


def fp32_config(kernel: str, head_dim: int):
    """The one configuration of ``kernel`` for fp32 inputs at this padded head dim (FP32_SHAPES)."""
    shapes = FP32_SHAPES[kernel]
    return make_configs([shapes[min(d for d in shapes if d >= head_dim)]])[0]


def pruner(kernel: str):
    """The autotuner's early_config_prune for ``kernel``: the target family's list (at the head dims
    HEAD_DIMS allows), within its shared memory, on sm_80 without the configurations whose warps
    repeat multiply-adds (mma_sync_work), and without those SPILLS lists for this head dim,
    causality and GQA (unknown ones count as spilling) nor those VARIANT_SPILLS lists for the
    launch's masks; on Blackwell (family 100) also without those whose accumulators need more
    tensor memory than an SM has (tmem_columns, TMEM_COLUMNS). Never empty: if every configuration
    spills, those that do each multiply-add once are kept, else those that fit, and if none fits,
    the fp32 one (small enough for any head dim). fp32 (IEEE dots, a correctness path rather than
    a fast one) gets its one configuration of FP32_SHAPES."""

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
            if config_shape(config) not in wanted or not offered_at(family, kernel, config, head_dim):
                continue
            if config.kwargs.get("WARP_SPECIALIZE") and not warp_specialization_compiles():
                continue
            if smem_estimate(config, head_dim, elem, kernel, family) > limit:
                continue
            # Blackwell: accumulators beyond the SM's tensor memory compile to a trap.
            if family >= 100 and tmem_columns(kernel, config, head_dim) > TMEM_COLUMNS:
                continue
            # Register budget: a 128-row fp32 accumulator of width 256 needs 8 warps.
            if head_dim >= 256 and config.kwargs["BLOCK_N" if kernel == "dkdv" else "BLOCK_M"] >= 128 and config.num_warps < 8:
                continue
            fitting.append(config)
        once = [c for c in fitting if family != 80 or mma_sync_work(kernel, c, head_dim) == 1.0]
        variants = {name for name, flag in VARIANT_FLAGS.items() if args.get(flag)}
        keep = [c for c in once if not spills(family, kernel, c, head_dim, causal, gqa)
                and not variant_spills(family, kernel, c, head_dim, variants, gqa)]
        return keep or once or fitting or [fp32_config(kernel, head_dim)]

    return prune


KERNELS = ("fwd", "dq", "dkdv")
# Per kernel: every configuration of every family (Hopper's, Ampere's, then Blackwell's new ones),
# in the autotuner's fixed order (the pruner picks the target's), and the pruner.
CONFIGS = {k: make_configs(dict.fromkeys(SHAPES[k][90] + SHAPES[k][80] + SHAPES[k][100])) for k in KERNELS}
PRUNERS = {k: pruner(k) for k in KERNELS}

__all__ = ["CONFIGS", "FP32_SHAPES", "HEAD_DIMS", "INTERPRETER_CONFIG", "KERNELS", "PRUNERS", "RESIDENT_TILES", "SHAPES", "SMEM_LIMIT", "SPILLS", "TMEM_COLUMNS", "TUNE_KEY", "VARIANT_FLAGS",
           "VARIANT_SPILLS", "config_shape", "fp32_config", "make_configs", "mma_sync_work", "offered_at", "pruner", "smem_estimate", "smem_limit",
           "spills", "tmem_columns", "variant_spills", "target_family", "warp_specialization_compiles"]
