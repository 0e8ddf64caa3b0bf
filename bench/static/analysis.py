"""``analyze``: one compiled kernel's compile-time facts, a row of static.json."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from bench.static.blackwell import (find_partitions, ptx_tcgen05, steady_state, tcgen05_macs, tmem_counts,
                                    ttgir_partitions)
from bench.static.cases import MATRIX_PRODUCTS
from bench.static.driver import Compiled
from bench.static.sass import (COPY, MMA, disassemble, find_loops, fp32_ops, hot_loop, instruction_mix, loop_body,
                               mma_macs, opcode, ptxas, ptxas_flags, run)
from bench.static.targets import Arch, blocks_per_sm


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
        path = ptxas(arch.capability)
        log = run([path, *ptxas_flags(path), "-v", f"--gpu-name={arch.name}", str(ptx), "-o", str(Path(tmp) / "k.o")])
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
    sass = disassemble(binary.asm["cubin"])
    code = [t for _, t in sass if not t.endswith(":")]
    kinds = sorted({m.group(1) for t in code if (m := MMA.search(t))})
    row["mma"] = "+".join(kinds) if kinds else "none"
    row["mma_shapes"] = sorted({m.group(0).split(" ")[0] for t in code if (m := MMA.search(t))})
    row["copy"] = "+".join(name for name, rx in COPY.items() if any(rx.search(t) for t in code)) or "none"
    row["sass_instructions"] = len(code)
    row["fp32_ops"] = fp32_ops(code)
    ptx_mmas = ptx_tcgen05(binary.asm["ptx"])
    utc = [i for i, (_, t) in enumerate(sass) if (m := MMA.search(t)) and m.group(1).startswith("UTC")]
    row["mma_kind"] = ("tcgen05" if utc or ptx_mmas else "wgmma" if "HGMMA" in kinds else "mma.sync" if "HMMA" in kinds
                       else "none")
    if utc or ptx_mmas:
        row["tcgen05"] = {
            "kinds": sorted({f"kind::{m['kind']}" for m in ptx_mmas}),
            "cta_group": max((m["cta_group"] for m in ptx_mmas), default=1),
            "shapes": sorted({"M{} N{} K{}".format(*m["shape"]) for m in ptx_mmas if m["shape"]}),
            "mma_instructions": len(utc),
            "a_in_tensor_memory": sum(m["a_in_tmem"] for m in ptx_mmas),
            "tensor_memory": tmem_counts(code),
        }
    ttgir = binary.asm["ttgir"] if "ttgir" in binary.asm else ""
    declared = ttgir_partitions(ttgir)
    loops = find_loops(sass)
    partitions = find_partitions(sass, loops, declared, ttgir) if declared else []
    if partitions:
        row["partitions"] = [{k: v for k, v in part.items() if k != "loop"} for part in partitions]
        row["setmaxnreg"] = sorted({int(t.split()[-1], 0) for t in code if opcode(t) == "USETMAXREG"})
        row["config"]["num_warps"] = partitions[0]["warps"] or compiled.num_warps  # as asked, not every partition's
        row["total_warps"] = compiled.num_warps
    hot, beside = steady_state(sass, partitions) if partitions else (None, [])
    hot = hot or hot_loop(sass)
    if hot:
        body = loop_body(sass, hot)
        row["hot_loop"] = {"instructions": len(body), "mix": instruction_mix(body), "fp32_ops": fp32_ops(body)}
        # Warps that run the loop: all of the kernel's, or where warp-specialized, each partition its own loop
        # with its own warps (the MMA partition's loop is the hot loop).
        runs = [(loop_body(sass, part["loop"]), part["warps"]) for part in beside if part["loop"]] or [(body, compiled.num_warps)]
        if partitions:
            everything = [t for b, _ in runs for t in b]
            row["hot_loop"].update(instructions=len(everything), mix=instruction_mix(everything), fp32_ops=fp32_ops(everything))
        mma_warps = next((part["warps"] for part in partitions if part["loop"] == hot), compiled.num_warps)
        products = MATRIX_PRODUCTS.get(compiled.kernel)
        if products and {"BLOCK_M", "BLOCK_N", "HEAD_DIM"} <= c.keys():
            needed = products * c["BLOCK_M"] * c["BLOCK_N"] * c["HEAD_DIM"]
            indices = [i for i in range(hot[0], hot[1] + 1) if MMA.search(sass[i][1])]
            tcgen05 = [i for i in indices if MMA.search(sass[i][1]).group(1).startswith("UTC")]
            executed = sum(mma_macs(sass[i][1]) * (mma_warps // 4 if MMA.search(sass[i][1]).group(1) == "HGMMA" else mma_warps)
                           for i in indices if i not in tcgen05)
            shapes = []
            if tcgen05:  # issued once per CTA by one thread, whatever the warps
                macs = tcgen05_macs(sass, tcgen05, hot, ptx_mmas)
                executed, shapes = (executed + macs[0], macs[1]) if macs else (None, [])
            warp_instructions = None if any(w is None for _, w in runs) else sum(len(b) * w for b, w in runs)
            row["hot_loop"].update(
                useful_macs=needed,
                warp_instructions_per_million_macs=round(warp_instructions * 1e6 / needed) if warp_instructions else None,
                mma_work_ratio=round(executed / needed, 3) if executed is not None else None,
            )
            if tcgen05:
                row["hot_loop"]["tcgen05_shapes"] = sorted({"M{} N{} K{}".format(*x) for x in shapes})
                row["hot_loop"]["tensor_memory"] = tmem_counts([t for b, _ in runs for t in b])
    return row
