"""`python -m bench frontier` end to end on CPU, on a short sequence: torch.compile's budget moves
what the meter sees and what backward replays, both curves count the same forward, and the files
hold every point."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.frontier import LAYER
from fused_remat.flops import visible_pairs

REPO = Path(__file__).resolve().parent.parent
SEQ_LEN = 64


@pytest.fixture(scope="module")
def frontier(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier")
    # A fresh process: TRITON_INTERPRET must be set before triton is imported, and compiled graphs
    # must not linger in this one. Budget 1 is always measured, as every other budget's baseline.
    env = {k: v for k, v in os.environ.items() if k != "FUSED_REMAT_BACKEND"}
    run = subprocess.run([sys.executable, "-m", "bench", "frontier", "--seq-lens", str(SEQ_LEN), "--budgets", "0.1",
                          "--device", "cpu", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    payload = json.loads((out / "frontier.json").read_text())
    points = {(p["source"], p["name"]): p for p in payload["points"]}
    return out, payload, points


def test_the_command_writes_the_results(frontier):
    out, payload, points = frontier
    assert {"device", "torch", "date", "commit"} <= payload["environment"].keys()
    assert payload["layer"] == LAYER
    table = (out / "frontier.md").read_text()
    for source, name in points:
        assert f"| {SEQ_LEN} | {source} | {name} |" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "frontier.png").stat().st_size > 0


def test_the_budget_moves_what_compile_keeps_and_replays(frontier):
    _, _, points = frontier
    whole, tenth = points[("torch.compile", "budget 1")], points[("torch.compile", "budget 0.1")]
    assert whole["kept_bytes_per_token"] > 2 * tenth["kept_bytes_per_token"] > 0
    assert whole["recompute"] == 0
    assert tenth["recompute"] > 0.1


def test_our_policies_are_beside_compile(frontier):
    _, _, points = frontier
    ours = {name: p for (source, name), p in points.items() if source == "fused_remat"}
    assert list(ours) == ["none", "cheap", "selective", "full"]
    assert ours["none"]["recompute"] == ours["cheap"]["recompute"] == 0
    assert 0 < ours["selective"]["recompute"] < ours["full"]["recompute"]
    kept = [p["kept_bytes_per_token"] for p in ours.values()]
    assert kept == sorted(kept, reverse=True)


def test_both_curves_count_the_forward_with_causal_attention(frontier):
    """The matmuls and attention's two products over the N(N+1)/2 pairs the causal mask leaves:
    so CPU attention (which PyTorch's counter misses) is counted, the same way in both curves."""
    _, _, points = frontier
    dim, heads, head_dim, ffn = LAYER["dim"], LAYER["n_heads"], LAYER["dim"] // LAYER["n_heads"], LAYER["ffn_dim"]
    qkv_width = (heads + 2 * LAYER["n_kv_heads"]) * head_dim
    matmuls = 2 * SEQ_LEN * dim * (qkv_width + dim + 2 * ffn) + 2 * SEQ_LEN * ffn * dim
    attention = 4 * heads * head_dim * visible_pairs(SEQ_LEN, SEQ_LEN, causal=True)
    for point in points.values():
        assert point["forward_flops_per_token"] * SEQ_LEN == matmuls + attention


def test_our_memory_budget_keeps_and_replays_no_more_than_compile_at_its_bytes(frontier):
    """Our block with memory_budget set to compile's kept bytes over our none's keeps no more than
    compile there and replays no more (at this short length attention is cheap to replay, so the
    two may tie; bench/results/frontier/ has the long lengths)."""
    _, _, points = frontier
    theirs = points[("torch.compile", "budget 0.1")]
    (ours,) = [p for (source, name), p in points.items() if source == "fused_remat memory_budget"]
    assert ours["name"].startswith("budget 0.1: memory_budget ")
    assert ours["kept_bytes_per_token"] <= theirs["kept_bytes_per_token"]
    assert ours["recompute"] <= theirs["recompute"] + 1e-9
