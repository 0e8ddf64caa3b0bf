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
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.static.cases import Case
from bench.static.run import can_compile, compile_case, sweep
from bench.static.tables import DEFAULT_OUT, REPO, markdown_document, write
from bench.static.targets import ARCHS


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
