"""bench/gpu_check.sh, the first-GPU-contact script, in its CPU dry run: every stage runs in
miniature and leaves its record, which `python -m bench results` turns into the table of stages in
docs/results.md, so that the script is known to work before the rare GPU window it is written for."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.report import results_section

REPO = Path(__file__).resolve().parent.parent
STAGES = ("install", "block", "train", "tests", "bench", "capacity")


def _gpu_check(*arguments: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FUSED_REMAT_BACKEND"}
    return subprocess.run(["bash", "bench/gpu_check.sh", *arguments], cwd=REPO, env={**env, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)


def test_every_stage_runs_in_its_dry_run_and_records_itself(tmp_path):
    out = tmp_path / "results" / "cpu-dry-run"
    run = _gpu_check("--dry-run", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stage in STAGES:
        record = json.loads((out / f"gpu_check_{stage}.json").read_text())
        assert record["exit"] == 0 and record["dry_run"] and not record["timed_out"], record
        assert {"device", "driver", "torch", "triton", "cuda", "commit"} <= record["environment"].keys()
        assert record["summary"], f"{stage}: an empty summary"
        assert f"== {stage} (exit 0" in run.stdout
    assert (out / "train_main" / "metrics.jsonl").exists() and (out / "find_max" / "max_seq_len.json").exists()
    section = results_section(tmp_path / "results")
    assert "GPU check on cpu" in section
    for stage in STAGES:
        assert f"| {stage} | 0 |" in section


def test_bad_calls_are_refused_before_any_stage(tmp_path):
    run = _gpu_check("--dry-run", "nonsense")
    assert run.returncode == 2 and "usage:" in run.stderr
    run = _gpu_check("--dry-run", "install")
    assert run.returncode == 2 and "--dry-run needs --out DIR" in run.stderr
