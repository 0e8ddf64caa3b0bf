"""`python -m bench static`: every Triton kernel of the project compiled for H100, A100 and B200, no GPU.

Triton compiles for a target it is told about; the GPU is needed only to launch. Here a stand-in
driver tells Triton's runtime that the current device is an sm_90a (or sm_80, sm_100a) part, the
project's own launchers run on ``device="meta"`` tensors (so every constexpr, specialization and
autotuner pruning is exactly what a real call would produce), and the stand-in's launcher records
each compiled kernel instead of launching it. The autotuner's benchmark is a stand-in too: it
"times" every configuration that survives the launcher's pruning, which compiles each one.

From each compiled kernel this reads compile-time facts, never speed:

- registers and spills (ptxas -v run again on Triton's PTX with the same ptxas), stack, shared
  memory (what the kernel requests at launch) against the target's per-block limit;
- blocks per SM from registers, shared memory and warps against the SM's limits;
- the MMA instruction (HGMMA = Hopper warpgroup MMA, wgmma; HMMA = mma.sync; on Blackwell UTCHMMA and
  kin = tcgen05.mma, its shape decoded from the instruction descriptor) and ptxas's advisory C7515
  (wgmma serialized); the copy engine (TMA ``UTMALDG``, ``cp.async`` ``LDGSTS``, plain ``LDG``);
  Blackwell's tensor-memory loads and stores (``LDTM``/``STTM``);
- warp-specialized kernels' partitions (the warps a dispatch ``BRX`` sends to each partition's code,
  their role, warps and the registers ``setmaxnreg`` gives them);
- the hot loop (the innermost SASS loop with the most MMA instructions; ties: the shortest, the
  unmasked one; warp-specialized: the MMA partition's, with every partition's loop beside it): its
  instruction mix, warp instructions per million useful multiply-adds, and the multiply-adds its
  MMA instructions execute over those the algorithm needs (1.0 = no repetition across warpgroups;
  a tcgen05.mma is issued once per CTA).

Beside the project's kernels it compiles yardsticks written here from the Triton tutorial's fused
attention (06-fused-attention): the forward with pointer loads, the forward with K and V through
device-side tensor descriptors (TMA on Hopper), on sm_100a also its warp-specialized forward (the
tutorial's Blackwell path), and the backward as a dK/dV and a dQ kernel.

Run ``python -m bench static`` (bf16, D 64/128 and 256, every configuration, sm_90a, sm_80 and
sm_100a where the installed Triton compiles for it) or ``--all`` (every dtype, every mask at every
head dim, GQA on every target).
Results: ``bench/results/static/static.json`` and ``static.md`` (or ``--out``); nothing else is
written (the README links to static.md). ``--markdown-only`` rewrites static.md from static.json
without compiling anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "static"


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arch:
    """What the occupancy arithmetic and the shared-memory check need of one GPU generation."""

    name: str  # ptxas's --gpu-name
    gpu: str
    capability: int
    smem_per_block: int  # opt-in maximum for one block (bytes)
    smem_per_sm: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    tmem_columns: int = 0  # Blackwell's tensor memory per SM: 512 columns of 128 lanes x 32 bits


ARCHS = {
    "sm_90a": Arch("sm_90a", "H100", 90, smem_per_block=227 * 1024, smem_per_sm=228 * 1024),
    "sm_80": Arch("sm_80", "A100", 80, smem_per_block=163 * 1024, smem_per_sm=164 * 1024),
    "sm_100a": Arch("sm_100a", "B200", 100, smem_per_block=227 * 1024, smem_per_sm=228 * 1024, tmem_columns=512),
}


def blocks_per_sm(arch: Arch, registers: int, shared: int, num_warps: int, tmem_columns: int = 0) -> int:
    """Resident blocks per SM: registers are allocated per warp in 256-register units; on Blackwell
    each block also holds the tensor-memory columns it allocates."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (arch.regs_per_sm // per_warp) // num_warps if per_warp else arch.max_blocks_per_sm
    by_smem = arch.smem_per_sm // (shared + 1024) if shared else arch.max_blocks_per_sm  # 1 KiB reserved per block
    by_warps = arch.max_warps_per_sm // num_warps
    by_tmem = arch.tmem_columns // tmem_columns if tmem_columns and arch.tmem_columns else arch.max_blocks_per_sm
    return max(0, min(by_regs, by_smem, by_warps, by_tmem, arch.max_blocks_per_sm))


# --------------------------------------------------------------------------------------------
# A stand-in for Triton's CUDA driver: compile for a named target, record instead of launching
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
    """One kernel Triton compiled for a launch (or an autotuner trial)."""

    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int
    binary: object  # triton's CompiledKernel


class StandInDriver:
    """Enough of ``triton.runtime.driver.active`` for JIT compilation and the autotuner.

    Each target gets its own device index: Triton keeps its per-kernel binders and caches per
    device, so switching targets never reuses a binary compiled for another one."""

    def __init__(self, arch: Arch):
        import types

        self.arch = arch
        self.launched: list[Compiled] = []
        self.utils = types.SimpleNamespace(
            get_device_properties=self._properties,
            load_binary=lambda name, binary, shared, device: (None, binary, 0, 0, 1024),
            unload_module=lambda module: None,
        )

    # -- what the JIT and the compiler ask
    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch.capability, 32)

    def get_current_device(self) -> int:
        return list(ARCHS).index(self.arch.name)

    def set_current_device(self, device) -> None:
        pass

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.arch.capability, 10)

    def get_active_torch_device(self):
        import torch

        return torch.device("meta")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def _properties(self, device) -> dict:
        return {"max_shared_mem": self.arch.smem_per_block, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}

    # -- the autotuner: every configuration "runs" (and so compiles) once, all tie
    def get_benchmarker(self):
        def bench(kernel_call, quantiles=None, **_):
            kernel_call()
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench

    # -- launching: record the compiled kernel, run nothing
    def launcher_cls(self, src, metadata):
        fn = src.fn
        binary = next(k for k in fn.device_caches[self.get_current_device()][0].values()
                      if getattr(k, "hash", None) == metadata.hash)
        constants = getattr(src, "constants", None) or getattr(src, "constexprs", {})  # name differs across versions
        constexprs = {fn.arg_names[key[0]]: value for key, value in constants.items() if len(key) == 1}
        self.launched.append(Compiled(fn.__name__, constexprs, metadata.num_warps, metadata.num_stages, binary))
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def compiling_for(arch: Arch, stand_in: StandInDriver | None = None):
    """Within: Triton compiles for ``arch`` and launches nothing; yields the driver's record.
    ``stand_in``: a StandInDriver (or subclass) for ``arch`` to use instead of a new one."""
    from triton.runtime import driver

    stand_in = stand_in or StandInDriver(arch)
    driver.set_active(stand_in)
    _forget_autotuning()
    try:
        yield stand_in.launched
    finally:
        driver.set_active(_previous_driver())


def _forget_autotuning() -> None:
    """Clear the launchers' autotuner choices: a choice made for another target, or for another
    case sharing its key (the attention key leaves GQA out), would skip compiling the others."""
    from triton.runtime.autotuner import Autotuner

    from fused_remat.kernels import activations, attention, norm, rope

    for module in (attention, norm, activations, rope):
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                value.cache.clear()


def _previous_driver():
    """Triton's own driver where one is active (never on a machine without a GPU): None otherwise,
    so that a later ``driver.active`` builds it afresh."""
    from triton.runtime import driver

    try:
        return driver.default
    except RuntimeError:
        return None


# --------------------------------------------------------------------------------------------
# Cases: the project's launchers on meta tensors
# --------------------------------------------------------------------------------------------

ATTENTION_KERNELS = ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")
# Multiply-adds the algorithm needs per hot-loop iteration, in units of BLOCK_M * BLOCK_N * HEAD_DIM:
# forward S = QK^T and PV; dQ: S, dP = dO V^T, dS K; dK/dV: S^T, dV, dP^T, dK.
MATRIX_PRODUCTS = {"_attn_fwd": 2, "_attn_bwd_dq": 3, "_attn_bwd_dkdv": 4, "_tutorial_attn_fwd": 2,
                   "_tutorial_tma_attn_fwd": 2, "_tutorial_attn_bwd_dq": 3, "_tutorial_attn_bwd_dkdv": 4,
                   "_tutorial_ws_attn_fwd": 2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One launcher call. ``config`` pins the attention configuration; None lets the autotuner
    offer every configuration its pruning keeps (each is compiled and recorded)."""

    op: str  # attention_fwd, attention_bwd, layer_norm_fwd/_bwd, rms_norm_fwd/_bwd, gelu_fwd/_bwd, swiglu_fwd/_bwd, rope,
    # and the yardsticks tutorial_fwd, tutorial_tma_fwd, tutorial_bwd
    dtype: str = "bfloat16"
    head_dim: int = 128
    causal: bool = False
    gqa: bool = False
    width: int = 4096  # norms and activations: columns
    config: tuple | None = None  # (BLOCK_M, BLOCK_N, num_warps, num_stages); backward: the dQ kernel's
    dkdv_config: tuple | None = None  # backward: the dK/dV kernel's (default: config)
    variant: str = "dense"  # attention: "dense", or one of VARIANTS (the masks of real batches)

    @property
    def id(self) -> str:
        if self.op.startswith(("attention", "tutorial")):
            parts = [self.op, self.dtype, f"D{self.head_dim}", "causal" if self.causal else "full", "gqa" if self.gqa else "mha"]
            if self.variant != "dense":
                parts.append(self.variant)
            if self.config:
                parts.append("M{}N{}w{}s{}".format(*self.config) + "".join(f"ws{cap}" for cap in self.config[4:]))
            if self.dkdv_config:
                parts.append("dkdv_M{}N{}w{}s{}".format(*self.dkdv_config))
        elif self.op == "rope":
            parts = [self.op, self.dtype, f"D{self.head_dim}"]
        else:
            parts = [self.op, self.dtype, f"N{self.width}"]
        return "-".join(parts)


# The attention variants beside the dense kernels: their launch keywords (varlen adds its documents).
VARIANTS = {
    "dense": {},
    "window": {"window": (1024, -1)},  # a 1024-key sliding window (with causal: Mistral's)
    "softcap": {"softcap": 50.0},  # Gemma 2's attention softcap
    "varlen": {},  # packed documents (cu_seqlens)
}


# Bytes a warp-specialized kernel may spill, all outside its loops: where the loop masks rows, ptxas
# keeps two registers a thread (its row of the tile and that row's byte offset, computed before the
# partitions start) in local memory across setmaxnreg, stored once a program and reloaded where a
# partition starts (the attention forward's causal, window and document masks on sm_100a).
PARTITION_ENTRY_SPILL = 8


def spill_free(row: dict) -> bool:
    """No spills; for a warp-specialized kernel, at most PARTITION_ENTRY_SPILL bytes stored and no
    local memory access in any partition's loop."""
    if "partitions" in row:
        return row["spill_stores"] <= PARTITION_ENTRY_SPILL and row["hot_loop"]["mix"].get("local ld/st", 0) == 0
    return row["spill_stores"] == row["spill_loads"] == 0


def launch_config(shape: tuple) -> dict:
    """A launcher's ``config`` from a shape as kernels/attention_configs.make_configs takes it."""
    from fused_remat.kernels.attention_configs import make_configs

    (config,) = make_configs([shape])
    cap = {"maxnreg": config.maxnreg} if config.maxnreg else {}
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages, **cap}


def row_shape(row: dict) -> tuple:
    """A compiled attention row's configuration as the shape make_configs takes (and config_shape gives)."""
    c = row["config"]
    return (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) + ((c["maxnreg"],) if "maxnreg" in c else ())


def _run_case(case: Case) -> None:
    """Call the project's launcher for ``case`` on meta tensors (under a stand-in driver)."""
    import torch

    from fused_remat.kernels import activations, attention, norm, rope

    dtype = getattr(torch, case.dtype)
    meta = dict(device="meta", dtype=dtype)
    if case.op.startswith(("attention", "tutorial")):
        batch, q_heads, length = 2, 16, 4096
        kv_heads = 4 if case.gqa else q_heads
        q = torch.empty(batch, q_heads, length, case.head_dim, **meta)
        k = torch.empty(batch, kv_heads, length, case.head_dim, **meta)
        v = torch.empty_like(k)
        scale = case.head_dim ** -0.5
        config, dkdv_config = (None if c is None else launch_config(c) for c in (case.config, case.dkdv_config))
        mask = VARIANTS[case.variant]
        if case.variant == "varlen":  # the same tokens as documents of `length` packed along the rows
            q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], case.head_dim) for t in (q, k, v))
            offsets = torch.empty(batch + 1, device="meta", dtype=torch.int32)
            mask = dict(mask, documents=attention.Documents(offsets, offsets, length, length))
        if case.op == "attention_fwd":
            attention.attention_fwd(q, k, v, case.causal, scale, config=config, **mask)
        elif case.op == "attention_bwd":
            lse = torch.empty(q.shape[:-1] if case.variant != "varlen" else q.shape[1::-1], device="meta",
                              dtype=torch.float32)
            o = torch.empty_like(q)
            attention.attention_bwd(torch.empty_like(q), q, k, v, o, lse, case.causal, scale, config=config,
                                    dkdv_config=dkdv_config, **mask)
        else:
            _tutorial_launch(case.op, q, k, v, case.causal, scale, config, dkdv_config)
        return
    rows = 8192
    x = torch.empty(rows, case.width, **meta)
    w = torch.empty(case.width, device="meta", dtype=torch.float32)
    stats = torch.empty(rows, device="meta", dtype=torch.float32)
    if case.op == "layer_norm_fwd":
        norm.norm_fwd(x, w, w, torch.empty_like(x), 1e-5, rms=False)
    elif case.op == "rms_norm_fwd":
        norm.norm_fwd(x, w, None, torch.empty_like(x), 1e-6, rms=True)
    elif case.op == "layer_norm_bwd":
        norm.norm_bwd(torch.empty_like(x), x, w, w, stats, stats, torch.empty_like(x), rms=False, has_bias=True,
                      rebuild_output=True)
    elif case.op == "rms_norm_bwd":
        norm.norm_bwd(torch.empty_like(x), x, w, None, None, stats, torch.empty_like(x), rms=True, has_bias=False,
                      rebuild_output=True)
    elif case.op == "gelu_fwd":
        activations.gelu_fwd(x, "tanh")
    elif case.op == "gelu_bwd":
        activations.gelu_bwd(torch.empty_like(x), x, "none", rebuild_output=True)
    elif case.op == "swiglu_fwd":
        activations.swiglu_fwd(x, torch.empty_like(x))
    elif case.op == "swiglu_bwd":
        activations.swiglu_bwd(torch.empty_like(x), x, torch.empty_like(x), rebuild_output=True)
    elif case.op == "rope":
        heads = 24  # q and k heads of a packed qkv buffer (16 + 8), rotated in place
        qkv = torch.empty(4, 2048, heads + 8, case.head_dim, **meta)
        freqs = torch.empty(case.head_dim // 2, device="meta", dtype=torch.float32)
        rope.rope_(qkv[:, :, :heads], freqs)
    else:
        raise ValueError(f"unknown op {case.op!r}")


# --------------------------------------------------------------------------------------------
# Yardsticks: the Triton tutorial's fused attention (06-fused-attention), written here from its
# idea. Forward: a resident query tile, K and V streamed, online softmax in base 2, the scale
# folded into the exponent's fma, causal as two stages; once with pointer loads, once with K and
# V through device-side tensor descriptors (TMA on Hopper), as the tutorial does there. Backward:
# dK/dV (one key block a program, a loop over query blocks) and dQ (one query block a program, a
# loop over key blocks) as two kernels, pointer loads; causal: the diagonal blocks masked first,
# then the rest unmasked (with the same block size, where the tutorial halves it on the diagonal).
# Every accumulation happens inside tl.dot.
# --------------------------------------------------------------------------------------------

TUTORIAL_CONFIGS = ((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3))  # its Hopper favourites at D 64/128
# (BLOCK_M, BLOCK_N, num_warps, num_stages), the tutorial's Hopper choice first. dK/dV: BLOCK_M query
# rows a step, BLOCK_N keys a program; dQ: BLOCK_M queries a program, BLOCK_N keys a step.
TUTORIAL_DKDV_CONFIGS = ((32, 128, 4, 5), (64, 128, 8, 3))
TUTORIAL_DQ_CONFIGS = ((128, 32, 4, 5), (128, 64, 8, 3))
# The tutorial's Blackwell forward (sm_100a only): K and V through descriptors and its loop warp-specialized,
# tl.range(..., warp_specialize=True), under the tutorial's register cap (maxnreg: 168 at D=128, else
# 80; the tutorial keys 168 on fp16 too, the one dtype it tunes, and these yardsticks run bf16). From its
# autotuning space (BLOCK_M 64/128, BLOCK_N 32/64/128, 2-4 stages, 4/8 warps), what compiles without
# spilling under the cap and launches: at 80 registers a 128-key tile spills (at D 64 and 128), and
# at 8 warps the partitions add up to 20 warps, too many for 168 registers each in one SM.
TUTORIAL_WS_CONFIGS = {64: ((128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3)),
                       128: ((128, 128, 4, 3), (128, 128, 4, 2), (128, 64, 4, 3))}


def tutorial_maxnreg(head_dim: int) -> int:
    return 168 if head_dim == 128 else 80


TUTORIAL_KERNELS = ("_tutorial_attn_fwd", "_tutorial_tma_attn_fwd", "_tutorial_attn_bwd_dkdv", "_tutorial_attn_bwd_dq",
                    "_tutorial_ws_attn_fwd")


@functools.lru_cache(maxsize=None)
def _tutorial_kernels() -> dict:
    """The yardstick kernels by name; each takes (tensors..., sm_scale, N_CTX) and the constexprs
    HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N. Tensors are contiguous (batch, heads, N_CTX, HEAD_DIM)."""
    import triton
    import triton.language as tl

    log2e = tl.constexpr(1.4426950408889634)

    @triton.jit
    def tile_ptrs(base, row0, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
        """Pointers to the (ROWS, HEAD_DIM) tile from row0 of a row-major matrix, or to its transpose."""
        rows = row0 + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        if TRANSPOSED:
            return base + rows[None, :] * HEAD_DIM + cols[:, None]
        else:
            return base + rows[:, None] * HEAD_DIM + cols[None, :]

    @triton.jit
    def kv_source(base, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr,
                  TMA: tl.constexpr):
        """Where K or V tiles come from: a device-side tensor descriptor, or pointers to the first tile."""
        if TMA:
            return tl.make_tensor_descriptor(base, shape=[N_CTX, HEAD_DIM], strides=[HEAD_DIM, 1],
                                             block_shape=[BLOCK_N, HEAD_DIM])
        else:
            return tile_ptrs(base, 0, BLOCK_N, HEAD_DIM, TRANSPOSED)

    @triton.jit
    def kv_tiles(k_src, v_src, n, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
        """K^T (HEAD_DIM, BLOCK_N) and V (BLOCK_N, HEAD_DIM) of the key block from row n."""
        if TMA:
            return tl.trans(k_src.load([n, 0])), v_src.load([n, 0])
        else:
            return tl.load(k_src + n * HEAD_DIM), tl.load(v_src + n * HEAD_DIM)

    @triton.jit
    def softmax_step(s, v, m, denom, acc, scale2):
        """One key block of the online softmax: s = q k^T, to be scaled by scale2 (-inf where masked)."""
        m_new = tl.maximum(m, tl.max(s, 1) * scale2)
        p = tl.math.exp2(s * scale2 - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        return m_new, denom * alpha + tl.sum(p, 1), tl.dot(p.to(v.dtype), v, acc * alpha[:, None])

    @triton.jit
    def forward(start, bh, Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
        """The query rows from start of (batch x head) bh."""
        head_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        kv_off = (bh // GROUP).to(tl.int64) * N_CTX * HEAD_DIM
        rows = start + tl.arange(0, BLOCK_M)
        q = tl.load(tile_ptrs(Q + head_off, start, BLOCK_M, HEAD_DIM, False))
        k_src = kv_source(K + kv_off, N_CTX, HEAD_DIM, BLOCK_N, True, TMA)
        v_src = kv_source(V + kv_off, N_CTX, HEAD_DIM, BLOCK_N, False, TMA)
        scale2 = sm_scale * log2e
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = start if CAUSAL else N_CTX
        for n in range(0, end, BLOCK_N):  # blocks no row of the tile needs to mask
            kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, TMA)
            m, denom, acc = softmax_step(tl.dot(q, kt), v, m, denom, acc, scale2)
        if CAUSAL:  # the diagonal tile(s)
            tl.static_assert(BLOCK_M % BLOCK_N == 0)
            for n in range(start, start + BLOCK_M, BLOCK_N):
                kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, TMA)
                s = tl.where(rows[:, None] >= (n + tl.arange(0, BLOCK_N))[None, :], tl.dot(q, kt) * scale2, float("-inf"))
                m, denom, acc = softmax_step(s, v, m, denom, acc, 1.0)  # scaled before the mask
        tl.store(M + bh * N_CTX + rows, m + tl.math.log2(denom))
        tl.store(tile_ptrs(O + head_off, start, BLOCK_M, HEAD_DIM, False), (acc / denom[:, None]).to(O.dtype.element_ty))

    @triton.jit
    def _tutorial_attn_fwd(Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        forward(tl.program_id(0) * BLOCK_M, tl.program_id(1), Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM, CAUSAL,
                BLOCK_M, BLOCK_N, False)

    @triton.jit
    def _tutorial_tma_attn_fwd(Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        forward(tl.program_id(0) * BLOCK_M, tl.program_id(1), Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM, CAUSAL,
                BLOCK_M, BLOCK_N, True)

    @triton.jit
    def forward_ws(start, bh, Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """forward through descriptors, each loop warp-specialized as the tutorial's Blackwell path; at
        BLOCK_M = HEAD_DIM = 128 the accumulator is rescaled in two column halves, as it does there."""
        head_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        kv_off = (bh // GROUP).to(tl.int64) * N_CTX * HEAD_DIM
        rows = start + tl.arange(0, BLOCK_M)
        q = tl.load(tile_ptrs(Q + head_off, start, BLOCK_M, HEAD_DIM, False))
        k_src = kv_source(K + kv_off, N_CTX, HEAD_DIM, BLOCK_N, True, True)
        v_src = kv_source(V + kv_off, N_CTX, HEAD_DIM, BLOCK_N, False, True)
        scale2 = sm_scale * log2e
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = start if CAUSAL else N_CTX
        for n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, True)
            m, denom, acc = softmax_step_ws(tl.dot(q, kt), v, m, denom, acc, scale2, BLOCK_M, HEAD_DIM)
        if CAUSAL:
            tl.static_assert(BLOCK_M % BLOCK_N == 0)
            for n in tl.range(start, start + BLOCK_M, BLOCK_N, warp_specialize=True):
                kt, v = kv_tiles(k_src, v_src, n, HEAD_DIM, True)
                s = tl.where(rows[:, None] >= (n + tl.arange(0, BLOCK_N))[None, :], tl.dot(q, kt) * scale2, float("-inf"))
                m, denom, acc = softmax_step_ws(s, v, m, denom, acc, 1.0, BLOCK_M, HEAD_DIM)
        tl.store(M + bh * N_CTX + rows, m + tl.math.log2(denom))
        tl.store(tile_ptrs(O + head_off, start, BLOCK_M, HEAD_DIM, False), (acc / denom[:, None]).to(O.dtype.element_ty))

    @triton.jit
    def softmax_step_ws(s, v, m, denom, acc, scale2, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
        m_new = tl.maximum(m, tl.max(s, 1) * scale2)
        p = tl.math.exp2(s * scale2 - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        if BLOCK_M == 128 and HEAD_DIM == 128:
            acc0, acc1 = acc.reshape([BLOCK_M, 2, HEAD_DIM // 2]).permute(0, 2, 1).split()
            acc = tl.join(acc0 * alpha[:, None], acc1 * alpha[:, None]).permute(0, 2, 1).reshape([BLOCK_M, HEAD_DIM])
        else:
            acc = acc * alpha[:, None]
        return m_new, denom * alpha + tl.sum(p, 1), tl.dot(p.to(v.dtype), v, acc)

    @triton.jit
    def _tutorial_ws_attn_fwd(Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        forward_ws(tl.program_id(0) * BLOCK_M, tl.program_id(1), Q, K, V, O, M, GROUP, sm_scale, N_CTX, HEAD_DIM, CAUSAL,
                   BLOCK_M, BLOCK_N)

    @triton.jit
    def dkdv_stage(dk, dv, k, v, Q, DO, M, Delta, start_n, q0, q1, scale2, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
        """dK and dV of the key block from start_n, accumulated over query rows [q0, q1)."""
        keys = start_n + tl.arange(0, BLOCK_N)
        qt_ptrs = tile_ptrs(Q, 0, BLOCK_M, HEAD_DIM, True)
        do_ptrs = tile_ptrs(DO, 0, BLOCK_M, HEAD_DIM, False)
        for m0 in range(q0, q1, BLOCK_M):
            queries = m0 + tl.arange(0, BLOCK_M)
            qt = tl.load(qt_ptrs + m0 * HEAD_DIM)
            do = tl.load(do_ptrs + m0 * HEAD_DIM)
            pt = tl.math.exp2(tl.dot(k, qt) * scale2 - tl.load(M + queries)[None, :])
            if MASK:
                pt = tl.where(queries[None, :] >= keys[:, None], pt, 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv)
            dst = pt * (tl.dot(v, tl.trans(do)) - tl.load(Delta + queries)[None, :])
            dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
        return dk, dv

    @triton.jit
    def _tutorial_attn_bwd_dkdv(Q, K, V, DO, DK, DV, M, Delta, sm_scale, N_CTX, HEAD_DIM: tl.constexpr,
                                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_n = tl.program_id(0) * BLOCK_N
        bh = tl.program_id(1)
        off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        M += bh * N_CTX
        Delta += bh * N_CTX
        k = tl.load(tile_ptrs(K + off, start_n, BLOCK_N, HEAD_DIM, False))
        v = tl.load(tile_ptrs(V + off, start_n, BLOCK_N, HEAD_DIM, False))
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        scale2 = sm_scale * log2e
        if CAUSAL:  # the query blocks on the diagonal, then those below it
            tl.static_assert(BLOCK_N % BLOCK_M == 0)
            dk, dv = dkdv_stage(dk, dv, k, v, Q + off, DO + off, M, Delta, start_n, start_n, start_n + BLOCK_N, scale2,
                                HEAD_DIM, BLOCK_M, BLOCK_N, True)
            dk, dv = dkdv_stage(dk, dv, k, v, Q + off, DO + off, M, Delta, start_n, start_n + BLOCK_N, N_CTX, scale2,
                                HEAD_DIM, BLOCK_M, BLOCK_N, False)
        else:
            dk, dv = dkdv_stage(dk, dv, k, v, Q + off, DO + off, M, Delta, start_n, 0, N_CTX, scale2,
                                HEAD_DIM, BLOCK_M, BLOCK_N, False)
        tl.store(tile_ptrs(DV + off, start_n, BLOCK_N, HEAD_DIM, False), dv.to(DV.dtype.element_ty))
        tl.store(tile_ptrs(DK + off, start_n, BLOCK_N, HEAD_DIM, False), (dk * sm_scale).to(DK.dtype.element_ty))

    @triton.jit
    def dq_stage(dq, q, do, m, delta, K, V, start_m, k0, k1, scale2, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
        """dQ of the query block from start_m, accumulated over key rows [k0, k1)."""
        queries = start_m + tl.arange(0, BLOCK_M)
        kt_ptrs = tile_ptrs(K, 0, BLOCK_N, HEAD_DIM, True)
        vt_ptrs = tile_ptrs(V, 0, BLOCK_N, HEAD_DIM, True)
        for n0 in range(k0, k1, BLOCK_N):
            kt = tl.load(kt_ptrs + n0 * HEAD_DIM)
            vt = tl.load(vt_ptrs + n0 * HEAD_DIM)
            p = tl.math.exp2(tl.dot(q, kt) * scale2 - m[:, None])
            if MASK:
                p = tl.where(queries[:, None] >= (n0 + tl.arange(0, BLOCK_N))[None, :], p, 0.0)
            ds = p * (tl.dot(do, vt) - delta[:, None])
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
        return dq

    @triton.jit
    def _tutorial_attn_bwd_dq(Q, K, V, DO, DQ, M, Delta, sm_scale, N_CTX, HEAD_DIM: tl.constexpr,
                              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        off = bh.to(tl.int64) * N_CTX * HEAD_DIM
        rows = bh * N_CTX + start_m + tl.arange(0, BLOCK_M)
        q = tl.load(tile_ptrs(Q + off, start_m, BLOCK_M, HEAD_DIM, False))
        do = tl.load(tile_ptrs(DO + off, start_m, BLOCK_M, HEAD_DIM, False))
        m = tl.load(M + rows)
        delta = tl.load(Delta + rows)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        scale2 = sm_scale * log2e
        if CAUSAL:  # the key blocks on the diagonal, then those left of it
            tl.static_assert(BLOCK_M % BLOCK_N == 0)
            dq = dq_stage(dq, q, do, m, delta, K + off, V + off, start_m, start_m, start_m + BLOCK_M, scale2,
                          HEAD_DIM, BLOCK_M, BLOCK_N, True)
            dq = dq_stage(dq, q, do, m, delta, K + off, V + off, start_m, 0, start_m, scale2,
                          HEAD_DIM, BLOCK_M, BLOCK_N, False)
        else:
            dq = dq_stage(dq, q, do, m, delta, K + off, V + off, start_m, 0, N_CTX, scale2,
                          HEAD_DIM, BLOCK_M, BLOCK_N, False)
        tl.store(tile_ptrs(DQ + off, start_m, BLOCK_M, HEAD_DIM, False), (dq * sm_scale).to(DQ.dtype.element_ty))

    return {k.__name__: k for k in (_tutorial_attn_fwd, _tutorial_tma_attn_fwd, _tutorial_attn_bwd_dkdv,
                                    _tutorial_attn_bwd_dq, _tutorial_ws_attn_fwd)}


def _tutorial_launch(op, q, k, v, causal, scale, config, dkdv_config) -> None:
    """Compile ``op``'s yardstick kernels: each at the pinned configuration, else at every default one."""
    import torch

    batch, heads, length, head_dim = q.shape
    kernels = _tutorial_kernels()
    stats = dict(device=q.device, dtype=torch.float32)
    m, delta = torch.empty(batch, heads, length, **stats), torch.empty(batch, heads, length, **stats)

    def launch(name, configs, pinned, by_keys, *tensors, **options):
        for block_m, block_n, warps, stages in [tuple(pinned.values())] if pinned else configs:
            grid = (length // (block_n if by_keys else block_m), batch * heads)
            kernels[name][grid](*tensors, scale, length, HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=block_m,
                                BLOCK_N=block_n, num_warps=warps, num_stages=stages, **options)

    if op == "tutorial_bwd":
        if k.shape[1] != heads:
            raise ValueError("the backward yardstick is MHA only")
        do = torch.empty_like(q)
        launch("_tutorial_attn_bwd_dkdv", TUTORIAL_DKDV_CONFIGS, dkdv_config or config, True,
               q, k, v, do, torch.empty_like(k), torch.empty_like(v), m, delta)
        launch("_tutorial_attn_bwd_dq", TUTORIAL_DQ_CONFIGS, config, False, q, k, v, do, torch.empty_like(q), m, delta)
    elif op == "tutorial_ws_fwd":
        launch("_tutorial_ws_attn_fwd", TUTORIAL_WS_CONFIGS.get(head_dim, TUTORIAL_WS_CONFIGS[64]), config, False,
               q, k, v, torch.empty_like(q), m, heads // k.shape[1], maxnreg=tutorial_maxnreg(head_dim))
    else:
        name = "_tutorial_tma_attn_fwd" if op == "tutorial_tma_fwd" else "_tutorial_attn_fwd"
        launch(name, TUTORIAL_CONFIGS, config, False, q, k, v, torch.empty_like(q), m, heads // k.shape[1])


# --------------------------------------------------------------------------------------------
# Reading the binary
# --------------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


@functools.lru_cache(maxsize=None)
def _ptxas(capability: int) -> str:
    """The ptxas Triton itself uses for this target (3.9: the legacy one below sm_90, else
    ptxas-blackwell; older Triton: one ptxas)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            return get_ptxas(capability).path
        except TypeError:  # Triton versions whose get_ptxas takes no architecture
            return get_ptxas().path
    except ImportError:
        return _tool("ptxas")


@functools.lru_cache(maxsize=None)
def _ptxas_flags(path: str) -> tuple[str, ...]:
    """The flags of Triton's own ptxas call that change code generation: -lineinfo always, and
    --regAllocOptLevel=2 where Triton passes it (its workaround for ptxas 13)."""
    import inspect

    from triton.backends.nvidia import compiler

    flags = ["-lineinfo"]
    if "regAllocOptLevel=2" in inspect.getsource(compiler):
        flags.append("--regAllocOptLevel=2")
    return tuple(flags)


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


# HGMMA: Hopper's warpgroup MMA (wgmma), its shape in the opcode (HGMMA.64x128x16.F32.BF16); HMMA:
# mma.sync (HMMA.16816.F32.BF16). Blackwell's tcgen05.mma is UTC*MMA with no shape in the opcode
# ("UTCHMMA gdesc[UR16], gdesc[UR24], tmem[UR12], tmem[UR48], idesc[UR49], !UPT"; A from tensor memory:
# "UTCHMMA tmem[UR14], gdesc[...], ..."): UTCHMMA for kind::f16 and kind::tf32, UTCQMMA for kind::f8f6f4,
# UTCIMMA for kind::i8 (ptxas 13, Triton 3.9); UTCOMMA (kind::mxf4) not seen here. Its M and N are in
# the instruction descriptor, a uniform register (idesc[URn]) set by a UMOV.
_MMA = re.compile(r"\b(HGMMA|HMMA|UTC[A-Z]*MMA)\b(?:\.(\S+))?")
# Blackwell's tensor memory: LDTM / STTM (tcgen05.ld / .st, registers <-> tensor memory), UTCCP (tcgen05.cp,
# shared -> tensor memory); UTCBAR is tcgen05.commit (an mbarrier arrives when the issued MMAs are done).
_TMEM = re.compile(r"\b(LDTM|STTM|UTCCP|UTCSHIFT)\b")
_COPY = {"TMA": re.compile(r"\bUTMALDG\b"), "cp.async": re.compile(r"\bLDGSTS\b"), "ld.global": re.compile(r"\bLDG\b")}


def _sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's code, and labels as (address, '.L_x_n:')."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = _run([_tool("nvdisasm"), "-c", str(path)])
    lines, pending = [], []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            lines.extend((address, name + ":") for name in pending)
            pending = []
            lines.append((address, m.group(2).strip()))
    return lines


def _opcode(instruction: str) -> str:
    """The opcode without predicate and modifiers: '@!P0 BRA `(.L_x_3)' -> 'BRA'."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def _mma_macs(instruction: str) -> int:
    """Multiply-adds one warp's (HMMA) or one warpgroup's (HGMMA) instruction performs."""
    kind, shape = _MMA.search(instruction).groups()
    if kind == "HGMMA":
        m, n, k = (int(x) for x in shape.split(".")[0].split("x"))
        return m * n * k
    if kind == "HMMA":
        digits = shape.split(".")[0]  # 16816 = m16 n8 k16; 1688 = m16 n8 k8
        return 16 * 8 * int(digits[3:])
    return 0


def _loops(sass: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) index ranges of the code's loops: every backward branch closes one, except a
    jump back from code past an EXIT (ptxas puts the retry loops of mbarrier waits, TMA's among
    them, after the function's end; each jumps back to where its wait resumes)."""
    labels = {text[:-1]: i for i, (_, text) in enumerate(sass) if text.endswith(":")}
    loops = []
    for i, (_, text) in enumerate(sass):
        if _opcode(text) == "BRA":
            target = re.search(r"\(?(\.L_x_\d+)\)?", text)
            if target and labels.get(target.group(1), i) < i:
                first = labels[target.group(1)]
                if not any(t.split()[:1] == ["EXIT"] for _, t in sass[first:i]):
                    loops.append((first, i))
    return loops


def _hot_loop(sass):
    """The innermost loop with the most MMA instructions (ties: the shortest), or None."""
    def mmas(lo, hi):
        return sum(1 for _, t in sass[lo:hi + 1] if _MMA.search(t))

    loops = [(lo, hi) for lo, hi in _loops(sass) if mmas(lo, hi)]
    innermost = [(lo, hi) for lo, hi in loops
                 if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops)]
    if not innermost:
        return None
    return min(innermost, key=lambda r: (-mmas(*r), r[1] - r[0]))


def _instruction_mix(instructions: list[str]) -> dict:
    groups = {"mma": 0, "exp2/mufu": 0, "fp32 math": 0, "async copy": 0, "shared ld/st": 0, "tensor memory": 0,
              "global ld/st": 0, "local ld/st": 0, "sync/wait": 0, "other": 0}
    for text in instructions:
        op = _opcode(text)
        if _MMA.search(text):
            groups["mma"] += 1
        elif op == "MUFU":
            groups["exp2/mufu"] += 1
        elif op in ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "F2FP", "FMUL2", "FADD2", "FFMA2"):
            groups["fp32 math"] += 1
        elif op in ("LDGSTS", "UTMALDG"):
            groups["async copy"] += 1
        elif op in ("LDS", "STS", "LDSM", "STSM"):
            groups["shared ld/st"] += 1
        elif _TMEM.search(text):
            groups["tensor memory"] += 1
        elif op in ("LDG", "STG", "UTMASTG"):
            groups["global ld/st"] += 1
        elif op in ("LDL", "STL"):  # spilled registers
            groups["local ld/st"] += 1
        elif op in ("WARPGROUP", "BAR", "SYNCS", "DEPBAR", "WARPSYNC", "ARRIVES", "UTMACCTL", "UTCBAR"):
            groups["sync/wait"] += 1
        else:
            groups["other"] += 1
    return groups


_FP32_OPS = ("FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2")


def _fp32_ops(instructions: list[str]) -> dict:
    """Counts of fp32 multiply-adds, multiplies and adds (the paired forms of sm_100 where present):
    compiled without floating-point fusion, an FFMA becomes an FMUL and an FADD."""
    counts = {name: 0 for name in _FP32_OPS}
    for text in instructions:
        op = _opcode(text)
        if op in counts:
            counts[op] += 1
    return {name: n for name, n in counts.items() if n or len(name) == 4}


# --------------------------------------------------------------------------------------------
# Blackwell: tcgen05 MMAs and their shapes, tensor memory, warp-specialized partitions
# --------------------------------------------------------------------------------------------

# K of one tcgen05.mma per kind (32 bytes of each A and B row: 16 halves, 8 tf32, 32 bytes of fp8 or int8).
_TCGEN05_K = {"f16": 16, "tf32": 8, "f8f6f4": 32, "i8": 32, "mxf8f6f4": 32, "mxf4": 64, "mxf4nvf4": 64}
_UTC_KIND = {"UTCHMMA": "f16", "UTCQMMA": "f8f6f4", "UTCIMMA": "i8", "UTCOMMA": "mxf4"}
_WORK = re.compile(r"\b(HGMMA|HMMA|UTC[A-Z]*MMA|LDTM|STTM|UTCCP|MUFU|UTMALDG|LDGSTS)\b")
_LOAD = re.compile(r"\b(UTMALDG|LDGSTS)\b")


def _idesc_shape(idesc: int, kind: str) -> tuple[int, int, int]:
    """(M, N, K) of a tcgen05.mma from its 32-bit instruction descriptor (PTX ISA, tcgen05
    "Instruction descriptor"): N >> 3 in bits 17-22, M >> 4 in bits 24-28; K is the kind's (an A of
    format 2, bits 7-9, under kind::f16's opcode is tf32)."""
    if kind == "f16" and (idesc >> 7) & 7 == 2:
        kind = "tf32"
    return ((idesc >> 24) & 0x1F) << 4, ((idesc >> 17) & 0x3F) << 3, _TCGEN05_K.get(kind, 0)


def _ptx_tcgen05(ptx: str) -> list[dict]:
    """Every tcgen05.mma of the PTX in order: kind, cta_group, (M, N, K) where its instruction descriptor
    is a constant (an immediate, or a register with one mov.b32 value), and whether A is read from
    tensor memory (P of P @ V kept there) rather than shared memory."""
    values: dict[str, set] = {}
    for reg, value in re.findall(r"\bmov\.b32\s+(%r\d+),\s*(-?\d+);", ptx):
        values.setdefault(reg, set()).add(int(value) & 0xFFFFFFFF)
    mmas = []
    for m in re.finditer(r"\btcgen05\.mma(\S*)\s+([^;]*);", ptx):
        modifiers, operands = m.group(1), [o.strip() for o in m.group(2).split(",")]
        kind = re.search(r"kind::(\w+)", modifiers)
        kind = kind.group(1) if kind else "f16"
        cta = re.search(r"cta_group::(\d)", modifiers)
        idesc = operands[3] if len(operands) > 3 else ""
        value = int(idesc, 0) if re.fullmatch(r"-?\d+|0x[0-9a-fA-F]+", idesc) else (
            next(iter(values[idesc])) if len(values.get(idesc, ())) == 1 else None)
        mmas.append({"kind": kind, "cta_group": int(cta.group(1)) if cta else 1,
                     "shape": _idesc_shape(value, kind) if value is not None else None,
                     "a_in_tmem": bool(operands) and len(operands) > 1 and operands[1].startswith("[")})
    return mmas


def _sass_idesc(sass: list[tuple[int, str]], i: int, loop: tuple[int, int] | None = None) -> int | None:
    """The instruction descriptor of the UTC*MMA at ``i``: the immediate of the UMOV that last wrote its
    idesc register before it (inside ``loop``: earlier in the body, then later in it round the back
    edge, then before the loop), or None where another instruction wrote it."""
    reg = re.search(r"idesc\[(UR\d+)\]", sass[i][1])
    if not reg:
        return None
    reg = reg.group(1)
    pair = f"UR{int(reg[2:]) - 1}"  # a 64-bit write to the register below writes this one too
    writes = re.compile(rf"^(?:@\S+\s+)?(\S+)\s+({reg}|{pair})\b")
    lo, hi = loop if loop else (i, i)
    order = [*range(i - 1, lo - 1, -1), *range(hi, i, -1), *range(lo - 1, -1, -1)] if loop else range(i - 1, -1, -1)
    for j in order:
        written = writes.match(sass[j][1])
        if not written or (written.group(2) == pair and ".64" not in written.group(1)):
            continue
        value = re.fullmatch(r"(?:@\S+\s+)?UMOV\s+\S+,\s*(0x[0-9a-f]+|\d+)", sass[j][1])
        return int(value.group(1), 0) if value and written.group(2) == reg else None
    return None


def _tcgen05_macs(sass, indices, loop, ptx_mmas) -> tuple[int, list] | None:
    """Multiply-adds a CTA's tcgen05 MMAs at ``indices`` of the SASS execute (each is issued once per
    CTA, by one thread; with cta_group::2 a pair of CTAs shares each), and their shapes; None where
    a shape is unknown. A shape comes from the SASS instruction descriptor, else from the PTX where
    all its tcgen05.mma share one."""
    ptx_shapes = {(m["kind"], m["shape"]) for m in ptx_mmas}
    pair = 2 if any(m["cta_group"] == 2 for m in ptx_mmas) else 1
    total, shapes = 0, []
    for i in indices:
        kind = _UTC_KIND.get(_MMA.search(sass[i][1]).group(1), "f16")
        idesc = _sass_idesc(sass, i, loop)
        if idesc is not None:
            shape = _idesc_shape(idesc, kind)
        elif len(ptx_shapes) == 1 and None not in next(iter(ptx_shapes)):
            shape = next(iter(ptx_shapes))[1]
        else:
            return None
        if not all(shape):
            return None
        total += shape[0] * shape[1] * shape[2] // pair
        shapes.append(shape)
    return total, shapes


def _ttgir_partitions(ttgir: str) -> list[dict]:
    """The partitions a warp-specialized kernel declares (TTGIR ``ttg.warp_specialize``): per partition
    its warps, the registers it asks for and its role (mma: issues the MMAs; load: the TMA or cp.async
    copies; compute: the rest, softmax and the accumulator's corrections among it). Empty where none."""
    if "ttg.warp_specialize" not in ttgir:
        return []
    requested = [[int(x) for x in group.split(",")]
                 for group in re.findall(r"requestedRegisters = array<i32:\s*([\d,\s]+)>", ttgir)]
    parts, op = [], -1
    for header in re.finditer(r"\bpartition(\d+)\(.*?\)\s*num_warps\((\d+)\)", ttgir):
        index = int(header.group(1))
        op += index == 0
        end = ttgir.find("ttg.warp_return", header.end())
        body = ttgir[header.end():end if end >= 0 else None]
        role = ("mma" if re.search(r"tc_gen5_mma|warp_group_dot", body) else
                "load" if re.search(r"async_tma_copy_global_to_local|async_copy_global_to_local|async_tma_gather", body)
                else "compute")
        regs = requested[op][index] if op < len(requested) and index < len(requested[op]) else None
        parts.append({"partition": index, "warps": int(header.group(2)), "requested_registers": regs, "role": role,
                      "op": op})
    return parts


def _reachable(sass: list[tuple[int, str]], start: int, labels: dict) -> set[int]:
    """Indices of the SASS reachable from ``start`` along fall-through and branches (BRX, the warp
    dispatch of a warp-specialized kernel, is not followed)."""
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        while i < len(sass) and i not in seen:
            seen.add(i)
            text = sass[i][1]
            if text.endswith(":"):
                i += 1
                continue
            words = text.split()
            conditional = words[0].startswith("@") or (len(words) > 2 and re.match(r"!?U?P[T\d]", words[1]))
            op = _opcode(text)
            target = re.search(r"`\((\.L_x_\d+)\)", text)
            if op == "BRA" and target and target.group(1) in labels:
                todo.append(labels[target.group(1)])
            if op in ("BRA", "BRX", "EXIT", "RET", "JMP", "JMX") and not conditional:
                break
            i += 1
    return seen


def _sass_partitions(sass: list[tuple[int, str]]) -> tuple[set[int], list[dict]]:
    """A warp-specialized kernel's SASS by partition: the default partition's code (reachable from the
    entry; it includes the dispatch, where the other warps wait for work and jump, BRX, to their
    partition's code), and in the jump's order (Triton numbers the partitions of each warp-specialized
    loop in turn) each branch target with the code it reaches (not the default's), its role from its
    code (mma: issues the MMAs; load: the TMA or cp.async copies; compute: the rest) unless it does no
    work (a warpgroup's padding warps)."""
    labels = {text[:-1]: i for i, (_, text) in enumerate(sass) if text.endswith(":")}
    default = _reachable(sass, 0, labels)
    regions = []
    for _, text in sass:
        if _opcode(text) != "BRX" or "BRANCH_TARGETS" not in text:
            continue
        for name in re.findall(r"\.L_x_\d+", text.split("BRANCH_TARGETS", 1)[1]):
            if name not in labels:
                continue
            mine = _reachable(sass, labels[name], labels) - default
            code = [sass[i][1] for i in sorted(mine) if not sass[i][1].endswith(":")]
            if not any(_WORK.search(t) for t in code):
                continue
            role = ("mma" if any(_MMA.search(t) for t in code) else "load" if any(_LOAD.search(t) for t in code)
                    else "compute")
            regions.append({"indices": mine, "role": role})
    return default, regions


def _registers_at(sass, indices: set[int], at: int | None) -> int | None:
    """The register count setmaxnreg (USETMAXREG) last set before index ``at`` (the partition's loop) in
    this partition's code, else the first it sets there."""
    marks = [i for i in sorted(indices) if _opcode(sass[i][1]) == "USETMAXREG"]
    before = [i for i in marks if at is not None and i < at]
    chosen = before[-1] if before else marks[0] if marks else None
    return int(sass[chosen][1].split()[-1], 0) if chosen is not None else None


def _partition_loop(sass, loops, indices: set[int]):
    """The steady-state loop of a partition's code: of its innermost loops that do work (MMA, tensor
    memory, MUFU, tile copies), the one with the most MMAs, then the most work, then the shortest (of
    the masked and unmasked loops of a causal kernel, the unmasked)."""
    def count(a, b, rx):
        return sum(1 for _, t in sass[a:b + 1] if rx.search(t))

    mine = [(a, b) for a, b in loops if a in indices and b in indices and count(a, b, _WORK)]
    innermost = [(a, b) for a, b in mine if not any((x, y) != (a, b) and a <= x and y <= b for x, y in mine)]
    if not innermost:
        return None
    return min(innermost, key=lambda r: (-count(*r, _MMA), -count(*r, _WORK), r[1] - r[0]))


def _tmem_counts(code: list[str]) -> dict:
    """Tensor-memory instructions by opcode (LDTM, STTM, UTCCP)."""
    counts: dict[str, int] = {}
    for text in code:
        if m := _TMEM.search(text):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def _partitions(sass, loops, declared: list[dict], ttgir: str) -> list[dict]:
    """A warp-specialized kernel's partitions, the default first: role, warps, registers (setmaxnreg's
    count in the SASS where its loop runs), the TTGIR's requested count, which warp-specialized loop
    of the source (``op``: a causal kernel has two) and the partition's loop (index range, or None).
    The SASS partitions are the declared ones in order where their roles agree, else matched by role
    and registers (``op`` then unknown)."""
    default_code, regions = _sass_partitions(sass)
    if not regions:
        return []
    warps = re.search(r'"ttg.num-warps"\s*=\s*(\d+)', ttgir)
    loop = _partition_loop(sass, loops, default_code)
    default = {"partition": "default", "role": "compute", "warps": int(warps.group(1)) if warps else None,
               "registers": _registers_at(sass, default_code, loop[0] if loop else None),
               "requested_registers": None, "op": None, "loop": loop}
    if loop and any(_MMA.search(t) for t in _body(sass, loop)):
        default["role"] = "mma"
    in_order = len(regions) == len(declared) and all(r["role"] == d["role"] for r, d in zip(regions, declared))
    parts, unused = [default], list(declared)
    for k, region in enumerate(regions):
        loop = _partition_loop(sass, loops, region["indices"])
        registers = _registers_at(sass, region["indices"], loop[0] if loop else None)
        if in_order:
            match = declared[k]
        else:
            same = [d for d in unused if d["role"] == region["role"]]
            match = next((d for d in same if d["requested_registers"] == registers), same[0] if same else None)
            if match:
                unused.remove(match)
        parts.append({"partition": match["partition"] if match else None, "role": region["role"],
                      "warps": match["warps"] if match else None, "registers": registers,
                      "requested_registers": match["requested_registers"] if match else None,
                      "op": match["op"] if match and in_order else None, "loop": loop})
    for part in parts:
        part["loop_instructions"] = len(_body(sass, part["loop"])) if part["loop"] else 0
    return parts


def _steady_state(sass, partitions: list[dict]) -> tuple[tuple[int, int] | None, list[dict]]:
    """The hot loop of a warp-specialized kernel and the partitions that run beside it: the MMA
    partition's loop with the most MMAs (ties: the first warp-specialized loop of the source, a causal
    kernel's unmasked one), with the default partition and the other partitions of its loop."""
    def mmas(part):
        return sum(1 for t in _body(sass, part["loop"]) if _MMA.search(t)) if part["loop"] else 0

    workers = [p for p in partitions[1:] if p["role"] == "mma" and p["loop"]]
    if not workers:
        return None, partitions
    best = min(workers, key=lambda p: (-mmas(p), p["op"] if p["op"] is not None else 0))
    if best["op"] is None:
        return best["loop"], partitions
    return best["loop"], [partitions[0]] + [p for p in partitions[1:] if p["op"] == best["op"]]


def _body(sass, loop) -> list[str]:
    return [t for _, t in sass[loop[0]:loop[1] + 1] if not t.endswith(":")]


def analyze(compiled: Compiled, arch: Arch) -> dict:
    """The compile-time facts of one kernel, as a flat dict (a row of the table)."""
    binary = compiled.binary
    c = compiled.constexprs
    row = {
        "kernel": compiled.kernel, "target": arch.name,
        "config": {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_H", "BLOCK_HALF") if k in c}
        | {"num_warps": compiled.num_warps, "num_stages": compiled.num_stages}
        | ({"maxnreg": binary.metadata.maxnreg} if c.get("WARP_SPECIALIZE") else {}),
        "constexprs": {k: (v if isinstance(v, (bool, int, float, str)) or v is None else str(v)) for k, v in c.items()},
        "shared": int(binary.metadata.shared),
        "smem_limit": arch.smem_per_block,
        "fp_fusion": bool(getattr(binary.metadata, "enable_fp_fusion", True)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(binary.asm["ptx"])
        path = _ptxas(arch.capability)
        log = _run([path, *_ptxas_flags(path), "-v", f"--gpu-name={arch.name}", str(ptx), "-o", str(Path(tmp) / "k.o")])
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    row.update(
        registers=int(used.group(1)) if used else None,
        spill_stores=int(spills.group(1)) if spills else 0,
        spill_loads=int(spills.group(2)) if spills else 0,
        stack=int(stack.group(1)) if stack else 0,
        wgmma_serialized="C7515" in log,
        advisories=sorted(set(re.findall(r"\b(C\d{4})\b", log))),
    )
    # Tensor memory (Blackwell): the columns the kernel allocates (tcgen05.alloc, a power of two) or, where
    # they exceed the SM's 512, what Triton computed (it then compiles the kernel to a trap and refuses to
    # launch it: OutOfResources, which the autotuner skips).
    columns = [int(x) for x in re.findall(r"\btcgen05\.alloc\S*\s+\[[^\]]*\],\s*(\d+);", binary.asm["ptx"])]
    tmem = max(columns + [int(getattr(binary.metadata, "tmem_size", 0) or 0)])
    if tmem:
        row["tensor_memory_columns"] = tmem
    row["blocks_per_sm"] = blocks_per_sm(arch, row["registers"] or 0, row["shared"], compiled.num_warps, tmem)
    sass = _sass(binary.asm["cubin"])
    code = [t for _, t in sass if not t.endswith(":")]
    kinds = sorted({m.group(1) for t in code if (m := _MMA.search(t))})
    row["mma"] = "+".join(kinds) if kinds else "none"
    row["mma_shapes"] = sorted({m.group(0).split(" ")[0] for t in code if (m := _MMA.search(t))})
    row["copy"] = "+".join(name for name, rx in _COPY.items() if any(rx.search(t) for t in code)) or "none"
    row["sass_instructions"] = len(code)
    row["fp32_ops"] = _fp32_ops(code)
    ptx_mmas = _ptx_tcgen05(binary.asm["ptx"])
    utc = [i for i, (_, t) in enumerate(sass) if (m := _MMA.search(t)) and m.group(1).startswith("UTC")]
    row["mma_kind"] = ("tcgen05" if utc or ptx_mmas else "wgmma" if "HGMMA" in kinds else "mma.sync" if "HMMA" in kinds
                       else "none")
    if utc or ptx_mmas:
        row["tcgen05"] = {
            "kinds": sorted({f"kind::{m['kind']}" for m in ptx_mmas}),
            "cta_group": max((m["cta_group"] for m in ptx_mmas), default=1),
            "shapes": sorted({"M{} N{} K{}".format(*m["shape"]) for m in ptx_mmas if m["shape"]}),
            "mma_instructions": len(utc),
            "a_in_tensor_memory": sum(m["a_in_tmem"] for m in ptx_mmas),
            "tensor_memory": _tmem_counts(code),
        }
    ttgir = binary.asm["ttgir"] if "ttgir" in binary.asm else ""
    declared = _ttgir_partitions(ttgir)
    loops = _loops(sass)
    partitions = _partitions(sass, loops, declared, ttgir) if declared else []
    if partitions:
        row["partitions"] = [{k: v for k, v in part.items() if k != "loop"} for part in partitions]
        row["setmaxnreg"] = sorted({int(t.split()[-1], 0) for t in code if _opcode(t) == "USETMAXREG"})
        row["config"]["num_warps"] = partitions[0]["warps"] or compiled.num_warps  # as asked, not every partition's
        row["total_warps"] = compiled.num_warps
    hot, beside = _steady_state(sass, partitions) if partitions else (None, [])
    hot = hot or _hot_loop(sass)
    if hot:
        body = _body(sass, hot)
        row["hot_loop"] = {"instructions": len(body), "mix": _instruction_mix(body), "fp32_ops": _fp32_ops(body)}
        # Warps that run the loop: all of the kernel's, or where warp-specialized, each partition its own loop
        # with its own warps (the MMA partition's loop is the hot loop).
        runs = [(_body(sass, part["loop"]), part["warps"]) for part in beside if part["loop"]] or [(body, compiled.num_warps)]
        if partitions:
            everything = [t for b, _ in runs for t in b]
            row["hot_loop"].update(instructions=len(everything), mix=_instruction_mix(everything), fp32_ops=_fp32_ops(everything))
        mma_warps = next((part["warps"] for part in partitions if part["loop"] == hot), compiled.num_warps)
        products = MATRIX_PRODUCTS.get(compiled.kernel)
        if products and {"BLOCK_M", "BLOCK_N", "HEAD_DIM"} <= c.keys():
            needed = products * c["BLOCK_M"] * c["BLOCK_N"] * c["HEAD_DIM"]
            indices = [i for i in range(hot[0], hot[1] + 1) if _MMA.search(sass[i][1])]
            tcgen05 = [i for i in indices if _MMA.search(sass[i][1]).group(1).startswith("UTC")]
            executed = sum(_mma_macs(sass[i][1]) * (mma_warps // 4 if _MMA.search(sass[i][1]).group(1) == "HGMMA" else mma_warps)
                           for i in indices if i not in tcgen05)
            shapes = []
            if tcgen05:  # issued once per CTA by one thread, whatever the warps
                macs = _tcgen05_macs(sass, tcgen05, hot, ptx_mmas)
                executed, shapes = (executed + macs[0], macs[1]) if macs else (None, [])
            warp_instructions = None if any(w is None for _, w in runs) else sum(len(b) * w for b, w in runs)
            row["hot_loop"].update(
                useful_macs=needed,
                warp_instructions_per_million_macs=round(warp_instructions * 1e6 / needed) if warp_instructions else None,
                mma_work_ratio=round(executed / needed, 3) if executed is not None else None,
            )
            if tcgen05:
                row["hot_loop"]["tcgen05_shapes"] = sorted({"M{} N{} K{}".format(*x) for x in shapes})
                row["hot_loop"]["tensor_memory"] = _tmem_counts([t for b, _ in runs for t in b])
    return row


# --------------------------------------------------------------------------------------------
# Running cases
# --------------------------------------------------------------------------------------------


def compile_case(case: Case, target: str) -> list[dict]:
    """Rows for every kernel the launcher compiled for ``case`` on ``target``; a launcher or
    compiler failure is one row with ``error``."""
    arch = ARCHS[target]
    started = time.perf_counter()
    with compiling_for(arch) as launched:
        try:
            _run_case(case)
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
            for dim in dims:
                pairs.append((Case("rope", dtype, dim), target))
    return pairs


def can_compile(target: str) -> bool:
    """Whether the installed Triton and its ptxas compile for ``target`` (sm_100a needs a recent one)."""
    rows = compile_case(Case("gelu_fwd", "bfloat16", width=1024), target)
    return not any("error" in r for r in rows)


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _config_text(config: dict) -> str:
    if "BLOCK_M" in config and "BLOCK_N" in config:
        specialized = f" ws{config['maxnreg']}" if "maxnreg" in config else ""
        return f"M{config['BLOCK_M']} N{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}{specialized}"
    blocks = " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in config.items() if k.startswith("BLOCK"))
    return f"{blocks} w{config['num_warps']}"


def _shape_text(row: dict) -> str:
    """What the row's case is: dtype, head dim / width, causal, GQA."""
    parts = row["case"].split("-")[1:]
    return " ".join(p for p in parts if not re.fullmatch(r"M\d+N\d+w\d+s\d+(ws\d+)?", p))


def markdown(rows: list[dict]) -> str:
    """One table row per compiled kernel (or error) of ``rows``."""
    head = (
        "| target | kernel | case | config | regs | spills (st/ld B) | smem KiB (limit) | blocks/SM | MMA | C7515 | copy "
        "| hot loop instr | warp instr / M MAC | MMA work / needed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['target']} | {r['kernel']} | {r['case']} | | | | | | | | | | | error: {r['error'][:120]} |")
            continue
        hot = r.get("hot_loop", {})
        lines.append(
            f"| {r['target']} | {r['kernel'].lstrip('_')} | {_shape_text(r)} | {_config_text(r['config'])} | {r['registers']} "
            f"| {r['spill_stores']}/{r['spill_loads']} | {r['shared'] / 1024:.0f} ({r['smem_limit'] // 1024}) | {r['blocks_per_sm']} "
            f"| {r['mma']} | {'yes' if r['wgmma_serialized'] else 'no'} | {r['copy']} | {hot.get('instructions', '')} "
            f"| {hot.get('warp_instructions_per_million_macs', '')} | {hot.get('mma_work_ratio', '')} |"
        )
    return head + "\n".join(lines) + "\n"


def environment() -> dict:
    import torch
    import triton

    import hashlib

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "kernels"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if dirty:
        commit += " with uncommitted kernel changes"
    return {"triton": triton.__version__, "torch": torch.__version__, "python": sys.version.split()[0], "commit": commit,
            "date": time.strftime("%Y-%m-%d"),
            "kernels_sha256": hashlib.sha256(b"".join(p.read_bytes() for p in sorted((REPO / "kernels").glob("*.py")))).hexdigest()[:16],
            "ptxas": {t: Path(_ptxas(a.capability)).name for t, a in ARCHS.items()}}


NOTE = ("Compile-time facts, not speed: each kernel compiled by Triton {triton} for the target without a GPU "
        "(commit {commit}, {date}), read from ptxas -v and the SASS. Registers and spills per thread; "
        "smem = shared memory the kernel requests per block; blocks/SM from registers, shared memory and warps; "
        "MMA: HGMMA = Hopper warpgroup MMA (wgmma), HMMA = mma.sync; C7515 = ptxas serialized the wgmma; "
        "copy: TMA, cp.async or plain global loads; hot loop = the innermost loop with the most MMAs; "
        "warp instructions per million useful multiply-adds and the multiply-adds the MMAs execute over those "
        "needed (1.0 = no repeated work) are per iteration of that loop.")


def overview_rows(rows: list[dict]) -> list[dict]:
    """The attention kernels and the tutorial yardsticks at bf16, MHA, not causal, on sm_90a and
    sm_80, one row per configuration (and every error): static.md's first table."""
    return [r for r in rows if "error" in r or (
        r["kernel"] in ATTENTION_KERNELS + TUTORIAL_KERNELS and r["dtype"] == "bfloat16"
        and r["case"].endswith("-full-mha") and r["target"] in ("sm_90a", "sm_80"))]


def variant_table(rows: list[dict]) -> str:
    """Each attention kernel compiled under a mask of real batches (a VARIANTS case) beside the same
    kernel, configuration and target of its dense twin: registers, spills and the hot loop's warp
    instructions per million useful multiply-adds."""
    dense = {(r["case"], r["target"], r["kernel"], _config_text(r["config"])): r
             for r in rows if "error" not in r and r["kernel"] in ATTENTION_KERNELS}
    head = ("| target | kernel | case | config | regs (dense) | spills st/ld B (dense) | warp instr / M MAC (dense) "
            "| ratio |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        variant = r["case"].rsplit("-", 1)[-1]
        if "error" in r or variant not in VARIANTS or variant == "dense" or r["kernel"] not in ATTENTION_KERNELS:
            continue
        config = _config_text(r["config"])
        twin = dense.get((r["case"].removesuffix(f"-{variant}"), r["target"], r["kernel"], config))
        ours = r.get("hot_loop", {}).get("warp_instructions_per_million_macs")
        theirs = twin.get("hot_loop", {}).get("warp_instructions_per_million_macs") if twin else None
        ratio = f"{ours / theirs:.2f}" if ours and theirs else ""
        twin_regs = twin["registers"] if twin else "n/a"
        twin_spills = f"{twin['spill_stores']}/{twin['spill_loads']}" if twin else "n/a"
        lines.append(
            f"| {r['target']} | {r['kernel'].lstrip('_')} | {_shape_text(r)} | {config} "
            f"| {r['registers']} ({twin_regs}) | {r['spill_stores']}/{r['spill_loads']} ({twin_spills}) "
            f"| {ours or ''} ({theirs or 'n/a'}) | {ratio} |"
        )
    return head + "\n".join(lines) + "\n"


# What the Blackwell table compares each attention kernel with: the yardsticks of the same work.
BLACKWELL_YARDSTICKS = {"_attn_fwd": ("_tutorial_attn_fwd", "_tutorial_tma_attn_fwd", "_tutorial_ws_attn_fwd"),
                        "_attn_bwd_dq": ("_tutorial_attn_bwd_dq",), "_attn_bwd_dkdv": ("_tutorial_attn_bwd_dkdv",)}


def _per_mac(row: dict):
    return row.get("hot_loop", {}).get("warp_instructions_per_million_macs")


def _tcgen05_text(row: dict) -> str:
    """The MMA column of the Blackwell table: tcgen05's kind and the hot loop's shapes (M N K per instruction)."""
    if row.get("mma_kind") != "tcgen05":
        return row.get("mma_kind", row["mma"])
    info = row["tcgen05"]
    shapes = row.get("hot_loop", {}).get("tcgen05_shapes") or info["shapes"]
    pair = " cta_group::2" if info["cta_group"] == 2 else ""
    return f"tcgen05 {'+'.join(info['kinds']) or 'kind::?'}{pair} {', '.join(shapes)}".replace("kind::", "")


def _partitions_text(row: dict) -> str:
    """Warp-specialized partitions as role warps x registers (setmaxnreg's count), the default first."""
    parts = row.get("partitions")
    if not parts:
        return ""
    shown = [p for p in parts if p["loop_instructions"] or p["partition"] == "default"]
    return ", ".join(f"{p['role']} {p['warps']}w x{p['registers']}" for p in shown)


def blackwell_rows(rows: list[dict]) -> list[dict]:
    """The sm_100a attention kernels and yardsticks (every dtype but fp32, dense masks only)."""
    return [r for r in rows if r.get("target") == "sm_100a" and "error" not in r
            and r["kernel"] in ATTENTION_KERNELS + TUTORIAL_KERNELS and r["dtype"] != "float32"
            and r["case"].rsplit("-", 1)[-1] not in tuple(v for v in VARIANTS if v != "dense")]


def blackwell_table(rows: list[dict]) -> str:
    """One line per sm_100a attention kernel: registers, spills, the tcgen05 MMAs, the hot loop's tensor-memory
    loads and stores, the partitions where warp-specialized, the hot loop (for a warp-specialized kernel the
    loops of all partitions, each weighted by its warps), and its warp instructions per million useful
    multiply-adds over the best yardstick's of the same head dim and causality (ratio < 1: fewer).
    Lines start with the kernel, not the target: they are all sm_100a."""
    best: dict = {}
    for r in rows:
        if r.get("target") == "sm_100a" and "error" not in r and r["kernel"] in TUTORIAL_KERNELS and _per_mac(r):
            key = (r["kernel"], r["constexprs"].get("HEAD_DIM"), bool(r["constexprs"].get("CAUSAL")))
            best[key] = min(best.get(key, _per_mac(r)), _per_mac(r))
    head = ("| kernel | case | config | regs | spills (st/ld B) | smem KiB | TMEM cols | blocks/SM | MMA (hot loop shapes) "
            "| TMEM ld/st | partitions | hot loop instr | warp instr / M MAC | MMA work / needed | vs yardstick |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in blackwell_rows(rows):
        hot = r.get("hot_loop", {})
        tmem = hot.get("tensor_memory", {})
        dim, causal = r["constexprs"].get("HEAD_DIM"), bool(r["constexprs"].get("CAUSAL"))
        yard = [best[(k, dim, causal)] for k in BLACKWELL_YARDSTICKS.get(r["kernel"], ()) if (k, dim, causal) in best]
        ratio = f"{_per_mac(r) / min(yard):.2f} ({min(yard)})" if yard and _per_mac(r) else ""
        lines.append(
            f"| {r['kernel'].lstrip('_')} | {_shape_text(r)} | {_config_text(r['config'])} | {r['registers']} "
            f"| {r['spill_stores']}/{r['spill_loads']} | {r['shared'] / 1024:.0f} | {r.get('tensor_memory_columns', '')} "
            f"| {r['blocks_per_sm']} | {_tcgen05_text(r)} "
            f"| {tmem.get('LDTM', 0)}/{tmem.get('STTM', 0)} | {_partitions_text(r)} | {hot.get('instructions', '')} "
            f"| {hot.get('warp_instructions_per_million_macs', '')} | {hot.get('mma_work_ratio', '')} | {ratio} |"
        )
    return head + "\n".join(lines) + "\n"


BLACKWELL_NOTE = (
    "Every attention kernel compiled for sm_100a (B200), beside the tutorial's yardsticks there, its "
    "warp-specialized forward (tutorial_ws_attn_fwd) among them. MMA: tcgen05.mma (SASS UTCHMMA for kind::f16), "
    "issued by one thread for the CTA and asynchronous, its M N K per instruction read from the instruction "
    "descriptor; MMA work / needed from those shapes. TMEM cols: tensor memory the kernel allocates (512 columns "
    "an SM; more, and Triton compiles the kernel to a trap and refuses to launch it, MMA none); blocks/SM counts "
    "it with shared memory and registers (0: does not fit). TMEM ld/st: tensor-memory loads and stores (LDTM/STTM, "
    "tcgen05.ld/st) in the hot loop. Partitions (warp-specialized kernels): role, warps and the register count "
    "setmaxnreg gives them; their loops all count in the hot loop's instructions, each weighted by its own warps "
    "in the instructions per multiply-add. vs yardstick: instructions per multiply-add over the best yardstick's "
    "at the same head dim and causality (in brackets).")


def _compiled_note(env: dict) -> str:
    """Where ``--merge`` left targets compiled at other commits: each target's commit, Triton and day."""
    compiled = env.get("compiled", {})
    if len({(c["commit"], c["triton"], c["date"]) for c in compiled.values()}) <= 1:
        return ""
    return " Targets compiled apart (`--merge`): " + "; ".join(
        f"{target} at commit {c['commit']} by Triton {c['triton']} ({c['date']})" for target, c in compiled.items()) + "."


def markdown_document(payload: dict) -> str:
    """static.md from static.json's content: the note, the attention overview, the masks beside
    the dense kernels, Blackwell's attention where the run compiled for sm_100a, then every row."""
    env, rows = payload["environment"], payload["rows"]
    blackwell = blackwell_rows(rows)
    title = "H100, A100 and B200" if blackwell else "H100 and A100"
    return (
        f"# Compiled for {title}\n\nGenerated by `python -m bench static` (no GPU needed). {NOTE.format(**env)}"
        f"{_compiled_note(env)}\n\n"
        "## Attention against the tutorial's yardsticks\n\n"
        "bf16, MHA, not causal: every configuration the autotuner can pick, beside the Triton tutorial's "
        "fused attention compiled the same way.\n\n" + markdown(overview_rows(rows))
        + "\n## The masks of real batches beside the dense kernels\n\n"
        "Each kernel compiled with a 1024-key window, softcap 50 or two packed documents (bench/static.py's "
        "VARIANTS), beside the dense kernel of the same case, configuration and target (n/a: the autotuner "
        "picks that configuration only under the mask).\n\n" + variant_table(rows)
        + (f"\n## Blackwell (sm_100a)\n\n{BLACKWELL_NOTE}\n\n" + blackwell_table(rows) if blackwell else "")
        + "\n## Every kernel\n\nEvery kernel the run compiled: attention causal and with GQA too, the norms, activations and RoPE.\n\n"
        + markdown(rows)
    )


def write(rows: list[dict], out: Path, kept: dict | None = None) -> tuple[Path, Path]:
    """static.json and static.md in ``out`` from ``rows``, this run's; ``kept`` (``--merge``) is a
    previous static.json whose rows of the targets this run did not compile stay beside them. Its
    ``compiled`` entry says, per target, from which commit, Triton and day its rows come."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "static.json", out / "static.md"
    env = environment()
    here = {"commit": env["commit"], "triton": env["triton"], "date": env["date"], "kernels_sha256": env["kernels_sha256"]}
    compiled = {target: here for target in dict.fromkeys(row["target"] for row in rows)}
    if kept is not None:
        earlier = kept["environment"]
        others = [row for row in kept["rows"] if row["target"] not in compiled]
        for target in dict.fromkeys(row["target"] for row in others):
            compiled[target] = earlier.get("compiled", {}).get(target) or {
                key: earlier[key] for key in ("commit", "triton", "date", "kernels_sha256")}
        rows = others + rows
    payload = {"suite": "static", "environment": {**env, "compiled": compiled}, "rows": rows}
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(markdown_document(payload))
    return json_path, md_path


def _compiled_cases(pairs: list[tuple[Case, str]], jobs: int):
    """(case, target, rows) in ``pairs``' order, compiled ``jobs`` at a time (each in its own
    interpreter when more than one: Triton's stand-in driver is per process)."""
    if jobs == 1:
        for case, target in pairs:
            yield case, target, compile_case(case, target)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_in_subprocess, case, target, 1800) for case, target in pairs]
        for (case, target), future in zip(pairs, futures):
            yield case, target, future.result()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench static", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="every dtype, head dims 64/128/256, GQA everywhere (long)")
    parser.add_argument("--targets", nargs="+", choices=list(ARCHS), help="only these targets")
    parser.add_argument("--only", help="only cases whose id contains this text (e.g. attention_fwd-bfloat16-D128)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT.relative_to(REPO)})")
    parser.add_argument("--jobs", type=int, default=1, help="cases compiled at once, each in its own process (default 1)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the targets this run does not compile from the static.json in --out "
                        "(regenerate one target at a time; the file records each target's commit)")
    parser.add_argument("--markdown-only", action="store_true",
                        help="compile nothing: rewrite static.md in --out from the static.json there")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)  # internal: one case (JSON), rows as JSON on stdout
    args = parser.parse_args(argv)
    if args.markdown_only:
        md_path = args.out / "static.md"
        md_path.write_text(markdown_document(json.loads((args.out / "static.json").read_text())))
        print(f"wrote {md_path}")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret
    # Triton 3.9 fuses multiply-adds by default but warns that 3.10 will not: pin the fused form GPUs run
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.case_json:
        spec = json.loads(args.case_json)
        case = Case(**{k: tuple(v) if k == "config" and v else v for k, v in spec["case"].items()})
        print(json.dumps(compile_case(case, spec["target"])))
        return 0
    pairs = [(c, t) for c, t in sweep(args.all) if (not args.targets or t in args.targets) and (not args.only or args.only in c.id)]
    usable = {t: can_compile(t) for t in dict.fromkeys(t for _, t in pairs)}
    for target, ok in usable.items():
        if not ok:
            print(f"{target}: the installed Triton cannot compile for it; skipped", file=sys.stderr)
    kept = json.loads((args.out / "static.json").read_text()) if args.merge else None
    rows, started = [], time.perf_counter()
    compiling = [p for p in pairs if usable[p[1]]]
    for i, (case, target, new) in enumerate(_compiled_cases(compiling, max(args.jobs, 1))):
        rows.extend(new)
        write(rows, args.out, kept)  # after every case: a long run interrupted keeps what it compiled
        print(f"[{i + 1}/{len(pairs)} {time.perf_counter() - started:.0f}s] {target} {case.id}: {len(new)} kernel(s)"
              + "".join(f"; ERROR {r['error'][:200]}" for r in new if "error" in r), file=sys.stderr, flush=True)
    json_path, md_path = write(rows, args.out, kept)
    print(f"wrote {json_path} and {md_path} ({time.perf_counter() - started:.0f} s)")
    return 0


def run_in_subprocess(case: Case, target: str, timeout: float = 600) -> list[dict]:
    """compile_case in a fresh interpreter without TRITON_INTERPRET (the test process interprets)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    spec = json.dumps({"case": dataclasses.asdict(case), "target": target})
    done = subprocess.run([sys.executable, "-m", "bench", "static", "--case-json", spec], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"compiling {case.id} for {target} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
