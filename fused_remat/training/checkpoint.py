"""Training checkpoints that are either whole or absent, rotated so that a bad one has a predecessor.

A checkpoint is written to a temporary file in the run's folder (``.checkpoint.pt.<pid>.partial``),
flushed to disk, then renamed over the previous one (``os.replace`` is atomic on one file system):
a crash or Ctrl-C in the middle of a write leaves the last good checkpoint as it was. With
``keep > 1`` the previous checkpoints stay beside it as ``checkpoint.1.pt`` (the one before),
``checkpoint.2.pt`` and so on: each is hard-linked (or copied) into place before the new file is
renamed in, so ``checkpoint.pt`` itself is never missing. A partial file left by a process that was
killed is removed on the next start (``remove_stale_partials``).

Loading first checks every entry of the file's zip archive against its CRC-32 (torch.load does not:
a flipped bit in a tensor would load silently), then the format and that the run being resumed is
the one that wrote it; any problem is a
``CheckpointError`` that says what is wrong, raised before anything in the run's folder is touched.
An unreadable newest checkpoint falls back to the newest readable predecessor
(``load_newest_checkpoint``). Errors never pass on torch's suggestion to load with
``weights_only=False``: a checkpoint holds only tensors and plain containers, and unpickling
anything else could run arbitrary code. A failed write is a ``CheckpointWriteError`` naming the
path, the reason (disk full, permission denied) and the bytes the checkpoint needs, and whether a
previous checkpoint is there to fall back to.

The metrics record of a checkpoint's last step carries a ``checkpoint`` field (``checkpoint_mark``:
the tokens trained on and a digest of the RNG state), appended and fsynced before the checkpoint is
written; on resume ``check_metrics`` compares it with the checkpoint, so a ``metrics.jsonl`` of
another run is refused instead of being spliced into this one's history.

Sharded checkpoints (``checkpoint.dcp``, the default of a multi-process run): a folder that
torch.distributed.checkpoint (DCP) writes, every rank its own shards in parallel (``__<rank>_0.distcp``
and DCP's ``.metadata``), beside ``run.pt``, the run state that is not model or optimizer (step, RNG,
the run's settings, the backend), a plain ``torch.save`` file readable with ``weights_only=True``. The
ranks write into ``.checkpoint.dcp.staging``; once DCP has finished on every rank, rank 0 writes
``run.pt`` last, then renames the staging folder to ``checkpoint.dcp``: that rename is the commit, so
a folder named ``checkpoint[.k].dcp`` is always complete. Predecessors are ``checkpoint.1.dcp`` and so
on; the two forms share one sequence of ages (``checkpoint_files``), so a run that changes form (a
single-process run resumed under torchrun) rotates and falls back across both. A staging folder left
by a killed job is removed on the next start. With ``--async-checkpoint`` the shards are copied into
host memory at the checkpoint step and written by DCP's thread while training goes on
(``start_sharded_checkpoint``); the commit (``ShardedSave.finish``) waits for them, so the folder
becomes a checkpoint only once every rank's shards are on disk. ``python -m
fused_remat.training.checkpoint convert SRC DST`` converts between the two forms (``convert``).

One trainer per run folder (``RunLock``): two trainers writing one folder would rotate each other's
checkpoints away and interleave their metrics.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import pickle
import re
import shutil
import socket
import sys
import warnings
import zipfile
from pathlib import Path

import torch

CHECKPOINT_NAME = "checkpoint.pt"
SHARDED_NAME = "checkpoint.dcp"
RUN_STATE_NAME = "run.pt"  # inside a sharded checkpoint: everything but the model and optimizer
STAGING_NAME = ".checkpoint.dcp.staging"
FORMATS = ("sharded", "single")
LOCK_NAME = ".lock"
_FORMAT = "fused_remat.train checkpoint"
_VERSION = 1
_ONE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's, in one process: intended here
_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)\.partial")


class CheckpointError(RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the previous checkpoints are as they were."""


class RunLock:
    """An exclusive ``flock`` on ``<out>/.lock``, held while a trainer runs in that folder. The
    kernel releases it when the process ends, however it ends (kill -9 included), so a lock is never
    stale; the file names its holder (pid and host) for the refusal a second trainer gets. A folder
    the lock had to create is removed again when the run leaves nothing else in it (a refused
    setting leaves no empty run folder behind)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.folder = Path(out_dir)
        self.path = self.folder / LOCK_NAME
        self._file = None
        self._created_folder = False

    def __enter__(self) -> RunLock:
        self._created_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process that has not written its name yet"
            file.close()
            raise CheckpointError(f"--out {self.folder}: another trainer is running in this folder ({holder}); "
                                  "wait for it to finish, or choose another --out") from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self._file = file
        return self

    def __exit__(self, *exc) -> None:
        if self._created_folder and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
            self.path.unlink()
            self.folder.rmdir()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def checkpoint_path(out_dir: str | os.PathLike, form: str = "single") -> Path:
    """Where a run in ``out_dir`` writes its newest checkpoint in ``form`` (FORMATS)."""
    return Path(out_dir) / (SHARDED_NAME if form == "sharded" else CHECKPOINT_NAME)


def is_sharded(path: Path) -> bool:
    return path.suffix == ".dcp"


def _age(path: Path) -> int:
    """How many saves ago ``path`` (checkpoint.pt, checkpoint.3.dcp, ...) was written."""
    parts = path.name.split(".")
    return int(parts[1]) if len(parts) == 3 else 0


def _named(path: Path, age: int, sharded: bool) -> Path:
    """The checkpoint beside ``path`` of ``age`` in either form."""
    stem = path.name.split(".")[0]
    return predecessor(path.with_name(f"{stem}.dcp" if sharded else f"{stem}.pt"), age)


def predecessor(path: Path, age: int) -> Path:
    """The checkpoint ``age`` saves before ``path``: checkpoint.pt -> checkpoint.1.pt, ..."""
    return path if age == 0 else path.with_name(f"{path.stem}.{age}{path.suffix}")


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoints beside ``path`` that exist, in either form (checkpoint[.k].pt files,
    checkpoint[.k].dcp folders), newest first; at one age, the newer step first."""
    found, age = [], 0

    def exists(age: int) -> bool:
        return any(_named(path, age, sharded).exists() for sharded in (False, True))

    while age == 0 or exists(age) or exists(age + 1):
        here = [p for p in (_named(path, age, False), _named(path, age, True))
                if (p.is_dir() if is_sharded(p) else p.is_file())]
        if len(here) == 2:  # only after a crash between two renames of a rotation
            here.sort(key=lambda p: -(checkpoint_step(p) or -1))
        found.extend(here)
        age += 1
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _shift(path: Path) -> None:
    """Renames every checkpoint beside ``path`` one age older (checkpoint.pt -> checkpoint.1.pt,
    checkpoint.dcp -> checkpoint.1.dcp), oldest first, leaving age 0 free for the new one."""
    for entry in reversed(checkpoint_files(path)):
        target = _named(path, _age(entry) + 1, is_sharded(entry))
        if target.exists():
            _remove(target)
        os.replace(entry, target)


def _prune(path: Path, keep: int) -> None:
    """Removes the checkpoints beside ``path`` of age ``keep`` and older."""
    for entry in checkpoint_files(path):
        if _age(entry) >= keep:
            _remove(entry)


def _partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def state_bytes(state) -> int:
    """The bytes of the tensors in ``state`` (nested dicts, lists, tuples): about a checkpoint's size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def save_checkpoint(path: Path, state: dict, keep: int = 1, rotate: bool = True) -> None:
    """Writes ``state`` (plus the format tag) to ``path`` atomically, keeping the ``keep - 1``
    checkpoints before it as predecessors (``rotate``; without, ``path`` is simply replaced).
    CheckpointWriteError when the write fails."""
    temporary = _partial_path(path)
    try:
        with open(temporary, "wb") as stream:
            torch.save({"format": _FORMAT, "version": _VERSION, **state}, stream)
            stream.flush()
            os.fsync(stream.fileno())
        if not rotate:
            os.replace(temporary, path)
        elif any(is_sharded(entry) for entry in checkpoint_files(path)):
            _shift(path)  # a run that changed form: one sequence of ages for both
            os.replace(temporary, path)
            _prune(path, max(keep, 1))
        else:
            _rotate(path, keep)
            os.replace(temporary, path)
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
        raise CheckpointWriteError(_write_failure(path, state, error)) from error
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def _rotate(path: Path, keep: int) -> None:
    """Shifts checkpoint.k.pt to checkpoint.k+1.pt (the oldest beyond ``keep`` drops out), then
    links the current checkpoint as checkpoint.1.pt; the current one stays in place throughout."""
    if keep <= 1 or not path.is_file():
        return
    predecessor(path, keep).unlink(missing_ok=True)
    for age in range(keep - 1, 1, -1):
        if predecessor(path, age - 1).is_file():
            os.replace(predecessor(path, age - 1), predecessor(path, age))
    previous = predecessor(path, 1)
    link = previous.with_name(f".{previous.name}.{os.getpid()}.partial")
    link.unlink(missing_ok=True)
    try:
        os.link(path, link)
    except OSError:  # a file system without hard links
        shutil.copyfile(path, link)
    os.replace(link, previous)


def _write_failure(path: Path, state: dict, error: BaseException, needed: int | None = None) -> str:
    needed = state_bytes(state) if needed is None else needed
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    code = getattr(error, "errno", None)
    if code == errno.ENOSPC or (code is None and free is not None and free < needed):
        reason = "the disk is full"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = "permission denied" if code != errno.EROFS else "the file system is read-only"
    else:
        reason = f"{type(error).__name__}: {_first_line(error)}"
    space = f"; {free:,} bytes free there" if free is not None else ""
    # a failed write leaves ``path`` as it was: there is a previous checkpoint exactly when it exists
    fallback = ("the previous checkpoint is untouched" if path.exists() else
                f"there is no previous checkpoint (this was the run's first): its {state['step']} finished steps "
                "are not saved")
    return f"could not write the checkpoint {path}: {reason} (it needs about {needed:,} bytes{space}); {fallback}"


def rng_digest(rng_state: torch.Tensor) -> str:
    """A short fingerprint of a torch RNG state: the first 16 hex digits of its bytes' sha256."""
    return hashlib.sha256(rng_state.numpy().tobytes()).hexdigest()[:16]


def checkpoint_mark(step: int, tokens_per_step: int, rng_state: torch.Tensor) -> dict:
    """The ``checkpoint`` field of the metrics record of a checkpoint's last step (step ``step - 1``
    in metrics.jsonl): the tokens trained on up to the checkpoint and the digest of its RNG state."""
    return dict(tokens_seen=step * tokens_per_step, rng=rng_digest(rng_state))


def check_metrics(state: dict, path: Path, records: list[dict], metrics_path: Path, tokens_per_step: int) -> list[str]:
    """Checks the metrics history (``records`` of ``metrics_path``) against the checkpoint ``state``
    read from ``path``; returns the warnings to print. A record of the checkpoint's last step whose
    ``checkpoint`` field differs from the checkpoint is a CheckpointError: the history before the
    checkpoint would be another run's. A history that ends before the checkpoint (a lost line or
    file) or records a newer checkpoint than ``path`` (a write that failed, a checkpoint set aside)
    is a warning: the run goes on from the checkpoint, and redoes and records again the steps after
    it."""
    step = state["step"]
    if not metrics_path.is_file():
        return [f"{metrics_path} is missing: the history of steps before {step} is lost; it is written again from here"]
    by_step = {record["step"]: record for record in records}
    warnings = []
    last = by_step.get(step - 1)
    if last is None:
        first = max((s + 1 for s in by_step if s < step - 1), default=0)
        warnings.append(f"{metrics_path} has no record of {_steps(first, step - 1)}, which {path.name} (step {step}) "
                        "holds: that history is lost; the run goes on from the checkpoint")
    elif "checkpoint" in last:
        ours = checkpoint_mark(step, tokens_per_step, state["rng"]["cpu"])
        theirs = last["checkpoint"] if isinstance(last["checkpoint"], dict) else {}  # another tool's field
        differences = [f"{key}: {path.name} has {value!r}, {metrics_path.name} has {theirs.get(key)!r}"
                       for key, value in ours.items() if theirs.get(key) != value]
        if differences:
            raise CheckpointError(
                f"--resume: {metrics_path} does not belong with {path} (step {step}): its record of step {step - 1}, "
                "the checkpoint's last, was logged for another checkpoint:\n  " + "\n  ".join(differences) +
                f"\nthe metrics come from another run, or the checkpoint does; put back this run's metrics.jsonl, "
                f"or move {metrics_path} aside to resume without the earlier history")
    newer = [s + 1 for s, record in by_step.items() if s >= step and "checkpoint" in record]
    if newer:
        warnings.append(f"{metrics_path} records a checkpoint at step {max(newer)}, newer than {path} (step {step}): "
                        f"the run resumes from {path.name} and trains {_steps(step, max(newer) - 1)} again")
    return warnings


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} to {last}"


def checkpoint_step(path: Path) -> int | None:
    """The step of the checkpoint at ``path`` without reading its tensors (memory-mapped), or None
    where it cannot be read."""
    try:
        if is_sharded(path):
            return torch.load(path / RUN_STATE_NAME, map_location="cpu", weights_only=True)["step"]
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception:  # torch.load raises many types for damaged files; the caller only names the step
        return None


def remove_stale_partials(out_dir: Path) -> list[tuple[Path, int]]:
    """Deletes partial checkpoint files in ``out_dir`` whose writing process no longer runs (killed
    during a write); returns (path, bytes) of each one removed."""
    removed = []
    if not out_dir.is_dir():
        return removed
    for candidate in sorted(out_dir.iterdir()):
        if candidate.name == STAGING_NAME and candidate.is_dir():  # one trainer per folder (RunLock): not ours
            size = sum(f.stat().st_size for f in candidate.rglob("*") if f.is_file())
            shutil.rmtree(candidate)
            removed.append((candidate, size))
            continue
        match = _PARTIAL.fullmatch(candidate.name)
        if match is None or not match["name"].endswith(".pt") or not candidate.is_file():
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and _process_alive(pid):
            continue  # another run may be writing into this folder right now
        size = candidate.stat().st_size
        candidate.unlink(missing_ok=True)
        removed.append((candidate, size))
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _fsync_directory(directory: Path) -> None:
    """Makes the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(error: BaseException) -> str:
    """The gist of ``error``: its first line, without torch's advice to load with weights_only=False."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if "weights_only" not in line and "arbitrary code" not in line]
    return (lines[0] if lines else "")[:200]


def _damaged_entry(path: Path) -> str | None:
    """The first entry of the checkpoint's zip archive whose CRC-32 does not match its bytes (a bit
    flipped on disk or in transit, which torch.load does not check), or None. Reading the whole file
    once costs about what loading it does."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError):
        return None  # not an archive at all: torch.load says what is wrong


def _read_sharded(path: Path) -> dict:
    """The run state of the sharded checkpoint ``path`` (its tensors stay on disk, for DCP to load
    resharded: ``state["sharded"]`` is the folder)."""
    missing = [name for name in (".metadata", RUN_STATE_NAME) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"--resume: {path} is not a readable checkpoint (it lacks {' and '.join(missing)}; a "
                              "sharded checkpoint folder is complete when renamed into place: this one was changed since)")
    state = _read(path / RUN_STATE_NAME)
    if not state.get("sharded"):
        raise CheckpointError(f"--resume: {path / RUN_STATE_NAME} is not the run state of a sharded checkpoint")
    state["sharded"] = path
    return state


def _read(path: Path) -> dict:
    if is_sharded(path):
        return _read_sharded(path)
    damaged = _damaged_entry(path)
    if damaged is not None:
        raise CheckpointError(f"--resume: {path} is not a readable checkpoint (its entry {damaged} fails its CRC-32 "
                              "check: the file changed after it was written)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types for damaged files
        if isinstance(error, pickle.UnpicklingError) and "weights_only" in str(error):
            why = ("it holds Python objects other than tensors and plain containers, which a training checkpoint "
                   "never does; it is not unpickled, as that could run arbitrary code")
        else:
            why = f"{type(error).__name__}: {_first_line(error)}; it may be truncated or corrupt"
        raise CheckpointError(f"--resume: {path} is not a readable checkpoint ({why})") from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointError(f"--resume: {path} is not a fused_remat.train checkpoint")
    if state.get("version") != _VERSION:
        raise CheckpointError(f"--resume: {path} has checkpoint version {state.get('version')}, expected {_VERSION}")
    run = state.get("run")
    if isinstance(run, dict) and "micro_batches" not in run and "data_parallel" in run:
        # written before the data order was per micro-batch slot: the same rule (loop.run_settings)
        run["micro_batches"] = run["data_parallel"] * run.get("grad_accum", 1)
    return state


def load_checkpoint(path: Path, expected_run: dict, sources: dict[str, str] | None = None) -> dict:
    """The checkpoint at ``path``, after checking it was written by a run whose settings
    (``state["run"]``) equal ``expected_run`` wherever the trajectory depends on them; each
    difference names what sets it (``sources``: setting -> flag) and both values."""
    if not path.exists():
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    state = _read(path)
    saved_run = state.get("run", {})
    sources = sources or {}
    differences = [f"{key}: checkpoint has {saved_run.get(key)!r}, this run has {value!r}"
                   + (f" ({sources[key]})" if key in sources else "")
                   for key, value in expected_run.items() if saved_run.get(key) != value]
    if differences:
        raise CheckpointError(f"--resume: {path} was written by a different run; resume with its settings or "
                              "choose another --out:\n  " + "\n  ".join(differences))
    return state


def load_newest_checkpoint(path: Path, expected_run: dict,
                           sources: dict[str, str] | None = None) -> tuple[dict, Path, list[str]]:
    """The newest readable checkpoint among ``path`` and its predecessors (``load_checkpoint``'s
    checks apply), where it was, and one warning per newer checkpoint that could not be read. A
    checkpoint of a different run is an error at once; when none is readable, the error is the
    newest one's."""
    files = checkpoint_files(path)
    if not files:
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    warnings, first_error = [], None
    for candidate in files:
        try:
            return load_checkpoint(candidate, expected_run, sources), candidate, warnings
        except CheckpointError as error:
            if "different run" in str(error):
                raise
            first_error = first_error or error
            warnings.append(str(error).removeprefix("--resume: "))
    raise first_error


def promote(chosen: Path, path: Path) -> list[Path]:
    """After resuming from the predecessor ``chosen``, moves the unreadable newer checkpoints aside
    (``<name>.unreadable``) and ``chosen`` to ``path``, so that rotation goes on from the good one.
    Returns the files set aside."""
    aside = []
    for newer in checkpoint_files(path):
        if newer == chosen:
            break
        target = newer.with_name(newer.name + ".unreadable")
        if target.exists():
            _remove(target)
        os.replace(newer, target)
        aside.append(target)
    newest = _named(path, 0, is_sharded(chosen))
    if chosen != newest:
        os.replace(chosen, newest)
    return aside


def newest_name(chosen: Path) -> Path:
    """Where ``promote`` puts the checkpoint ``chosen``."""
    return _named(chosen, 0, is_sharded(chosen))


def save_sharded_checkpoint(path: Path, tensors: dict, state: dict, keep: int, rank: int, barrier,
                            rotate: bool = True) -> None:
    """The sharded checkpoint (module docstring), written by every rank: ``tensors`` is this rank's
    ``{"model": ..., "optimizer": ...}`` (sharded state dicts, DCP deduplicates replicated ones),
    ``state`` the run state that rank 0 writes as run.pt, the last file before the commit rename.
    ``barrier`` waits for every rank (a no-op in one process). CheckpointWriteError on every rank
    whose part failed; the previous checkpoints are as they were."""
    start_sharded_checkpoint(path, tensors, state, keep, rank, barrier, rotate).finish()


def start_sharded_checkpoint(path: Path, tensors: dict, state: dict, keep: int, rank: int, barrier,
                             rotate: bool = True, asynchronous: bool = False, group=None) -> ShardedSave:
    """Writes this rank's shards of a sharded checkpoint into the staging folder and returns the save,
    which ``finish`` commits. ``asynchronous`` (``--async-checkpoint``): DCP copies ``tensors`` into
    host memory now and writes them from a thread, its collectives on ``group`` (a gloo group of
    every rank, ``distributed.checkpoint_group``) so that they never interleave with training's on
    the default one; the caller trains on and calls ``finish`` later, on every rank at the same
    point of the run."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    staging = path.with_name(f".{path.name}.staging")
    if rank == 0 and staging.exists():
        _remove(staging)
    barrier()
    if asynchronous and not dist.is_initialized():
        # DCP's writer thread warns after quiet_dcp (whose catch_warnings ends here) is over: ignored for good
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)
    save = ShardedSave(path, staging, state, state_bytes(tensors) + state_bytes(state), keep, rank, barrier, rotate)
    try:
        with quiet_dcp():
            if asynchronous:
                save.writing = dcp.async_save(tensors, checkpoint_id=staging, process_group=group,
                                              no_dist=not dist.is_initialized())
            else:
                dcp.save(tensors, checkpoint_id=staging, no_dist=not dist.is_initialized())
    except Exception as error:  # DCP gathers every rank's failure into one CheckpointException
        raise save.failure(error) from error
    return save


class ShardedSave:
    """A sharded checkpoint whose shards are written, or being written (``writing``, DCP's future),
    into ``staging``; ``finish`` commits it."""

    def __init__(self, path: Path, staging: Path, state: dict, needed: int, keep: int, rank: int, barrier,
                 rotate: bool):
        self.path, self.staging, self.state, self.needed = path, staging, state, needed
        self.keep, self.rank, self.barrier, self.rotate = keep, rank, barrier, rotate
        self.writing = None
        self.step = state["step"]

    def failure(self, error: BaseException) -> CheckpointWriteError:
        return CheckpointWriteError(_write_failure(self.path, self.state, error, self.needed))

    def finish(self) -> None:
        """Waits for this rank's shards (DCP's last step gathers every rank's result, so once rank 0
        has it all shards are on disk), then rank 0 writes run.pt and commits by renaming the folder;
        every rank returns once it is committed. CheckpointWriteError on every rank when any rank's
        write failed."""
        if self.writing is not None:
            try:
                with quiet_dcp():
                    self.writing.result()
            except Exception as error:
                raise self.failure(error) from error
        if self.rank == 0:
            try:
                with open(self.staging / RUN_STATE_NAME, "wb") as stream:
                    torch.save({"format": _FORMAT, "version": _VERSION, "sharded": True, **self.state}, stream)
                    stream.flush()
                    os.fsync(stream.fileno())
                _fsync_directory(self.staging)  # DCP fsyncs its files (FileSystemWriter's sync_files), not their names
                if self.rotate:
                    _commit_folder(self.staging, self.path, self.keep)
                else:
                    os.replace(self.staging, self.path)
            except OSError as error:
                _remove(self.staging)
                raise self.failure(error) from error
            _fsync_directory(self.path.parent)
        self.barrier()


@contextlib.contextmanager
def quiet_dcp():
    """Silences DCP's warning that it runs in one process: intended here (one process, or a converter)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)
        yield


def _commit_folder(staging: Path, path: Path, keep: int) -> None:
    """Renames the complete ``staging`` folder to ``path`` after shifting the checkpoints before it
    one age older; then drops those of age ``keep`` and older. A crash between the renames leaves
    the previous checkpoint under its next age, where fallback finds it."""
    _shift(path)
    os.replace(staging, path)
    _prune(path, max(keep, 1))


def read_checkpoint(path: Path) -> dict:
    """The whole checkpoint at ``path`` in the single-file layout, whichever its form: a sharded
    one's tensors are read in full into this process (DCP without a process group)."""
    state = _read(path)
    if not is_sharded(path):
        return state
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".convert.") as scratch:
        whole = Path(scratch) / "tensors.pt"
        with quiet_dcp():
            dcp_to_torch_save(path, whole)
        tensors = torch.load(whole, map_location="cpu", weights_only=True)
    del state["sharded"]
    return {**state, "model": tensors["model"], "optimizer": tensors["optimizer"]}


def convert(source: Path, target: Path) -> str:
    """Converts the checkpoint ``source`` to the other form at ``target``: a sharded folder
    (``.dcp``) to one checkpoint.pt file, which the trainer loads in any world, or a file to a
    folder. Both are written atomically; ``target`` must not exist. Returns what was done."""
    if target.exists():
        raise CheckpointError(f"convert: {target} exists; choose a new path")
    if is_sharded(source) == is_sharded(target):
        raise CheckpointError(f"convert: {source} and {target} are of one form; a sharded checkpoint is a folder "
                              "named *.dcp, a single-file one any other name (e.g. checkpoint.pt)")
    state = read_checkpoint(source)
    state = {key: value for key, value in state.items() if key not in ("format", "version", "sharded")}
    if is_sharded(target):
        tensors = {"model": state.pop("model"), "optimizer": state.pop("optimizer")}
        save_sharded_checkpoint(target, tensors, state, keep=1, rank=0, barrier=lambda: None, rotate=False)
    else:
        save_checkpoint(target, state, rotate=False)
    return f"{source} (step {state['step']}) -> {target}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fused_remat.training.checkpoint",
                                     description="Training checkpoints: convert between the sharded folder "
                                                 "(checkpoint.dcp) and the single file (checkpoint.pt).")
    commands = parser.add_subparsers(dest="command", required=True)
    converting = commands.add_parser("convert", help="SRC to the other form at DST (a *.dcp folder or a file)")
    converting.add_argument("source", type=Path, metavar="SRC")
    converting.add_argument("target", type=Path, metavar="DST")
    arguments = parser.parse_args(argv)
    try:
        print(convert(arguments.source, arguments.target))
    except CheckpointError as error:
        print(f"error: {str(error).removeprefix('--resume: ')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
