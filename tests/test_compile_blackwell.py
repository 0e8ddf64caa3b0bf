"""Blackwell (sm_100a) as a compile target: bench/static/blackwell.py reads tcgen05 code, without a GPU.

On sm_100a Triton compiles tl.dot to tcgen05.mma: in the SASS UTCHMMA (kind::f16) and its kin
(UTCQMMA, UTCIMMA, UTCOMMA), with no shape in the opcode (the shape is in the instruction
descriptor, a uniform register a UMOV sets), issued by one thread for the whole CTA, its accumulator
in tensor memory (LDTM / STTM move it to and from registers; UTCBAR is tcgen05.commit). Its tutorial
attention warp-specializes the loop (tl.range(..., warp_specialize=True)): the warps of each
partition jump to their code from a dispatch (BRX) and take their registers with setmaxnreg
(USETMAXREG). A report that knew none of this read ``MMA: none`` and no hot loop for every kernel.

sm_100a is family 100 in kernels/attention_configs.py: lists of its own, chosen from sm_100a
compiles, a shared memory estimate with the tcgen05 backward's extra tiles, and a tensor-memory
check (tmem_columns: never above the SM's 512 columns, beyond which Triton compiles a trap).

Ten compiles (each in a subprocess, this process interprets): the autotuner's sm_100a picks for
the forward at D=128 (warp-specialized, causal and not, and the tile Triton before 3.9 gets), the
backward at D=128 (dQ and MHA dK/dV), dK/dV with causal GQA at D=128 and the backward at D=256,
each held to the goals (no spills, tcgen05 MMAs only, each multiply-add once, at most 512
tensor-memory columns, within the shared memory estimate, at or below the yardstick's hot loop);
the tutorial's forward and backward at D=128 and its warp-specialized forward, causal and not (the
yardsticks of warp instructions per useful multiply-add). The pruning for family 100 is checked
without compiling, and the decoders on SASS and PTX text as ptxas and Triton print them.
"""

from __future__ import annotations

import pytest

from bench.static import (ARCHS, MMA, Case, compiling_for, find_loops, find_partitions, idesc_shape, ptx_tcgen05,
                          row_shape, run_in_subprocess, sass_idesc, spill_free, ttgir_partitions)

# Family 100's warp-specialized forward tile at D=128 (M128 N128 w4 s2, register cap 168: the
# fewest warp instructions per useful multiply-add), causal and not.
FORWARD = Case("attention_fwd", "bfloat16", 128, causal=False, config=(128, 128, 4, 2, 168))
FORWARD_CAUSAL = Case("attention_fwd", "bfloat16", 128, causal=True, config=(128, 128, 4, 2, 168))
# The tutorial's Blackwell forward at the tutorial's register cap for D=128 (168), at its tile with
# the fewest warp instructions per useful multiply-add.
YARDSTICK = Case("tutorial_ws_fwd", "bfloat16", 128, causal=False, config=(128, 128, 4, 2))
YARDSTICK_CAUSAL = Case("tutorial_ws_fwd", "bfloat16", 128, causal=True, config=(128, 128, 4, 2))


@pytest.fixture(scope="module")
def compiled():
    """A compiled kernel's row: each case compiled for sm_100a once per module (in a subprocess)."""
    cache = {}

    def row_of(case: Case, kernel: str) -> dict:
        if case not in cache:
            cache[case] = run_in_subprocess(case, "sm_100a")
        rows = cache[case]
        assert not [r for r in rows if "error" in r], rows
        (row,) = [r for r in rows if r["kernel"] == kernel]
        return row

    return row_of


@pytest.fixture(scope="module")
def forward_row(compiled):
    return compiled(FORWARD, "_attn_fwd")


@pytest.fixture(scope="module")
def yardstick_row(compiled):
    return compiled(YARDSTICK, "_tutorial_ws_attn_fwd")


def _assert_tcgen05_hot_loop(row, head_dim: int):
    where = f"{row['kernel']} {row['config']} on sm_100a"
    assert row["mma_kind"] == "tcgen05", f"{where}: MMA {row['mma_kind']} ({row['mma']})"
    assert row["mma"] == "UTCHMMA", where
    assert row["tcgen05"]["kinds"] == ["kind::f16"] and row["tcgen05"]["cta_group"] == 1, row["tcgen05"]
    hot = row.get("hot_loop")
    assert hot and hot["instructions"] > 0, f"{where}: no hot loop"
    assert hot["mix"]["mma"] > 0 and hot["mix"]["tensor memory"] > 0, f"{where}: {hot['mix']}"
    # S = Q K^T and O += P V, each a 128-row tcgen05.mma of K=16 a step: every multiply-add once.
    assert hot["mma_work_ratio"] == 1.0, f"{where}: MMAs execute {hot['mma_work_ratio']}x the needed multiply-adds"
    assert hot["tcgen05_shapes"] and all(s.startswith("M128 ") and s.endswith(" K16") for s in hot["tcgen05_shapes"])
    assert f"N{head_dim}" in " ".join(hot["tcgen05_shapes"])  # P V: N = the head dim
    assert hot["warp_instructions_per_million_macs"] > 0


def test_forward_compiles_to_tcgen05(forward_row):
    """The forward's dots are tcgen05 MMAs, read with their shapes, in a hot loop found as on Hopper;
    warp-specialized as the tutorial's: a one-warp MMA partition, a load partition and two compute
    partitions (softmax; the accumulator's rescaling) under setmaxnreg, for each of its loops."""
    _assert_tcgen05_hot_loop(forward_row, 128)
    assert (forward_row["spill_stores"], forward_row["spill_loads"]) == (0, 0), forward_row["registers"]
    assert forward_row["shared"] <= forward_row["smem_limit"] and forward_row["blocks_per_sm"] >= 1
    assert "TMA" in forward_row["copy"].split("+")
    assert forward_row["config"]["maxnreg"] == 168 and forward_row["registers"] <= 168
    parts = forward_row["partitions"]
    assert {p["role"] for p in parts if p["loop_instructions"]} == {"compute", "mma", "load"}, parts
    assert all(p["warps"] == 1 for p in parts if p["role"] == "mma"), parts
    # P of P V is read from tensor memory (the ts form), not shared memory.
    assert forward_row["tcgen05"]["a_in_tensor_memory"] > 0


def test_masked_forward_spills_only_at_partition_entry(compiled):
    """Causal, the warp-specialized forward keeps two registers a thread across setmaxnreg in local
    memory (bench.static.PARTITION_ENTRY_SPILL), none in any partition's loop; the row rescaling
    in column halves (kernels/attention_kernels.py, _rescaled) is what keeps the rescaling partition's
    few registers from spilling the accumulator row."""
    row = compiled(FORWARD_CAUSAL, "_attn_fwd")
    assert "partitions" in row and spill_free(row), (row["spill_stores"], row["spill_loads"], row["hot_loop"]["mix"])


def test_yardstick_is_warp_specialized(yardstick_row):
    """The tutorial's Blackwell forward: tcgen05 MMAs issued by a one-warp MMA partition, loads by a
    load partition, softmax and corrections by the default and a compute partition, each with the
    registers setmaxnreg gives it; every partition's loop counts, each by its own warps."""
    _assert_tcgen05_hot_loop(yardstick_row, 128)
    parts = yardstick_row["partitions"]
    assert parts[0]["partition"] == "default" and parts[0]["warps"] == 4
    roles = {p["role"] for p in parts if p["loop_instructions"]}
    assert roles == {"compute", "mma", "load"}, parts
    (mma,) = [p for p in parts if p["role"] == "mma"]
    assert mma["warps"] == 1 and mma["registers"] == mma["requested_registers"], mma
    assert all(p["registers"] in yardstick_row["setmaxnreg"] for p in parts), (parts, yardstick_row["setmaxnreg"])
    assert yardstick_row["total_warps"] > yardstick_row["config"]["num_warps"]
    hot = yardstick_row["hot_loop"]
    weighted = sum(p["loop_instructions"] * p["warps"] for p in parts)
    assert hot["instructions"] == sum(p["loop_instructions"] for p in parts)
    assert hot["warp_instructions_per_million_macs"] == round(weighted * 1e6 / hot["useful_macs"])


# Family 100's own picks (kernels/attention_configs.py, SHAPES[...][100]; dQ and dK/dV compile
# together, one backward case each) and the tutorial's yardsticks at D=128 (bf16, MHA, not causal),
# each pinned at its tile with the fewest warp instructions per useful multiply-add on sm_100a.
BACKWARD_D128 = Case("attention_bwd", "bfloat16", 128, config=(128, 64, 4, 2, 168), dkdv_config=(64, 128, 4, 2))
# With GQA at D=128 every 128-key dK/dV tile spills: the one the pruning leaves, 8 warps on 64 keys.
BACKWARD_D128_GQA = Case("attention_bwd", "bfloat16", 128, causal=True, gqa=True, config=(128, 64, 8, 3),
                         dkdv_config=(64, 64, 8, 2))
# D=256: dQ's M64 N64 w4 s2 and dK/dV's tcgen05 tile without GQA (the 128-key tiles trap there).
BACKWARD_D256 = Case("attention_bwd", "bfloat16", 256, config=(64, 64, 4, 2), dkdv_config=(32, 64, 4, 2))
TUTORIAL_FORWARD = Case("tutorial_tma_fwd", "bfloat16", 128, config=(128, 128, 8, 3))
# The forward's tile without warp specialization (what Triton before 3.9 gets), against the
# tutorial's forward without it.
FORWARD_PLAIN = Case("attention_fwd", "bfloat16", 128, causal=False, config=(128, 128, 8, 3))
TUTORIAL_BACKWARD = Case("tutorial_bwd", "bfloat16", 128, config=(128, 32, 4, 5), dkdv_config=(32, 128, 4, 5))
NAMES = {"_attn_fwd": "fwd", "_attn_bwd_dq": "dq", "_attn_bwd_dkdv": "dkdv"}
# (case, kernel, the yardstick's case and kernel, the bound on ours / the yardstick's warp instructions
# per million useful multiply-adds; None: no yardstick at that head dim). The bounds, whose compiled
# figures are in docs/tuning.md: the warp-specialized forward may issue a few integer instructions
# more an iteration than the tutorial's (address arithmetic of runtime strides where the tutorial's
# tensors are contiguous), hence 1.005; dQ with causal GQA, held to the yardstick without a causal
# mask, which the causal yardstick itself exceeds, hence 1.05; dK/dV with causal GQA takes the
# 64-key tile, hence 1.75: the price of no spills (the 128-key tiles issue fewer instructions there
# but spill).
PICKS = [
    (FORWARD, "_attn_fwd", (YARDSTICK, "_tutorial_ws_attn_fwd"), 1.005),
    (FORWARD_CAUSAL, "_attn_fwd", (YARDSTICK_CAUSAL, "_tutorial_ws_attn_fwd"), 1.005),
    (FORWARD_PLAIN, "_attn_fwd", (TUTORIAL_FORWARD, "_tutorial_tma_attn_fwd"), 1.0),
    (BACKWARD_D128, "_attn_bwd_dq", (TUTORIAL_BACKWARD, "_tutorial_attn_bwd_dq"), 1.0),
    (BACKWARD_D128, "_attn_bwd_dkdv", (TUTORIAL_BACKWARD, "_tutorial_attn_bwd_dkdv"), 1.0),
    (BACKWARD_D128_GQA, "_attn_bwd_dq", (TUTORIAL_BACKWARD, "_tutorial_attn_bwd_dq"), 1.05),
    (BACKWARD_D128_GQA, "_attn_bwd_dkdv", (TUTORIAL_BACKWARD, "_tutorial_attn_bwd_dkdv"), 1.75),
    (BACKWARD_D256, "_attn_bwd_dq", None, None),
    (BACKWARD_D256, "_attn_bwd_dkdv", None, None),
]
PICK_IDS = [f"{case.id}-{kernel.lstrip('_')}" for case, kernel, _, _ in PICKS]


def _picks(kernel: str, head_dim: int, causal: bool, gqa: bool, dtype: str = "bfloat16",
           target: str = "sm_100a") -> list[tuple]:
    """What the autotuner's pruning offers ``kernel`` on ``target`` (bench/static/driver.py's stand-in driver)."""
    import torch

    from fused_remat.kernels import attention_configs as tuning

    q = torch.empty(1, 1, 1, head_dim, device="meta", dtype=getattr(torch, dtype))
    with compiling_for(ARCHS[target]):
        kept = tuning.PRUNERS[kernel](tuning.CONFIGS[kernel], {"Q": q, "GROUP": 4 if gqa else 1},
                                      HEAD_DIM=head_dim, CAUSAL=causal)
    return [tuning.config_shape(c) for c in kept]


@pytest.mark.parametrize("case, kernel, yardstick, bound", PICKS, ids=PICK_IDS)
def test_blackwell_pick_meets_the_goals(compiled, case, kernel, yardstick, bound):
    """A family-100 pick compiled for sm_100a: offered by the pruning for its launch, no spills,
    every dot a tcgen05 MMA (kind::f16), each multiply-add once, at most 512 tensor-memory columns
    (the model's count too), within the shared memory limit and the family-100 estimate."""
    from fused_remat.kernels.attention_configs import (TMEM_COLUMNS, make_configs, smem_estimate,
                                                       tmem_columns)

    row = compiled(case, kernel)
    where = f"{kernel} {row['config']} on sm_100a ({case.id})"
    name, shape = NAMES[kernel], row_shape(row)
    assert shape in _picks(name, case.head_dim, case.causal, case.gqa), f"{where}: not among the picks"
    assert spill_free(row), f"{where}: spills {row['spill_stores']}/{row['spill_loads']} B at {row['registers']} registers"
    assert row["mma_kind"] == "tcgen05" and row["mma"] == "UTCHMMA", f"{where}: MMA {row['mma_kind']} ({row['mma']})"
    assert row["tcgen05"]["kinds"] == ["kind::f16"], row["tcgen05"]
    hot = row["hot_loop"]
    assert hot["mma_work_ratio"] == 1.0, f"{where}: MMAs execute {hot['mma_work_ratio']}x the needed multiply-adds"
    assert hot["mix"]["mma"] > 0 and hot["warp_instructions_per_million_macs"] > 0, hot
    config = make_configs([shape])[0]
    assert 0 < row["tensor_memory_columns"] <= TMEM_COLUMNS, f"{where}: {row['tensor_memory_columns']} columns"
    assert tmem_columns(name, config, case.head_dim) <= TMEM_COLUMNS
    assert row["shared"] <= row["smem_limit"] and row["blocks_per_sm"] >= 1, f"{where}: {row['shared']} B"
    assert row["shared"] <= smem_estimate(config, case.head_dim, 2, name, 100), \
        f"{where}: {row['shared']} B shared memory above the family-100 estimate"


@pytest.mark.parametrize("case, kernel, yardstick, bound",
                         [p for p in PICKS if p[2]], ids=[i for i, p in zip(PICK_IDS, PICKS) if p[2]])
def test_blackwell_pick_against_the_tutorial(compiled, case, kernel, yardstick, bound):
    """Warp instructions per million useful multiply-adds of the pick's hot loop, at most ``bound``
    times the tutorial's at D=128 (its fewest on sm_100a without warp specialization)."""
    ours = compiled(case, kernel)["hot_loop"]["warp_instructions_per_million_macs"]
    theirs = compiled(*yardstick)["hot_loop"]["warp_instructions_per_million_macs"]
    assert ours <= bound * theirs, f"{case.id} {kernel}: {ours} against the tutorial's {theirs} (bound {bound}x)"


@pytest.mark.parametrize("version, offered", [("3.9.0", True), ("3.10.1", True), ("3.6.0", False)])
def test_warp_specialized_forward_offered_where_triton_compiles_it(version, offered, monkeypatch):
    """sm_100a's forward list starts with warp-specialized tiles at D 64 and 128, on Triton 3.9 and
    later; Triton 3.6's warp-specialization pass fails on the forward, so there it gets the rest of
    the list. Never at D=256 (shared memory) nor on Hopper."""
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    for dim in (64, 128, 256):
        for causal in (False, True):
            specialized = [shape for shape in _picks("fwd", dim, causal, False) if len(shape) == 5]
            assert bool(specialized) == (offered and dim < 256), (version, dim, causal, specialized)
            assert _picks("fwd", dim, causal, False)  # never empty
        assert all(len(shape) == 4 for shape in _picks("fwd", dim, True, False, target="sm_90a")), "on Hopper"


def test_target_family_per_arch():
    """sm_100a is family 100, sm_90a 90, sm_80 80 (the stand-in driver's target, as a GPU's)."""
    from fused_remat.kernels.attention_configs import target_family

    for target, family in (("sm_100a", 100), ("sm_90a", 90), ("sm_80", 80)):
        with compiling_for(ARCHS[target]):
            assert target_family() == family, target


@pytest.mark.parametrize("arch, family", [(100, 100), (103, 100), (110, 100), (120, 80), (121, 80), (90, 90),
                                          (89, 80), (86, 80), (80, 80)])
def test_geforce_blackwell_takes_the_mma_sync_lists(arch, family, monkeypatch):
    """sm_120 (RTX 50 series, RTX PRO Blackwell) has neither tcgen05 nor wgmma: Triton compiles its
    dots to mma.sync as on Ampere, so it takes family 80's lists, not the tensor-memory ones."""
    from types import SimpleNamespace

    from fused_remat.kernels import attention_configs as tuning

    target = SimpleNamespace(get_current_target=lambda: SimpleNamespace(arch=arch))
    monkeypatch.setattr(tuning, "triton", SimpleNamespace(runtime=SimpleNamespace(driver=SimpleNamespace(active=target))))
    assert tuning.target_family() == family


BLACKWELL_LAUNCHES = [(dtype, dim, causal, gqa) for dtype in ("bfloat16", "float16") for dim in (64, 128, 256)
                      for causal in (False, True) for gqa in (False, True)]


def test_blackwell_picks_fit_and_do_not_spill():
    """Every sm_100a pick (no compile), every dtype the MMAs take, D 64/128/256, causal and not, MHA
    and GQA: within shared memory by the family-100 estimate and within tensor memory, none that
    SPILLS lists, never a dK/dV tile of 128 keys at D=256 (M16/M32 N128 w8 compiled to a trap,
    beyond the 512 columns), and with GQA only the tiles without spills: M64 N64 w8 s2 at D=128 and
    the mma.sync M64 N32 w8 s2 at D=256."""
    from fused_remat.kernels.attention_configs import (SMEM_LIMIT, TMEM_COLUMNS, make_configs, smem_estimate,
                                                       spills, tmem_columns)

    for dtype, dim, causal, gqa in BLACKWELL_LAUNCHES:
        for kernel in ("fwd", "dq", "dkdv"):
            picked = _picks(kernel, dim, causal, gqa, dtype)
            where = f"{kernel} {dtype} D{dim} {'causal' if causal else 'full'} {'gqa' if gqa else 'mha'}"
            assert picked, f"{where}: pruning left nothing"
            for shape in picked:
                config = make_configs([shape])[0]
                assert smem_estimate(config, dim, 2, kernel, 100) <= SMEM_LIMIT[100], (where, shape)
                assert tmem_columns(kernel, config, dim) <= TMEM_COLUMNS, (where, shape)
                assert not spills(100, kernel, config, dim, causal, gqa), (where, shape)
            if kernel == "dkdv" and dim == 256:
                assert not [s for s in picked if s[1] == 128], (where, picked)
            if kernel == "dkdv" and gqa and dim >= 128:
                assert picked == [(64, 64, 8, 2) if dim == 128 else (64, 32, 8, 2)], (where, picked)


def test_blackwell_tensor_memory_check_drops_traps(monkeypatch):
    """The pruner's tensor-memory check alone keeps the trapping dK/dV tiles out: offered them
    (SHAPES[...][100] with M16 N128 w8 s2/s3 and M32 N128 w8 s2, within the shared memory
    estimate at D=256), family 100 drops them at D=256 and keeps them at D=128."""
    import torch

    from fused_remat.kernels import attention_configs as tuning

    traps = [(16, 128, 8, 2), (16, 128, 8, 3), (32, 128, 8, 2)]
    monkeypatch.setitem(tuning.SHAPES["dkdv"], 100, traps)
    monkeypatch.setattr(tuning, "SPILLS", {})
    monkeypatch.setattr(tuning, "target_family", lambda: 100)
    monkeypatch.setattr(tuning, "smem_limit", lambda family: tuning.SMEM_LIMIT[family])
    configs = tuning.make_configs(traps)
    q = torch.empty(0, dtype=torch.bfloat16)
    for shape in traps:
        config = tuning.make_configs([shape])[0]
        assert tuning.smem_estimate(config, 256, 2, "dkdv", 100) <= tuning.SMEM_LIMIT[100], shape
        assert tuning.tmem_columns("dkdv", config, 256) > tuning.TMEM_COLUMNS, shape
    prune = tuning.pruner("dkdv")
    kept = prune(configs, {"Q": q, "GROUP": 1}, HEAD_DIM=128, CAUSAL=False)
    assert [tuning.config_shape(c) for c in kept] == traps
    kept = prune(configs, {"Q": q, "GROUP": 1}, HEAD_DIM=256, CAUSAL=False)
    assert [tuning.config_shape(c) for c in kept] == [tuning.FP32_SHAPES["dkdv"][256]]  # the fallback, no trap


# Compiled for sm_100a (Triton 3.9, bf16): whether Triton allocated the tensor memory (at most 512
# columns) or refused (OutOfResources, the kernel compiled to a trap), against tmem_columns' count.
TMEM_FACTS = [
    ("dkdv", (16, 128, 8, 2), 256, False),  # a trap: more than 512 columns
    ("dkdv", (32, 128, 8, 2), 256, False),
    ("dkdv", (16, 128, 8, 3), 256, False),
    ("dkdv", (32, 64, 4, 2), 256, True),
    ("dkdv", (16, 64, 8, 3), 256, True),
    ("dkdv", (64, 128, 4, 2), 128, True),
    ("dkdv", (64, 64, 8, 2), 128, True),
    ("dq", (128, 32, 8, 3), 256, True),
    ("dq", (64, 64, 4, 2), 256, True),
    ("fwd", (128, 128, 8, 3), 128, True),
    ("fwd", (128, 32, 8, 2), 256, True),
    ("fwd", (128, 128, 4, 2, 168), 128, True),  # warp-specialized: S double-buffered
    ("dq", (128, 64, 4, 2, 168), 128, True),  # double-buffered, within 512
    ("dq", (128, 128, 4, 2, 168), 128, False),  # double-buffered, beyond 512
]


def test_tmem_columns_model_matches_the_compiles():
    """tmem_columns is at most 512 exactly where Triton allocated the tensor memory."""
    from fused_remat.kernels.attention_configs import TMEM_COLUMNS, make_configs, tmem_columns

    for kernel, shape, dim, allocated in TMEM_FACTS:
        columns = tmem_columns(kernel, make_configs([shape])[0], dim)
        assert (columns <= TMEM_COLUMNS) == allocated, (kernel, shape, dim, columns)


def test_blackwell_smem_estimate():
    """dQ M128 N32 w8 s3 at D=256 compiled for sm_100a to more shared memory than an SM has (the
    bytes asserted below; no block fits): the Hopper estimate lets it through, the family-100 one
    does not. The forward and Hopper's estimates are as before."""
    from fused_remat.kernels.attention_configs import SMEM_LIMIT, make_configs, smem_estimate

    config = make_configs([(128, 32, 8, 3)])[0]
    assert smem_estimate(config, 256, 2, "dq", 90) <= SMEM_LIMIT[90] < 245872 <= smem_estimate(config, 256, 2, "dq", 100)
    fwd = make_configs([(128, 128, 8, 3)])[0]
    assert smem_estimate(fwd, 128, 2, "fwd", 100) == smem_estimate(fwd, 128, 2, "fwd") == 231424


# Decoders on text as ptxas 13 / Triton 3.9 print it (no compile).

SASS = [
    (0x00, "UMOV UR49, 0x8200490"),
    (0x10, ".L_x_7:"),
    (0x10, "UTCHMMA gdesc[UR16], gdesc[UR24], tmem[UR12], tmem[UR48], idesc[UR49], !UPT"),
    (0x20, "UMOV UR17, 0x8210490"),
    (0x30, "UTCHMMA tmem[UR14], gdesc[UR24], tmem[UR10], tmem[UR16], idesc[UR17], UPT"),
    (0x40, "UTCBAR [UR29], URZ"),
    (0x50, "LDTM.x64 R4, tmem[UR8]"),
    (0x60, "@P0 BRA `(.L_x_7)"),
    (0x70, "EXIT"),
]


def test_sass_tcgen05_decoding():
    assert MMA.search(SASS[2][1]).group(1) == "UTCHMMA"
    assert not MMA.search("UTCBAR [UR29], URZ") and not MMA.search("UTCATOMSWS.AND URZ, UR4")
    assert MMA.search("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT").groups() == ("HGMMA", "64x128x16.F32.BF16")
    assert find_loops(SASS) == [(1, 7)]
    # 0x8200490: f32 accumulator, bf16 A and B, N = 16 * 8, M = 8 * 16; bit 16 set: B transposed.
    assert sass_idesc(SASS, 2, (1, 7)) == 0x8200490
    assert idesc_shape(0x8200490, "f16") == (128, 128, 16)
    assert idesc_shape(sass_idesc(SASS, 4, (1, 7)), "f16") == (128, 128, 16)
    assert idesc_shape(0x8100490, "f16") == (128, 64, 16)
    assert idesc_shape(0x4100490, "f16") == (64, 64, 16)
    assert idesc_shape(0x8200910, "f16") == (128, 128, 8)  # A of format 2: tf32, K = 8
    # An idesc register some other instruction wrote: unknown, not guessed.
    assert sass_idesc([(0, "R2UR UR49, R3"), *SASS[1:]], 2, (1, 7)) is None


def test_ptx_tcgen05_decoding():
    ptx = """
        mov.b32 %r987, 136316048;
        @%p157 tcgen05.mma.cta_group::1.kind::f16 [ %r1714 + 0 ], %rd280, %rd281, %r987, %p156;
        mov.b32 %r1700, 136381584;
        @%p281 tcgen05.mma.cta_group::1.kind::f16 [ %r2655 + 0 ], [ %r1699 + 16 ], %rd361, %r1700, %p280;
    """
    assert ptx_tcgen05(ptx) == [
        {"kind": "f16", "cta_group": 1, "shape": (128, 128, 16), "a_in_tmem": False},
        {"kind": "f16", "cta_group": 1, "shape": (128, 128, 16), "a_in_tmem": True},
    ]


def test_partitions_from_dispatch():
    """The SASS of a warp-specialized kernel: the default partition's code up to its EXIT, then the
    dispatch (BRX) to each partition's code, matched in order to the TTGIR's declared partitions."""
    ttgir = """module attributes {"ttg.num-warps" = 4 : i32} {
      %0 = ttg.warp_specialize(%a) attributes {requestedRegisters = array<i32: 24, 24>}
      default {
      }
      partition0(%x: i32 loc("x")) num_warps(1) {
        ttng.tc_gen5_mma %a
        ttg.warp_return
      }
      partition1(%x: i32 loc("x")) num_warps(2) {
        ttng.async_tma_copy_global_to_local %b
        ttg.warp_return
      }
    }"""
    declared = ttgir_partitions(ttgir)
    assert [(d["partition"], d["role"], d["warps"], d["requested_registers"]) for d in declared] == [
        (0, "mma", 1, 24), (1, "load", 2, 24)]
    sass = [
        (0x00, "@!P0 BRA `(.L_x_5)"),
        (0x10, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x100"),
        (0x20, ".L_x_1:"), (0x20, "MUFU.EX2 R1, R2"), (0x30, "LDTM.x32 R4, tmem[UR5]"), (0x40, "@P1 BRA `(.L_x_1)"),
        (0x50, "EXIT"),
        (0x60, ".L_x_5:"), (0x60, "USETMAXREG.DEALLOC.CTAPOOL 0x78"),
        (0x70, "BRX R2 -0x80 (*\"BRANCH_TARGETS .L_x_10,.L_x_11,.L_x_12\"*)"),
        (0x80, ".L_x_10:"), (0x80, "USETMAXREG.DEALLOC.CTAPOOL 0x18"),
        (0x90, ".L_x_2:"), (0x90, "UTCHMMA gdesc[UR4], gdesc[UR10], tmem[UR6], tmem[UR28], idesc[UR29], !UPT"),
        (0xa0, "BRA.U !UP1, `(.L_x_2)"), (0xb0, "BRA `(.L_x_5)"),
        (0xc0, ".L_x_11:"), (0xc0, "USETMAXREG.DEALLOC.CTAPOOL 0x18"),
        (0xd0, ".L_x_3:"), (0xd0, "UTMALDG.2D [UR24], [UR6]"), (0xe0, "@P2 BRA `(.L_x_3)"), (0xf0, "BRA `(.L_x_5)"),
        (0x100, ".L_x_12:"), (0x100, "USETMAXREG.DEALLOC.CTAPOOL 0x18"), (0x110, "BRA `(.L_x_5)"),
    ]
    parts = find_partitions(sass, find_loops(sass), declared, ttgir)
    assert [(p["partition"], p["role"], p["warps"], p["registers"], p["loop_instructions"]) for p in parts] == [
        ("default", "compute", 4, 256, 3), (0, "mma", 1, 24, 2), (1, "load", 2, 24, 2)]
