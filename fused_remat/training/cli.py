"""`python -m fused_remat.train`: train a language model built from fused_remat's TransformerBlock.

    python -m fused_remat.train                                  # a short run on whatever device is here
    python -m fused_remat.train --preset gpt2-small --seq-len 32768 --remat auto --memory-limit 40GiB
    python -m fused_remat.train --data train.bin --vocab-size 50304 --document-boundary 50256 --out runs/owt
    python -m fused_remat.train --out runs/owt --resume          # continues bit for bit
    python -m fused_remat.train --find-max-seq-len               # longest trainable sequence per policy
    python -m fused_remat.train --cuda-graphs --document-boundary none   # every step one graph replay
    torchrun --nproc_per_node 8 -m fused_remat.train --distributed fsdp ...
    torchrun --nproc_per_node 8 -m fused_remat.train --distributed fsdp --context-parallel 4 --seq-len 131072 ...

Without CUDA the kernels run in Triton's interpreter (so only the tiny preset is practical), or
with ``--backend reference`` as plain PyTorch, much faster. The run's folder (``--out``)
receives ``checkpoint.pt`` (atomic, rotated, on an interval, on Ctrl-C and on an error),
``metrics.jsonl`` (one strict JSON record per step, validation loss where evaluated) and
``training.png``.

This module is the command line only: flags -> ``TrainConfig`` (``training/config.py``), then the
training loop (``training/loop.py``) or the capacity search (``training/capacity.py``). Exit
status 0 when done, 1 when the run failed (a NaN or infinite loss, a checkpoint that could not be
written, or any other error, shown with its traceback after the last finished step is
checkpointed), 2 for a bad flag, setting or data file (the message names the flag), and after a
checkpoint, 128 + the number of the signal that stopped the run: 130 for Ctrl-C, 143 for SIGTERM,
138 for SIGUSR1 (``loop.stop_status``). Under torchrun a rank that fails reports its own error and
the others name it as their cause (``_failed``); ranks that finish wait for each other before
leaving (``distributed.shutdown``). ``python -m fused_remat.train`` (the module
``fused_remat/train.py``) and ``python -m fused_remat.training`` both run ``main``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from ..backend import BACKEND_ENV, BACKENDS, requested_backend
from ..model import PRESETS
from .capacity import find_max_seq_len
from .checkpoint import FORMATS, CheckpointError, CheckpointWriteError
from .config import DEVICE_DEFAULTS, DTYPES, TrainConfig
from .distributed import STRATEGIES, Distributed, init_distributed, leave, leave_after_failure, shutdown
from .loop import TrainingFailed, train


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The run's config from the command line (``sys.argv[1:]`` when ``argv`` is None), with the
    defaults of the device this process sees; a bad value exits with a usage error (status 2)."""
    parser = argparse.ArgumentParser(prog="python -m fused_remat.train", description=__doc__.split("\n")[0])
    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]

    def by_device(name: str) -> str:
        return f"(default: {cpu[name]} on CPU, {gpu[name]} on a GPU)"

    parser.add_argument("--preset", choices=sorted(PRESETS), help=f"model shape {by_device('preset')}")
    parser.add_argument("--steps", type=int, help=f"optimizer steps {by_device('steps')}")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence {by_device('seq_len')}")
    parser.add_argument("--batch-size", type=int, help=f"sequences per micro-batch per process {by_device('batch_size')}")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--remat",
                        help="none | cheap (default; none with --block reference) | selective | full | offload | "
                        "keep:<tensors> (e.g. keep:o,lse,h) | auto "
                        "(plan for --memory-limit in bytes) | a comma list, one per layer")
    parser.add_argument("--memory-budget", help="instead of --remat: a fraction in [0, 1] (0.3), torch.compile's "
                        "activation_memory_budget: each layer keeps at most that share of what --remat none keeps, "
                        "choosing per call what to keep or rebuild for the least recompute")
    parser.add_argument("--memory-limit", help="bytes with a unit (40GiB, 800MiB, 1.5G, 4096B): the activation peak "
                        "--remat auto plans for, and the cap of --find-max-seq-len (required on a CPU; default on a GPU: "
                        "what is free after weights, gradients and optimizer state)")
    parser.add_argument("--block", choices=("fused", "reference"), default="fused",
                        help="fused_remat's block (default), or the plain-PyTorch twin (then --remat none is eager and "
                        "full is torch.utils.checkpoint)")
    parser.add_argument("--data", help="a text file, a nanoGPT uint16/uint32 .bin (or a folder with train.bin/val.bin); "
                        "default: the Python standard library's sources, byte-level")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of a .bin file (default 256: bytes)")
    parser.add_argument("--document-boundary", metavar="TOKEN_ID|none",
                        help="attend only within documents: in --data, each document begins with this token (a token "
                        "id of a .bin, a byte value 0..255 of text; an end-of-text token that follows each document "
                        "opens the next). The default corpus's documents are its source files; none: attend over whole "
                        "rows (default: within documents for the default corpus, whole rows for --data)")
    parser.add_argument("--out", help="the run's folder (default runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    parser.add_argument("--lr", type=float, help="peak learning rate (default by preset)")
    parser.add_argument("--min-lr", type=float, help="final learning rate of the cosine decay (default lr / 10)")
    parser.add_argument("--warmup", type=int, help="linear warm-up steps (default steps / 10, at most 200)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of the matrices (default 0.1)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this; 0: off (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help=f"bf16: autocast over fp32 master weights; fp32 {by_device('dtype')}")
    parser.add_argument("--seed", type=int, default=0, help="initialization and data order (default 0)")
    parser.add_argument("--eval-interval", type=int, default=25, help="steps between validation losses (default 25)")
    parser.add_argument("--eval-batches", type=int, default=4, help="batches per validation loss (default 4)")
    parser.add_argument("--checkpoint-interval", type=int, default=100, help="steps between checkpoints; 0: only at the end (default 100)")
    parser.add_argument("--keep-checkpoints", type=int, default=2,
                        help="checkpoints kept: the newest (checkpoint.pt) and those before it (checkpoint.1.pt, ...) (default 2)")
    parser.add_argument("--checkpoint-format", choices=FORMATS,
                        help="sharded: a folder checkpoint.dcp, every rank writing its shards in parallel "
                        "(torch.distributed.checkpoint); single: one file checkpoint.pt that rank 0 gathers and writes; "
                        "default: sharded under torchrun with more than one rank, else single. Either resumes on any "
                        "number of ranks")
    parser.add_argument("--async-checkpoint", action="store_true", default=None,
                        help="write sharded checkpoints in the background: each rank copies its shards to host memory "
                        "at the checkpoint step (one more copy of its model and optimizer state, held until written), "
                        "then trains on while a thread writes them; the checkpoint is committed at the next one, at a "
                        "stop or at the end (implies --checkpoint-format sharded; for FSDP2: under DDP every rank copies the "
                        "whole replicated state)")
    parser.add_argument("--skip-nonfinite", type=int, default=0,
                        help="steps with a NaN or infinite loss or gradient norm to skip (no update) before the run "
                        "stops; 0: stop at the first (default 0)")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="fused_remat's kernels: triton (compiled on a GPU, Triton's interpreter on a CPU), "
                        "reference (plain PyTorch: the fast choice on a CPU), auto (default: triton where it can run; "
                        f"on a CPU the interpreter); default: ${BACKEND_ENV} if set, else auto")
    parser.add_argument("--distributed", choices=STRATEGIES, help="under torchrun only: ddp (default) or fsdp (FSDP2)")
    parser.add_argument("--context-parallel", type=int, metavar="N",
                        help="under torchrun: split every sequence over N ranks (--seq-len divisible by 2N): whole "
                        "rows by ring attention over zigzag chunks, documents by pieces of each and gathered k/v; the "
                        "world is N-rank groups x data parallel (default 1)")
    parser.add_argument("--cuda-graphs", action="store_true", default=None,
                        help="capture one whole step (forward, backward, clipping, AdamW) as a CUDA graph after three "
                        "eager steps and replay it: a step's host time becomes a few copies and one launch. One GPU, "
                        "fixed batch shapes: not with documents (--document-boundary none), --remat offload, "
                        "--context-parallel or torchrun's data parallelism")
    parser.add_argument("--find-max-seq-len", action="store_true",
                        help="instead of training: the longest sequence that trains one step, per policy")
    flags = parser.parse_args(argv)
    try:
        return TrainConfig.build("cuda" if torch.cuda.is_available() else "cpu", **vars(flags))
    except ValueError as error:
        parser.error(str(error))


def choose_backend(backend: str | None) -> None:
    """Sets ``FUSED_REMAT_BACKEND`` from ``--backend`` (left as it is without the flag) and, on a
    machine without CUDA where the kernels are to run, ``TRITON_INTERPRET=1``: Triton's interpreter
    must be chosen before triton is imported, which fused_remat does only when a kernel first runs."""
    if backend is not None:
        os.environ[BACKEND_ENV] = backend
    if not torch.cuda.is_available() and requested_backend() != "reference":
        os.environ.setdefault("TRITON_INTERPRET", "1")


# The errors reported as one message with an exit status (no traceback): 1 for a run that failed,
# 2 for a bad flag, setting or data file.
REPORTED_ERRORS = (((CheckpointWriteError, TrainingFailed), 1), ((ValueError, FileNotFoundError, CheckpointError), 2))
# How long a rank whose peer failed waits before it exits itself: torchrun names the earliest failure
# (to the second, ties to the lowest rank) as the job's root cause and stops the remaining ranks as
# soon as it sees one exit, so the failed rank is seen first and this one is stopped meanwhile.
PEER_FAILURE_GRACE_S = 5


def main(argv: list[str] | None = None) -> int:
    """Runs the command line ``argv``; returns the exit status (module docstring)."""
    config = parse_args(argv)
    try:
        choose_backend(config.backend)
        # --find-max-seq-len answers for --context-parallel in one process (training/capacity.py).
        run = init_distributed(config.distributed, 1 if config.find_max_seq_len else config.context_parallel)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        status = find_max_seq_len(config, run) if config.find_max_seq_len else train(config, run)
        shutdown(run)  # waits for every rank (or names the missing ones), then leaves
        return status
    except Exception as error:
        return _failed(error, run)
    finally:
        leave(run)  # without waiting, if anything above went wrong


def _failed(error: Exception, run: Distributed) -> int:
    """The exit status of this rank after ``error``: a reported error's, printed as a message; any
    other error is re-raised (its traceback shown), unless another rank failed first, which this
    rank then names as the cause. In a multi-rank run this rank also leaves its error for the other
    ranks and for torchrun's report (whose "Root Cause" shows it instead of an empty error file)."""
    status = next((code for types, code in REPORTED_ERRORS if isinstance(error, types)), None)
    # The failed run's frames, which the traceback keeps, hold its model: a DDP reducer that outlives
    # the process group destroys the group later, joining gloo's thread while holding the GIL that
    # the thread may need (a hang seen in bench/checkpoint.py). Their locals go while it is there.
    traceback.clear_frames(error.__traceback__)
    gc.collect()
    first_failure = leave_after_failure(run, f"{type(error).__name__}: {error}") if run.world_size > 1 else None
    if status is None and first_failure is not None:
        here = str(error).splitlines()[0] if str(error) else ""
        print(f"error: rank {run.rank} stopped because {first_failure} (here: {type(error).__name__}: {here})",
              file=sys.stderr, flush=True)
        time.sleep(PEER_FAILURE_GRACE_S)
        return 1
    get_error_handler().record_exception(error)  # into torchrun's error file, where torchrun set one
    if status is None:
        raise error
    print(f"error: {error}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
