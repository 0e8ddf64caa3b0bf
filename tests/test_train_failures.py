"""The trainer never loses work and never hides a failure: bad data is found before the first step,
an error after a finished step checkpoints it, a NaN stops the run without overwriting the last good
checkpoint (or is skipped on request), checkpoints rotate and a bad newest one falls back to its
predecessor, stale partial files are cleaned up, write failures say why, a resume checks the
checkpoint against metrics.jsonl (fsynced before every checkpoint), misused flags are refused, a
rank that fails under torchrun brings the job down with its own error, and a resume at another
context-parallel degree is refused. The kernels are not the point here: everything runs on the
reference backend but context parallelism, whose ring runs only the kernels."""

import errno
import json
import math
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import torch

from fused_remat.training import checkpoint as checkpoints
from fused_remat.training import cli, loop, reporting
from fused_remat.training import step as step_module
from fused_remat.training.checkpoint import (CheckpointError, CheckpointWriteError, load_checkpoint,
                                             load_newest_checkpoint, remove_stale_partials, save_checkpoint)

SHORT = ["--backend", "reference", "--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1"]


@pytest.fixture(autouse=True)
def _reference_backend():
    """--backend sets FUSED_REMAT_BACKEND for the process; restored after each test by a patch of its
    own, which a test's monkeypatch.undo() leaves in place."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FUSED_REMAT_BACKEND", "reference")
        patch.delenv("WORLD_SIZE", raising=False)
        yield


def _strict_metrics(out: Path) -> list[dict]:
    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _finite_weights(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_checkpoint(path, {})["model"].values())


def _run(out: Path, *extra: str) -> int:
    return cli.main([*SHORT, "--out", str(out), *extra])


def test_a_bad_token_id_deep_in_train_bin_is_found_before_the_first_step(tmp_path, capsys):
    tokens = torch.randint(0, 500, (40_000,), dtype=torch.int32)
    tokens[31_234] = 777
    (tmp_path / "train.bin").write_bytes(tokens.to(torch.uint16).numpy().tobytes())
    assert _run(tmp_path / "run", "--data", str(tmp_path / "train.bin"), "--vocab-size", "500") == 2
    error = capsys.readouterr().err
    assert "train.bin holds token id 777 at token offset 31,234 (byte offset 62,468)" in error
    assert not (tmp_path / "run").exists()


def test_an_error_after_finished_steps_checkpoints_them_then_resume_finishes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    original = loop.token_data.train_batch

    def fails_at_step_3(data, step, *rest):
        if step == 3:
            raise RuntimeError("the data disk went away")
        return original(data, step, *rest)

    with monkeypatch.context() as patch:
        patch.setattr(loop.token_data, "train_batch", fails_at_step_3)
        with pytest.raises(RuntimeError, match="the data disk went away"):
            _run(out, "--steps", "5")
    assert "the 3 finished steps are checkpointed" in capsys.readouterr().err
    assert load_checkpoint(out / "checkpoint.pt", {})["step"] == 3
    assert [r["step"] for r in _strict_metrics(out)] == [0, 1, 2]
    assert _run(out, "--steps", "5", "--resume") == 0
    assert [r["step"] for r in _strict_metrics(out)] == [0, 1, 2, 3, 4]


def test_a_failing_first_checkpoint_write_is_not_retried_and_says_no_previous_one_exists(tmp_path, monkeypatch,
                                                                                          capsys):
    """The run's first checkpoint fails: nothing of the run is saved, and the message says so instead
    of promising a previous checkpoint that does not exist."""
    out = tmp_path / "run"
    calls = []

    def disk_full(obj, stream):
        calls.append(1)
        stream.write(b"some of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", disk_full)
    assert _run(out, "--steps", "2") == 1
    error = capsys.readouterr().err
    assert f"could not write the checkpoint {out / 'checkpoint.pt'}: the disk is full (it needs about " in error
    assert ("; there is no previous checkpoint (this was the run's first): its 2 finished steps are not saved"
            in error and "untouched" not in error)
    assert "Traceback" not in error and len(calls) == 1
    assert sorted(p.name for p in out.iterdir()) == [".lock", "metrics.jsonl"]  # no partial file left


@pytest.mark.parametrize("failure,reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "the disk is full"),
    (OSError(errno.EACCES, "Permission denied"), "permission denied"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), "the disk is full"),
])
def test_write_failures_name_the_path_the_reason_and_the_bytes(tmp_path, monkeypatch, failure, reason):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, dict(step=1, run={}, weights=torch.arange(5.0)))

    def fails(obj, stream):
        raise failure

    monkeypatch.setattr(checkpoints.torch, "save", fails)
    # torch.save reports a full disk only as a RuntimeError: the free space tells it apart.
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 100})())
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(path, dict(step=2, run={}, weights=torch.zeros(1000)))
    assert f"could not write the checkpoint {path}: {reason} (it needs about 4,000 bytes; 100 bytes free" in str(raised.value)
    assert str(raised.value).endswith("; the previous checkpoint is untouched")
    monkeypatch.undo()
    assert load_checkpoint(path, {})["step"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(out, "--steps", "6", "--lr", "1e4", "--grad-clip", "0", "--warmup", "0", "--checkpoint-interval", "1") == 1
    error = capsys.readouterr().err
    assert "training diverged" in error and "--skip-nonfinite" in error
    records = _strict_metrics(out)
    assert len(records) < 6 and records[-1]["nonfinite"] and records[-1]["skipped"]
    saved = load_checkpoint(out / "checkpoint.pt", {})["step"]
    assert saved == len(records) - 1 and f"checkpoint.pt at step {saved}, is kept" in error
    assert _finite_weights(out / "checkpoint.pt")


def _nan_at_calls(monkeypatch, bad_calls: set[int]) -> None:
    """train_step's forward gives a NaN loss on the given calls (one call per step here)."""
    original, calls = step_module.forward_loss, []

    def forward_loss(model, inputs, targets, compute_dtype=None):
        calls.append(1)
        loss = original(model, inputs, targets, compute_dtype)
        return loss * math.nan if len(calls) in bad_calls else loss

    monkeypatch.setattr(step_module, "forward_loss", forward_loss)


def test_skip_nonfinite_skips_up_to_n_steps_without_updating(tmp_path, monkeypatch, capsys):
    _nan_at_calls(monkeypatch, {2})
    out = tmp_path / "run"
    assert _run(out, "--steps", "3", "--skip-nonfinite", "1") == 0
    records = _strict_metrics(out)
    assert records[1]["loss"] is None and records[1]["nonfinite"] == {"loss": "nan", "grad_norm": "nan"}
    assert records[1]["skipped"] and not any("skipped" in r for r in (records[0], records[2]))
    assert "skipped without an update (1 of --skip-nonfinite 1)" in capsys.readouterr().err
    assert _finite_weights(out / "checkpoint.pt")

    _nan_at_calls(monkeypatch, {1, 2})
    assert _run(tmp_path / "again", "--steps", "3", "--skip-nonfinite", "1") == 1
    assert "more than --skip-nonfinite 1" in capsys.readouterr().err
    assert not (tmp_path / "again" / "checkpoint.pt").exists()


def test_checkpoints_rotate_and_resume_falls_back_past_a_corrupt_one_bit_for_bit(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--steps", "3", "--checkpoint-interval", "1", "--keep-checkpoints", "2"]
    assert _run(out, *args) == 0
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint.1.pt", "checkpoint.pt"]
    assert load_checkpoint(out / "checkpoint.1.pt", {})["step"] == 2
    finished = load_checkpoint(out / "checkpoint.pt", {})["model"]

    (out / "checkpoint.pt").write_bytes(b"\0" * 100)  # a bad newest checkpoint
    state, chosen, unreadable = load_newest_checkpoint(out / "checkpoint.pt", {})
    assert (state["step"], chosen.name, len(unreadable)) == (2, "checkpoint.1.pt", 1)
    capsys.readouterr()
    assert _run(out, *args, "--resume") == 0
    captured = capsys.readouterr()
    assert "checkpoint.pt is not a readable checkpoint" in captured.err
    assert "resuming from the previous checkpoint checkpoint.1.pt (step 2)" in captured.out
    assert (out / "checkpoint.pt.unreadable").is_file()
    resumed = load_checkpoint(out / "checkpoint.pt", {})["model"]
    assert all(torch.equal(resumed[name], finished[name]) for name in finished)


def test_a_finished_run_says_so_when_run_again(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(out, "--steps", "1") == 0
    metrics = (out / "metrics.jsonl").read_bytes()
    assert _run(out, "--steps", "1", "--resume") == 0
    assert "already finished (done: 1 steps" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_stale_partial_files_of_killed_processes_are_removed_on_start(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(out, "--steps", "1") == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f".checkpoint.pt.{dead.pid}.partial"
    stale.write_bytes(b"x" * 1000)
    (out / f".checkpoint.1.pt.{dead.pid}.partial").write_bytes(b"y")
    unrelated = out / ".notes.123.partial"
    unrelated.write_bytes(b"z")
    assert _run(out, "--steps", "2", "--resume") == 2  # a different run: refused before anything is touched
    assert stale.exists()
    assert _run(out, "--steps", "1", "--resume") == 0
    assert f"removed {stale}: a partial checkpoint (1,000 bytes)" in capsys.readouterr().out
    assert not stale.exists() and unrelated.exists()
    assert remove_stale_partials(out) == []


def test_checkpoint_errors_never_suggest_weights_only_false(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": "fused_remat.train checkpoint", "version": 1, "where": PurePosixPath("/tmp")}, path)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, {})
    message = str(raised.value)
    assert "not a readable checkpoint" in message and "not unpickled" in message
    assert "weights_only" not in message and "False" not in message


@pytest.mark.parametrize("arguments,message", [
    (["--distributed", "fsdp"], "--distributed fsdp needs torchrun"),
    (["--remat", "auto", "--memory-limit", "12B"], "--memory-limit was read as 12 bytes"),
    (["--backend", "triton"], "--backend triton"),
])
def test_misused_flags_are_errors(arguments, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # so --backend triton cannot run on this CPU
    if "--backend" in arguments and torch.cuda.is_available():
        pytest.skip("triton runs on the GPU here")
    assert cli.main([*SHORT, "--steps", "1", *arguments, "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert message in error
    if "12B" in arguments:
        assert "or B for bytes" in error
    assert not (tmp_path / "run").exists()


def test_the_header_says_which_backend_runs(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU backends")
    assert cli.main([*SHORT, "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert "fused_remat.train on CPU (PyTorch reference, backend reference) x 1" in capsys.readouterr().out
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for backend, shown in (("triton", "CPU (Triton interpreter, backend triton)"), ("auto", "CPU (Triton interpreter)")):
        monkeypatch.setenv("FUSED_REMAT_BACKEND", backend)
        assert loop.describe_backend(torch.device("cpu")) == shown


@pytest.mark.parametrize("first, second", [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGTERM"), ("SIGTERM", "SIGINT")])
def test_a_second_signal_stops_at_once(first, second):
    """The first SIGINT or SIGTERM asks for a checkpointed stop after the step; a second of either
    kind interrupts at once, as a second Ctrl-C always did."""
    import os
    import signal

    from fused_remat.training.loop import StopRequest

    with StopRequest() as stop:
        os.kill(os.getpid(), getattr(signal, first))
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), getattr(signal, second))


def test_one_trainer_per_run_folder(tmp_path, capsys):
    """While a trainer holds a run folder's lock, a second one there is refused, naming the holder;
    the lock goes with its holder, and a refused brand-new run leaves no folder behind."""
    import os

    from fused_remat.training import cli
    from fused_remat.training.checkpoint import RunLock

    out = tmp_path / "run"
    with RunLock(out):
        assert cli.main(["--preset", "tiny", "--steps", "1", "--out", str(out)]) == 2
        assert f"another trainer is running in this folder (pid {os.getpid()} on" in capsys.readouterr().err
    assert not out.exists()
    fresh = tmp_path / "refused"
    assert cli.main(["--preset", "tiny", "--steps", "1", "--out", str(fresh), "--resume"]) == 2
    assert not fresh.exists()


def test_resume_survives_a_torn_or_missing_metrics_file_and_names_a_garbage_line(tmp_path, capsys, monkeypatch):
    from test_train import _StopAt

    out = tmp_path / "run"
    args = [*SHORT, "--steps", "4", "--out", str(out)]
    monkeypatch.setattr(loop, "StopRequest", _StopAt(2))  # Ctrl-C after step 2: checkpointed there
    assert cli.main(args) == 130
    monkeypatch.undo()
    metrics = out / "metrics.jsonl"
    whole = metrics.read_text()
    assert [json.loads(line)["step"] for line in whole.splitlines()] == [0, 1]

    lines = whole.splitlines(keepends=True)
    metrics.write_text(lines[0] + "not a record\n" + "".join(lines[1:]))
    assert cli.main([*args, "--resume"]) == 2
    assert f"{metrics}:2 is not a metrics record" in capsys.readouterr().err

    metrics.write_text(whole + '{"step": 2, "lo')  # a write cut short by a crash
    monkeypatch.setattr(loop, "StopRequest", _StopAt(1))
    assert cli.main([*args, "--resume"]) == 130
    monkeypatch.undo()
    assert "dropped its last line, cut short by an interrupted write" in capsys.readouterr().err
    assert [r["step"] for r in _strict_metrics(out)] == [0, 1, 2]

    metrics.unlink()
    assert cli.main([*args, "--resume"]) == 0
    assert "is missing: the history of steps before 3 is lost" in capsys.readouterr().err
    assert [r["step"] for r in _strict_metrics(out)] == [3]


@pytest.mark.parametrize("entry", ["tensor", "pickle"])
def test_a_flipped_bit_sets_the_checkpoint_aside(entry, tmp_path, capsys):
    """One bit flipped in a tensor's bytes (which torch.load would load silently) or in the pickled
    step: the CRC-32 check refuses the file and the resume falls back to its predecessor."""
    import zipfile

    out = tmp_path / "run"
    args = ["--steps", "3", "--checkpoint-interval", "1", "--keep-checkpoints", "2"]
    assert _run(out, *args) == 0
    newest = out / "checkpoint.pt"
    with zipfile.ZipFile(newest) as archive:
        names = [i for i in archive.infolist() if i.filename.endswith("data.pkl") == (entry == "pickle")]
        info = max(names, key=lambda i: i.file_size)
    data = bytearray(newest.read_bytes())
    name_length, extra_length = (int.from_bytes(data[info.header_offset + at:info.header_offset + at + 2], "little")
                                 for at in (26, 28))
    start = info.header_offset + 30 + name_length + extra_length  # the entry's bytes, after its local header
    data[start + info.file_size // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert _run(out, *args, "--resume") == 0
    captured = capsys.readouterr()
    assert "fails its CRC-32 check" in captured.err
    assert "resuming from the previous checkpoint checkpoint.1.pt (step 2)" in captured.out


def test_resume_follows_the_data_content_not_its_path_and_warns_on_another_backend(tmp_path, capsys, monkeypatch):
    from test_train import _StopAt

    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    first, moved = tmp_path / "corpus.txt", tmp_path / "elsewhere" / "renamed.txt"
    first.write_text(text)
    out = tmp_path / "run"
    monkeypatch.setattr(loop, "StopRequest", _StopAt(1))
    assert _run(out, "--steps", "3", "--data", str(first)) == 130
    monkeypatch.undo()

    moved.parent.mkdir()
    first.rename(moved)
    moved.write_text(text.replace("fox", "cat"))  # the same size, other content
    assert _run(out, "--steps", "3", "--data", str(moved), "--resume") == 2
    assert "data: checkpoint has" in capsys.readouterr().err

    moved.write_text(text)  # the same content at another path
    monkeypatch.setattr(loop, "StopRequest", _StopAt(1))
    assert _run(out, "--steps", "3", "--data", str(moved), "--resume") == 130
    monkeypatch.undo()
    assert "warning" not in capsys.readouterr().err

    assert cli.main([*SHORT, "--out", str(out), "--steps", "3", "--data", str(moved), "--resume",
                     "--backend", "triton"]) == 0
    error = capsys.readouterr().err
    assert "the checkpoint was written on CPU (PyTorch reference" in error and "this run is on CPU (Triton" in error


def test_a_data_file_truncated_mid_run_stops_with_a_checkpoint_not_sigbus(tmp_path, capsys, monkeypatch):
    """The memory-mapped .bin shrinks under the run (another job rewrote it): the next step refuses
    before touching a page past its end, and the finished steps are checkpointed."""
    tokens = torch.randint(0, 300, (20_000,), dtype=torch.int32).to(torch.uint16)
    data = tmp_path / "train.bin"
    data.write_bytes(tokens.numpy().tobytes())
    calls = []
    check = loop.token_data.TokenData.check_files_unchanged

    def truncate_after_two_steps(self):
        calls.append(1)
        if len(calls) == 3:
            with open(data, "r+b") as stream:
                stream.truncate(1000)
        check(self)

    monkeypatch.setattr(loop.token_data.TokenData, "check_files_unchanged", truncate_after_two_steps)
    out = tmp_path / "run"
    assert _run(out, "--steps", "4", "--data", str(data), "--vocab-size", "300") == 2
    error = capsys.readouterr().err
    assert f"--data: {data} changed during the run (its size went from 40,000 to 1,000 bytes)" in error
    assert "the 2 finished steps are checkpointed" in error
    assert load_checkpoint(out / "checkpoint.pt", {})["step"] == 2


def test_a_failing_metrics_write_does_not_cost_the_finished_steps(tmp_path, capsys, monkeypatch):
    """The disk refuses the second step's metrics line: the checkpoint of both finished steps is
    written first, and the lost line is only a warning."""
    write = loop.write_metrics
    calls = []

    def failing_second_line(path, records, append=False, sync=False):
        if append:
            calls.append(1)
            if len(calls) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        write(path, records, append, sync)

    monkeypatch.setattr(loop, "write_metrics", failing_second_line)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left on device"):  # re-raised: the process exits 1 with it
        _run(out, "--steps", "4")
    error = capsys.readouterr().err
    assert "the last step's metrics line could not be written" in error
    assert "the 2 finished steps are checkpointed" in error
    assert load_checkpoint(out / "checkpoint.pt", {})["step"] == 2

    # The resume says which record is missing, and goes on: the checkpoint holds the lost step.
    monkeypatch.undo()
    assert _run(out, "--steps", "4", "--resume") == 0
    metrics = out / "metrics.jsonl"
    assert (f"warning: {metrics} has no record of step 1, which checkpoint.pt (step 2) holds: that history is lost; "
            "the run goes on from the checkpoint") in capsys.readouterr().err
    assert [r["step"] for r in _strict_metrics(out)] == [0, 2, 3]


def test_free_space_is_checked_before_the_first_step(tmp_path, capsys, monkeypatch):
    """12 bytes a parameter per checkpoint (fp32 weights and AdamW's moments): less than one
    refuses the run, less than the kept ones plus the one being written warns."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    from fused_remat.model import preset

    parameters = sum(p.numel() for p in loop.LanguageModel(preset("tiny", vocab_size=256), device="meta").parameters())
    one = loop.CHECKPOINT_BYTES_PER_PARAMETER * parameters
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * one, 9 * one, one // 2))
    assert _run(tmp_path / "full", "--steps", "1") == 2
    assert f"bytes free, but one checkpoint needs about {one:,}" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * one, 8 * one, 2 * one))
    assert _run(tmp_path / "tight", "--steps", "1", "--keep-checkpoints", "2") == 0
    assert "2 kept checkpoints and the one being written need about" in capsys.readouterr().err


def test_resume_refuses_the_metrics_of_another_run_naming_both_files_and_the_values(tmp_path, capsys, monkeypatch):
    """metrics.jsonl copied from another run (another seed and batch size): its record of the
    checkpoint's last step was logged for another checkpoint. Resuming would splice two runs'
    histories, so the resume is refused before anything in the folder changes; moving the file aside
    (as the message says) resumes with the earlier history lost."""
    from test_train import _StopAt

    from fused_remat.training.checkpoint import rng_digest

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for out, extra in ((ours, []), (theirs, ["--seed", "1", "--batch-size", "4"])):
        with monkeypatch.context() as patch:
            patch.setattr(loop, "StopRequest", _StopAt(2))
            assert _run(out, "--steps", "4", *extra) == 130
    metrics, ckpt = ours / "metrics.jsonl", ours / "checkpoint.pt"
    assert _strict_metrics(ours)[1]["checkpoint"]["tokens_seen"] == 2 * 2 * 16
    metrics.write_bytes((theirs / "metrics.jsonl").read_bytes())
    before = {p.name: p.read_bytes() for p in ours.iterdir()}
    capsys.readouterr()

    assert _run(ours, "--steps", "4", "--resume") == 2
    error = capsys.readouterr().err
    digest = {out: rng_digest(load_checkpoint(out / "checkpoint.pt", {})["rng"]["cpu"]) for out in (ours, theirs)}
    assert (f"error: --resume: {metrics} does not belong with {ckpt} (step 2): its record of step 1, the "
            "checkpoint's last, was logged for another checkpoint:\n"
            "  tokens_seen: checkpoint.pt has 64, metrics.jsonl has 128\n"
            f"  rng: checkpoint.pt has '{digest[ours]}', metrics.jsonl has '{digest[theirs]}'\n"
            "the metrics come from another run, or the checkpoint does; put back this run's metrics.jsonl, "
            f"or move {metrics} aside to resume without the earlier history") in error
    assert {p.name: p.read_bytes() for p in ours.iterdir()} == before

    metrics.rename(ours / "metrics.theirs.jsonl")
    assert _run(ours, "--steps", "4", "--resume") == 0
    assert f"{metrics} is missing: the history of steps before 2 is lost" in capsys.readouterr().err
    assert [r["step"] for r in _strict_metrics(ours)] == [2, 3]


def test_resume_from_a_checkpoint_older_than_the_metrics_record_warns_and_redoes_the_steps(tmp_path, capsys,
                                                                                          monkeypatch):
    """The checkpoint of step 4 fails to write (its metrics line, with its checkpoint field, is
    already on disk): the resume goes on from the checkpoint of step 2 and warns that metrics.jsonl
    recorded a newer one; steps 2 and 3 are trained and recorded again."""
    out = tmp_path / "run"
    save, calls = checkpoints.torch.save, []

    def second_save_fails(obj, stream):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(obj, stream)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints.torch, "save", second_save_fails)
        assert _run(out, "--steps", "4", "--checkpoint-interval", "2") == 1
    assert "the disk is full" in capsys.readouterr().err
    assert [r["step"] for r in _strict_metrics(out) if "checkpoint" in r] == [1, 3]

    assert _run(out, "--steps", "4", "--checkpoint-interval", "2", "--resume") == 0
    metrics, ckpt = out / "metrics.jsonl", out / "checkpoint.pt"
    assert (f"warning: {metrics} records a checkpoint at step 4, newer than {ckpt} (step 2): the run resumes from "
            "checkpoint.pt and trains steps 2 to 3 again") in capsys.readouterr().err
    records = _strict_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and "checkpoint" in records[3]
    assert load_checkpoint(ckpt, {})["step"] == 4


@pytest.mark.parametrize("keep", [1, 2])
def test_a_resumed_run_that_diverges_at_once_names_its_checkpoint_and_the_way_back(keep, tmp_path, capsys,
                                                                                   monkeypatch):
    """A NaN at the first step after resuming: the message names the checkpoint resumed from and its
    step, and the previous kept checkpoint to fall back to (or says there is none); following it
    resumes from that predecessor."""
    from test_train import _StopAt

    out = tmp_path / "run"
    args = ["--steps", "4", "--checkpoint-interval", "1", "--keep-checkpoints", str(keep), "--lr", "1e-3", "--warmup", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(loop, "StopRequest", _StopAt(2))
        assert _run(out, *args) == 130
    capsys.readouterr()
    with monkeypatch.context() as patch:
        _nan_at_calls(patch, {1})
        assert _run(out, *args, "--resume") == 1
    error = capsys.readouterr().err
    ckpt = out / "checkpoint.pt"
    assert (f"step 2: loss nan, gradient norm nan: training diverged at the first step after resuming from {ckpt} "
            "(step 2), stopping; checkpoint.pt is kept as it was. ") in error
    new_run = ("start a new run with another --out and a lower --lr (now 0.001), gradient clipping (--grad-clip, "
               "now 1) or a longer --warmup (now 1) (--resume keeps the run's settings); "
               "--skip-nonfinite N skips up to N such steps")
    assert load_checkpoint(ckpt, {})["step"] == 2 and _finite_weights(ckpt)
    if keep == 1:
        assert f"No earlier checkpoint is kept to fall back to (checkpoint.1.pt does not exist): {new_run}" in error
        return
    assert ("Fall back to the previous checkpoint, checkpoint.1.pt (step 1): move checkpoint.pt aside (e.g. to "
            f"checkpoint.pt.diverged) and --resume again; if it diverges there too, {new_run}") in error

    ckpt.rename(out / "checkpoint.pt.diverged")
    assert _run(out, *args, "--resume") == 0
    captured = capsys.readouterr()
    assert "resuming from the previous checkpoint checkpoint.1.pt (step 1), now checkpoint.pt\n" in captured.out
    assert "trains step 1 again" in captured.err
    assert [r["step"] for r in _strict_metrics(out)] == [0, 1, 2, 3]


def test_metrics_jsonl_is_fsynced_before_each_checkpoint(tmp_path, monkeypatch):
    """At a checkpoint step the metrics line is on disk (fsynced) before the checkpoint is written,
    so a machine crash cannot leave a checkpoint ahead of its metrics; other steps are not synced."""
    import os

    out = tmp_path / "run"
    fsync, synced = os.fsync, []

    def recording_fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name == "metrics.jsonl":
            synced.append(("metrics.jsonl", len(path.read_text().splitlines())))
        else:
            synced.append(("checkpoint" if path.name.endswith(".partial") else path.name, None))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    assert _run(out, "--steps", "5", "--checkpoint-interval", "2") == 0
    # the empty metrics.jsonl, written atomically (its .tmp, the folder's rename); the lines of steps 0-1, then
    # checkpoint 2 and its folder's rename; 0-3, checkpoint 4; 0-4, checkpoint 5
    assert synced == [("metrics.jsonl.tmp", None), ("run", None),
                      ("metrics.jsonl", 2), ("checkpoint", None), ("run", None),
                      ("metrics.jsonl", 4), ("checkpoint", None), ("run", None),
                      ("metrics.jsonl", 5), ("checkpoint", None), ("run", None)]


def _disk_full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("failing", ["strict_record", "replace"])
def test_a_failing_metrics_rewrite_on_resume_loses_no_history(failing, tmp_path, capsys, monkeypatch):
    """The resume rewrites metrics.jsonl through metrics.jsonl.tmp and a rename: a disk that fails
    while the records are written (which a truncating rewrite in place would have lost) or at the
    rename leaves metrics.jsonl as it was, says so, and leaves no .tmp; a .tmp left by an earlier
    crash is overwritten, not read."""
    from test_train import _StopAt

    out = tmp_path / "run"
    metrics, temporary = out / "metrics.jsonl", out / "metrics.jsonl.tmp"
    with monkeypatch.context() as patch:
        patch.setattr(loop, "StopRequest", _StopAt(2))
        assert _run(out, "--steps", "4") == 130
    before = metrics.read_bytes()
    capsys.readouterr()

    with monkeypatch.context() as patch:
        patch.setattr(reporting if failing == "strict_record" else reporting.os, failing, _disk_full)
        assert _run(out, "--steps", "4", "--resume") == 1
    assert (f"error: could not rewrite {metrics} (No space left on device); its earlier records are intact"
            in capsys.readouterr().err)
    assert metrics.read_bytes() == before and not temporary.exists()

    temporary.write_text("not a record\n")
    assert _run(out, "--steps", "4", "--resume") == 0
    assert [r["step"] for r in _strict_metrics(out)] == [0, 1, 2, 3] and not temporary.exists()


def test_a_failing_rank_brings_the_job_down_with_its_own_error(tmp_path):
    """Rank 1's data disk goes away at step 2 while rank 0 waits in that step's gradient all-reduce:
    rank 1 leaves at once with its own error (torchrun's root cause shows it, not an empty error
    file or a signal), and rank 0, whose all-reduce lost its peer, names rank 1's error as the cause
    instead of hanging or blaming its broken connection."""
    from test_train_preemption import torchrun_trainer

    failed = torchrun_trainer(tmp_path / "run", *SHORT, "--steps", "5", fault="raise:1:2")
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    root_cause = output.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "exitcode  : 1 " in root_cause, output
    assert "RuntimeError: the data disk went away" in root_cause, output
    assert ("error: rank 0 stopped because rank 1 failed: RuntimeError: the data disk went away (here: RuntimeError: "
            in output), output


def test_a_resume_with_another_context_parallel_degree_is_refused_naming_both(tmp_path, monkeypatch):
    """The checkpoint of a --context-parallel 2 run (stopped by SIGUSR1 on rank 0 while it sets up:
    both ranks of the ring stop after step 1) records the degree; resuming it on the same two ranks
    with --context-parallel 1 (two data-parallel replicas) would change the global batch (1
    micro-batch per step, then 2), so it is
    refused with the differences listed, each with both values and the flag that sets it."""
    from test_train_preemption import torchrun_trainer

    monkeypatch.setenv("FUSED_REMAT_BACKEND", "triton")  # the ring runs the kernels only (Triton's interpreter here)
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--seq-len", "16", "--batch-size", "1", "--eval-batches", "1", "--steps", "2",
            "--document-boundary", "none"]
    stopped = torchrun_trainer(out, *args, "--context-parallel", "2", fault="SIGUSR1:0:0")
    assert "stopped by SIGUSR1 at step 1" in stopped.stdout, stopped.stdout + stopped.stderr
    checkpoint = load_checkpoint(out / "checkpoint.dcp", {})  # sharded: the default under torchrun
    assert (checkpoint["run"]["context_parallel"], checkpoint["run"]["micro_batches"]) == (2, 1)
    before = _snapshot_without_lock(out)

    refused = torchrun_trainer(out, *args, "--context-parallel", "1", "--resume")
    error = refused.stderr
    assert refused.returncode != 0
    assert f"error: --resume: {out / 'checkpoint.dcp'} was written by a different run; resume with its settings" in error
    assert "\n  micro_batches: checkpoint has 1, this run has 2 (micro-batches per step: data-parallel ranks (the " \
           "ranks / --context-parallel) x --grad-accum)\n" in error, error
    assert "\n  context_parallel: checkpoint has 2, this run has 1 (--context-parallel)" in error, error
    assert _snapshot_without_lock(out) == before


def _snapshot_without_lock(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}
