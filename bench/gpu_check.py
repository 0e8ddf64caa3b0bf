"""`python -m bench gpu_stage STAGE ...`: the record of one stage of ``bench/gpu_check.sh``.

``gpu_check_<stage>.json`` beside the stage's log: the machine (device, NVIDIA driver, torch,
Triton, CUDA, Python, date, commit), the stage's exit status and seconds, and its summary, the
log's last lines and every FAILED or ERROR line. ``python -m bench results`` turns the records into
the table of GPU check stages in docs/results.md (``bench/report.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench import harness

SUMMARY_LINES = 8
FAILURE_LINES = 20
_FAILURE = re.compile(r"^(FAILED|ERROR)\b")


def summary(log: str) -> list[str]:
    """What a reader of the stages' table needs from a stage's log: its failures, then its last lines."""
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    failures = [line for line in lines if _FAILURE.match(line)][:FAILURE_LINES]
    tail = [line for line in lines[-SUMMARY_LINES:] if line not in failures]
    return failures + tail


def record(stage: str, exit_status: int, seconds: int, log_path: Path, out: Path, dry_run: bool) -> Path:
    payload = {
        "stage": stage, "dry_run": dry_run, "exit": exit_status, "timed_out": exit_status == 124, "seconds": seconds,
        "environment": harness.environment(), "log": log_path.name,
        "summary": summary(log_path.read_text(errors="replace") if log_path.exists() else ""),
    }
    path = out / f"gpu_check_{stage}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    verdict = "timed out" if payload["timed_out"] else f"exit {exit_status}"
    print(f"== {stage} ({verdict}, {seconds} s){' [dry run]' if dry_run else ''}")
    for line in payload["summary"]:
        print(f"   {line}")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu_stage", description=__doc__.split("\n")[0])
    parser.add_argument("stage")
    parser.add_argument("--exit", type=int, required=True, dest="exit_status")
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    record(args.stage, args.exit_status, args.seconds, args.log, args.out, args.dry_run)
    return 0
