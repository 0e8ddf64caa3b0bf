"""The GPU targets compiled for: what the occupancy arithmetic and the shared-memory check need of each."""

from __future__ import annotations

import dataclasses


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
