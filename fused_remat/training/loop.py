"""The training loop of ``python -m fused_remat.train`` (``training/cli.py`` parses the flags):
``train(config, run)`` builds the data, the model with its per-layer remat policies, the optimizer,
resumes from the run's checkpoint, then steps (``training/step.py``), evaluates, writes
``metrics.jsonl`` and checkpoints until ``config.steps`` or a stop signal (Ctrl-C, SIGTERM,
SIGUSR1), which every rank obeys at the same step boundary.

A resumed run must share with the run that wrote the checkpoint every setting that decides the
trajectory (``run_settings``); remat is not among them: every policy computes bitwise the same
gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from ..backend import requested_backend, use_triton
from ..block import TransformerBlock
from ..context_parallel_documents import shard_documents
from ..model import LanguageModel, ModelConfig
from ..planner import RematPlan, explain_policies, measure_policy_costs, plan_remat
from ..remat import Remat
from . import data as token_data
from .checkpoint import (CheckpointError, CheckpointWriteError, RunLock, ShardedSave, check_metrics, checkpoint_files,
                         checkpoint_mark, checkpoint_path, checkpoint_step, load_newest_checkpoint, newest_name,
                         predecessor, promote, remove_stale_partials, save_checkpoint, start_sharded_checkpoint)
from .config import TrainConfig, describe_size
from .distributed import (Distributed, checkpoint_group, load_sharded_training_state, load_training_state,
                          sharded_training_state, training_state, unwrap, wrap_model)
from .reporting import Progress, plot_metrics, pyplot, read_metrics, write_metrics
from .graphs import GraphedTrainStep
from .step import batch_loss, make_optimizer, set_learning_rate, train_step


def resolve_remat(config: TrainConfig, model_config: ModelConfig, device: torch.device, run: Distributed,
                  attention_pairs: float | None = None, longest_document: int | None = None,
                  ) -> tuple[list[Remat], RematPlan | None]:
    """The per-layer policies of ``--remat``, and for fused blocks the plan that explains them
    (printed at the start of a run); ``--remat auto`` plans them for ``--memory-limit``; under
    ``--memory-budget`` the point the layers choose for the first batch
    (``TransformerBlock.budget_point``, which they ask again on every call). ``attention_pairs``
    and ``longest_document``: the (query, key) pairs of a sequence under document masking and the
    longest document (the first batch's), for the price of replaying attention."""
    precision = config.precision
    local_seq_len = config.seq_len // run.context_parallel  # the tokens of a sequence one rank holds
    document_ranks = run.context_parallel if config.document_masking else 1  # attention gathers k and v
    if config.memory_budget is not None:
        layer = TransformerBlock(model_config.dim, model_config.n_heads, **model_config.block_kwargs(),
                                 memory_budget=config.memory_budget, device="meta")
        policies = [layer.budget_point(longest_document or config.seq_len, precision.residual, precision.compute)]
        policies *= model_config.n_layers
        return policies, explain_policies(model_config, config.batch_size, local_seq_len, precision, policies,
                                          attention_pairs=attention_pairs, budget_fraction=config.memory_budget,
                                          document_ranks=document_ranks)
    if config.remat is not None:
        policies = list(config.remat)
        if config.block != "fused":
            return policies, None
        return policies, explain_policies(model_config, config.batch_size, local_seq_len, precision, policies,
                                          attention_pairs=attention_pairs, document_ranks=document_ranks)
    shards = run.world_size if run.strategy == "fsdp" else 1
    budget = config.memory_limit
    if budget is None:
        budget = default_activation_budget(model_config, device, shards)
    if device.type == "cuda":
        costs = measure_policy_costs(model_config, config.batch_size, local_seq_len, precision, device)
        source = f"timings on {torch.cuda.get_device_name(device)}"
    else:
        costs, source = None, "FLOP model"
    try:
        plan = plan_remat(model_config, config.batch_size, local_seq_len, precision, budget, costs=costs,
                          cost_source=source, owner="--memory-limit", attention_pairs=attention_pairs,
                          document_ranks=document_ranks)
    except ValueError as error:
        if config.memory_limit is None:
            raise
        raise ValueError(f"{error} ({describe_size('--memory-limit', config.memory_limit)})") from None
    return plan.policies, plan


def default_activation_budget(model_config: ModelConfig, device: torch.device, shards: int = 1) -> int:
    """On a GPU: free memory, less fp32 weights, gradients and two AdamW moments (16 bytes per
    parameter, split over ``shards`` processes under FSDP), less 10% for the allocator and what the
    planner's peak leaves out (the loss's chunk of logits; it counts the largest layer transient)."""
    if device.type != "cuda":
        raise ValueError("--remat auto on CPU needs --memory-limit (there is no device memory to measure)")
    free, _ = torch.cuda.mem_get_info(device)
    parameters = sum(p.numel() for p in LanguageModel(model_config, device="meta").parameters())
    return int(0.9 * (free - 16 * parameters // shards))


def run_settings(config: TrainConfig, model_config: ModelConfig, data: token_data.TokenData, run: Distributed) -> dict:
    """What a checkpoint records of its run, and a resumed run must match: everything the
    trajectory depends on, the data by its content (``TokenData.fingerprint``, not its path) and the
    context-parallel degree among them. The backend is recorded apart (``backend`` in the
    checkpoint): a change is allowed, with a warning.

    The number of ranks, their strategy (DDP, FSDP2) and ``--grad-accum`` are not: a run resumes on
    any world whose micro-batches per step (data-parallel ranks x ``--grad-accum``, ``micro_batches``)
    are the checkpoint's, so that each step trains on the same global batch (``micro_batch_slot``):
    2 ranks x 1 resume as 1 rank x 2, or 4 x 1 as 2 x 2."""
    return dict(model=dataclasses.asdict(model_config), block=config.block, steps=config.steps, seq_len=config.seq_len,
                batch_size=config.batch_size, micro_batches=run.data_parallel_size * config.grad_accum, lr=config.lr,
                min_lr=config.min_lr, warmup=config.warmup, weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                dtype=config.dtype, seed=config.seed, data=data.fingerprint(), documents=data.documents,
                context_parallel=run.context_parallel)


def micro_batch_slot(run: Distributed, grad_accum: int, micro_step: int) -> int:
    """Which of a step's data-parallel ranks x ``grad_accum`` micro-batches this rank's
    ``micro_step`` is: rank r draws slots r x grad_accum .. (r + 1) x grad_accum - 1. A step's global
    batch is the micro-batches of slots 0 .. micro_batches - 1 (``token_data.train_batch`` keyed by
    the slot), whatever the world that splits them: 2 ranks x 1 draw slots 0 and 1, as 1 rank x 2."""
    return run.data_rank * grad_accum + micro_step


def checkpoint_form(config: TrainConfig, run: Distributed) -> str:
    """--checkpoint-format, by default sharded on more than one rank or with --async-checkpoint, and
    single in one process."""
    if config.async_checkpoint:
        return "sharded"
    return config.checkpoint_format or ("sharded" if run.world_size > 1 else "single")


# What sets each entry of run_settings, named beside a difference when a resume is refused.
SETTING_SOURCES = dict(model="--preset, --vocab-size", block="--block", steps="--steps", seq_len="--seq-len",
                       batch_size="--batch-size",
                       micro_batches="micro-batches per step: data-parallel ranks (the ranks / --context-parallel) x "
                                     "--grad-accum", lr="--lr", min_lr="--min-lr",
                       warmup="--warmup", weight_decay="--weight-decay", grad_clip="--grad-clip", dtype="--dtype",
                       seed="--seed", data="--data", documents="--document-boundary",
                       context_parallel="--context-parallel")


# The signals a scheduler sends before it ends a job (SIGUSR1: SLURM's --signal warning; SIGTERM:
# preemption, a time limit, Kubernetes' eviction): a run they stop exits 128 + the signal's number,
# the status of a process that signal terminated, which schedulers and their scripts read as
# "stopped from outside" and requeue (SIGTERM 143, SIGUSR1 138). Any other stop (Ctrl-C) exits 130.
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
INTERRUPTED = 130


def stop_status(signum: int) -> int:
    """The exit status of a run stopped, checkpointed, at the request of signal ``signum``."""
    return 128 + signum if signum in SCHEDULER_SIGNALS else INTERRUPTED


class StopRequest:
    """Ctrl-C (SIGINT), SIGTERM or SIGUSR1 asks the loop to checkpoint at the next step boundary and
    stop; the handler only records the signal, the loop acts on it. A second SIGINT or SIGTERM
    interrupts at once (a scheduler that sends SIGTERM twice means it); SIGUSR1 never does, as
    SLURM's warning can reach a worker twice, directly and forwarded by torchrun."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signal = 0  # the number of the first signal that asked, 0 while none has
        self._interrupting = False  # a SIGINT or SIGTERM has arrived
        self._previous = {}

    @property
    def requested(self) -> int:
        """The number of the signal that asked for the stop; 0 (false) while none has."""
        return self.signal

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum != signal.SIGUSR1:
            if self._interrupting:
                raise KeyboardInterrupt
            self._interrupting = True
        self.signal = self.signal or signum


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@torch.no_grad()
def validation_loss(model, batches: list[token_data.Batch], device, compute_dtype) -> float:
    total = 0.0
    for batch in batches:
        total += batch_loss(model, batch.to(device), compute_dtype).item()
    return total / len(batches)


def local_batch(batch: token_data.Batch, run: Distributed, window: tuple[int, int]) -> token_data.Batch:
    """This rank's part of ``batch`` under context parallelism: its zigzag chunks of every row, or
    with documents its pieces of every document (``shard_documents``, for causal attention under
    the model's ``window``), laid out as rows of seq_len / N tokens."""
    if run.context_parallel == 1:
        return batch
    if batch.cu_seqlens is None:
        return dataclasses.replace(batch, inputs=run.shard_sequence(batch.inputs),
                                   targets=run.shard_sequence(batch.targets))
    shards = shard_documents(batch.cu_seqlens, run.context_parallel, run.rank % run.context_parallel, causal=True,
                             window=window)
    rows = batch.inputs.shape[0]
    return token_data.Batch(shards.shard(batch.inputs.flatten()).view(rows, -1),
                            shards.shard(batch.targets.flatten()).view(rows, -1), documents=shards)


# A checkpoint holds the fp32 weights and AdamW's two fp32 moments: 12 bytes a parameter.
CHECKPOINT_BYTES_PER_PARAMETER = 12


def check_free_space(out: Path, parameters: int, keep: int) -> None:
    """Before the first step: refuse a run folder that cannot hold one checkpoint, and warn where it
    cannot hold the ``keep`` kept ones and the next one being written (the predecessors stay until
    the new file is complete)."""
    one = CHECKPOINT_BYTES_PER_PARAMETER * parameters
    free = shutil.disk_usage(out).free
    if free < one:
        raise ValueError(f"--out {out}: {free:,} bytes free, but one checkpoint needs about {one:,}; "
                         "free some space or choose another --out")
    needed = one * (keep + 1)
    if free < needed:
        print(f"warning: --out {out} has {free:,} bytes free; {keep} kept checkpoints and the one being written "
              f"need about {needed:,}: a later checkpoint write may fail (--keep-checkpoints lowers it)",
              file=sys.stderr, flush=True)


def describe_documents(data: token_data.TokenData, first_batch: token_data.Batch) -> str:
    """The run's header line on document masking: on or off, and when on, how much of causal
    attention's work it leaves in the first batch."""
    if first_batch.cu_seqlens is None:
        return ("document masking off: attention spans whole rows (--document-boundary TOKEN_ID marks where the "
                "documents of --data begin)")
    masked = first_batch.causal_attention_pairs()
    dense = dataclasses.replace(first_batch, cu_seqlens=None, max_seqlen=None).causal_attention_pairs()
    return (f"document masking on (a document begins at {data.documents}): attention in the first batch scores "
            f"{masked:,} causal (query, key) pairs instead of {dense:,}, {masked / dense:.2f}x the work")


class TrainingFailed(RuntimeError):
    """The run stopped on a failure it explains itself (a NaN or infinite loss or gradient norm, a
    metrics.jsonl that could not be rewritten); the last good checkpoint is left as it was."""


def train(config: TrainConfig, run: Distributed) -> int:
    """Trains (or resumes) the run ``config`` describes; 0 when finished, ``stop_status`` of the
    signal when stopped by one (checkpointed first). TrainingFailed for a non-finite loss; any
    other exception after a finished step is re-raised once that step is checkpointed (single
    process). The run folder is locked for the run's life (rank 0 holds the lock): a second
    trainer in it is refused. The stop signals are caught from the start, so that one arriving
    while a long resume loads stops the run at its first step boundary instead of killing it."""
    with RunLock(config.out) if run.is_main else contextlib.nullcontext(), StopRequest() as stop:
        return _train(config, run, stop)


def _train(config: TrainConfig, run: Distributed, stop: StopRequest) -> int:
    device = run.device()
    log = functools.partial(print, flush=True) if run.is_main else (lambda *a, **k: None)
    warn = functools.partial(print, "warning:", file=sys.stderr, flush=True) if run.is_main else (lambda *a, **k: None)
    backend = describe_backend(device)
    data = token_data.load_data(config.data, config.vocab_size, config.seq_len, config.document_boundary)
    model_config = config.model_config(data.vocab_size)
    settings = run_settings(config, model_config, data, run)
    ckpt = checkpoint_path(config.out, checkpoint_form(config, run))
    metrics_path = config.out / "metrics.jsonl"
    tokens_per_step = config.batch_size * config.seq_len * config.grad_accum * run.data_parallel_size
    state, history, disagreements = None, [], []
    if config.resume:
        state, resumed_from, unreadable = load_newest_checkpoint(ckpt, settings, SETTING_SOURCES)
        # every rank reads the history, as it reads the checkpoint, so that every rank refuses a mismatch
        history = read_metrics(metrics_path, warn)
        disagreements = check_metrics(state, resumed_from, history, metrics_path, tokens_per_step)
    elif checkpoint_files(ckpt):
        raise CheckpointError(f"--out {config.out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    run.barrier()  # every rank has read its checkpoint before rank 0 renames any
    if run.is_main:
        for partial, size in remove_stale_partials(config.out):
            log(f"removed {partial}: a partial checkpoint ({size:,} bytes) left by a process killed while writing it")
        if state is not None and resumed_from != ckpt:
            for reason in unreadable:
                warn(reason)
            aside = promote(resumed_from, ckpt)
            log(f"resuming from the previous checkpoint {resumed_from.name} (step {state['step']}), now {ckpt.name}"
                + (f"; set aside: {', '.join(p.name for p in aside)}" if aside else ""))
        for disagreement in disagreements:
            warn(disagreement)
    run.barrier()
    if state is not None and "sharded" in state:
        state["sharded"] = newest_name(resumed_from)  # where promote put it
    if state is not None and state["step"] >= config.steps:
        log(f"nothing to do: the run in {config.out} is already finished (done: {config.steps} steps, checkpoint {ckpt}); "
            f"its metrics are in {config.out / 'metrics.jsonl'}. To train further, start a new run with another --out")
        return 0

    first_batch = token_data.train_batch(data, 0 if state is None else state["step"], 0,
                                         micro_batch_slot(run, config.grad_accum, 0),
                                         config.batch_size, config.seq_len, config.seed)
    masked_pairs = None if first_batch.cu_seqlens is None else first_batch.causal_attention_pairs() / config.batch_size
    policies, plan = resolve_remat(config, model_config, device, run, masked_pairs, first_batch.max_seqlen)
    torch.manual_seed(config.seed)
    model = LanguageModel(model_config, None if config.memory_budget is not None else policies, block_impl=config.block,
                          memory_budget=config.memory_budget, context_parallel=run.context_parallel_group, device=device)
    model = wrap_model(model, run)
    optimizer = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay, capturable=config.cuda_graphs)
    start_step = 0
    if state is not None:
        if state.get("backend", backend) != backend:
            print(f"warning: the checkpoint was written on {state['backend']}, this run is on {backend}: it continues, "
                  "but no longer bit for bit what the first backend would have computed", file=sys.stderr, flush=True)
        if "sharded" in state:
            load_sharded_training_state(model, optimizer, state["sharded"])
        else:
            load_training_state(model, optimizer, state["model"], state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        start_step = state["step"]
    val_batches = [local_batch(batch, run, model_config.window) for batch in
                   token_data.val_batches(data, config.eval_batches, config.batch_size, config.seq_len, config.seed)]

    parameters = sum(p.numel() for p in unwrap(model).parameters())
    budget_choice = "" if config.memory_budget is None else (
        f" for the first batch (--memory-budget {config.memory_budget:g}: each layer chooses per call, by the "
        "longest document)")
    log(f"fused_remat.train on {backend} x {run.world_size}{'' if run.strategy is None else ' ' + run.strategy}: "
        f"{config.preset} ({model_config.describe()}, {parameters / 1e6:.2f}M parameters), {config.block} blocks, "
        f"remat {_summarize(policies)}{budget_choice}, {config.dtype}")
    log(f"data: {data.description}")
    log(describe_documents(data, first_batch))
    if plan is not None:
        log(plan.table())
    if run.is_main:
        check_free_space(config.out, parameters, config.keep_checkpoints)
    if run.is_main:
        config.out.mkdir(parents=True, exist_ok=True)
        # records after the checkpoint's step belong to steps this run redoes: it writes them again
        try:
            write_metrics(metrics_path, [r for r in history if r["step"] < start_step])
        except OSError as error:
            raise TrainingFailed(f"could not rewrite {metrics_path} ({error.strerror or error}); its earlier records "
                                 "are intact; free some space or fix the folder's permissions, then run the same "
                                 "command again") from error
    run.barrier()

    saved = start_step  # the step of the newest committed checkpoint
    # --async-checkpoint: the save being written in the background, committed before the next one
    # starts, at a stop and at the end (one at a time: its staging folder is the next one's too).
    pending: ShardedSave | None = None
    writers = checkpoint_group(run) if config.async_checkpoint else None

    def commit_pending() -> None:
        nonlocal saved, pending
        if pending is not None:
            done, pending = pending, None
            done.finish()
            saved = done.step

    def save(step: int, wait: bool = True) -> None:
        nonlocal saved, pending
        commit_pending()
        run_state = dict(step=step, run=settings, backend=backend, rng=dict(cpu=torch.get_rng_state()))
        writing = start_checkpoint(ckpt, model, optimizer, run_state, config, run, writers)
        if writing is not None and config.async_checkpoint and not wait:
            pending = writing
            return
        if writing is not None:
            writing.finish()
        run.barrier()
        saved = step

    options = dict(compute_dtype=config.compute_dtype, grad_clip=config.grad_clip, finite_only=True)
    if config.cuda_graphs:  # made after the resume: the graph updates the optimizer state loaded above
        step_once = GraphedTrainStep(model, optimizer, **options)
    else:
        step_once = functools.partial(train_step, model, optimizer, gradient_scale=run.gradient_scale, **options)
    progress = Progress(config.steps, start_step, enabled=run.is_main)
    step, skipped, unwritten = start_step, 0, None
    try:
        while step < config.steps:
            started = time.perf_counter()
            lr = config.learning_rate(step)
            set_learning_rate(optimizer, lr)
            data.check_files_unchanged()
            slots = [micro_batch_slot(run, config.grad_accum, micro) for micro in range(config.grad_accum)]
            micro_batches = [local_batch(token_data.train_batch(data, step, 0, slot, config.batch_size, config.seq_len,
                                                                config.seed), run, model_config.window).to(device)
                             for slot in slots]
            loss, grad_norm = step_once(micro_batches)
            step += 1
            record = unwritten = dict(step=step - 1, loss=run.mean(float(loss)), lr=lr,
                                      grad_norm=float(_full(grad_norm)), peak_memory=peak_memory(device))
            elapsed = time.perf_counter() - started
            record["tokens_per_s"] = tokens_per_step / elapsed
            record["step_time"] = elapsed
            diverged = not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]))
            if diverged:
                skipped += 1
                record["skipped"] = True  # train_step made no update
            if not diverged and (step % config.eval_interval == 0 or step == config.steps):
                record["val_loss"] = validation_loss(model, val_batches, device, config.compute_dtype)
            # every rank stops at this step boundary if a signal reached any of them, with one status
            stop_signal = run.max(int(stop.requested))
            stopping = stop_signal != 0
            failed = diverged and skipped > config.skip_nonfinite  # the run stops here, without a checkpoint
            checkpointing = not failed and (stopping or step == config.steps or (
                config.checkpoint_interval > 0 and step % config.checkpoint_interval == 0))
            if checkpointing:
                record["checkpoint"] = checkpoint_mark(step, tokens_per_step, torch.get_rng_state())
            if run.is_main:
                # synced at a checkpoint step, before the checkpoint: on disk, metrics never lag a checkpoint
                write_metrics(metrics_path, [record], append=True, sync=checkpointing)
            unwritten = None
            progress.update(record)
            if diverged:
                _handle_nonfinite(config, record, skipped, failed, saved, ckpt, progress,
                                  None if state is None else start_step)
            if checkpointing:
                save(step, wait=stopping or step == config.steps)  # a stop or the end waits for its checkpoint
            if stopping:
                progress.close()
                status = stop_status(stop_signal)
                asked = f" by {signal.Signals(stop_signal).name}" if stop_signal in SCHEDULER_SIGNALS else ""
                log(f"stopped{asked} at step {step}; checkpoint saved in {ckpt}; continue with --resume "
                    f"(exit status {status})")
                return status
    except Exception as error:
        progress.close()
        if run.world_size == 1 and pending is not None:
            try:
                commit_pending()  # a finished step's checkpoint, written in the background: kept
            except CheckpointWriteError as write_error:
                print(f"warning: {write_error}", file=sys.stderr)
        if step > saved and run.world_size == 1 and not isinstance(error, (CheckpointWriteError, TrainingFailed)):
            _checkpoint_after_error(error, step, save, ckpt, lambda: unwritten is not None and write_metrics(
                metrics_path, [{**unwritten, "checkpoint": checkpoint_mark(step, tokens_per_step, torch.get_rng_state())}],
                append=True, sync=True))
        raise
    progress.close()
    if run.is_main:
        suffix = f" ({skipped} non-finite steps skipped)" if skipped else ""
        log(f"done: {config.steps} steps{suffix}; metrics in {metrics_path}; checkpoint {ckpt}")
        plot = plot_metrics(metrics_path, config.out / "training.png")
        if plot is not None:
            log(f"plot: {plot}")
        elif pyplot() is None:
            log("no plot: matplotlib is not installed (pip install 'fused_remat[train]')")
    return 0


def _handle_nonfinite(config: TrainConfig, record: dict, skipped: int, failed: bool, saved: int, ckpt: Path,
                      progress: Progress, resumed_at: int | None) -> None:
    """A step with a NaN or infinite loss or gradient norm (train_step made no update): skipped
    while ``--skip-nonfinite`` allows, else (``failed``) TrainingFailed, before anything is
    checkpointed. ``resumed_at``: the step the run resumed from (None for a new run); when no step
    since then was finite, the message names that checkpoint and how to fall back from it."""
    what = f"step {record['step']}: loss {record['loss']}, gradient norm {record['grad_norm']}"
    if not failed:
        print(f"\nwarning: {what}: skipped without an update ({skipped} of --skip-nonfinite {config.skip_nonfinite})",
              file=sys.stderr)
        return
    progress.close()
    allowance = (f"more than --skip-nonfinite {config.skip_nonfinite} such steps" if config.skip_nonfinite
                 else "--skip-nonfinite N skips up to N such steps")
    remedies = (f"a lower --lr (now {config.lr:g}), gradient clipping (--grad-clip, now {config.grad_clip:g}) or a "
                f"longer --warmup (now {config.warmup})")
    since = None if resumed_at is None else record["step"] - resumed_at + 1  # steps since the resume
    if since != skipped or saved != resumed_at:
        kept = (f"the last good checkpoint, {ckpt} at step {saved}, is kept as it was" if saved
                else "no checkpoint was written")
        raise TrainingFailed(f"{what}: training diverged, stopping; {kept}. Try {remedies}; {allowance}")
    # every step since the resume diverged, and the checkpoint resumed from is still the newest: it is the suspect
    new_run = f"start a new run with another --out and {remedies} (--resume keeps the run's settings)"
    previous = checkpoint_files(ckpt)[1:]
    if previous:
        step = checkpoint_step(previous[0])
        fallback = (f"Fall back to the previous checkpoint, {previous[0].name}"
                    f"{'' if step is None else f' (step {step})'}: move {ckpt.name} aside (e.g. to "
                    f"{ckpt.name}.diverged) and --resume again; if it diverges there too, {new_run}")
    else:
        fallback = f"No earlier checkpoint is kept to fall back to ({predecessor(ckpt, 1).name} does not exist): {new_run}"
    when = "the first step after" if since == 1 else f"each of the {since} steps since"
    raise TrainingFailed(f"{what}: training diverged at {when} resuming from {ckpt} (step {resumed_at}), stopping; "
                         f"{ckpt.name} is kept as it was. {fallback}; {allowance}")


def start_checkpoint(ckpt: Path, model, optimizer, run_state: dict, config: TrainConfig, run: Distributed,
                     writers=None) -> ShardedSave | None:
    """Writes the checkpoint ``ckpt`` of the run's model, optimizer and ``run_state`` as the trainer
    does. The sharded form (``.dcp``): every rank's shards, and the ``ShardedSave`` that commits
    them, to finish at once or, with --async-checkpoint, later (DCP's thread writes them, its
    collectives on ``writers``, ``checkpoint_group``). The single file: gathered and written by rank
    0, None."""
    if ckpt.suffix == ".dcp":
        return start_sharded_checkpoint(ckpt, sharded_training_state(model, optimizer), run_state,
                                        keep=config.keep_checkpoints, rank=run.rank, barrier=run.barrier,
                                        asynchronous=config.async_checkpoint, group=writers)
    model_state, optimizer_state = training_state(model, optimizer)
    if run.is_main:
        save_checkpoint(ckpt, dict(run_state, model=model_state, optimizer=optimizer_state), keep=config.keep_checkpoints)
    return None


def _checkpoint_after_error(error: Exception, step: int, save, ckpt, flush_metrics) -> None:
    """Saves the ``step`` finished steps after ``error`` stopped the loop (the weights and AdamW
    state are those of the last finished step: an error inside a step stops before its update).
    The checkpoint comes first and does not depend on the metrics: a disk that refuses the metrics
    line (the error itself, perhaps) must not cost the finished steps."""
    try:
        save(step)
    except Exception as save_error:
        print(f"error: {type(error).__name__} after step {step}, and the checkpoint could not be written either: "
              f"{save_error}", file=sys.stderr)
        return
    try:
        flush_metrics()
    except Exception as metrics_error:
        print(f"warning: the last step's metrics line could not be written ({metrics_error}); the checkpoint has it",
              file=sys.stderr)
    print(f"error: {type(error).__name__} after step {step}: the {step} finished steps are checkpointed in {ckpt}; "
          "fix the cause and continue with --resume", file=sys.stderr)


def describe_backend(device: torch.device) -> str:
    """The device and what really runs fused_remat's kernels on it, for the run's header: "CPU
    (Triton interpreter)", "CPU (PyTorch reference)", "NVIDIA H100 80GB HBM3 (Triton)"."""
    try:
        triton = use_triton("fused_remat.train", device)
    except RuntimeError as error:
        raise ValueError(f"--backend triton: {error}") from None
    if device.type == "cuda":
        name, kernels = torch.cuda.get_device_name(device), "Triton" if triton else "PyTorch reference"
    else:
        name, kernels = "CPU", "Triton interpreter" if triton else "PyTorch reference"
    forced = requested_backend()
    return f"{name} ({kernels}{'' if forced == 'auto' else ', backend ' + forced})"


def _full(value):
    """A DTensor (FSDP2's gradient norm) as a plain tensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _summarize(policies: list[Remat]) -> str:
    counts = {p: policies.count(p) for p in dict.fromkeys(policies)}
    return ", ".join(f"{p} x{n}" for p, n in counts.items()) if len(counts) > 1 else f"{policies[0]} (all layers)"
