"""Sharded checkpoints (torch.distributed.checkpoint) and restarts on another world: two gloo ranks
under torchrun (FSDP2, DDP) write ``checkpoint.dcp`` in parallel; a run resumes from it on one
process, and a one-process run's ``checkpoint.pt`` resumes on two ranks, each drawing every batch
once (a step's global batch is its micro-batch slots, whoever draws them: 2 ranks x --grad-accum 1
resume as 1 rank x --grad-accum 2). A save that dies midway leaves the previous checkpoint the
newest complete one, and ``python -m fused_remat.training.checkpoint convert`` goes both ways.

Exactness: on the same world a resumed run is bit for bit the uninterrupted one (same kernels, same
reductions). Across worlds it is within a float tolerance, not bitwise: the gradient of a step is
the same sum over the same sequences, but added in another order (gloo's all-reduce of two ranks'
means, or one process accumulating two micro-batches, each scaled by 1/2 at another point), and
FSDP2 applies AdamW to shards where one process applies it to whole tensors; fp32 rounding differs
in the last bits, which the following steps carry on (rel 1e-4 over a few steps; weights whose
gradients are near zero within 1% of one learning-rate step, where AdamW's normalised step turns a
rounding difference into a step of another size).

Worlds tested: 2 FSDP2 ranks -> 2 and 1; 4 FSDP2 ranks -> 2 (x --grad-accum 2) and 1 (x 4); 1
process (x 4) -> 4 FSDP2 ranks; 1 process -> 2 DDP ranks.

The reference backend throughout (the kernels are not the point), on the tiny preset.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fused_remat.training import checkpoint as checkpoints
from fused_remat.training import cli
from fused_remat.training.checkpoint import checkpoint_files, load_checkpoint, read_checkpoint
from fused_remat.training.config import PEAK_LR
from test_train import _metrics, _trajectory
from test_train_failures import SHORT
from test_train_preemption import _signal_at_step, torchrun_trainer

ARGS = [*SHORT, "--steps", "4", "--eval-interval", "2", "--warmup", "1", "--checkpoint-interval", "2"]
# A tolerance for the same steps on another world (module docstring).
REL = 1e-4
TINY_LR = PEAK_LR["tiny"]

# The trainer on a rank that dies by SIGKILL inside its second sharded save (after the first, at step
# 2, completed), the way a node fails: its peer has written its shards into the staging folder.
DYING_TRAINER = '''
import os
import signal
import sys

import torch.distributed.checkpoint as dcp

from fused_remat.training import cli

original, saves = dcp.save, []


def save(*args, **kwargs):
    saves.append(1)
    if len(saves) == 2 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)


dcp.save = save
sys.exit(cli.main())
'''


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _losses(out: Path) -> list[float]:
    return [record["loss"] for record in _metrics(out)]


def _assert_close_states(ours: dict, theirs: dict, rel: float, atol: float = 1e-6) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rel, atol=atol, msg=name)


def test_fsdp_sharded_checkpoint_resumes_bitwise_on_two_ranks_and_closely_on_one(tmp_path, capsys):
    whole, split, one = tmp_path / "whole", tmp_path / "split", tmp_path / "one"
    args = [*ARGS, "--distributed", "fsdp"]
    finished = torchrun_trainer(whole, *args)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert [p.name for p in checkpoint_files(whole / "checkpoint.dcp")] == ["checkpoint.dcp", "checkpoint.1.dcp"]
    assert sorted(p.name for p in (whole / "checkpoint.dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "run.pt"]  # each rank wrote its shards

    stopped = torchrun_trainer(split, *args, fault="SIGUSR1:1:1")
    assert "exitcode  : 138" in stopped.stderr, stopped.stdout + stopped.stderr  # torchrun itself exits 1
    assert f"checkpoint saved in {split / 'checkpoint.dcp'}" in stopped.stdout
    shutil.copytree(split, one)

    resumed = torchrun_trainer(split, *args, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _trajectory(split) == _trajectory(whole)  # the same world: bit for bit
    _assert_close_states(read_checkpoint(split / "checkpoint.dcp")["model"],
                         read_checkpoint(whole / "checkpoint.dcp")["model"], 0)

    # 2 FSDP2 ranks x 1 micro-batch resume as 1 process x 2: the same global batches, resharded state
    assert cli.main([*ARGS, "--grad-accum", "2", "--resume", "--out", str(one)]) == 0
    assert _losses(one)[:2] == _losses(whole)[:2]  # the history before the checkpoint, kept
    assert _losses(one) == pytest.approx(_losses(whole), rel=REL)
    single = load_checkpoint(one / "checkpoint.pt", {})  # one process writes the single file again
    assert single["step"] == 4 and [p.name for p in checkpoint_files(one / "checkpoint.pt")] == [
        "checkpoint.pt", "checkpoint.1.dcp"]  # one sequence of ages across both forms
    _assert_close_states(single["model"], read_checkpoint(whole / "checkpoint.dcp")["model"], REL)


def test_four_fsdp_ranks_resume_on_two_and_one_and_one_process_resumes_on_four(tmp_path):
    """4 FSDP2 ranks x 1 micro-batch = 2 ranks x 2 = 1 process x 4: a step's global batch is the same
    four micro-batch slots on each world, and DCP reshards the model and optimizer state."""
    whole, four, two, one, reverse = (tmp_path / name for name in ("whole", "four", "two", "one", "reverse"))
    args = [*ARGS, "--distributed", "fsdp"]
    finished = torchrun_trainer(whole, *args, ranks=4)
    assert finished.returncode == 0, finished.stdout + finished.stderr

    stopped = torchrun_trainer(four, *args, fault="SIGTERM:3:1", ranks=4)  # one rank's signal stops all four
    assert f"checkpoint saved in {four / 'checkpoint.dcp'}" in stopped.stdout, stopped.stdout + stopped.stderr
    assert sorted(p.name for p in (four / "checkpoint.dcp").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert read_checkpoint(four / "checkpoint.dcp")["step"] == 2
    shutil.copytree(four, two)
    shutil.copytree(four, one)

    resumed = torchrun_trainer(two, *args, "--grad-accum", "2", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert cli.main([*ARGS, "--grad-accum", "4", "--resume", "--out", str(one)]) == 0
    expected = read_checkpoint(whole / "checkpoint.dcp")["model"]
    for out in (two, one):
        assert _losses(out)[:2] == _losses(whole)[:2]  # the history before the checkpoint, kept
        assert _losses(out) == pytest.approx(_losses(whole), rel=REL)
    _assert_close_states(read_checkpoint(two / "checkpoint.dcp")["model"], expected, REL)
    _assert_close_states(load_checkpoint(one / "checkpoint.pt", {})["model"], expected, REL)

    # the reverse: one process x 4 micro-batches, stopped after step 2, resumes on 4 FSDP2 ranks
    stopped_once = torchrun_trainer(reverse, *ARGS, "--grad-accum", "4", fault="SIGTERM:0:1", ranks=1)
    assert load_checkpoint(reverse / "checkpoint.pt", {})["step"] == 2, stopped_once.stdout + stopped_once.stderr
    resumed = torchrun_trainer(reverse, *args, "--resume", ranks=4)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _losses(reverse) == pytest.approx(_losses(whole), rel=REL)
    # Its first two steps were summed in another order than on 4 ranks, and AdamW divides each
    # gradient by its own RMS: an element whose gradient is near zero steps by up to the learning
    # rate whatever its size, so there the rounding differences move weights by a fraction of it.
    _assert_close_states(read_checkpoint(reverse / "checkpoint.dcp")["model"], expected, REL, atol=TINY_LR / 100)


def _assert_same_checkpoints(ours: Path, theirs: Path) -> None:
    """Every checkpoint age of two runs holds the same step and the same bits."""
    assert [p.name for p in checkpoint_files(ours / "checkpoint.dcp")] == [
        p.name for p in checkpoint_files(theirs / "checkpoint.dcp")]
    for mine, other in zip(checkpoint_files(ours / "checkpoint.dcp"), checkpoint_files(theirs / "checkpoint.dcp")):
        mine, other = read_checkpoint(mine), read_checkpoint(other)
        assert mine["step"] == other["step"]
        _assert_close_states(mine["model"], other["model"], 0, atol=0)
        _assert_close_states(mine["optimizer"]["state"], other["optimizer"]["state"], 0, atol=0)


def test_an_asynchronous_checkpoint_holds_its_steps_state_while_training_goes_on(tmp_path, monkeypatch):
    """--async-checkpoint: the step loop trains on while a thread writes the shards (here made to
    take a while); what is written is the state of the checkpoint's step, committed at the next."""
    from torch.distributed.checkpoint import FileSystemWriter

    from fused_remat.training import loop

    events, write, step = [], FileSystemWriter.write_data, loop.train_step

    def slow_write(self, *args, **kwargs):
        events.append("write starts")
        time.sleep(1.0)
        result = write(self, *args, **kwargs)
        events.append("write ends")
        return result

    def logged_step(*args, **kwargs):
        events.append("step")
        return step(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    monkeypatch.setattr(loop, "train_step", logged_step)
    waited, background = tmp_path / "waited", tmp_path / "background"
    arguments = [*ARGS, "--steps", "6", "--checkpoint-interval", "2", "--keep-checkpoints", "3"]
    assert cli.main([*arguments, "--checkpoint-format", "sharded", "--out", str(waited)]) == 0
    events.clear()
    assert cli.main([*arguments, "--async-checkpoint", "--out", str(background)]) == 0
    steps, written = ([i for i, event in enumerate(events) if event == what] for what in ("step", "write ends"))
    assert len(steps) == 6 and len(written) == 3, events
    # the saves of steps 2 and 4 were still being written when steps 3 and 5 began; the last one waits
    assert written[0] > steps[2] and written[1] > steps[4], events
    assert written[2] == len(events) - 1, events
    assert _trajectory(background) == _trajectory(waited)
    _assert_same_checkpoints(background, waited)


def test_asynchronous_checkpoints_are_sharded_and_refuse_the_single_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main([*ARGS, "--async-checkpoint", "--checkpoint-format", "single", "--out", str(tmp_path)])
    assert "--async-checkpoint writes sharded checkpoints" in capsys.readouterr().err


def test_asynchronous_checkpoints_on_two_fsdp_ranks_and_a_stop_in_between(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    args = [*ARGS, "--distributed", "fsdp", "--steps", "6", "--keep-checkpoints", "3"]
    finished = torchrun_trainer(whole, *args)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    interrupted = torchrun_trainer(stopped, *args, "--async-checkpoint", fault="SIGTERM:1:3")  # after step 4's save
    assert "exitcode  : 143" in interrupted.stderr, interrupted.stdout + interrupted.stderr
    assert [checkpoints.checkpoint_step(p) for p in checkpoint_files(stopped / "checkpoint.dcp")] == [4, 2]
    resumed = torchrun_trainer(stopped, *args, "--async-checkpoint", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _trajectory(stopped) == _trajectory(whole)
    _assert_same_checkpoints(stopped, whole)


def test_a_single_file_checkpoint_resumes_on_two_ddp_ranks_and_converts_both_ways(tmp_path, capsys, monkeypatch):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main([*ARGS, "--grad-accum", "2", "--out", str(whole)]) == 0
    _signal_at_step(monkeypatch, signal.SIGUSR1, 1)
    assert cli.main([*ARGS, "--grad-accum", "2", "--out", str(split)]) == 128 + signal.SIGUSR1
    assert load_checkpoint(split / "checkpoint.pt", {})["step"] == 2

    resumed = torchrun_trainer(split, *ARGS, "--distributed", "ddp", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _losses(split) == pytest.approx(_losses(whole), rel=REL)
    assert [p.name for p in checkpoint_files(split / "checkpoint.dcp")] == ["checkpoint.dcp", "checkpoint.1.pt"]
    sharded = read_checkpoint(split / "checkpoint.dcp")
    _assert_close_states(sharded["model"], load_checkpoint(whole / "checkpoint.pt", {})["model"], REL)

    # convert: folder -> file -> folder, each equal to what the trainer wrote
    converted, back = tmp_path / "converted.pt", tmp_path / "back.dcp"
    assert checkpoints.main(["convert", str(split / "checkpoint.dcp"), str(converted)]) == 0
    assert checkpoints.main(["convert", str(converted), str(back)]) == 0
    as_file = load_checkpoint(converted, {})  # what the trainer itself loads (weights_only)
    for state in (as_file, read_checkpoint(back)):
        assert state["step"] == sharded["step"] and state["run"] == sharded["run"]
        assert torch.equal(state["rng"]["cpu"], sharded["rng"]["cpu"])
        _assert_close_states(state["model"], sharded["model"], 0)
        _assert_close_states(state["optimizer"]["state"], sharded["optimizer"]["state"], 0)
        assert state["optimizer"]["param_groups"] == sharded["optimizer"]["param_groups"]
    assert checkpoints.main(["convert", str(converted), str(back)]) == 1
    assert "exists; choose a new path" in capsys.readouterr().err


def test_a_rank_killed_mid_save_leaves_the_previous_sharded_checkpoint_newest(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "dying_trainer.py"
    script.write_text(DYING_TRAINER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               *ARGS, "--distributed", "ddp", "--checkpoint-interval", "2", "--out", str(out)]
    died = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert died.returncode != 0, died.stdout + died.stderr
    assert [p.name for p in checkpoint_files(out / "checkpoint.dcp")] == ["checkpoint.dcp"]
    assert read_checkpoint(out / "checkpoint.dcp")["step"] == 2  # the save at step 4 never committed
    assert (out / ".checkpoint.dcp.staging").is_dir()

    # the staging folder is removed on the next start; a refused world names what differs
    assert cli.main([*ARGS, "--resume", "--out", str(out)]) == 2
    assert "micro_batches: checkpoint has 2, this run has 1" in capsys.readouterr().err
    assert cli.main([*ARGS, "--grad-accum", "2", "--resume", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ".checkpoint.dcp.staging: a partial checkpoint" in printed
    assert not (out / ".checkpoint.dcp.staging").exists()
    assert [r["step"] for r in _metrics(out)] == [0, 1, 2, 3]


def test_a_failing_sharded_write_keeps_the_previous_checkpoint_and_says_why(tmp_path, capsys, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    out, original, calls = tmp_path / "run", dcp.save, []

    def save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save)
    assert cli.main([*ARGS, "--checkpoint-format", "sharded", "--checkpoint-interval", "2", "--out", str(out)]) == 1
    error = capsys.readouterr().err
    assert f"could not write the checkpoint {out / 'checkpoint.dcp'}: the disk is full" in error, error
    assert "the previous checkpoint is untouched" in error
    assert [checkpoints.checkpoint_step(p) for p in checkpoint_files(out / "checkpoint.dcp")] == [2]
