"""The settings of a training run: ``TrainConfig``, its defaults by device and preset, and
``parse_size`` for byte counts such as ``12GiB``.

``TrainConfig.build(device_type, **options)`` fills what was left out (``None``) and checks the
rest; the command line (``training/cli.py``) passes its parsed flags through it, and the benchmark
(``bench/bench_train.py``) uses it for the trainer's learning rate, weight decay and clipping.
Its ``ValueError`` messages name the command-line flag, as the CLI shows them unchanged: where a
library function checks a value (``--remat``'s policies), it is told the flag's name to use.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import torch

from ..backend import BACKENDS
from ..model import PRESETS, ModelConfig, preset, resolve_policies
from ..planner import Precision
from ..remat import Remat, check_memory_budget
from .data import NO_DOCUMENTS

# What a run does when an option is left out, by device: a short real run either way.
DEVICE_DEFAULTS = {
    "cpu": dict(preset="tiny", steps=50, seq_len=64, batch_size=4, dtype="fp32"),
    "cuda": dict(preset="gpt2-small", steps=200, seq_len=8192, batch_size=4, dtype="bf16"),
}
PEAK_LR = {"tiny": 3e-3, "gpt2-small": 6e-4, "gpt2-medium": 3e-4, "llama-1b": 3e-4}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Binary multiples, as nvidia-smi's MiB: "12G", "12GB" and "12GiB" are all 12 * 2**30 bytes.
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)


def parse_size(text: str, owner: str = "size") -> int:
    """A byte count from ``text``: a bare number of bytes (``1000000``) or a number with a unit
    K, M, G or T, optionally followed by B or iB, in any case (``800MiB``, ``1.5G``, ``12gb``);
    the units are powers of 1024. Rounds down to whole bytes; ValueError naming ``owner`` unless
    positive."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{owner}: expected a size such as 12GiB, 800MiB or a number of bytes, got {text!r}")
    size = float(match.group(1)) * SIZE_UNITS[(match.group(2) or "").upper()]
    if not math.isfinite(size) or int(size) < 1:
        raise ValueError(f"{owner}: expected a positive size, got {text!r}")
    return int(size)


def _budget_fraction(value) -> float:
    """``--memory-budget``: a fraction in [0, 1] of what ``--remat none`` keeps, as the library's
    ``memory_budget`` (``remat.check_memory_budget``); an error that names ``--memory-limit`` where
    the value reads as bytes."""
    if not isinstance(value, str):
        return check_memory_budget(value, owner="--memory-budget")
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None and 0.0 <= number <= 1.0:
        return number
    if number is not None and math.isfinite(number):
        hint = f"; a limit in bytes is --memory-limit with a unit, e.g. --memory-limit {value}GiB"
    elif _SIZE.fullmatch(value):
        hint = f"; a limit in bytes is --memory-limit {value}"
    else:
        hint = ""
    raise ValueError(f"--memory-budget must be a fraction in [0, 1] of what --remat none keeps (torch.compile's "
                     f"activation_memory_budget), got {value!r}{hint}")


def _memory_limit(value) -> int:
    """``--memory-limit``: bytes (``parse_size``); a bare number up to 1, a fraction, is refused
    naming ``--memory-budget``."""
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None and 0.0 <= number <= 1.0:
        raise ValueError(f"--memory-limit {value}: a limit in bytes (40GiB, 800MiB, 4096); a fraction of what "
                         f"--remat none keeps is --memory-budget {value}")
    return parse_size(str(value), owner="--memory-limit")


def describe_size(flag: str, size: int) -> str:
    """How ``flag``'s value was read, for its error messages: "--memory-limit was read as 12 bytes
    (0.0 MiB); sizes take the binary units K, M, G, T (800MiB, 40GiB), or B for bytes"."""
    return (f"{flag} was read as {size:,} bytes ({size / 2**20:,.1f} MiB); sizes take the binary units K, M, G, T "
            "(800MiB, 40GiB), or B for bytes")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run (the CLI's flags, ``--memory-limit`` in bytes, ``--out`` a Path),
    with the defaults already filled in: use ``TrainConfig.build``."""

    preset: str
    steps: int
    seq_len: int
    batch_size: int
    lr: float
    min_lr: float
    warmup: int
    dtype: str
    out: Path
    grad_accum: int = 1
    # --remat: one policy per layer (a policy for all, or a comma list), parsed by ``build``; None
    # under --memory-budget, and for "auto", planned for --memory-limit when the run starts (it
    # needs the device).
    remat: tuple[Remat, ...] | None = None
    # --memory-budget: a fraction in [0, 1]; each layer keeps at most that share of what remat "none"
    # keeps and picks its point per call (TransformerBlock.memory_budget)
    memory_budget: float | None = None
    # --memory-limit: bytes, the activation peak --remat auto plans for and --find-max-seq-len's cap
    memory_limit: int | None = None
    block: str = "fused"
    data: str | None = None
    vocab_size: int | None = None
    resume: bool = False
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 0
    eval_interval: int = 25
    eval_batches: int = 4
    checkpoint_interval: int = 100  # 0: only at the end
    distributed: str | None = None
    context_parallel: int = 1  # ranks each sequence is split over (torchrun)
    find_max_seq_len: bool = False
    keep_checkpoints: int = 2  # the newest checkpoint and this many - 1 before it
    # --checkpoint-format sharded|single; None: sharded on more than one rank, else single (loop.checkpoint_form)
    checkpoint_format: str | None = None
    # --async-checkpoint: sharded checkpoints written from a thread while training goes on (loop.train)
    async_checkpoint: bool = False
    skip_nonfinite: int = 0  # steps with a NaN/inf loss or gradient norm skipped before the run stops
    backend: str | None = None  # --backend auto|triton|reference; None: FUSED_REMAT_BACKEND decides
    # --document-boundary: the token id that begins each document of --data, NO_DOCUMENTS, or None
    # for the documents the data marks itself (the default corpus's files; none in text and .bin).
    document_boundary: int | str | None = None
    cuda_graphs: bool = False  # --cuda-graphs: each step after the warm-up one graph replay (graphs.GraphedTrainStep)

    @classmethod
    def build(cls, device_type: str, **options) -> TrainConfig:
        """The config for a run on ``device_type`` ("cuda" or "cpu"): options that are None or left
        out take the device's defaults (DEVICE_DEFAULTS), the preset's peak learning rate, lr / 10
        and steps / 10 (at most 200) warm-up steps. ValueError naming the flag for a bad value."""
        given = {name: value for name, value in options.items() if value is not None}
        values = {**DEVICE_DEFAULTS[device_type], **given}
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches", "eval_interval", "keep_checkpoints",
                     "context_parallel"):
            if values.get(name, 1) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {values[name]}")
        for name in ("checkpoint_interval", "skip_nonfinite"):
            if values.get(name, 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {values[name]}")
        if values.get("checkpoint_format", "single") not in ("sharded", "single"):
            raise ValueError(f"--checkpoint-format must be sharded or single, got {values['checkpoint_format']!r}")
        if values.get("async_checkpoint") and values.get("checkpoint_format") == "single":
            raise ValueError("--async-checkpoint writes sharded checkpoints (torch.distributed.checkpoint's async_save): "
                             "leave out --checkpoint-format single")
        if values.get("backend", "auto") not in BACKENDS:  # None is dropped with the other defaults
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {values['backend']!r}")
        parallel = values.get("context_parallel", 1)
        if parallel > 1:
            if values["seq_len"] % (2 * parallel):
                raise ValueError(f"--seq-len {values['seq_len']} must be divisible by 2 x --context-parallel = {2 * parallel}: "
                                 f"each of the {parallel} ranks holds two equal zigzag chunks of every sequence")
            if values.get("block", "fused") != "fused" or values.get("backend") == "reference":
                raise ValueError("--context-parallel needs the fused block on its Triton kernels (ring attention): "
                                 "leave out --block reference and --backend reference")
        if "document_boundary" in values:
            values["document_boundary"] = _parse_document_boundary(values["document_boundary"])
        if values.get("cuda_graphs"):
            _check_cuda_graphs(device_type, values)
        if values["preset"] not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {values['preset']!r}")
        values.setdefault("lr", PEAK_LR[values["preset"]])
        values.setdefault("min_lr", values["lr"] / 10)
        values.setdefault("warmup", min(200, values["steps"] // 10))
        if not values["lr"] > 0 or values["min_lr"] < 0 or values["warmup"] < 0:
            raise ValueError("--lr must be positive, --min-lr and --warmup non-negative")
        if values["dtype"] not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {values['dtype']!r}")
        values["out"] = Path(values.get("out") or f"runs/{values['preset']}")
        block = values.get("block", "fused")
        remat = values.get("remat")  # None: not given
        if "memory_limit" in values:
            values["memory_limit"] = _memory_limit(values["memory_limit"])
        if "memory_budget" in values:
            fraction = values["memory_budget"] = _budget_fraction(values["memory_budget"])
            if remat is not None:
                raise ValueError(f"--memory-budget {fraction:g} lets each layer choose what it keeps (at most that share "
                                 f"of what --remat none keeps): leave out --remat {remat}, or leave out --memory-budget "
                                 "(--remat auto plans per layer for --memory-limit in bytes)")
            if block != "fused":
                raise ValueError(f"--memory-budget {fraction:g} lets each fused layer choose what it keeps: "
                                 "leave out --block reference, whose layers keep everything (--remat none) or x (full)")
            if values.get("find_max_seq_len"):
                raise ValueError("--find-max-seq-len measures each policy on its own; its memory cap is --memory-limit "
                                 "in bytes, not --memory-budget")
        elif values.get("memory_limit") is not None and remat != "auto" and not values.get("find_max_seq_len"):
            raise ValueError(f"--memory-limit {options['memory_limit']} is the limit that --remat "
                             f"auto plans for and --find-max-seq-len searches under; with "
                             f"--remat {remat or ('cheap' if block == 'fused' else 'none')} nothing would use it: add "
                             "--remat auto, or give --memory-budget, a fraction in [0, 1], for each layer to keep at "
                             "most that share of what --remat none keeps")
        if values.get("memory_budget") is not None or (remat == "auto" and block == "fused"):
            values["remat"] = None
        else:
            # the reference block is eager PyTorch, whose own policies are none and full
            values["remat"] = _policies(remat or ("cheap" if block == "fused" else "none"),
                                        PRESETS[values["preset"]].n_layers, block)
        if values.get("vocab_size", 1) < 1:
            raise ValueError(f"--vocab-size must be positive, got {values['vocab_size']}")
        return cls(**values)

    @property
    def document_masking(self) -> bool:
        """Whether attention stays within documents (training/data.py says where they start)."""
        return _document_masking(self.document_boundary, self.data)

    def learning_rate(self, step: int) -> float:
        """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at the
        last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The ``preset`` model with ``vocab_size`` tokens."""
        return preset(self.preset, vocab_size=vocab_size)

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def precision(self) -> Precision:
        """fp32 master weights and residual stream; matmuls in ``dtype`` (bf16: under autocast)."""
        return Precision(residual=torch.float32, compute=self.compute_dtype)


def _policies(remat: str | tuple, n_layers: int, block: str) -> tuple[Remat, ...]:
    """``--remat``'s per-layer policies for ``--block``; an error names what was given and, for a
    value that is no policy, every form the flag takes."""
    try:
        return tuple(resolve_policies(remat, n_layers, block, owner="--remat"))
    except ValueError as error:
        if "must be one of" not in str(error):
            raise  # a wrong count of per-layer policies: the message says so
        if block != "fused":
            raise ValueError(f"--block {block} runs eager PyTorch, which takes --remat none (keep everything) or full "
                             f"(torch.utils.checkpoint), or a comma list of those, one per layer; got --remat {remat}") from None
        names = ", ".join(point.value for point in Remat)
        example = ",".join(["full"] + ["cheap"] * (n_layers - 1))
        raise ValueError(f"--remat must be one of {names}, keep:<tensors> (e.g. keep:o,lse,h), auto (a plan for "
                         f"--memory-limit in bytes), or a comma list with one per layer ({n_layers} layers, e.g. "
                         f"{example}); got {remat!r}") from None


def _parse_document_boundary(value: int | str) -> int | str:
    """``--document-boundary``'s value: a token id >= 0, or NO_DOCUMENTS."""
    if isinstance(value, str) and value.strip().lower() == NO_DOCUMENTS:
        return NO_DOCUMENTS
    try:
        token = int(value)
    except ValueError:
        token = -1
    if token < 0:
        raise ValueError(f"--document-boundary must be a token id (an integer >= 0) or {NO_DOCUMENTS}, got {value!r}")
    return token


def _document_masking(document_boundary: int | str | None, data: str | None) -> bool:
    if document_boundary is None:
        return data is None  # only the default corpus marks its own documents
    return document_boundary != NO_DOCUMENTS


def _check_cuda_graphs(device_type: str, values: dict) -> None:
    """Refuse, naming the flag, what one captured step cannot hold (graphs.check_capturable says why)."""
    why = None
    if device_type != "cuda":
        why = "needs a CUDA device"
    elif values.get("find_max_seq_len"):
        why = "does not apply to --find-max-seq-len, which measures eager steps"
    elif values.get("context_parallel", 1) > 1:
        why = "cannot capture --context-parallel's ring communication"
    elif values.get("distributed") is not None:
        why = "captures one process's step: leave out --distributed (and torchrun)"
    elif "offload" in str(values.get("remat", "")).split(","):
        why = "cannot hold --remat offload's copies to host memory"
    if why is not None:
        raise ValueError(f"--cuda-graphs {why}")
