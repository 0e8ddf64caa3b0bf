"""Cases: the project's launchers called on meta tensors, and what the rows of attention are read against."""

from __future__ import annotations

import dataclasses

from bench.static.tutorial import tutorial_launch

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

    op: str  # attention_fwd, attention_bwd, layer_norm_fwd/_bwd, rms_norm_fwd/_bwd, gelu_fwd/_bwd, swiglu_fwd/_bwd,
    # cross_entropy, target_statistics (dtype int64, the targets'), rope,
    # and the yardsticks tutorial_fwd, tutorial_tma_fwd, tutorial_bwd
    dtype: str = "bfloat16"
    head_dim: int = 128
    causal: bool = False
    gqa: bool = False
    width: int = 4096  # norms and activations: columns; cross_entropy, target_statistics: the vocabulary
    config: tuple | None = None  # (BLOCK_M, BLOCK_N, num_warps, num_stages); backward: the dQ kernel's
    dkdv_config: tuple | None = None  # backward: the dK/dV kernel's (default: config)
    variant: str = "dense"  # attention: "dense", or one of VARIANTS (the masks of real batches); rope: "dense"
    # or "varlen" (positions found from packed documents' offsets)

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
            parts = [self.op, self.dtype, f"D{self.head_dim}"] + ([self.variant] if self.variant != "dense" else [])
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


def run_case(case: Case) -> None:
    """Call the project's launcher for ``case`` on meta tensors (under a stand-in driver)."""
    import torch

    from fused_remat.kernels import activations, attention, cross_entropy, norm, rope

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
            mask = dict(mask, documents=attention.Documents((offsets, offsets, length, length)))
        if case.op == "attention_fwd":
            attention.attention_fwd(q, k, v, case.causal, scale, config=config, **mask)
        elif case.op == "attention_bwd":
            lse = torch.empty(q.shape[:-1] if case.variant != "varlen" else q.shape[1::-1], device="meta",
                              dtype=torch.float32)
            o = torch.empty_like(q)
            attention.attention_bwd(torch.empty_like(q), q, k, v, o, lse, case.causal, scale, config=config,
                                    dkdv_config=dkdv_config, **mask)
        else:
            tutorial_launch(case.op, q, k, v, case.causal, scale, config, dkdv_config)
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
    elif case.op == "cross_entropy":  # a chunk of LM-head logits, gradient written over them
        targets = torch.empty(rows, device="meta", dtype=torch.int64)
        scale = torch.empty((), device="meta", dtype=torch.float32)
        cross_entropy.cross_entropy_rows_(x, targets, stats, -100, scale)
    elif case.op == "target_statistics":  # the loss's count of its targets and the mean's scales
        targets = torch.empty(rows, device="meta", dtype=torch.int64)
        cross_entropy.target_statistics_(targets, case.width, -100,
                                         torch.empty(cross_entropy.STATISTICS, device="meta", dtype=torch.float32),
                                         torch.empty((), device="meta", dtype=torch.float32))
    elif case.op == "rope":
        heads = 24  # q and k heads of a packed qkv buffer (16 + 8), rotated in place
        qkv = torch.empty(4, 2048, heads + 8, case.head_dim, **meta)
        freqs = torch.empty(case.head_dim // 2, device="meta", dtype=torch.float32)
        documents = torch.empty(9, device="meta", dtype=torch.int32) if case.variant == "varlen" else None
        rope.rope_(qkv[:, :, :heads], freqs, cu_seqlens=documents)
    else:
        raise ValueError(f"unknown op {case.op!r}")
