"""`python -m bench`: run benchmark suites on the GPU and write results, tables and plots.

    python -m bench                      # every suite, full mode (train the longest: its timings and its
                                         # longest-sequence search)
    python -m bench --quick norms        # chosen suites, quick mode (fewer cases, shorter timing windows)
    python -m bench results              # rebuild the generated tables of docs/results.md from bench/results/
    python -m bench summary --out DIR    # one line per suite of the run in DIR
    python -m bench static               # no GPU: every kernel compiled for sm_90a and sm_80 (bench/static/)
    python -m bench host                 # no GPU: each op's and block's host time per call, launches stubbed,
                                         # beside eager PyTorch (bench/host.py)
    python -m bench frontier             # torch.compile's memory/recompute frontier beside ours, one layer
                                         # (bench/frontier.py; runs on CPU too)
    python -m bench checkpoint           # no GPU: the trainer's checkpoint save/load time and bytes per rank,
                                         # sharded against gathered, DDP and FSDP2 on gloo CPU ranks
                                         # (bench/checkpoint.py)
    python -m bench peak                 # no GPU: one block's peak memory beside what autograd keeps (bench/peak.py)
    python -m bench context_parallel     # no GPU: context parallelism over packed documents, per rank: pairs,
                                         # bytes received, transient memory (bench/context_parallel.py)
    python -m bench traffic              # no GPU: the bytes each norm and activation kernel moves against what it
                                         # must move, per width (bench/traffic.py)

Results go to bench/results/<gpu-name>/ (or --out): <suite>.json with the device, versions, date
and commit; <suite>.md; <suite>*.png.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

from bench import harness, report

# The registry: suite name -> the module whose SUITE (a harness.Suite) it is. A suite module is
# imported only when it runs, after --smoke has set TRITON_INTERPRET.
SUITES = {"norms": "bench.bench_norms", "attention": "bench.bench_attention", "memory": "bench.bench_memory",
          "block": "bench.bench_block", "train": "bench.bench_train", "loss": "bench.bench_loss"}
# Commands that are not timing suites and need no GPU: name -> module with main(argv).
COMMANDS = {"static": "bench.static", "host": "bench.host", "frontier": "bench.frontier", "checkpoint": "bench.checkpoint",
            "gpu_stage": "bench.gpu_check", "peak": "bench.peak", "context_parallel": "bench.context_parallel",
            "traffic": "bench.traffic"}


def load_suite(name: str) -> harness.Suite:
    suite = importlib.import_module(SUITES[name]).SUITE
    if suite.name != name:
        raise RuntimeError(f"{SUITES[name]}.SUITE is named {suite.name!r}, registered as {name!r}")
    return suite


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="*", help=f"'results' (rebuild docs/results.md's tables), 'summary', or suites among {', '.join(SUITES)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing windows")
    parser.add_argument("--out", type=Path, help="results folder (default: bench/results/<gpu-name>/)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU only, tiny cases through the Triton interpreter, to prove the pipeline runs "
                        "(CI does this); its timings say nothing about speed and --out is required")
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES and s not in ("results", "summary")]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}, 'results' or 'summary'")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    args = _parse(argv)
    if args.suites == ["summary"]:
        print(report.summary(args.out or report.device_folder(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")))
        return 0
    if args.suites == ["results"]:
        print(f"updated {report.update_results_page()}")
        return 0
    if args.smoke and args.out is None:
        print("--smoke needs --out: its timings are meaningless and never go to bench/results/", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("python -m bench measures kernel speed and needs a CUDA GPU (or --smoke --out DIR to test the pipeline on CPU).", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any suite imports triton
        os.environ.setdefault("FUSED_REMAT_BACKEND", "triton")
    started = time.perf_counter()
    environment = harness.environment()
    folder = args.out or report.device_folder(environment["device"])
    print(f"{environment['device']}: torch {environment['torch']}, triton {environment['triton']}, CUDA {environment['cuda']}, commit {environment['commit']}")
    ceilings = harness.measure_ceilings(args.quick)
    if ceilings:
        print(f"measured ceilings: copy {ceilings['copy_GBps']:,.0f} GB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:,.0f} TFLOP/s\n")
    for name in args.suites or list(SUITES):
        suite = load_suite(name)
        suite_started = time.perf_counter()
        results = suite.run(args.quick, device)
        report.write_json(folder, name, environment, ceilings, results)
        report.write_markdown(folder, name, environment, ceilings, results)
        suite.plots(folder, results, ceilings)
        print(report.markdown_table(name, environment, ceilings, results))
        print(f"({name}: {time.perf_counter() - suite_started:.0f} s)\n")
    print(f"results in {folder} ({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
