"""What a training run shows and leaves behind: the progress line, ``metrics.jsonl``, the plot
(and the matplotlib set-up the benchmark plots share: ``pyplot``, ``save_figure``)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from .checkpoint import _fsync_directory


def read_metrics(path: Path, warn=None) -> list[dict]:
    """The records of ``metrics.jsonl``, one JSON object a line ([] without the file). A last line
    cut short by a crash (no newline, not JSON) is dropped, and ``warn`` told; a line that is not a
    record anywhere else is a ValueError naming the file and the line."""
    if not path.is_file():
        return []
    records = []
    lines = path.read_text().split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif number == len(lines):  # the file does not end in a newline: a write cut short
            if warn is not None:
                warn(f"{path}: dropped its last line, cut short by an interrupted write: {line[:80]!r}")
        else:
            raise ValueError(f"{path}:{number} is not a metrics record (a JSON object with a step): {line[:80]!r}; "
                             "fix or delete that line, then resume")
    return records


def strict_record(record: dict) -> dict:
    """``record`` as strict JSON can hold it: a NaN or infinite number becomes null, and the record's
    ``nonfinite`` list names those fields (with their value as text: "nan", "inf", "-inf")."""
    bad = {key: value for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)}
    if not bad:
        return record
    flagged = dict(record.get("nonfinite", {}), **{key: str(value) for key, value in bad.items()})
    return {**record, **{key: None for key in bad}, "nonfinite": flagged}


def write_metrics(path: Path, records: list[dict], append: bool = False, sync: bool = False) -> None:
    """One strict JSON record per line (``strict_record``); each line is flushed as it is written,
    so a crash of the process loses at most one. ``sync`` also fsyncs the file, so that a crash of
    the machine cannot lose it either: the trainer asks for it at checkpoint steps, before the
    checkpoint is written, so a checkpoint is never ahead of its metrics on disk.

    Without ``append`` the file is replaced atomically (always synced): the records go to
    ``<path>.tmp``, which is fsynced, renamed over ``path``, and the folder fsynced. A crash or a
    failed write leaves either the old file or the new one whole, never a truncated one."""
    if append:
        with open(path, "a") as stream:
            _write_records(stream, records, sync)
        return
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "w") as stream:  # "w": a .tmp left by an earlier crash is overwritten, never read
            _write_records(stream, records, sync=True)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # ``path`` is as it was; leave no partial copy taking up space
        raise
    _fsync_directory(path.parent)  # makes the rename itself survive a crash of the machine


def _write_records(stream, records: list[dict], sync: bool) -> None:
    for record in records:
        stream.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
    stream.flush()
    if sync:
        os.fsync(stream.fileno())


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A one-line progress bar (step, loss, tokens/s, peak memory, ETA) redrawn in place on a
    terminal; elsewhere (CI logs, files) one line every ``every`` steps and at validation."""

    def __init__(self, total: int, start: int, enabled: bool, every: int = 10, stream=None):
        self.total, self.start, self.enabled, self.every = total, start, enabled, every
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.began = time.perf_counter()

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        done = record["step"] + 1
        elapsed = time.perf_counter() - self.began
        remaining = elapsed / max(1, done - self.start) * (self.total - done)
        width = 24
        filled = int(width * done / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} loss {record['loss']:.4f}"
                + (f" val {record['val_loss']:.4f}" if "val_loss" in record else "")
                + f" | {record['tokens_per_s']:,.0f} tok/s | peak {_gib(record['peak_memory'])} | ETA {_duration(remaining)}")
        if self.interactive:
            self.stream.write("\r" + line.ljust(110))
            if "val_loss" in record:
                self.stream.write("\n")
        elif done % self.every == 0 or done == self.total or "val_loss" in record:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.interactive:
            self.stream.write("\n")
            self.stream.flush()


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or None when matplotlib is not installed.
    The one matplotlib set-up of the project: the training plot here, the benchmark plots (bench/)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path) -> Path:
    """Writes ``fig`` to ``path`` with everything in it (titles, labels, legends) inside the image,
    and closes it."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def plot_metrics(metrics_path: Path, png_path: Path) -> Path | None:
    """Training and validation loss, and peak memory, against the step; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    records = read_metrics(metrics_path)
    if not records:
        return None
    figure, (loss_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in records]
    trained = [r for r in records if r.get("loss") is not None]  # a non-finite loss is null
    loss_axis.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="train", linewidth=1)
    evaluated = [r for r in records if r.get("val_loss") is not None]
    loss_axis.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-", label="validation")
    loss_axis.set(xlabel="step", ylabel="loss (nats per token)", title="loss")
    loss_axis.legend()
    memory_axis.plot(steps, [r["peak_memory"] / 2**30 for r in records])
    memory_axis.set(xlabel="step", ylabel="GiB", title="peak memory (CUDA allocated; on CPU the process's RSS)")
    figure.tight_layout()
    return save_figure(figure, png_path)
