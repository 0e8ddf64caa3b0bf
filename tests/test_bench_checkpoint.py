"""`python -m bench checkpoint` end to end on CPU: the tiny preset on 2 gloo ranks, DDP and FSDP2,
sharded (written at once or from DCP's thread) and single, each a torchrun job calling the trainer's own save and load. Every row is
there and consistent: bytes written, every rank's DCP file present, the sharded checkpoint about as
large as the single file, and the state loaded back equal to the state saved.

The vocabulary is raised to 8192 (the trainer's --vocab-size: unused embedding rows) so that the
tensors outweigh DCP's fixed framing per tensor (bench/checkpoint.py), as they do at gpt2-medium."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.checkpoint import FORMS, STRATEGIES, Row

REPO = Path(__file__).resolve().parent.parent
RANKS = 2
REPEATS = 2
VOCAB = 8192


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "TRITON_INTERPRET")}
    run = subprocess.run([sys.executable, "-m", "bench", "checkpoint", "--preset", "tiny", "--ranks", str(RANKS),
                          "--vocab-size", str(VOCAB), "--repeats", str(REPEATS), "--out", str(out / "results"),
                          "--scratch", str(out / "scratch")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    payload = json.loads((out / "results" / "checkpoint.json").read_text())
    return out, payload


def _rows(payload) -> dict[tuple[str, str], dict]:
    return {(row["strategy"], row["form"]): row for row in payload["rows"]}


def test_every_combination_is_measured(results):
    out, payload = results
    rows = _rows(payload)
    assert sorted(rows) == sorted((s, f) for s in STRATEGIES for f in FORMS)
    assert {"device", "torch", "date", "commit"} <= payload["environment"].keys()
    assert payload["settings"]["preset"] == "tiny" and payload["settings"]["ranks"] == RANKS
    table = (out / "results" / "checkpoint.md").read_text()
    assert f"Machine: {os.cpu_count()} CPU cores, cpu, torch " in table
    for row in rows.values():
        assert row["preset"] == "tiny" and row["ranks"] == RANKS and row["vocab_size"] == VOCAB
        assert len(row["save_s"]) == len(row["written_s"]) == len(row["load_s"]) == REPEATS
        assert min(row["save_s"]) > 0 and min(row["load_s"]) > 0
        if row["form"] == "async":  # training waits for the copy into host memory, not for the disk
            assert all(0 < waited < written for waited, written in zip(row["save_s"], row["written_s"])), row
        else:
            assert row["save_s"] == row["written_s"]
        assert min(row["save_s"]) <= row["save_median_s"] <= max(row["save_s"])
        assert min(row["load_s"]) <= row["load_median_s"] <= max(row["load_s"])
        assert len(row["bytes_per_rank"]) == len(row["peak_rss_bytes"]) == RANKS
        assert row["total_bytes"] == sum(row["bytes_per_rank"]) > 0
        assert all(peak > 0 for peak in row["peak_rss_bytes"]) and len(row["host_load"]) == 2
        assert row["restored"], row
        loaded = Row(**{k: v for k, v in row.items() if k not in ("total_bytes", "save_median_s", "load_median_s")})
        assert loaded.total_bytes == row["total_bytes"] and loaded.load_median == row["load_median_s"]
        assert f"| {row['strategy']} | {row['form']} | {RANKS} |" in table
    assert not list((out / "scratch").iterdir())  # the checkpoints are removed after measuring


def test_single_is_one_file_on_rank_0(results):
    _, payload = results
    for strategy in STRATEGIES:
        row = _rows(payload)[(strategy, "single")]
        assert row["files_per_rank"] == [["checkpoint.pt"]] + [[]] * (RANKS - 1)
        assert row["bytes_per_rank"][0] > 0 and row["bytes_per_rank"][1:] == [0] * (RANKS - 1)
        # fp32 weights and AdamW's two moments: 12 bytes a parameter, and a little more
        assert 12 * row["parameters"] <= row["bytes_per_rank"][0] < 1.05 * 12 * row["parameters"]


def test_sharded_is_every_rank_writing_about_the_single_file(results):
    _, payload = results
    rows = _rows(payload)
    for strategy, form in ((s, f) for s in STRATEGIES for f in ("sharded", "async")):
        sharded, single = rows[(strategy, form)], rows[(strategy, "single")]
        for rank, files in enumerate(sharded["files_per_rank"]):
            assert f"__{rank}_0.distcp" in files, (strategy, sharded["files_per_rank"])
            assert sharded["bytes_per_rank"][rank] > 0
        assert {".metadata", "run.pt"} <= set(sharded["files_per_rank"][0])
        assert abs(sharded["total_bytes"] - single["total_bytes"]) <= 0.1 * single["total_bytes"], (strategy, sharded,
                                                                                                     single)
    # FSDP2 shards every tensor: each rank writes about half
    fsdp = rows[("fsdp", "sharded")]["bytes_per_rank"]
    assert min(fsdp) > 0.4 * sum(fsdp)
