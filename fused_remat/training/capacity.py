"""`--find-max-seq-len`: the longest sequence that trains one step, per remat policy, beside the
reference block eager and under torch.utils.checkpoint — "how much longer can I train".

On a GPU a length fits when one full training step (forward, backward, AdamW update) at
``--batch-size`` runs without running out of CUDA memory; ``--memory-limit`` caps the memory
the process may use, to ask the question for a smaller card. On CPU there is no allocator to
exhaust, so a length fits when the step's predicted peak plus 16 bytes per parameter (fp32
weights, gradients, two AdamW moments) stays within ``--memory-limit``: the bytes autograd keeps
(the saved-memory meter) plus the largest transient among the model's layers at that length
(``planner.layer_transient_bytes_per_token``, from ``remat.peak_bytes_per_token``: what one
layer's step holds above what it keeps; the layers below it still hold theirs), as the planner
prices a plan (``RematPlan.peak_bytes``). The reference block, eager or under
torch.utils.checkpoint, has no such formula: its transient is measured instead, on a copy of one of
its blocks at that length (the peak-memory meter's high-water mark of a forward and backward, less
what the block keeps), so that checkpoint's replay counts as ours does.
Lengths are searched by doubling, then bisection, in multiples of ``GRANULARITY``, to within
1/64 of the answer (a probe at long lengths is a slow step), up to ``MAX_SEQ_LEN``.

With ``--context-parallel N`` the question is per rank: a sequence of S tokens split over N ranks
fits when one rank's share fits, and a rank keeps for backward what one process keeps at S / N
tokens (the saved-memory meter measures exactly that, tests/test_context_parallel.py). So the probe
runs one process at S / N, for our block only (the reference block has no ring attention). Not
counted: the ring's transient buffers (two k/v blocks in flight, fp32 accumulators of one layer's
attention output and gradients), which a GPU run would have to confirm. Where the run masks
documents, attention gathers every rank's k and v instead: that transient is counted
(``context_parallel_documents.attention_transient_bytes_per_token``, in the layer transient).

``find_max_seq_len(config, run)`` is what ``python -m fused_remat.train --find-max-seq-len`` runs;
``TrainStepProbe`` and ``largest_fitting`` are also the training benchmark's
(``bench/bench_train.py``). A probe steps as training does (``training/step.py``).
"""

from __future__ import annotations

import copy
import gc
import json
import time
from collections.abc import Callable

import torch

from ..memory import peak_memory, saved_memory
from ..model import LanguageModel, ModelConfig
from ..planner import Precision, layer_transient_bytes_per_token, plan_remat
from .config import TrainConfig
from .distributed import Distributed
from .loop import describe_backend
from .step import forward_loss, make_optimizer, train_step

GRANULARITY = {"cuda": 256, "cpu": 32}
MAX_SEQ_LEN = 1 << 18  # 262,144 tokens: a probe step costs N^2, and a longer one is too slow to search
# (label, block implementation, remat): the baselines first, then ours.
CANDIDATES = (
    ("reference, eager", "reference", "none"),
    ("reference, torch.utils.checkpoint", "reference", "full"),
    ("fused_remat none", "fused", "none"),
    ("fused_remat cheap", "fused", "cheap"),
    ("fused_remat selective", "fused", "selective"),
    ("fused_remat full", "fused", "full"),
    ("fused_remat offload", "fused", "offload"),
    ("fused_remat auto", "fused", "auto"),
)


def largest_fitting(fits: Callable[[int], bool], granularity: int, limit: int = MAX_SEQ_LEN) -> int:
    """The largest multiple of ``granularity`` up to ``limit`` for which ``fits`` holds (to within
    1/64 of it), assuming it holds below some length and fails above; 0 when not even
    ``granularity`` fits, ``limit`` when everything probed fits."""
    good, bad = 0, None
    length = granularity
    while length <= limit:
        if not fits(length):
            bad = length
            break
        good, length = length, length * 2
    if bad is None:
        return good
    while bad - good > max(granularity, good // 64):
        middle = (good + bad) // 2 // granularity * granularity
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


class TrainStepProbe:
    """One training step of one model at a given length; True when it fits."""

    def __init__(self, config: ModelConfig, block_impl: str, remat: str, batch: int, precision: Precision,
                 device: torch.device, budget: int | None, document_ranks: int = 1):
        self.config, self.remat, self.batch, self.precision = config, remat, batch, precision
        self.device, self.budget = device, budget
        self.document_ranks = document_ranks  # context parallelism over documents: see planner.layer_transient_bytes_per_token
        self.model = LanguageModel(config, "none" if remat == "auto" else remat, block_impl=block_impl, device=device)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.optimizer = make_optimizer(self.model, lr=1e-4, weight_decay=0.1)
        # One short step first, so the AdamW moments exist as they do during training.
        self._step(torch.randint(0, config.vocab_size, (1, 17), device=device))

    def _activation_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            allowed = free if self.budget is None else min(free, self.budget - torch.cuda.memory_allocated(self.device))
            return int(0.9 * (allowed - 4 * self.parameters))  # the gradients, allocated during backward
        return self.budget - 16 * self.parameters

    def __call__(self, seq_len: int) -> bool:
        if self.remat == "auto":
            try:
                plan = plan_remat(self.config, self.batch, seq_len, self.precision, self._activation_budget(),
                                  document_ranks=self.document_ranks)
            except ValueError:
                return False
            self.model.set_remat(plan.policies)
        tokens = torch.randint(0, self.config.vocab_size, (self.batch, seq_len + 1), device=self.device)
        try:
            if self.device.type == "cuda":
                return self._step_fits_on_gpu(tokens)
            return self._saved_bytes_fit(tokens)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            del tokens
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _loss(self, tokens):
        return forward_loss(self.model, tokens[:, :-1], tokens[:, 1:], self.precision.compute)

    def _step(self, tokens) -> None:
        train_step(self.model, self.optimizer, [(tokens[:, :-1], tokens[:, 1:])], compute_dtype=self.precision.compute)

    def _step_fits_on_gpu(self, tokens) -> bool:
        try:
            self._step(tokens)
            torch.cuda.synchronize(self.device)
            return True
        except torch.OutOfMemoryError:
            return False

    def _saved_bytes_fit(self, tokens) -> bool:
        """On CPU: the saved bytes (the meter) plus the largest layer transient plus 16 bytes per
        parameter within the budget (the module docstring)."""
        with saved_memory(exclude=self.model.parameters()) as meter:
            loss = self._loss(tokens)
        del loss
        saved = meter.device_bytes  # offloaded layer inputs wait in host memory
        if self.model.block_impl == "reference":
            # torch.utils.checkpoint keeps each checkpointed block's input through saved-tensor
            # hooks of its own, which hide it from the meter's: count those inputs here.
            hidden = self.batch * (tokens.shape[1] - 1) * self.config.dim * self.precision.residual_bytes
            saved += hidden * self.model.remat.count("full")
        transient = self.largest_transient(tokens.shape[1] - 1)
        return saved + transient + 16 * self.parameters <= self.budget

    def largest_transient(self, seq_len: int) -> int:
        """The most bytes one layer's step holds above what it keeps, over the model's layers at
        ``seq_len``: for our block the formula (``planner.layer_transient_bytes_per_token``), for
        the reference block, which has none, measured (``_measured_transient``)."""
        if self.model.block_impl == "reference":
            one_per_policy = {block.remat: block for block in self.model.blocks}.values()
            return max(self._measured_transient(block, seq_len) for block in one_per_policy)
        return self.batch * seq_len * max(layer_transient_bytes_per_token(self.config, policy, self.precision,
                                                                          self.document_ranks)
                                          for policy in self.model.remat)

    def _measured_transient(self, block: torch.nn.Module, seq_len: int) -> int:
        """One block's forward and backward (the gradient of its input only, on a frozen copy) at
        ``seq_len``: the peak-memory meter's high-water mark, which counts the output y and not the
        input x, less what the block keeps (the saved-memory meter; under torch.utils.checkpoint,
        x, which its own hooks hide), as ``remat.peak_bytes_per_token`` less what a point keeps."""
        block = copy.deepcopy(block).requires_grad_(False)
        x = torch.randn(self.batch, seq_len, self.config.dim, device=self.device, dtype=self.precision.residual,
                        requires_grad=True)
        dy = torch.randn_like(x)
        autocast = torch.autocast(self.device.type, dtype=self.precision.compute,
                                  enabled=self.precision.compute != self.precision.residual)

        def step():
            with autocast:
                y = block(x)
            torch.autograd.grad(y, x, dy)

        step()  # warm
        with saved_memory(exclude=block.parameters()) as saved, autocast:
            block(x)
        kept = saved.device_bytes + (x.numel() * x.element_size() if block.remat == "full" else 0)
        with peak_memory(self.device) as peak:
            step()
        return peak.peak_bytes - kept


def _reporting(fits: Callable[[int], bool]) -> Callable[[int], bool]:
    """``fits`` that prints each probed length, its verdict and how long the probe took, as it goes."""
    def probe(seq_len: int) -> bool:
        started = time.perf_counter()
        verdict = fits(seq_len)
        print(f"    {seq_len:>9,d} tokens: {'fits' if verdict else 'does not fit'} ({time.perf_counter() - started:.1f} s)",
              flush=True)
        return verdict

    return probe


def find_max_seq_len(config: TrainConfig, run: Distributed) -> int:
    """Prints the longest trainable sequence of every candidate in CANDIDATES and writes them to
    ``config.out``/max_seq_len.json; 0 when done."""
    device = run.device()
    if run.world_size > 1:
        raise ValueError("--find-max-seq-len runs in one process (one GPU); start it without torchrun")
    if device.type != "cuda" and config.memory_limit is None:
        raise ValueError("--find-max-seq-len on CPU needs --memory-limit (there is no device memory to exhaust), "
                         "e.g. --preset tiny --memory-limit 2MiB")
    budget = config.memory_limit
    model_config = config.model_config(config.vocab_size or 256)
    if device.type == "cuda" and budget is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    parallel = config.context_parallel
    granularity = GRANULARITY[device.type] * parallel  # a multiple of 2N: every rank holds two equal chunks
    criterion = ("one training step without CUDA out-of-memory" if device.type == "cuda"
                 else "saved activations (meter) + the largest layer transient (remat.peak_bytes_per_token; "
                      "the reference block's measured) + 16 B/parameter within --memory-limit")
    candidates = CANDIDATES
    if parallel > 1:
        criterion += f", per rank of --context-parallel {parallel} (one process at seq_len / {parallel})"
        candidates = [(f"{label}, context parallel {parallel}", block, remat)
                      for label, block, remat in CANDIDATES if block == "fused"]
    print(f"longest trainable sequence on {describe_backend(device)} (a doubling, then a bisection, per candidate): {config.preset} ({model_config.describe()}), batch {config.batch_size}, {config.dtype}, "
          f"criterion: {criterion}, in steps of {granularity}", flush=True)
    rows = []
    for label, block_impl, remat in candidates:
        torch.manual_seed(config.seed)
        probe = TrainStepProbe(model_config, block_impl, remat, config.batch_size, config.precision, device, budget,
                               parallel if config.document_masking else 1)
        print(f"  {label}: probing", flush=True)
        per_rank = probe if parallel == 1 else lambda seq_len, probe=probe: probe(seq_len // parallel)
        longest = largest_fitting(_reporting(per_rank), granularity, MAX_SEQ_LEN * parallel)
        del probe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        capped = longest == MAX_SEQ_LEN * parallel
        rows.append(dict(candidate=label, block=block_impl, remat=remat, context_parallel=parallel, max_seq_len=longest,
                         capped=capped))
        baseline = rows[0]["max_seq_len"]
        ratio = f"{longest / baseline:.2f}x" if baseline else "-"
        print(f"  {label:<36} {'>=' if capped else '  '}{longest:>10,d} tokens  {ratio:>7} vs {rows[0]['candidate']}",
              flush=True)
    config.out.mkdir(parents=True, exist_ok=True)
    result = dict(preset=config.preset, batch_size=config.batch_size, dtype=config.dtype, criterion=criterion,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  memory_limit=budget, rows=rows)
    (config.out / "max_seq_len.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {config.out / 'max_seq_len.json'}")
    return 0
