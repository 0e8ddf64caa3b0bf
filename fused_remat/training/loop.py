"""`python -m fused_remat.train`: train a language model built from fused_remat's TransformerBlock.

    python -m fused_remat.train                                  # a short run on whatever device is here
    python -m fused_remat.train --preset gpt2-small --seq-len 32768 --remat auto --memory-budget 40GiB
    python -m fused_remat.train --data train.bin --vocab-size 50304 --out runs/owt
    python -m fused_remat.train --out runs/owt --resume          # continues bit for bit
    python -m fused_remat.train --find-max-seq-len               # longest trainable sequence per policy
    torchrun --nproc_per_node 8 -m fused_remat.train --distributed fsdp ...

Without CUDA the kernels run in Triton's interpreter (so only the tiny preset is practical).
The run's folder (``--out``) receives ``checkpoint.pt`` (atomic, on an interval and on Ctrl-C),
``metrics.jsonl`` (one record per step, validation loss where evaluated) and ``training.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

from . import data as token_data
from ..block import REMAT_POLICIES
from .checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from .distributed import (
    STRATEGIES, Distributed, gradient_sync, init_distributed, load_training_state, shutdown, training_state, unwrap,
    wrap_model,
)
from ..model import PRESETS, LanguageModel, ModelConfig, preset
from ..planner import PLANNED_POLICIES, Precision, explain_policies, measure_policy_costs, parse_bytes, plan_remat
from .reporting import Progress, plot_metrics, read_metrics, write_metrics

# What a run does when an option is left out, by device: a short real run either way.
DEVICE_DEFAULTS = {
    "cpu": dict(preset="tiny", steps=50, seq_len=64, batch_size=4, dtype="fp32"),
    "cuda": dict(preset="gpt2-small", steps=200, seq_len=8192, batch_size=4, dtype="bf16"),
}
PEAK_LR = {"tiny": 3e-3, "gpt2-small": 6e-4, "gpt2-medium": 3e-4, "llama-1b": 3e-4}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Settings a resumed run must share with the run that wrote the checkpoint: they decide the
# trajectory. remat is not among them: every policy computes bitwise the same gradients.
TRAJECTORY_SETTINGS = ("model", "block", "steps", "seq_len", "batch_size", "grad_accum", "lr", "min_lr", "warmup",
                       "weight_decay", "grad_clip", "dtype", "seed", "data", "world_size", "strategy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fused_remat.train", description=__doc__.split("\n")[0])
    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]

    def by_device(name: str) -> str:
        return f"(default: {cpu[name]} on CPU, {gpu[name]} on a GPU)"

    parser.add_argument("--preset", choices=sorted(PRESETS), help=f"model shape {by_device('preset')}")
    parser.add_argument("--steps", type=int, help=f"optimizer steps {by_device('steps')}")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence {by_device('seq_len')}")
    parser.add_argument("--batch-size", type=int, help=f"sequences per micro-batch per process {by_device('batch_size')}")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--remat", default="cheap",
                        help="none | cheap (default) | full | auto (plan for --memory-budget) | a comma list, one policy per layer")
    parser.add_argument("--memory-budget", help="activation budget for --remat auto, e.g. 40GiB (default on a GPU: "
                        "what is free after weights, gradients and optimizer state)")
    parser.add_argument("--block", choices=("fused", "reference"), default="fused",
                        help="fused_remat's block (default), or the plain-PyTorch twin (then --remat none is eager and "
                        "full is torch.utils.checkpoint)")
    parser.add_argument("--data", help="a text file, a nanoGPT uint16/uint32 .bin (or a folder with train.bin/val.bin); "
                        "default: the Python standard library's sources, byte-level")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of a .bin file (default 256: bytes)")
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
    parser.add_argument("--distributed", choices=STRATEGIES, help="under torchrun: ddp (default) or fsdp (FSDP2)")
    parser.add_argument("--find-max-seq-len", action="store_true",
                        help="instead of training: the longest sequence that trains one step, per policy")
    args = parser.parse_args(argv)
    _fill_defaults(args, parser)
    return args


def _fill_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    defaults = DEVICE_DEFAULTS["cuda" if torch.cuda.is_available() else "cpu"]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches", "eval_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.checkpoint_interval < 0:
        parser.error("--checkpoint-interval must be >= 0")
    args.lr = PEAK_LR[args.preset] if args.lr is None else args.lr
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.warmup = min(200, args.steps // 10) if args.warmup is None else args.warmup
    if not args.lr > 0 or args.min_lr < 0 or args.warmup < 0:
        parser.error("--lr must be positive, --min-lr and --warmup non-negative")
    args.out = Path(args.out or f"runs/{args.preset}")
    if args.memory_budget is not None:
        try:
            args.memory_budget = parse_bytes(args.memory_budget)
        except ValueError as error:
            parser.error(str(error))
    if args.vocab_size is not None and args.vocab_size < 1:
        parser.error(f"--vocab-size must be positive, got {args.vocab_size}")


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (not norms, biases), fused on CUDA, foreach elsewhere."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    others = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [dict(params=matrices, weight_decay=args.weight_decay), dict(params=others, weight_decay=0.0)]
    implementation = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **implementation)


def resolve_remat(args, config: ModelConfig, precision: Precision, device: torch.device, run: Distributed):
    """The per-layer policies, and the plan that explains them (printed at the start of a run)."""
    if args.block == "reference":
        return args.remat.split(",") if "," in args.remat else args.remat, None
    if args.remat != "auto":
        policies = args.remat.split(",") if "," in args.remat else [args.remat] * config.n_layers
        if not set(policies) <= set(REMAT_POLICIES):
            raise ValueError(f"--remat: fused blocks take {', '.join(REMAT_POLICIES)}, auto or a comma list, got {args.remat!r}")
        return policies, explain_policies(config, args.batch_size, args.seq_len, precision, policies)
    shards = run.world_size if run.strategy == "fsdp" else 1
    budget = args.memory_budget if args.memory_budget is not None else default_activation_budget(config, device, shards)
    if device.type == "cuda":
        costs = measure_policy_costs(config, args.batch_size, args.seq_len, precision, device)
        source = f"timings on {torch.cuda.get_device_name(device)}"
    else:
        costs, source = None, "FLOP model"
    plan = plan_remat(config, args.batch_size, args.seq_len, precision, budget, costs=costs, cost_source=source,
                      candidates=PLANNED_POLICIES)
    return plan.policies, plan


def default_activation_budget(config: ModelConfig, device: torch.device, shards: int = 1) -> int:
    """On a GPU: free memory, less fp32 weights, gradients and two AdamW moments (16 bytes per
    parameter, split over ``shards`` processes under FSDP), less 10% for the allocator and the
    transient buffers of one layer's backward."""
    if device.type != "cuda":
        raise ValueError("--remat auto on CPU needs --memory-budget (there is no device memory to measure)")
    free, _ = torch.cuda.mem_get_info(device)
    parameters = sum(p.numel() for p in LanguageModel(config, device="meta").parameters())
    return int(0.9 * (free - 16 * parameters // shards))


def run_settings(args: argparse.Namespace, config: ModelConfig, data: token_data.TokenData, run: Distributed) -> dict:
    return dict(model=dataclasses.asdict(config), block=args.block, steps=args.steps, seq_len=args.seq_len,
                batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, min_lr=args.min_lr,
                warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip, dtype=args.dtype,
                seed=args.seed, data=data.description, world_size=run.world_size, strategy=run.strategy)


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current step and checkpoint; a
    second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@torch.no_grad()
def validation_loss(model, batches, device, autocast_dtype) -> float:
    total = 0.0
    for inputs, targets in batches:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            total += model(inputs.to(device), targets.to(device)).item()
    return total / len(batches)


def train(args: argparse.Namespace, run: Distributed) -> int:
    device = run.device()
    dtype = DTYPES[args.dtype]
    autocast_dtype = dtype if dtype != torch.float32 else None
    precision = Precision(residual=torch.float32, compute=dtype)
    data = token_data.load_data(args.data, args.vocab_size, args.seq_len)
    config = preset(args.preset, vocab_size=data.vocab_size)
    settings = run_settings(args, config, data, run)
    ckpt = checkpoint_path(args.out)
    state = None
    if args.resume:
        state = load_checkpoint(ckpt, settings)
    elif ckpt.exists():
        raise CheckpointError(f"--out {args.out} already holds a checkpoint; pass --resume to continue it or choose another --out")

    policies, plan = resolve_remat(args, config, precision, device, run)
    torch.manual_seed(args.seed)
    model = LanguageModel(config, policies, block_impl=args.block, device=device)
    model = wrap_model(model, run)
    optimizer = make_optimizer(model, args, device)
    start_step = 0
    if state is not None:
        load_training_state(model, optimizer, state["model"], state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        start_step = state["step"]
    val_batches = list(token_data.val_batches(data, args.eval_batches, args.batch_size, args.seq_len, args.seed))

    log = print if run.is_main else (lambda *a, **k: None)
    parameters = sum(p.numel() for p in unwrap(model).parameters())
    log(f"fused_remat.train on {_device_name(device)} x {run.world_size}{'' if run.strategy is None else ' ' + run.strategy}: "
        f"{args.preset} ({config.describe()}, {parameters / 1e6:.2f}M parameters), {args.block} blocks, "
        f"remat {_summarize(unwrap(model).remat)}, {args.dtype}")
    log(f"data: {data.description}")
    if plan is not None:
        log(plan.table())
    if run.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        metrics_path = args.out / "metrics.jsonl"
        kept = [r for r in read_metrics(metrics_path) if r["step"] < start_step] if args.resume else []
        write_metrics(metrics_path, kept)
    run.barrier()

    def save(step: int) -> None:
        model_state, optimizer_state = training_state(model, optimizer)
        if run.is_main:
            save_checkpoint(ckpt, dict(step=step, model=model_state, optimizer=optimizer_state, run=settings,
                                       rng=dict(cpu=torch.get_rng_state())))
        run.barrier()

    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * run.world_size
    progress = Progress(args.steps, start_step, enabled=run.is_main)
    step = start_step
    with StopRequest() as stop:
        while step < args.steps:
            started = time.perf_counter()
            lr = learning_rate(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            for micro in range(args.grad_accum):
                inputs, targets = token_data.train_batch(data, step, micro, run.rank, args.batch_size, args.seq_len, args.seed)
                with gradient_sync(model, enabled=micro == args.grad_accum - 1):
                    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                        loss = model(inputs.to(device), targets.to(device))
                    (loss / args.grad_accum).backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            record = dict(step=step - 1, loss=run.mean(float(loss_sum) / args.grad_accum), lr=lr,
                          grad_norm=float(_full(grad_norm)), peak_memory=peak_memory(device))
            elapsed = time.perf_counter() - started
            record["tokens_per_s"] = tokens_per_step / elapsed
            record["step_time"] = elapsed
            if step % args.eval_interval == 0 or step == args.steps:
                record["val_loss"] = validation_loss(model, val_batches, device, autocast_dtype)
            if run.is_main:
                write_metrics(metrics_path, [record], append=True)
            progress.update(record)
            stopping = run.any(stop.requested)
            if stopping or step == args.steps or (args.checkpoint_interval and step % args.checkpoint_interval == 0):
                save(step)
            if stopping:
                progress.close()
                log(f"stopped at step {step}; checkpoint saved in {ckpt}; continue with --resume")
                return 130
    progress.close()
    if run.is_main:
        log(f"done: {args.steps} steps; metrics in {metrics_path}; checkpoint {ckpt}")
        plot = plot_metrics(metrics_path, args.out / "training.png")
        if plot is not None:
            log(f"plot: {plot}")
    return 0


def _full(value):
    """A DTensor (FSDP2's gradient norm) as a plain tensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "CPU (PyTorch reference)"


def _summarize(policies: list[str]) -> str:
    counts = {p: policies.count(p) for p in dict.fromkeys(policies)}
    return ", ".join(f"{p} x{n}" for p, n in counts.items()) if len(counts) > 1 else f"{policies[0]} (all layers)"


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        # Triton's interpreter runs the kernels on CPU tensors; it must be chosen before triton is
        # imported, which fused_remat does only when a kernel first runs.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args = parse_args(argv)
    run = init_distributed(args.distributed)
    try:
        if args.find_max_seq_len:
            from .capacity import find_max_seq_len

            return find_max_seq_len(args, run)
        return train(args, run)
    except (ValueError, FileNotFoundError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        shutdown(run)


if __name__ == "__main__":
    sys.exit(main())
