"""static.json and static.md: the tables, the environment a run records, and writing both."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.static.cases import ATTENTION_KERNELS, VARIANTS
from bench.static.sass import ptxas
from bench.static.targets import ARCHS
from bench.static.tutorial import TUTORIAL_KERNELS

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "static"


def config_text(config: dict) -> str:
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
            f"| {r['target']} | {r['kernel'].lstrip('_')} | {_shape_text(r)} | {config_text(r['config'])} | {r['registers']} "
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
            "ptxas": {t: Path(ptxas(a.capability)).name for t, a in ARCHS.items()}}


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
    dense = {(r["case"], r["target"], r["kernel"], config_text(r["config"])): r
             for r in rows if "error" not in r and r["kernel"] in ATTENTION_KERNELS}
    head = ("| target | kernel | case | config | regs (dense) | spills st/ld B (dense) | warp instr / M MAC (dense) "
            "| ratio |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        variant = r["case"].rsplit("-", 1)[-1]
        if "error" in r or variant not in VARIANTS or variant == "dense" or r["kernel"] not in ATTENTION_KERNELS:
            continue
        config = config_text(r["config"])
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
            f"| {r['kernel'].lstrip('_')} | {_shape_text(r)} | {config_text(r['config'])} | {r['registers']} "
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
        "Each kernel compiled with a 1024-key window, softcap 50 or two packed documents (bench/static/cases.py's "
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
