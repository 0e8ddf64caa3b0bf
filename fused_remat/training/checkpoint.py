"""Training checkpoints that are either whole or absent.

A checkpoint is written to a temporary file in the run's folder, flushed to disk, then renamed over
the previous one (``os.replace`` is atomic on one file system): a crash or Ctrl-C in the middle of
a write leaves the last good checkpoint as it was. Loading checks the format and that the run
being resumed is the one that wrote it; any problem is a ``CheckpointError`` that says what is
wrong, raised before anything in the run's folder is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHECKPOINT_NAME = "checkpoint.pt"
_FORMAT = "fused_remat.train checkpoint"
_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / CHECKPOINT_NAME


def save_checkpoint(path: Path, state: dict) -> None:
    """Writes ``state`` (plus the format tag) to ``path`` atomically."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(temporary, "wb") as stream:
            torch.save({"format": _FORMAT, "version": _VERSION, **state}, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(path.parent)


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


def load_checkpoint(path: Path, expected_run: dict) -> dict:
    """The checkpoint at ``path``, after checking it was written by a run whose settings
    (``state["run"]``) equal ``expected_run`` wherever the trajectory depends on them."""
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types for damaged files
        raise CheckpointError(f"--resume: {path} is not a readable checkpoint ({type(error).__name__}: {error}); "
                              "it may be truncated or corrupt") from error
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointError(f"--resume: {path} is not a fused_remat.train checkpoint")
    if state.get("version") != _VERSION:
        raise CheckpointError(f"--resume: {path} has checkpoint version {state.get('version')}, expected {_VERSION}")
    saved_run = state.get("run", {})
    differences = [f"{key}: checkpoint has {saved_run.get(key)!r}, this run has {value!r}"
                   for key, value in expected_run.items() if saved_run.get(key) != value]
    if differences:
        raise CheckpointError(f"--resume: {path} was written by a different run; resume with its settings or "
                              "choose another --out:\n  " + "\n  ".join(differences))
    return state
