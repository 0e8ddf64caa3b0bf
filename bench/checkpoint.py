"""`python -m bench checkpoint`: the trainer's checkpoint save and load, sharded against gathered.

    python -m bench checkpoint                                  # gpt2-medium, 2 ranks, into bench/results/checkpoint/
    python -m bench checkpoint --preset tiny --out DIR          # a quick run (the test's)

For each strategy (DDP, FSDP2) and form (``sharded``: torch.distributed.checkpoint, every rank
writing its own shards into ``checkpoint.dcp``; ``async``: the same written from DCP's thread,
``--async-checkpoint``; ``single``: the full state gathered to rank 0, which writes
``checkpoint.pt``) one ``torchrun --standalone`` job of ``--ranks`` gloo CPU ranks,
on the reference backend (``FUSED_REMAT_BACKEND=reference``: plain PyTorch, no Triton
interpreter), runs this module as its worker (``--worker``). Each rank builds the model and AdamW
as the trainer does (``cli.parse_args``, ``LanguageModel``, ``wrap_model``, ``make_optimizer``),
trains one step (``train_step``, a short sequence) so that AdamW's moments exist, then calls the
trainer's own checkpoint code, as ``training/loop.py`` does:

- save: the trainer's ``start_checkpoint`` (``start_sharded_checkpoint`` on every rank and its
  ``finish``, the commit; or ``training_state``, a collective, and ``save_checkpoint`` on rank 0),
  then a barrier. Two times, each from a barrier and the largest over the ranks: how long training
  waits (``save_s``: up to the commit, but for ``async`` only until DCP has copied the shards into
  host memory and its thread writes them) and how long until the checkpoint is committed
  (``written_s``; the same as ``save_s`` but for ``async``, whose commit the trainer makes at its
  next checkpoint, while it trains). ``--repeats`` saves (5), each into a fresh folder (nothing to
  rotate), each followed by a load, and the table gives the median and the range;
- load: the weights and AdamW's state zeroed and the checkpoint's files dropped from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)``, so read through the disk, as a restart reads them), then
  ``load_newest_checkpoint`` (which for the single file checks every entry's CRC-32 and reads it
  whole on every rank) and ``load_sharded_training_state`` (DCP, each rank reading its own pieces)
  or ``load_training_state``, into the same world, between two barriers. After it the checksum of
  the weights and AdamW's state (a float64 sum over every rank's local tensors) must equal the one
  taken before the save: ``restored`` in the results.

Bytes per rank: the files each rank wrote. DCP names a rank's data ``__<rank>_<n>.distcp``; rank 0
also writes DCP's ``.metadata`` and the trainer's ``run.pt``, and all of the single file. Under DDP
every rank holds every tensor, and DCP deduplicates them, spreading the writes over the ranks.
DCP stores every tensor (every shard of one, under FSDP2) as its own record with framing of its
own, and an index of them in ``.metadata``: next to the single file, a sharded checkpoint is larger
by that fixed amount, which weighs on a tiny model's checkpoint and vanishes beside a large one's
(``total MiB`` in bench/results/checkpoint).

Peak RSS: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of each rank at the end, so the peak of the
whole job (model, the training step, the save and the load), one job per row.

These are CPU processes on one host writing to one local disk: the numbers say what the two forms
cost relative to each other on that machine (and how they scale with the checkpoint), not what a
cluster's parallel file system does. Results: ``checkpoint.json`` (environment, settings, rows)
and ``checkpoint.md`` under ``--out`` (default ``bench/results/checkpoint/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import harness

DEFAULT_OUT = harness.REPO / "bench" / "results" / "checkpoint"
STRATEGIES = ("ddp", "fsdp")
FORMS = ("sharded", "async", "single")
SEQ_LEN = 32  # one short sequence: the step only has to make AdamW's state
BATCH_SIZE = 1
REPEATS = 5  # saves and loads per job, each timed: the table gives their median and range
JOB_TIMEOUT_S = 3600
_DCP_FILE = re.compile(r"__(?P<rank>[0-9]+)_[0-9]+\.distcp")


@dataclasses.dataclass(frozen=True)
class Row:
    strategy: str
    form: str
    ranks: int
    preset: str
    vocab_size: int
    parameters: int
    save_s: list[float]  # how long training waits for each save (from a barrier), the largest over the ranks
    written_s: list[float]  # how long until each save is committed (save_s but for async)
    load_s: list[float]  # the same for each load into the same world
    bytes_per_rank: list[int]  # the bytes of the files each rank wrote
    files_per_rank: list[list[str]]  # their names, relative to the checkpoint
    peak_rss_bytes: list[int]  # each rank's ru_maxrss at the end of the job
    restored: bool  # the loaded weights and AdamW state equal the saved ones (checksum)
    host_load: list[float]  # the host's 1-minute load average when the job started and when it ended

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_rank)

    @property
    def save_median(self) -> float:
        return statistics.median(self.save_s)

    @property
    def load_median(self) -> float:
        return statistics.median(self.load_s)


# --------------------------------------------------------------------------------------------
# The worker: one rank of a torchrun job
# --------------------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensor: this rank's shard


def _training_tensors(model, optimizer) -> list[torch.Tensor]:
    tensors = [_local(p) for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [_local(value) for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


def _checksum(model, optimizer) -> float:
    """A float64 sum of every value of the weights and AdamW's state, over all ranks' local tensors."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64)
    for tensor in _training_tensors(model, optimizer):
        total += tensor.detach().sum(dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def files_by_rank(path: Path, ranks: int) -> list[list[Path]]:
    """The files of the checkpoint ``path`` by the rank that wrote them: a sharded folder's
    ``__<rank>_<n>.distcp`` to their rank, everything else (DCP's .metadata, run.pt) and a single
    file to rank 0."""
    written = [[] for _ in range(ranks)]
    for file in sorted(path.rglob("*") if path.is_dir() else [path]):
        if file.is_file():
            match = _DCP_FILE.fullmatch(file.name)
            written[int(match["rank"]) if match else 0].append(file)
    return written


def evict(path: Path) -> None:
    """Drops the checkpoint's files from this machine's page cache (written and fsynced: clean pages),
    so that the load reads them from the disk as a restart would."""
    for file in path.rglob("*") if path.is_dir() else [path]:
        if file.is_file():
            descriptor = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def worker(args) -> int:
    """One rank: build, train a step, save and load the checkpoint as the trainer does (module
    docstring). It leaves the process group only once the model is gone, as the trainer does: a DDP
    model's reducer holds the gloo group, and a group destroyed by the reducer after it was left
    joins gloo's thread while holding the GIL that thread may still need (a hang seen here)."""
    from fused_remat.training import cli
    from fused_remat.training.distributed import init_distributed, shutdown

    vocab = [] if args.vocab_size is None else ["--vocab-size", str(args.vocab_size)]
    config = cli.parse_args(["--backend", "reference", "--preset", args.preset, "--seq-len", str(args.seq_len),
                             "--batch-size", str(BATCH_SIZE), "--steps", "1", "--distributed", args.strategy,
                             *(["--async-checkpoint"] if args.form == "async" else ["--checkpoint-format", args.form]),
                             "--out", str(args.scratch), *vocab])
    cli.choose_backend(config.backend)
    run = init_distributed(config.distributed)
    row = _measure(args, config, run)
    if row is not None:
        Path(args.result).write_text(json.dumps(dataclasses.asdict(row)))
    shutdown(run)
    return 0


def _measure(args, config, run) -> Row | None:
    """The worker's saves and loads on this rank; rank 0's row."""
    import resource

    import torch.distributed as dist

    from fused_remat.model import LanguageModel
    from fused_remat.training import data as token_data
    from fused_remat.training.checkpoint import checkpoint_path, load_newest_checkpoint
    from fused_remat.training.distributed import (checkpoint_group, load_sharded_training_state, load_training_state,
                                                  unwrap, wrap_model)
    from fused_remat.training.loop import (checkpoint_form, micro_batch_slot, resolve_remat, run_settings,
                                           start_checkpoint)
    from fused_remat.training.step import make_optimizer, train_step

    out = Path(args.scratch)
    device = run.device()
    data = token_data.load_data(config.data, config.vocab_size, config.seq_len, config.document_boundary)
    model_config = config.model_config(data.vocab_size)
    settings = run_settings(config, model_config, data, run)
    policies, _ = resolve_remat(config, model_config, device, run)
    torch.manual_seed(config.seed)
    model = wrap_model(LanguageModel(model_config, policies, block_impl=config.block, device=device), run)
    optimizer = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    batch = token_data.train_batch(data, 0, 0, micro_batch_slot(run, config.grad_accum, 0), config.batch_size,
                                   config.seq_len, config.seed)
    train_step(model, optimizer, [batch])  # AdamW's moments now exist; the gradients are freed
    parameters = sum(p.numel() for p in unwrap(model).parameters())
    before = _checksum(model, optimizer)
    if run.is_main:
        out.mkdir(parents=True, exist_ok=True)
    writers = checkpoint_group(run) if config.async_checkpoint else None

    def save(ckpt: Path) -> tuple[float, float]:
        """What loop.py's save() does: how long training waits for it and how long until it is
        committed (from a barrier, the largest over the ranks)."""
        run.barrier()
        started = time.perf_counter()
        run_state = dict(step=1, run=settings, backend="reference", rng=dict(cpu=torch.get_rng_state()))
        writing = start_checkpoint(ckpt, model, optimizer, run_state, config, run, writers)
        waited = time.perf_counter() - started
        if writing is not None:
            writing.finish()
        run.barrier()
        written = time.perf_counter() - started
        return _max_over_ranks(waited if config.async_checkpoint else written), _max_over_ranks(written)

    def load(ckpt: Path) -> float:
        """What loop.py's resume does, from the disk, into weights and moments zeroed first."""
        with torch.no_grad():
            for tensor in _training_tensors(model, optimizer):
                tensor.zero_()
        if run.is_main:
            evict(ckpt)
        run.barrier()
        started = time.perf_counter()
        state, _, _ = load_newest_checkpoint(ckpt, settings)
        if "sharded" in state:
            load_sharded_training_state(model, optimizer, state["sharded"])
        else:
            load_training_state(model, optimizer, state["model"], state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        del state
        run.barrier()
        return _max_over_ranks(time.perf_counter() - started)

    save_s, written_s, load_s, restored = [], [], [], True
    for repeat in range(args.repeats):  # each into a folder of its own: no rotation, nothing to overwrite
        ckpt = checkpoint_path(out / f"repeat{repeat}", checkpoint_form(config, run))
        if run.is_main:
            ckpt.parent.mkdir(parents=True)
        run.barrier()
        waited, written = save(ckpt)
        save_s.append(waited)
        written_s.append(written)
        load_s.append(load(ckpt))
        restored = restored and _checksum(model, optimizer) == before != 0.0
        if repeat == 0 and run.is_main:
            written = files_by_rank(ckpt, run.world_size)
            bytes_per_rank = [sum(f.stat().st_size for f in files) for files in written]
            files_per_rank = [[f.relative_to(ckpt).as_posix() if ckpt.is_dir() else f.name for f in files]
                              for files in written]
        run.barrier()
        if run.is_main:
            shutil.rmtree(ckpt.parent)

    peaks = [None] * run.world_size
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    if not run.is_main:
        return None
    return Row(strategy=args.strategy, form=args.form, ranks=run.world_size, preset=args.preset,
               vocab_size=model_config.vocab_size, parameters=parameters, save_s=save_s, written_s=written_s,
               load_s=load_s, bytes_per_rank=bytes_per_rank, files_per_rank=files_per_rank, peak_rss_bytes=peaks,
               restored=restored, host_load=[args.host_load, os.getloadavg()[0]])


# --------------------------------------------------------------------------------------------
# The driver: one torchrun job per row
# --------------------------------------------------------------------------------------------


def run_job(preset: str, ranks: int, strategy: str, form: str, seq_len: int, scratch: Path,
            vocab_size: int | None = None, repeats: int = REPEATS) -> Row:
    """One row: a torchrun job of ``ranks`` gloo CPU ranks writing into a fresh folder in ``scratch``
    (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix=f"checkpoint-{strategy}-{form}-", dir=scratch))
    result = folder / "row.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", FUSED_REMAT_BACKEND="reference")
    env.pop("TRITON_INTERPRET", None)
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "bench.checkpoint", "--worker", "--preset", preset, "--strategy", strategy, "--form", form,
               "--seq-len", str(seq_len), "--scratch", str(folder / "run"), "--result", str(result),
               "--host-load", str(os.getloadavg()[0]), "--repeats", str(repeats),
               *([] if vocab_size is None else ["--vocab-size", str(vocab_size)])]
    try:
        job = subprocess.Popen(command, cwd=harness.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
        try:
            output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            job.terminate()  # torchrun passes SIGTERM on to its ranks
            output, _ = job.communicate(timeout=60)
            raise RuntimeError(f"{strategy} {form}: torchrun still running after {JOB_TIMEOUT_S} s:\n{output[-3000:]}")
        if job.returncode != 0 or not result.is_file():
            raise RuntimeError(f"{strategy} {form}: torchrun exited with {job.returncode}:\n{output[-5000:]}")
        return Row(**json.loads(result.read_text()))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _spread(times: list[float]) -> str:
    """The median of ``times``, and their range when there are several: 5.30 (5.02-6.28)."""
    median = f"{statistics.median(times):.2f}"
    return median if len(times) == 1 else f"{median} ({min(times):.2f}-{max(times):.2f})"


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f}"


def _mib(count: float) -> str:
    return f"{count / 2**20:,.1f}"


def markdown_table(rows: list[Row], environment: dict, settings: dict) -> str:
    first = rows[0]
    cores = settings["cpu_cores"]
    lines = [f"**checkpoint**: `{settings['command']}`: the "
             f"trainer's checkpoint save and load for `{first.preset}` (vocab {first.vocab_size}, "
             f"{first.parameters / 1e6:.1f}M parameters, fp32 "
             f"weights and AdamW's two moments) on {first.ranks} gloo CPU ranks (torchrun, reference backend, one "
             f"training step of {settings['batch_size']} x {settings['seq_len']} tokens first), sharded "
             "(torch.distributed.checkpoint, every rank its own shards; async: the same written from DCP's thread, "
             "--async-checkpoint) against single (gathered to rank 0, one file). "
             f"Machine: {cores} CPU cores, {environment['device']}, torch {environment['torch']}, Python "
             f"{environment['python']}, {environment['date']}, commit {environment['commit']}. These are CPU "
             "processes on one host writing to one local disk: the two forms compared on that machine, not a "
             "cluster's file system.",
             "",
             "| strategy | form | ranks | save s | written s | load s | MiB per rank | total MiB | rank 0 peak RSS GiB "
             "| restored | host load |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for row in rows:
        lines.append(f"| {row.strategy} | {row.form} | {row.ranks} | {_spread(row.save_s)} | {_spread(row.written_s)} | "
                     f"{_spread(row.load_s)} | "
                     f"{' / '.join(_mib(b) for b in row.bytes_per_rank)} | {_mib(row.total_bytes)} | "
                     f"{_gib(row.peak_rss_bytes[0])} | {'yes' if row.restored else 'NO'} | "
                     f"{' -> '.join(f'{load:.1f}' for load in row.host_load)} |")
    lines += ["", f"Save, written and load: seconds, the median (and range) of {settings['repeats']} in one job, each "
              "from a barrier, the largest over the ranks, each save into a fresh folder. Save: how long training "
              "waits; written: until the checkpoint is committed (the same but for async, whose shards are copied "
              "into host memory while training waits and written by DCP's thread while it trains on; the trainer "
              "commits them at its next checkpoint). A load reads the "
              "checkpoint back into the same world (the single file: CRC-32 check and the whole file read on every "
              "rank), its files first dropped from the page cache (posix_fadvise DONTNEED), so read through the disk "
              "(here a virtual machine's disk, which its host may cache). MiB per rank: the files each rank wrote "
              "(rank 0 also DCP's .metadata and run.pt). Peak RSS: "
              "rank 0's ru_maxrss over its whole job (model, one training step, save, load). Restored: the weights "
              "and AdamW state after the load sum to what they summed to before the save. Host load: the 1-minute load "
              f"average when the job started and when it ended, on {cores} cores: above {cores} the ranks shared the "
              "cores with other processes, and the times are longer than on an idle machine."]
    return "\n".join(lines) + "\n"


def write_results(folder: Path, rows: list[Row], environment: dict, settings: dict) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"command": "checkpoint", "environment": environment, "settings": settings,
               "rows": [{**dataclasses.asdict(row), "total_bytes": row.total_bytes, "save_median_s": row.save_median,
                        "load_median_s": row.load_median} for row in rows]}
    written = [folder / "checkpoint.json", folder / "checkpoint.md"]
    written[0].write_text(json.dumps(payload, indent=1) + "\n")
    written[1].write_text(markdown_table(rows, environment, settings))
    return written


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-medium", help="the trainer's model preset (default: gpt2-medium)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo CPU ranks per torchrun job (default: 2)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"saves and loads per job, each timed; the table gives the median and range (default {REPEATS})")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help=f"tokens of the one training step (default {SEQ_LEN})")
    parser.add_argument("--vocab-size", type=int,
                        help="the trainer's --vocab-size (default: its byte-level 256); a larger one adds embedding rows")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="where the checkpoints are written, then removed (default: the system's temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default: {DEFAULT_OUT})")
    # one rank of a job (run_job starts these)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--form", choices=FORMS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--host-load", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (sharded against gathered needs more than one rank)")
    return args


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    scratch = args.scratch or Path(tempfile.gettempdir())
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    for strategy in args.strategies:
        for form in args.forms:
            job_started = time.perf_counter()
            row = run_job(args.preset, args.ranks, strategy, form, args.seq_len, scratch, args.vocab_size, args.repeats)
            rows.append(row)
            print(f"{strategy} {form}: save {_spread(row.save_s)} s, load {_spread(row.load_s)} s, "
                  f"{' / '.join(_mib(b) for b in row.bytes_per_rank)} MiB per rank "
                  f"({time.perf_counter() - job_started:.0f} s)", flush=True)
    environment = harness.environment()
    command = f"python -m bench checkpoint --preset {args.preset} --ranks {args.ranks}"
    command += "" if args.vocab_size is None else f" --vocab-size {args.vocab_size}"
    command += "" if args.seq_len == SEQ_LEN else f" --seq-len {args.seq_len}"
    command += "" if args.repeats == REPEATS else f" --repeats {args.repeats}"
    settings = dict(command=command, preset=args.preset, vocab_size=rows[0].vocab_size, ranks=args.ranks,
                    repeats=args.repeats, seq_len=args.seq_len, batch_size=BATCH_SIZE,
                    backend="reference", process_group="gloo", cpu_cores=os.cpu_count(), scratch=str(scratch))
    written = write_results(args.out, rows, environment, settings)
    print(markdown_table(rows, environment, settings))
    print(f"wrote {', '.join(str(path) for path in written)} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
