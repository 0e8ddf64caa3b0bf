"""The whole training step as one CUDA graph: ``GraphedTrainStep``, what ``--cuda-graphs`` runs and
what a user's own loop can call in place of ``train_step``.

    optimizer = make_optimizer(model, lr=3e-4, weight_decay=0.1, capturable=True)
    step = GraphedTrainStep(model, optimizer, compute_dtype=torch.bfloat16, grad_clip=1.0, finite_only=True)
    for i, batch in enumerate(batches):
        set_learning_rate(optimizer, schedule(i))
        loss, grad_norm = step([batch])

The first ``warmup`` calls are ordinary ``train_step``s on a side stream: real steps, during which
Triton compiles and autotunes, AdamW makes its state and the allocator settles. The next call
copies its micro-batches into static buffers and captures ``train_step`` (forward and loss,
backward, clipping, the optimizer's step, ``zero_grad``) into one graph; from then on a call copies
its batches in and replays the graph, so a step's host cost is a few copies and one launch. Every
call is a step, computed by the same kernels in the same order, so graphed steps give the eager
steps' losses and weights.

A replay reads, in place, the static batches, the parameters, the optimizer's state and its
learning rates (0-dim device tensors, set with ``set_learning_rate``). Whatever else the step
depended on when it was captured is frozen into the graph, so a change that a replay would ignore
is refused instead (silently training with stale settings is the failure this module exists to
prevent): batches of another count, shape or dtype; a learning rate replaced rather than set in
place; another hyperparameter changed; the optimizer's state loaded anew. So are steps a graph
cannot hold: remat ``offload`` (host copies on a side stream), context parallelism (the ring's
communication) and data-parallel gradient communication; they stay on ``train_step``. With
``finite_only`` a non-finite step is dropped on the device (the optimizer's ``found_inf``, as under
a GradScaler): the optimizer must support it, as fused AdamW does.

Packed documents (a batch's ``cu_seqlens``) change their count and lengths with every batch, so
every step, the warm-up's included, runs on them in one fixed form: the offsets padded with empty
documents to a fixed count (twice the first batch's, rounded up to a power of two, or
``max_documents``) and the longest document bounded by the row length (or the first batch's
longest document, if longer). Empty documents add nothing and a bound is only a bound: the step
computes what it computes on the batch as given, the attention's tiles chosen by the bound's length
bucket (bit for bit an eager step given the same bound). The offsets are read and checked on the
host before each step (free where they are on the CPU or ``Batch.to`` brought them from there, one
wait for the GPU where they were made on it) and copied into the graph's buffer. A batch that does
not fit (documents where the graph had none, more documents, or a longer one) drops the graph: its
step runs eagerly in a form that fits it, and the next step captures again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..kernels.limits import check_documents, known_offsets
from .data import Batch
from .step import train_step

_WHAT = "GraphedTrainStep"


class CudaGraphs:
    """Where the graph is made: the device check, the side stream of the warm-up, the capture."""

    @staticmethod
    def check_device(device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"{_WHAT}: CUDA graphs need the model on a CUDA device, it is on {device}")

    @staticmethod
    @contextlib.contextmanager
    def side_stream(device: torch.device):
        """Work on a fresh stream that starts after, and is waited for by, the current one: a
        capture's warm-up must not run on the stream the caching allocator saw before."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(device).wait_stream(stream)

    @staticmethod
    def capture(step: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
        """``step`` captured (not run); returns its replay, which runs the captured work and returns
        the tensors ``step`` returned during capture, now holding that replay's values."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()

        def replay() -> tuple[torch.Tensor, ...]:
            graph.replay()
            return outputs

        return replay


GRAPHS = CudaGraphs()


class GraphedTrainStep:
    """``train_step(model, optimizer, micro_batches, ...)`` captured after ``warmup`` eager steps and
    replayed; the module docstring says what a replay reads and what it refuses. Returns what
    ``train_step`` returns (fresh tensors each call, never the graph's own buffers)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, compute_dtype: torch.dtype | None = None,
                 grad_clip: float = 0.0, finite_only: bool = False, warmup: int = 3, max_documents: int | None = None):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"{_WHAT}: warmup must be an int >= 1 (Triton compiles and the optimizer makes its "
                             f"state in eager steps before the capture), got {warmup!r}")
        if max_documents is not None and (isinstance(max_documents, bool) or not isinstance(max_documents, int)
                                          or max_documents < 1):
            raise ValueError(f"{_WHAT}: max_documents must be an int >= 1 or None, got {max_documents!r}")
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if not parameters:
            raise ValueError(f"{_WHAT}: the optimizer has no parameters")
        self.device = parameters[0].device
        GRAPHS.check_device(self.device)
        check_capturable(model, optimizer, finite_only)
        self.model, self.optimizer, self.warmup = model, optimizer, warmup
        self.options = dict(compute_dtype=compute_dtype, grad_clip=grad_clip, finite_only=finite_only)
        # The learning rates as device tensors, set in place (set_learning_rate): a graph reads them
        # at each replay, where a float would be frozen at capture.
        for group in optimizer.param_groups:
            if not (isinstance(group["lr"], torch.Tensor) and group["lr"].device == self.device):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
        self.steps = 0
        self.replay: Callable[[], tuple[torch.Tensor, ...]] | None = None
        self.static: list[Batch] = []
        self.layout, self.settings = (), ()  # as captured
        # packed documents' fixed form (module docstring): the offsets' count and the longest document
        self.documents = _DocumentForm(max_documents)

    def __call__(self, micro_batches: Sequence[Batch | tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        batches = [batch if isinstance(batch, Batch) else Batch(*batch) for batch in micro_batches]
        offsets = [self.documents.read(batch) for batch in batches]
        self.steps += 1
        fits = self.documents.holds(offsets)
        if not fits:  # this step runs eagerly, the next captures again
            self.replay, self.static = None, []  # the graph's memory goes back before the step runs
            self.documents.widen(batches, offsets)
        if self.steps <= self.warmup or not fits:
            with GRAPHS.side_stream(self.device):
                return train_step(self.model, self.optimizer, self.documents.fixed(batches, offsets), **self.options)
        if self.replay is None:
            self._make_static(batches)
        else:
            self._check_unchanged(batches)
        for static, batch, read in zip(self.static, batches, offsets):
            static.inputs.copy_(batch.inputs, non_blocking=True)
            static.targets.copy_(batch.targets, non_blocking=True)
            if read is not None:
                self.documents.copy_into(static, read)
        if self.replay is None:  # captured once the buffers hold a batch: the offsets' check has read it
            self.replay = GRAPHS.capture(lambda: train_step(self.model, self.optimizer, self.static, **self.options))
        loss, grad_norm = self.replay()
        return loss.clone(), grad_norm.clone()

    def _make_static(self, batches: list[Batch]) -> None:
        for batch in batches:
            if batch.inputs.device != self.device or batch.targets.device != self.device:
                raise ValueError(f"{_WHAT}: the batches must be on the model's device {self.device}, got inputs on "
                                 f"{batch.inputs.device} and targets on {batch.targets.device}")
        self.static = [self.documents.static(Batch(torch.empty_like(batch.inputs), torch.empty_like(batch.targets)),
                                             batch) for batch in batches]
        self.layout, self.settings = _layout(batches), _settings(self.optimizer)

    def _check_unchanged(self, batches: list[Batch]) -> None:
        layout = _layout(batches)
        if layout != self.layout:
            raise ValueError(f"{_WHAT}: the graph was captured for micro-batches {self.layout} (count, then the "
                             "inputs' and targets' shape, dtype and device of each, and whether it has documents) "
                             f"and got {layout}; a graph replays one layout: keep the batch shape fixed, or call "
                             "train_step")
        state, param_groups, groups = self.settings
        if self.optimizer.state is not state or self.optimizer.param_groups is not param_groups:
            raise RuntimeError(f"{_WHAT}: the optimizer's state or parameter groups were replaced after the capture "
                               "(load_state_dict?), and the graph updates the old ones; load state before the first "
                               "call, or make a new GraphedTrainStep")
        for index, ((lr, hyper), (lr_now, hyper_now)) in enumerate(zip(groups, _settings(self.optimizer)[2])):
            if lr_now is not lr:
                raise RuntimeError(f"{_WHAT}: param group {index}'s learning rate was replaced after the capture, "
                                   "which the graph would not see; set it in place with set_learning_rate")
            if hyper_now != hyper:
                changed = sorted(name for name in hyper_now.keys() | hyper.keys() if hyper_now.get(name) != hyper.get(name))
                raise RuntimeError(f"{_WHAT}: param group {index}'s {', '.join(changed)} changed after the capture, "
                                   "and the graph keeps the values it was captured with; make a new GraphedTrainStep")


def _settings(optimizer: torch.optim.Optimizer) -> tuple:
    """What a replay cannot follow if it changes: the optimizer's state and groups (by identity:
    load_state_dict replaces them), each group's learning rate tensor (by identity) and its other
    hyperparameters (by value)."""
    groups = [(group["lr"], {name: value for name, value in group.items() if name not in ("params", "lr")})
              for group in optimizer.param_groups]
    return optimizer.state, optimizer.param_groups, groups


def _layout(batches: list[Batch]) -> tuple:
    return len(batches), tuple((tuple(b.inputs.shape), b.inputs.dtype, b.inputs.device, tuple(b.targets.shape),
                                b.targets.dtype, b.targets.device, b.cu_seqlens is not None) for b in batches)


class _DocumentForm:
    """The fixed form a graphed step gives packed documents (module docstring): offsets padded with
    empty documents to ``count`` + 1 entries, and ``longest`` the step's max_seqlen. Both are set by
    the first batch with documents (``widen``) and grow only when a batch does not fit."""

    def __init__(self, count: int | None):
        self.count, self.longest = count, 0

    @staticmethod
    def read(batch: Batch) -> list[int] | None:
        """The batch's offsets on the host, checked as the model checks them (None without documents)."""
        if batch.documents is not None:
            raise ValueError(f"{_WHAT}: a batch with context-parallel document shards; context parallelism is not "
                             "captured (train_step)")
        if batch.cu_seqlens is None:
            return None
        offsets = known_offsets(batch.cu_seqlens) or batch.cu_seqlens.tolist()  # Batch.to keeps them
        check_documents(_WHAT, batch.cu_seqlens, batch.inputs.numel(), batch.inputs.device, batch.max_seqlen,
                        offsets=offsets)
        return offsets

    def holds(self, offsets: list[list[int] | None]) -> bool:
        return all(read is None or (self.count is not None and len(read) - 1 <= self.count
                                    and _longest(read) <= self.longest) for read in offsets)

    def widen(self, batches: list[Batch], offsets: list[list[int] | None]) -> None:
        """Room for these batches' documents: twice the most documents, rounded up to a power of two
        (a count given by the user stays unless a batch holds more), and the longest document or
        the row length, whichever is longer."""
        reads = [(batch, read) for batch, read in zip(batches, offsets) if read is not None]
        most = max(len(read) - 1 for _, read in reads)
        if self.count is None or most > self.count:
            self.count = 1 << (2 * most - 1).bit_length()  # a power of two (kernels.launch imports triton)
        self.longest = max(self.longest, *[max(batch.inputs.shape[-1], _longest(read)) for batch, read in reads])

    def fixed(self, batches: list[Batch], offsets: list[list[int] | None]) -> list[Batch]:
        """The batches with their documents in the fixed form, as the eager steps run them."""
        return [batch if read is None else Batch(batch.inputs, batch.targets, self._offsets(batch, read), self.longest)
                for batch, read in zip(batches, offsets)]

    def static(self, static: Batch, batch: Batch) -> Batch:
        """The graph's buffers for ``batch``: ``static`` with room for the offsets where it has documents."""
        if batch.cu_seqlens is None:
            return static
        buffer = torch.empty(self.count + 1, dtype=torch.int32, device=batch.inputs.device)
        return Batch(static.inputs, static.targets, buffer, self.longest)

    def copy_into(self, static: Batch, offsets: list[int]) -> None:
        padded = self._padded(static, offsets)
        static.cu_seqlens.copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
        self._checked(static, static.cu_seqlens, padded)

    def _offsets(self, batch: Batch, offsets: list[int]) -> torch.Tensor:
        padded = self._padded(batch, offsets)
        tensor = torch.tensor(padded, dtype=torch.int32, device=batch.inputs.device)
        self._checked(batch, tensor, padded)
        return tensor

    def _padded(self, batch: Batch, offsets: list[int]) -> list[int]:
        return offsets + [batch.inputs.numel()] * (self.count + 1 - len(offsets))

    def _checked(self, batch: Batch, cu_seqlens: torch.Tensor, padded: list[int]) -> None:
        """Checks ``cu_seqlens`` from ``padded``, the values just put in it, which marks it checked: the
        model, which checks offsets once per tensor version, does not read it again (a capture
        cannot read it, and a replay runs no Python)."""
        check_documents(_WHAT, cu_seqlens, batch.inputs.numel(), batch.inputs.device, self.longest, offsets=padded)


def _longest(offsets: list[int]) -> int:
    return max(end - start for start, end in zip(offsets, offsets[1:]))


def check_capturable(model: nn.Module, optimizer: torch.optim.Optimizer, finite_only: bool) -> None:
    """Refuse, naming the setting, a step that one CUDA graph cannot hold."""
    if not all(group.get("capturable", False) for group in optimizer.param_groups):
        raise ValueError(f"{_WHAT}: the optimizer must be capturable (its step count and learning rate on the "
                         "device): make_optimizer(..., capturable=True), or capturable=True to torch.optim")
    if finite_only and not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise ValueError(f"{_WHAT}: finite_only drops a non-finite step on the device through the optimizer's "
                         f"found_inf, which {type(optimizer).__name__} without fused=True does not take: use a fused "
                         "optimizer (make_optimizer on CUDA) or finite_only=False")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ValueError(f"{_WHAT}: data-parallel gradient communication is not captured; CUDA graphs run one "
                         "process's step (world size 1)")
    for name, module in model.named_modules():
        if getattr(module, "context_parallel", None) is not None:
            raise ValueError(f"{_WHAT}: {name or 'the model'} runs context parallelism, whose ring "
                             "communication a graph does not capture; train it with train_step")
        remat = getattr(module, "remat", None)
        if getattr(remat, "host_resident", False) and getattr(module, "memory_budget", None) is None:
            raise ValueError(f"{_WHAT}: {name or 'the model'} has remat 'offload', whose copies to and from host "
                             "memory a graph cannot hold; choose a policy that keeps x on the device")
