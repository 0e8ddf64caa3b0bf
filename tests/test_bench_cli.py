"""The benchmark CLI end to end on CPU (--smoke: tiny cases through the interpreter), so the
pipeline that a GPU run depends on cannot rot. Its timings are meaningless and stay in tmp_path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import harness, report
from bench.__main__ import SUITES, load_suite

REPO = Path(__file__).resolve().parent.parent


def _bench(*args):
    env = {k: v for k, v in os.environ.items() if k != "FUSED_REMAT_BACKEND"}
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_smoke_run_writes_results_tables_and_plots(suite, tmp_path):
    out = tmp_path / "results" / "cpu-smoke"
    run = _bench("--smoke", "--quick", suite, "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    payload = json.loads((out / f"{suite}.json").read_text())
    assert {"device", "torch", "triton", "cuda", "date", "commit"} <= payload["environment"].keys()
    assert payload["results"], "no case ran"
    failures = [(r["case"], r["provider"], r["error"]) for r in payload["results"] if r["error"]]
    assert not failures, failures
    assert "fused_remat" in {r["provider"] for r in payload["results"]}
    assert (out / f"{suite}.md").read_text().count("\n|") >= 2
    assert list(out.glob(f"{suite}*.png")), "no plot written"
    section = report.readme_section(tmp_path / "results")
    assert f"**{suite}**" in section and "Not yet measured" not in section


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_registered_suite_is_a_suite_of_its_name(name):
    suite = load_suite(name)
    assert isinstance(suite, harness.Suite) and suite.name == name


def test_importing_the_cli_leaves_triton_and_the_suites_unimported():
    """--smoke sets TRITON_INTERPRET in main(): nothing imported before that may import triton."""
    code = "import sys, bench.__main__; print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('bench.bench_')))"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-3000:]


def test_readme_section_says_not_measured_without_results(tmp_path):
    assert report.readme_section(tmp_path).startswith("Not yet measured")


def test_readme_section_leaves_out_compile_facts_and_their_variants(tmp_path):
    """bench/results/static-triton3.6 (the static compile on another Triton) is compile-time facts
    like static/, not a GPU's timings: `bench readme` crashed on it before."""
    for name in ("static", "static-triton3.6", "checkpoint"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.json").write_text(json.dumps({"suite": "static", "rows": []}))
    assert report.readme_section(tmp_path).startswith("Not yet measured")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would start a real run")
def test_speed_run_refuses_without_a_gpu():
    run = _bench("--quick", "norms")
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


def test_unknown_suite_is_named():
    run = _bench("--smoke", "nonsense")
    assert run.returncode == 2 and "unknown suite(s) nonsense" in run.stderr


def test_summary_reads_past_the_gpu_check_records_and_cells_show_host_time(tmp_path):
    """bench/gpu_check.sh leaves gpu_check_<stage>.json beside the suites' JSON: `bench summary`
    failed on them on the H200 and must read past them; a result's host time per call shows in
    its cell (where it nears the median, the call is host-bound)."""
    ours = harness.Result("norms", "rms fwd", {}, "fused_remat", unit="GB/s", ms=0.3, metric=1.0,
                          extra={"host_ms": 0.29})
    peer = harness.Result("norms", "rms fwd", {}, "eager", unit="GB/s", ms=0.1, metric=3.0)
    environment = dict(device="NVIDIA H200", torch="2.11", triton="3.6", cuda="13.0", date="d", commit="c")
    report.write_json(tmp_path, "norms", environment, {}, [ours, peer])
    (tmp_path / "gpu_check_tests.json").write_text(json.dumps({"stage": "tests", "exit": 0}))
    assert "| norms | 1 | 0 | 0.33x |" in report.summary(tmp_path)
    table = report.markdown_table("norms", environment, {}, [ours, peer])
    assert "1.0 (0.300 ms), host 0.290 ms" in table and "'host': the host's time per call" in table
