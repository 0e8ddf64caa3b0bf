"""The training CLI on CPU: it learns and resumes bit for bit on our kernels (Triton's interpreter),
attends within documents, its checkpoints survive interrupted writes, bad input gets a clear error,
and it runs under torchrun with DDP and FSDP2 (gloo, two processes). Tests that are not about the kernels run the reference
backend; the failure paths are in test_train_failures.py."""

import json
import re
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fused_remat.training import checkpoint as checkpoints
from fused_remat.training import capacity, cli, loop
from fused_remat.training.checkpoint import CheckpointError, CheckpointWriteError, load_checkpoint, save_checkpoint
from fused_remat.training.config import TrainConfig, parse_size
from fused_remat.training.data import Batch
from fused_remat.training.distributed import Distributed
from fused_remat.training.step import batch_loss
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, preset
from fused_remat.planner import Precision, explain_policies, layer_transient_bytes_per_token
from fused_remat.remat import Remat
from fused_remat.block import TransformerBlock

UNIFORM_LOSS = math.log(256)
# Small enough for the interpreter on a CI core.
SHORT = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "2"]
TRAJECTORY_KEYS = ("step", "loss", "lr", "grad_norm", "val_loss")


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _trajectory(out: Path) -> list[tuple]:
    return [tuple(record.get(key) for key in TRAJECTORY_KEYS) for record in _metrics(out)]


@pytest.fixture(autouse=True)
def _reference_kernels():
    """The reference backend where the kernels are not the point (it is much faster on a CPU);
    the tests that are about the kernels ask for ``triton_backend``, which overrides this. A patch of
    its own: a test's monkeypatch.undo() leaves it in place, and a --backend that the CLI writes into
    the environment is undone after the test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FUSED_REMAT_BACKEND", "reference")
        yield


def test_a_short_run_learns_well_below_uniform_bytes(tmp_path, triton_backend):
    out = tmp_path / "run"
    assert cli.main(["--preset", "tiny", "--steps", "50", "--seq-len", "32", "--batch-size", "4",
                       "--eval-interval", "25", "--out", str(out)]) == 0
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(50))
    final_train = sum(r["loss"] for r in records[-10:]) / 10
    validation = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(validation) == 2
    assert records[0]["loss"] > 0.95 * UNIFORM_LOSS  # it starts from (near) uniform guessing
    assert final_train < 0.7 * UNIFORM_LOSS, final_train
    assert validation[-1] < 0.7 * UNIFORM_LOSS, validation
    assert all(r["tokens_per_s"] > 0 and r["peak_memory"] > 0 for r in records)
    assert (out / "training.png").stat().st_size > 0
    assert (out / "checkpoint.pt").is_file()


class _StopAt:
    """Stands in for Ctrl-C: the stop flag the SIGINT handler sets, raised after ``step`` steps."""

    def __init__(self, step: int):
        self.step, self.checks = step, 0

    def __call__(self):
        stop = self

        class Request:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            @property
            def requested(self):
                stop.checks += 1
                return stop.checks >= stop.step

        return Request()


def test_resume_continues_bit_for_bit(tmp_path, monkeypatch, triton_backend):
    common = [*SHORT, "--steps", "4", "--eval-interval", "2", "--warmup", "1", "--grad-accum", "2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main([*common, "--out", str(whole)]) == 0

    with monkeypatch.context() as patch:
        patch.setattr(loop, "StopRequest", _StopAt(2))
        assert cli.main([*common, "--out", str(split)]) == 130
    assert load_checkpoint(split / "checkpoint.pt", {})["step"] == 2
    assert len(_metrics(split)) == 2
    # A different remat policy is allowed on resume: every policy computes the same bits.
    assert cli.main([*common, "--out", str(split), "--resume", "--remat", "full"]) == 0

    assert _trajectory(split) == _trajectory(whole)
    ours, theirs = (load_checkpoint(out / "checkpoint.pt", {}) for out in (split, whole))
    assert all(torch.equal(ours["model"][name], theirs["model"][name]) for name in theirs["model"])


def test_document_masking_on_the_default_corpus_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    common = [*SHORT, "--steps", "3", "--eval-interval", "3", "--warmup", "1"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main([*common, "--out", str(whole)]) == 0
    assert "document masking on (a document begins at each source file)" in capsys.readouterr().out

    with monkeypatch.context() as patch:
        patch.setattr(loop, "StopRequest", _StopAt(1))
        assert cli.main([*common, "--out", str(split)]) == 130
    # Masking decides the trajectory: a resumed run must keep it.
    assert cli.main([*common, "--out", str(split), "--resume", "--document-boundary", "none"]) == 2
    assert "documents: checkpoint has 'each source file', this run has 'none'" in capsys.readouterr().err
    assert cli.main([*common, "--out", str(split), "--resume"]) == 0

    assert _trajectory(split) == _trajectory(whole)
    ours, theirs = (load_checkpoint(out / "checkpoint.pt", {}) for out in (split, whole))
    assert all(torch.equal(ours["model"][name], theirs["model"][name]) for name in theirs["model"])


def test_a_boundary_token_keeps_attention_within_documents(tmp_path, capsys):
    tokens = torch.randint(1, 1000, (5000,), dtype=torch.int32)
    tokens[::9] = 0  # the boundary token begins a document every 9 tokens
    (tmp_path / "tokens.bin").write_bytes(tokens.to(torch.uint16).numpy().tobytes())
    data = [*SHORT, "--steps", "1", "--data", str(tmp_path / "tokens.bin"), "--vocab-size", "1000"]
    assert cli.main([*data, "--document-boundary", "0", "--out", str(tmp_path / "masked")]) == 0
    banner = capsys.readouterr().out
    assert "document masking on (a document begins at each token 0)" in banner
    ratio = float(banner.split("instead of 1,056, ")[1].split("x the work")[0])  # 2 rows x 32 x 33 / 2 pairs
    assert 0.1 < ratio < 0.5
    assert cli.main([*data, "--out", str(tmp_path / "whole")]) == 0
    assert "document masking off" in capsys.readouterr().out
    masked, whole = (_metrics(tmp_path / name)[0]["loss"] for name in ("masked", "whole"))
    assert masked != whole


def test_a_step_attends_within_the_documents_of_its_batch():
    model = LanguageModel(preset("tiny"))
    inputs, targets = torch.randint(0, 256, (2, 2, 16)).unbind()
    documents = torch.tensor([0, 5, 16, 20, 32], dtype=torch.int32)
    expected = model(inputs, targets, cu_seqlens=documents, max_seqlen=12)
    assert torch.equal(batch_loss(model, Batch(inputs, targets, documents, 12)), expected)
    assert torch.equal(batch_loss(model, (inputs, targets)), model(inputs, targets))
    assert not torch.equal(model(inputs, targets), expected)


def test_document_masking_is_on_where_the_data_marks_documents_with_or_without_context_parallel():
    assert TrainConfig.build("cpu").document_masking
    assert not TrainConfig.build("cpu", document_boundary="none").document_masking
    assert not TrainConfig.build("cpu", data="tokens.bin").document_masking
    marked = TrainConfig.build("cpu", data="tokens.bin", document_boundary="50256")
    assert marked.document_masking and marked.document_boundary == 50256
    for documents in (dict(), dict(data="tokens.bin", document_boundary="7"), dict(document_boundary="none")):
        config = TrainConfig.build("cpu", seq_len=32, context_parallel=2, **documents)
        assert config.context_parallel == 2
        assert config.document_masking == (documents.get("document_boundary") != "none")


def test_ctrl_c_checkpoints_and_exits(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, TRITON_INTERPRET="1")
    process = subprocess.Popen([sys.executable, "-m", "fused_remat.train", *SHORT, "--steps", "1000", "--out", str(out)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "no step finished in time"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 130, output
    assert "continue with --resume" in output
    step = load_checkpoint(out / "checkpoint.pt", {})["step"]
    assert step == len(_metrics(out)) >= 1


def test_an_interrupted_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, dict(step=1, run={}, weights=torch.arange(5.0)))

    def torn_write(obj, stream):
        stream.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints.torch, "save", torn_write)
    with pytest.raises(CheckpointWriteError, match="OSError: disk full"):
        save_checkpoint(path, dict(step=2, run={}, weights=torch.zeros(5)))
    monkeypatch.undo()
    state = load_checkpoint(path, {})
    assert state["step"] == 1 and torch.equal(state["weights"], torch.arange(5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_corrupt_and_mismatched_checkpoints_are_refused_without_touching_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*SHORT, "--steps", "1", "--out", str(out)]
    assert cli.main(args) == 0
    before = _snapshot(out)

    assert cli.main([*SHORT, "--steps", "1", "--seq-len", "48", "--out", str(out), "--resume"]) == 2
    error = capsys.readouterr().err
    assert "different run" in error and "seq_len: checkpoint has 32, this run has 48" in error
    assert _snapshot(out) == before

    assert cli.main(args) == 2  # a second run into the same folder without --resume
    assert "--resume" in capsys.readouterr().err
    assert _snapshot(out) == before

    data = bytearray((out / "checkpoint.pt").read_bytes())
    (out / "checkpoint.pt").write_bytes(bytes(data[: len(data) // 2]))
    before = _snapshot(out)
    assert cli.main([*args, "--resume"]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err
    assert _snapshot(out) == before

    (out / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(out / "checkpoint.pt", {})
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "elsewhere" / "checkpoint.pt", {})
    torch.save({"weights": torch.ones(1)}, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a fused_remat.train checkpoint"):
        load_checkpoint(out / "checkpoint.pt", {})


def test_the_reference_block_alone_defaults_to_its_eager_policy():
    """--block reference without --remat runs eager PyTorch keeping everything (cheap is the fused
    block's default, which the reference block does not have)."""
    config = TrainConfig.build("cpu", block="reference")
    assert [policy.value for policy in config.remat] == ["none", "none"]
    assert [policy.value for policy in TrainConfig.build("cpu").remat] == ["cheap", "cheap"]


@pytest.mark.parametrize("arguments,message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--preset", "gpt5"], "invalid choice"),
    (["--memory-budget", "lots"], "--memory-budget must be a fraction in [0, 1] of what --remat none keeps "
     "(torch.compile's activation_memory_budget), got 'lots'"),
    (["--memory-limit", "lots"], "--memory-limit: expected a size"),
    (["--lr", "-1"], "--lr"),
    (["--remat", "lazy"], "--remat must be one of none, cheap, selective, full, offload, keep:<tensors> (e.g. "
     "keep:o,lse,h), auto (a plan for --memory-limit in bytes), or a comma list with one per layer (2 layers, "
     "e.g. full,cheap); got 'lazy'"),
    (["--remat", "cheap,full,full"], "--remat: got 3 policies for 2 layers"),
    (["--block", "reference", "--remat", "cheap"], "--block reference runs eager PyTorch, which takes --remat none"),
    (["--memory-budget", "2.5"], "--memory-budget must be a fraction in [0, 1] of what --remat none keeps "
     "(torch.compile's activation_memory_budget), got '2.5'; a limit in bytes is --memory-limit with a unit, e.g. "
     "--memory-limit 2.5GiB"),
    (["--memory-budget", "-0.1"], "--memory-budget must be a fraction in [0, 1] of what --remat none keeps "
     "(torch.compile's activation_memory_budget), got '-0.1'"),
    (["--memory-budget", "40GiB"], "got '40GiB'; a limit in bytes is --memory-limit 40GiB"),
    (["--memory-limit", "0.3"], "--memory-limit 0.3: a limit in bytes (40GiB, 800MiB, 4096); a fraction of what "
     "--remat none keeps is --memory-budget 0.3"),
    (["--memory-limit", "40GiB"], "--memory-limit 40GiB is the limit that --remat auto plans for and "
     "--find-max-seq-len searches under; with --remat cheap nothing would use it"),
    (["--memory-budget", "0.3", "--remat", "full"], "--memory-budget 0.3 lets each layer choose what it keeps (at most "
     "that share of what --remat none keeps): leave out --remat full"),
    (["--memory-budget", "0.3", "--remat", "auto"], "leave out --remat auto"),
    (["--memory-budget", "0.3", "--block", "reference"], "--memory-budget 0.3 lets each fused layer choose what it "
     "keeps: leave out --block reference"),
    (["--memory-budget", "0.3", "--find-max-seq-len"], "its memory cap is --memory-limit in bytes, not --memory-budget"),
    (["--document-boundary", "eos"], "--document-boundary must be a token id (an integer >= 0) or none, got 'eos'"),
])
def test_bad_arguments_exit_with_a_usage_error(arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*SHORT, *arguments, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("arguments,message", [
    (["--data", "no/such/file.txt"], "--data"),
    (["--document-boundary", "10"], "--document-boundary 10: the default corpus's documents are its source files"),
    (["--remat", "auto"], "--remat auto on CPU needs --memory-limit"),
    (["--remat", "auto", "--memory-limit", "1KiB"], "--memory-limit: 0.0 MiB is below"),
    (["--resume"], "no checkpoint"),
])
def test_bad_settings_give_a_clear_error(arguments, message, tmp_path, capsys):
    assert cli.main([*SHORT, "--steps", "1", *arguments, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_remat_auto_prints_its_plan_and_trains(tmp_path, capsys):
    """A byte budget just below cheap's peak (what it keeps + its transient; more than it keeps)
    makes the planner replay more than cheap does, and the plan prints its peak."""
    fp32 = Precision(torch.float32, torch.float32)
    cheap = explain_policies(preset("tiny"), 2, 32, fp32, ["cheap", "cheap"])
    budget = cheap.peak_bytes - 1
    assert budget > cheap.predicted_bytes
    out = tmp_path / "run"
    assert cli.main([*SHORT, "--steps", "1", "--remat", "auto", "--memory-limit", f"{budget}B",
                       "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "remat plan" in printed and "budget" in printed and "kept + the largest layer transient" in printed
    assert re.search(r"remat (selective|full|keep:\S+) \(all layers\)", printed), "each layer replays"


def test_a_memory_budget_fraction_lets_each_layer_choose_and_trains_the_same_bits(tmp_path, capsys):
    """--memory-budget 0.2 is torch.compile's spelling: a fraction of what remat none keeps, each
    layer picking what to keep; the run computes the bits of --remat cheap's."""
    config = TrainConfig.build("cpu", memory_budget="0.2")
    assert (config.memory_budget, config.memory_limit, config.remat) == (0.2, None, None)
    assert TrainConfig.build("cpu", memory_budget="1").memory_budget == 1.0
    assert TrainConfig.build("cpu", memory_budget=0.5).memory_budget == 0.5, "the library's value, unparsed"
    assert TrainConfig.build("cpu", memory_limit="4096", remat="auto").memory_limit == 4096, "bare bytes"
    assert TrainConfig.build("cpu", memory_limit="2B", remat="auto").memory_limit == 2
    common = [*SHORT, "--steps", "2", "--eval-interval", "2", "--warmup", "1"]
    assert cli.main([*common, "--memory-budget", "0.2", "--out", str(tmp_path / "budget")]) == 0
    printed = capsys.readouterr().out
    assert "remat keep:" in printed, "the plan names the point the budget picks"
    assert "memory_budget 0.2 (each layer keeps at most that share of what none keeps)" in printed
    assert cli.main([*common, "--out", str(tmp_path / "cheap")]) == 0
    assert _trajectory(tmp_path / "budget") == _trajectory(tmp_path / "cheap")


def test_the_budget_plan_shows_the_point_the_blocks_choose_for_the_longest_document():
    """Under --memory-budget the plan printed at the start names the point every layer's
    ``budget_point`` gives for the first batch's longest document, as the blocks price each call;
    a GPT-2-small layer at 8,192 tokens chooses differently for one 512-token document."""
    config = TrainConfig.build("cpu", preset="gpt2-small", seq_len=8192, memory_budget="0.3")
    model_config = config.model_config(256)
    block = TransformerBlock(model_config.dim, model_config.n_heads, **model_config.block_kwargs(), memory_budget=0.3,
                             device="meta")
    points = {}
    for longest in (None, 512):
        policies, plan = loop.resolve_remat(config, model_config, torch.device("cpu"), Distributed(),
                                            longest_document=longest)
        points[longest] = block.budget_point(longest or 8192, torch.float32, torch.float32)
        assert policies == plan.policies == [points[longest]] * model_config.n_layers
        assert plan.budget_fraction == 0.3
    assert points[None] != points[512]


def test_trains_on_a_nanogpt_bin_file(tmp_path):
    tokens = torch.randint(0, 1000, (5000,), dtype=torch.int32).to(torch.uint16)
    (tmp_path / "tokens.bin").write_bytes(bytes(tokens.view(torch.uint8).tolist()))
    out = tmp_path / "run"
    assert cli.main([*SHORT, "--steps", "2", "--data", str(tmp_path / "tokens.bin"), "--vocab-size", "1000",
                       "--out", str(out)]) == 0
    assert load_checkpoint(out / "checkpoint.pt", {})["model"]["embed.weight"].shape == (1000, 64)


def test_learning_rate_warms_up_then_decays_to_the_minimum():
    config = cli.parse_args(["--steps", "100", "--lr", "1e-3", "--warmup", "10", "--out", "unused"])
    rates = [config.learning_rate(step) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert rates[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))


@pytest.mark.parametrize("text,size", [
    ("1000000", 1_000_000), ("12GiB", 12 * 2**30), ("800MiB", 800 * 2**20), ("1.5G", 3 * 2**29), ("800MB", 800 * 2**20),
    ("64k", 64 * 2**10), ("2TiB", 2 * 2**40), (" 1.8mib ", int(1.8 * 2**20)), ("100B", 100), ("1e3", 1000),
])
def test_parse_size_reads_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "12 GiB of memory", "-1GiB", "0", "0.1", "GiB", "1.5.2M", "12PiB", "inf"])
def test_parse_size_refuses_what_is_not_a_positive_size(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_config_fills_defaults_by_device_and_preset():
    config = TrainConfig.build("cpu", steps=None, memory_limit="1.5KiB", remat="auto", out=None)
    assert (config.preset, config.steps, config.seq_len, config.dtype) == ("tiny", 50, 64, "fp32")
    assert config.lr == 3e-3 and config.min_lr == pytest.approx(3e-4) and config.warmup == 5
    assert config.memory_limit == 1536 and config.out == Path("runs/tiny")
    gpu = TrainConfig.build("cuda", preset="llama-1b", steps=5000)
    assert (gpu.dtype, gpu.compute_dtype, gpu.warmup, gpu.lr) == ("bf16", torch.bfloat16, 200, 3e-4)
    assert gpu.precision == Precision(torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="--memory-limit: expected a size"):
        TrainConfig.build("cpu", memory_limit="lots")
    with pytest.raises(ValueError, match="--preset must be one of"):
        TrainConfig.build("cpu", preset="gpt5")


def test_remat_is_parsed_once_into_policies_per_layer():
    layers = preset("tiny").n_layers
    assert TrainConfig.build("cpu").remat == (Remat.CHEAP,) * layers
    assert TrainConfig.build("cpu", remat="full,cheap").remat == (Remat.FULL, Remat.CHEAP)
    assert all(type(policy) is Remat for policy in TrainConfig.build("cpu", remat="offload").remat)
    assert TrainConfig.build("cpu", remat="auto").remat is None
    assert TrainConfig.build("cpu", remat="full", block="reference").remat == (Remat.FULL,) * layers
    with pytest.raises(ValueError, match=r"^--remat must be one of none, cheap, selective, full, offload, "
                       r"keep:<tensors> \(e.g. keep:o,lse,h\), auto .*; got 'lazy'$"):
        TrainConfig.build("cpu", remat="lazy")
    assert TrainConfig.build("cpu", remat="keep:o,lse,h,cheap").remat == (Remat.keeping(["o", "lse", "h"]), Remat.CHEAP)
    with pytest.raises(ValueError, match=r"^--block reference runs eager PyTorch, which takes --remat none .*; got --remat auto$"):
        TrainConfig.build("cpu", remat="auto", block="reference")


def test_python_m_fused_remat_training_is_the_same_cli():
    shown = [subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True).stdout
             for module in ("fused_remat.train", "fused_remat.training")]
    assert shown[0] == shown[1] and "--find-max-seq-len" in shown[0] and "--document-boundary TOKEN_ID|none" in shown[0]


def test_find_max_seq_len_on_cpu_ranks_the_policies(tmp_path, capsys, triton_backend):
    out = tmp_path / "run"
    assert cli.main(["--preset", "tiny", "--batch-size", "1", "--find-max-seq-len", "--memory-limit", "1.8MiB",
                       "--out", str(out)]) == 0
    rows = {row["candidate"]: row["max_seq_len"] for row in json.loads((out / "max_seq_len.json").read_text())["rows"]}
    assert 0 < rows["reference, eager"] <= rows["fused_remat cheap"] <= rows["fused_remat selective"] \
        <= rows["fused_remat full"]
    assert rows["reference, eager"] <= rows["reference, torch.utils.checkpoint"] <= rows["fused_remat full"]
    assert rows["fused_remat cheap"] <= rows["fused_remat auto"] <= rows["fused_remat offload"]
    assert rows["fused_remat full"] <= rows["fused_remat offload"]
    printed = capsys.readouterr().out
    assert "longest trainable sequence" in printed
    assert "fused_remat full: probing" in printed and "tokens: fits (" in printed and "tokens: does not fit (" in printed


def test_find_max_seq_len_on_cpu_counts_the_largest_layer_transient(triton_backend):
    """On CPU a length fits when the saved bytes (the meter) plus the largest layer transient plus
    16 bytes per parameter fit the budget: a budget that holds the saved bytes and the weights but
    not the transient does not fit. Our block's transient is the formula's
    (planner.layer_transient_bytes_per_token); the reference block's, which has none, is measured."""
    config, fp32, seq = preset("tiny"), Precision(torch.float32, torch.float32), 64
    probe = capacity.TrainStepProbe(config, "fused", "cheap", 1, fp32, torch.device("cpu"), None)
    probe.model.set_remat(["full", "cheap"])
    checkpointed = capacity.TrainStepProbe(config, "reference", "full", 1, fp32, torch.device("cpu"), None)
    for each, transient in ((probe, seq * layer_transient_bytes_per_token(config, "full", fp32)),
                            (checkpointed, checkpointed.largest_transient(seq))):
        with saved_memory(exclude=each.model.parameters()) as meter:
            each._loss(torch.randint(0, config.vocab_size, (1, seq + 1)))
        saved = meter.device_bytes + config.n_layers * seq * config.dim * 4 * (each is checkpointed)  # its hidden x
        assert each.largest_transient(seq) == transient > 0
        fitting = saved + transient + 16 * each.parameters
        for budget, fits in ((fitting, True), (fitting - 1, False), (fitting - transient // 2, False)):
            each.budget = budget
            assert each(seq) is fits, (each.model.block_impl, budget)
    assert probe.largest_transient(seq) > seq * layer_transient_bytes_per_token(config, "cheap", fp32), "the largest"


def _torchrun(strategy: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "fused_remat.train", "--distributed", strategy, *SHORT, "--steps", "3", "--eval-interval", "3",
               "--grad-accum", "2", "--out", str(out), *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_ddp_and_fsdp2_train_the_same_model(tmp_path, triton_backend):
    results = {}
    for strategy in ("ddp", "fsdp"):
        finished = _torchrun(strategy, tmp_path / strategy)
        assert finished.returncode == 0, finished.stdout + finished.stderr
        results[strategy] = _metrics(tmp_path / strategy)
        assert f"x 2 {strategy}" in finished.stdout
    assert [r["step"] for r in results["fsdp"]] == [0, 1, 2]
    for ddp, fsdp in zip(results["ddp"], results["fsdp"]):
        assert ddp["loss"] == pytest.approx(fsdp["loss"], rel=1e-5)
    assert results["ddp"][-1]["val_loss"] == pytest.approx(results["fsdp"][-1]["val_loss"], rel=1e-5)
    ddp_state = checkpoints.read_checkpoint(tmp_path / "ddp" / "checkpoint.dcp")["model"]  # sharded under torchrun
    fsdp_state = checkpoints.read_checkpoint(tmp_path / "fsdp" / "checkpoint.dcp")["model"]
    assert ddp_state.keys() == fsdp_state.keys()
    for name in ddp_state:
        torch.testing.assert_close(fsdp_state[name], ddp_state[name], rtol=1e-4, atol=1e-6, msg=name)

    # Resuming the finished FSDP2 run loads each rank's shards of the model and optimizer (DCP),
    # then has nothing left to do.
    resumed = _torchrun("fsdp", tmp_path / "fsdp", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "done: 3 steps" in resumed.stdout
    assert _metrics(tmp_path / "fsdp") == results["fsdp"]


@pytest.mark.gpu
def test_gpu_training_run_learns(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["--preset", "gpt2-small", "--steps", "40", "--seq-len", "4096", "--batch-size", "2",
                       "--eval-interval", "20", "--out", str(out)]) == 0
    records = _metrics(out)
    assert records[-1]["val_loss"] < 0.7 * UNIFORM_LOSS
    assert all(r["peak_memory"] > 0 and r["tokens_per_s"] > 0 for r in records)
