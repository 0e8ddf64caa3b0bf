"""`python -m bench context_parallel`: context parallelism over packed documents, per rank, counted.

For one packed row of mixed document lengths (``MIX``: many short documents and a few long ones, as
a pretraining corpus packs them), at 2 and 4 ranks: what each rank's attention computes and what it
communicates per layer, for the per-document layout with gathered k and v
(``fused_remat.context_parallel_documents``), beside the zigzag ring over the whole row
(``fused_remat.context_parallel``, which cannot mask documents, so it computes every causal pair of
the row) and one process with ``attention_varlen``. Counted from the layouts the code builds, not
timed: pairs are (query, key) pairs per head that the kernels compute (masked tiles skipped);
bytes are what a rank receives per layer for a Llama-like GQA layer (8 k/v heads of 128, bf16),
forward and backward; transient is the document attention's working set above its inputs and
outputs (``attention_transient_bytes``, held to the peak meter in
tests/test_context_parallel_documents.py). Writes ``context_parallel.json`` and ``.md`` under
``bench/results/context_parallel/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from fused_remat.context_parallel_documents import attention_transient_bytes, shard_documents
from fused_remat.flops import visible_pairs

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "context_parallel"
# Document lengths of one packed 64k-token row: a long-tailed mix, the last one padding it to 65,536.
MIX = [4096, 17, 900, 2500, 33, 1, 12000, 640, 70, 3000, 8, 5000, 260, 1200, 9000, 311, 45, 7000, 128, 2, 1500,
       6200, 90, 3100, 700]
ROW = 65536
KV_WIDTH, COMPUTE_BYTES = 8 * 128, 2  # Llama-3-8B's k/v heads, bf16
WORLDS = (2, 4)


def _lengths() -> list[int]:
    return [*MIX, ROW - sum(MIX)]


def _cu_seqlens() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(_lengths()).cumsum(0).tolist()], dtype=torch.int32)


def rank_rows(world: int) -> list[dict]:
    cu = _cu_seqlens()
    local = ROW // world
    row, row32 = 2 * KV_WIDTH * COMPUTE_BYTES, 2 * KV_WIDTH * 4  # a token's k and v; their fp32 gradients
    ring_pairs = visible_pairs(ROW, ROW, True) // world
    rows = []
    for rank in range(world):
        keys = shard_documents(cu, world, rank).keys
        gathered = (world - 1) * local * row  # every other rank's k and v, once per all-gather
        rows.append(dict(
            world=world, rank=rank, tokens=local, pairs=keys.pairs(), ring_pairs=ring_pairs,
            forward_bytes=gathered, backward_bytes=gathered + (world - 1) * local * row32,  # + reduce-scatter
            ring_forward_bytes=(world - 1) * local * row,  # W - 1 shifts of a rank's k and v
            ring_backward_bytes=(world - 1) * local * row + world * local * row32,  # k/v again, dK/dV home
            transient_bytes=attention_transient_bytes(world, local, keys.keys, KV_WIDTH, COMPUTE_BYTES)))
    return rows


def markdown(rows: list[dict], one_process: int, env: dict) -> str:
    lines = [
        "# Context parallelism over packed documents, per rank",
        "",
        f"{env['machine']}; Python {env['python']}, torch {env['torch']}, commit {env['commit']}; counted from the "
        "layouts, not timed "
        "(`python -m bench context_parallel`, bench/context_parallel.py).",
        "",
        f"One packed row of {ROW:,} tokens in {len(_lengths())} documents ({min(_lengths()):,} to "
        f"{max(_lengths()):,} tokens); one process computes {one_process:,} causal pairs per head. Bytes "
        f"received per layer for k/v heads of {KV_WIDTH} elements, bf16 (Llama-3-8B's); the ring masks no "
        "documents, so it computes every causal pair of the row.",
        "",
        "| ranks | rank | tokens | pairs (documents) | pairs (ring, whole row) | received fwd / bwd MiB (documents) "
        "| received fwd / bwd MiB (ring) | attention transient MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 2**20
    for r in rows:
        lines.append(f"| {r['world']} | {r['rank']} | {r['tokens']:,} | {r['pairs']:,} | {r['ring_pairs']:,} | "
                     f"{r['forward_bytes'] / mib:.0f} / {r['backward_bytes'] / mib:.0f} | "
                     f"{r['ring_forward_bytes'] / mib:.0f} / {r['ring_backward_bytes'] / mib:.0f} | "
                     f"{r['transient_bytes'] / mib:.0f} |")
    lines.append("")
    for world in WORLDS:
        pairs = [r["pairs"] for r in rows if r["world"] == world]
        lines.append(f"- {world} ranks: the ranks' pairs sum to one process's ({sum(pairs) == one_process}); "
                     f"largest over smallest {max(pairs) / min(pairs):.5f}; the ring computes "
                     f"{visible_pairs(ROW, ROW, True) / one_process:.1f}x one process's pairs in all.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench context_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    one_process = shard_documents(_cu_seqlens(), 1, 0).keys.pairs()
    rows = [row for world in WORLDS for row in rank_rows(world)]
    from bench.harness import _git_commit

    env = dict(machine=platform.processor() or platform.machine(), python=platform.python_version(),
               torch=torch.__version__, commit=_git_commit())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_parallel.json").write_text(json.dumps(dict(environment=env, lengths=_lengths(),
                                                                    one_process_pairs=one_process, rows=rows),
                                                               indent=1) + "\n")
    (args.out / "context_parallel.md").write_text(markdown(rows, one_process, env))
    print((args.out / "context_parallel.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
