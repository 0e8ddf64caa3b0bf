"""Preemption and leaving a multi-rank run: SIGTERM and SIGUSR1 (what SLURM sends before a time
limit with --signal) stop the trainer at the next step boundary with a checkpoint, every rank at the
same step even when one rank alone got the signal, with the exit status a scheduler reads as
"stopped from outside" (128 + the signal's number); the resume continues bit for bit. A run that
ends waits for every rank at a barrier with a timeout before leaving its process group.

Multi-rank runs are two gloo processes on the CPU under torchrun, on the reference backend (the
kernels are not the point); ``torchrun_trainer`` is shared with test_train_failures.py.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from fused_remat.training import cli, loop
from fused_remat.training.checkpoint import load_checkpoint, read_checkpoint
from fused_remat.training.loop import StopRequest, stop_status
from test_train import _trajectory
from test_train_failures import SHORT

TIMEOUT_S = 240

# The trainer with a fault planted on one rank: FAULT=what:rank:step, where what is "raise" (a
# RuntimeError, as a data disk that went away) or a signal's name, which the rank sends itself, once,
# the first time it draws a batch of that step (0-based), as a scheduler's signal would arrive
# mid-step; step 0's first batch is drawn while the run sets up, before its first step.
FAULTY_TRAINER = '''
import os
import signal
import sys

from fused_remat.training import cli, loop

what, rank, at_step = os.environ["FAULT"].split(":")
original, struck = loop.token_data.train_batch, []


def train_batch(data, step, *rest):
    if step == int(at_step) and os.environ["RANK"] == rank and not struck:
        struck.append(what)
        if what == "raise":
            raise RuntimeError("the data disk went away")
        os.kill(os.getpid(), getattr(signal, what))
    return original(data, step, *rest)


loop.token_data.train_batch = train_batch
sys.exit(cli.main())
'''


def torchrun_trainer(out: Path, *arguments: str, fault: str | None = None, ranks: int = 2) -> subprocess.CompletedProcess:
    """``python -m fused_remat.train *arguments --out out`` on ``ranks`` gloo ranks under torchrun, with
    ``fault`` (FAULTY_TRAINER) planted when given. The backend comes from FUSED_REMAT_BACKEND."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    program = ["-m", "fused_remat.train"]
    if fault is not None:
        script = out.parent / "faulty_trainer.py"
        script.write_text(FAULTY_TRAINER)
        env["FAULT"] = fault
        program = [str(script)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *program,
               *arguments, "--out", str(out)]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = launcher.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM, which torchrun passes on to its ranks (their own sessions: killing torchrun would orphan them)
        launcher.terminate()
        stdout, stderr = launcher.communicate(timeout=60)
        pytest.fail(f"torchrun still running after {TIMEOUT_S} s (a hang):\n{stdout}{stderr}")
    return subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _signal_at_step(monkeypatch, signum: int, at_step: int) -> None:
    """This process sends itself ``signum`` once, while it draws the batches of step ``at_step``."""
    original, sent = loop.token_data.train_batch, []

    def train_batch(data, step, *rest):
        if step == at_step and not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return original(data, step, *rest)

    monkeypatch.setattr(loop.token_data, "train_batch", train_batch)


@pytest.mark.parametrize("signum,status", [(signal.SIGUSR1, 138), (signal.SIGTERM, 143)])
def test_a_scheduler_signal_checkpoints_at_the_step_boundary_and_the_resume_is_bit_exact(signum, status, tmp_path,
                                                                                      monkeypatch, capsys):
    """The signal arrives inside step 1: the step finishes, is checkpointed, and the run exits
    128 + the signal's number; resuming gives the uninterrupted run's losses, gradient norms and
    weights, bit for bit."""
    args = [*SHORT, "--steps", "4", "--eval-interval", "2", "--warmup", "1", "--grad-accum", "2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main([*args, "--out", str(whole)]) == 0

    handler = signal.getsignal(signum)
    with monkeypatch.context() as patch:
        _signal_at_step(patch, signum, 1)
        assert cli.main([*args, "--out", str(split)]) == status
    assert signal.getsignal(signum) is handler  # the trainer's handler lives as long as the run
    name = signal.Signals(signum).name
    assert f"stopped by {name} at step 2; checkpoint saved in {split / 'checkpoint.pt'}; continue with --resume " \
           f"(exit status {status})" in capsys.readouterr().out
    assert load_checkpoint(split / "checkpoint.pt", {})["step"] == 2
    assert cli.main([*args, "--out", str(split), "--resume"]) == 0

    assert _trajectory(split) == _trajectory(whole)
    ours, theirs = (load_checkpoint(out / "checkpoint.pt", {})["model"] for out in (split, whole))
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_sigusr1_never_interrupts_a_step_and_a_second_sigterm_does():
    """SLURM's SIGUSR1 can reach a worker twice (directly and forwarded by torchrun): it only asks
    for the stop. A SIGTERM after it is the first interrupting signal, and the second one stops at
    once; the status stays that of the signal that asked first."""
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert [stop_status(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)] == [138, 143, 130]


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step_and_the_resume_is_bit_exact(tmp_path):
    """Rank 1 alone gets SIGUSR1 during step 1: both ranks agree to stop after it, both write their
    shards of the checkpoint of step 2 (checkpoint.dcp) and exit 138; resuming on two ranks gives the uninterrupted two-rank
    run bit for bit."""
    args = [*SHORT, "--steps", "4", "--eval-interval", "2", "--warmup", "1"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    finished = torchrun_trainer(whole, *args)
    assert finished.returncode == 0, finished.stdout + finished.stderr

    stopped = torchrun_trainer(split, *args, fault="SIGUSR1:1:1")
    output = stopped.stdout + stopped.stderr
    assert "stopped by SIGUSR1 at step 2" in stopped.stdout, output  # printed by rank 0, which got no signal
    assert "exitcode  : 138" in output and "exitcode  : 1 " not in output, output
    assert load_checkpoint(split / "checkpoint.dcp", {})["step"] == 2

    resumed = torchrun_trainer(split, *args, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _trajectory(split) == _trajectory(whole)
    ours, theirs = (read_checkpoint(out / "checkpoint.dcp")["model"] for out in (split, whole))
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def _shutdown_rank(rank: int, ports: tuple[int, int], results) -> None:
    """Rank ``rank`` of two: a shutdown both ranks reach, then one that rank 1 never reaches."""
    import time

    import torch.distributed as dist

    from fused_remat.training.distributed import Distributed, leave, shutdown

    run = Distributed(rank=rank, world_size=2, strategy="ddp")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    shutdown(run, timeout=timedelta(seconds=60))
    results.put((rank, "both arrived", dist.is_initialized()))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(5)  # alive but elsewhere: a hung rank
        leave(run)
        return
    started = time.monotonic()
    try:
        shutdown(run, timeout=timedelta(seconds=1))
    except RuntimeError as error:
        results.put((rank, str(error), time.monotonic() - started, dist.is_initialized()))


def test_shutdown_waits_for_every_rank_and_names_one_that_never_arrives():
    from test_context_parallel import _free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = (_free_port(), _free_port())
    ranks = [context.Process(target=_shutdown_rank, args=(rank, ports, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(TIMEOUT_S)
    assert [process.exitcode for process in ranks] == [0, 0]
    reports = [results.get(timeout=1) for _ in range(3)]
    assert sorted(reports[:2]) == [(0, "both arrived", False), (1, "both arrived", False)]
    rank, message, waited, joined = reports[2]
    assert rank == 0 and not joined and waited < 30
    assert message.startswith("rank 0: not every rank reached the end of the run within 0:00:01 ")
    assert "Ranks 1 failed to pass monitoredBarrier" in message
