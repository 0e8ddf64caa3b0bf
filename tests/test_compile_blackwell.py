"""Blackwell (sm_100a) as a compile target: bench/static.py reads tcgen05 code, without a GPU.

On sm_100a Triton compiles tl.dot to tcgen05.mma: in the SASS UTCHMMA (kind::f16) and its kin
(UTCQMMA, UTCIMMA, UTCOMMA), with no shape in the opcode (the shape is in the instruction
descriptor, a uniform register a UMOV sets), issued by one thread for the whole CTA, its accumulator
in tensor memory (LDTM / STTM move it to and from registers; UTCBAR is tcgen05.commit). Its tutorial
attention warp-specializes the loop (tl.range(..., warp_specialize=True)): the warps of each
partition jump to their code from a dispatch (BRX) and take their registers with setmaxnreg
(USETMAXREG). A report that knew none of this read ``MMA: none`` and no hot loop for every kernel.

Two compiles (each in a subprocess, this process interprets): one forward configuration the
autotuner picks on sm_100a, and the tutorial's warp-specialized forward (the Blackwell yardstick).
The decoders are also checked on SASS and PTX text as ptxas and Triton print them, no compile.
"""

from __future__ import annotations

import pytest

from bench.static import (_MMA, Case, _idesc_shape, _loops, _partitions, _ptx_tcgen05, _sass_idesc,
                          _ttgir_partitions, run_in_subprocess)

# M128 N128 w8 s3: among the forward configurations the pruning keeps for sm_100a at bf16, D=128
# (the Hopper list: sm_100a is family 90 in kernels/attention_configs.py).
FORWARD = Case("attention_fwd", "bfloat16", 128, causal=False, config=(128, 128, 8, 3))
# The tutorial's Blackwell forward at the tutorial's register cap for D=128 (168).
YARDSTICK = Case("tutorial_ws_fwd", "bfloat16", 128, causal=False, config=(128, 128, 4, 3))


@pytest.fixture(scope="module")
def forward_row():
    rows = run_in_subprocess(FORWARD, "sm_100a")
    assert not [r for r in rows if "error" in r], rows
    (row,) = [r for r in rows if r["kernel"] == "_attn_fwd"]
    return row


@pytest.fixture(scope="module")
def yardstick_row():
    rows = run_in_subprocess(YARDSTICK, "sm_100a")
    assert not [r for r in rows if "error" in r], rows
    (row,) = [r for r in rows if r["kernel"] == "_tutorial_ws_attn_fwd"]
    return row


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
    """The forward's dots are tcgen05 MMAs, read with their shapes, in a hot loop found as on Hopper."""
    _assert_tcgen05_hot_loop(forward_row, 128)
    assert (forward_row["spill_stores"], forward_row["spill_loads"]) == (0, 0), forward_row["registers"]
    assert forward_row["shared"] <= forward_row["smem_limit"] and forward_row["blocks_per_sm"] >= 1
    assert "TMA" in forward_row["copy"].split("+")
    assert "partitions" not in forward_row  # the project's kernels are not warp-specialized
    # P of P V is read from tensor memory (the ts form), not shared memory.
    assert forward_row["tcgen05"]["a_in_tensor_memory"] > 0


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
    assert _MMA.search(SASS[2][1]).group(1) == "UTCHMMA"
    assert not _MMA.search("UTCBAR [UR29], URZ") and not _MMA.search("UTCATOMSWS.AND URZ, UR4")
    assert _MMA.search("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT").groups() == ("HGMMA", "64x128x16.F32.BF16")
    assert _loops(SASS) == [(1, 7)]
    # 0x8200490: f32 accumulator, bf16 A and B, N = 16 * 8, M = 8 * 16; bit 16 set: B transposed.
    assert _sass_idesc(SASS, 2, (1, 7)) == 0x8200490
    assert _idesc_shape(0x8200490, "f16") == (128, 128, 16)
    assert _idesc_shape(_sass_idesc(SASS, 4, (1, 7)), "f16") == (128, 128, 16)
    assert _idesc_shape(0x8100490, "f16") == (128, 64, 16)
    assert _idesc_shape(0x4100490, "f16") == (64, 64, 16)
    assert _idesc_shape(0x8200910, "f16") == (128, 128, 8)  # A of format 2: tf32, K = 8
    # An idesc register some other instruction wrote: unknown, not guessed.
    assert _sass_idesc([(0, "R2UR UR49, R3"), *SASS[1:]], 2, (1, 7)) is None


def test_ptx_tcgen05_decoding():
    ptx = """
        mov.b32 %r987, 136316048;
        @%p157 tcgen05.mma.cta_group::1.kind::f16 [ %r1714 + 0 ], %rd280, %rd281, %r987, %p156;
        mov.b32 %r1700, 136381584;
        @%p281 tcgen05.mma.cta_group::1.kind::f16 [ %r2655 + 0 ], [ %r1699 + 16 ], %rd361, %r1700, %p280;
    """
    assert _ptx_tcgen05(ptx) == [
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
    declared = _ttgir_partitions(ttgir)
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
    parts = _partitions(sass, _loops(sass), declared, ttgir)
    assert [(p["partition"], p["role"], p["warps"], p["registers"], p["loop_instructions"]) for p in parts] == [
        ("default", "compute", 4, 256, 3), (0, "mma", 1, 24, 2), (1, "load", 2, 24, 2)]
