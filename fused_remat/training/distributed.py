"""Running the trainer under ``torchrun``: process group, DDP or FSDP2 wrapping, and state dicts
that look the same whichever wrapping (or none) produced them.

Without ``torchrun`` (WORLD_SIZE unset or 1) everything here is the single-process identity.
CUDA uses NCCL with one GPU per process; CPU uses gloo (how CI tests it, two processes).

Context parallelism (``--context-parallel N``): the world is a 2-D device mesh ("dp", "cp") of
world/N x N ranks, rank = dp_index x N + cp_index. The N ranks of a "cp" row train on the same
sequences, each on its zigzag chunks (``fused_remat.context_parallel``), and attention is a ring
over that row. Parameters are replicated (DDP) or sharded (FSDP2) over the whole world, dp x cp
flattened: every rank holds the same parameters either way. The CP ranks' gradients are shares of
one sequence's gradient (they must be summed) while data-parallel reduction averages over all
world ranks, so each rank's backward is scaled by N (``gradient_scale``): the average over the
world is then the average over dp of the sums over cp.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

STRATEGIES = ("ddp", "fsdp")
# How long the ranks wait for each other when a run ends: all of them are past their last
# collective by then, and only rank 0's last writes (the plot) can hold one back.
SHUTDOWN_TIMEOUT = timedelta(minutes=5)
# The rendezvous store's key for the first failure of the job ("rank R failed: ..."); torchrun
# creates a new store for every restart, so a note never outlives its attempt.
FIRST_FAILURE_KEY = "fused_remat/first_failure"
# How long a rank waits for the store when it looks for another rank's failure: the store lives in
# torchrun's agent, or without torchrun in rank 0, which may be the rank that failed.
FAILURE_LOOKUP_TIMEOUT = timedelta(seconds=10)


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    strategy: str | None = None  # None when single-process
    context_parallel: int = 1  # ranks per sequence
    context_parallel_group: dist.ProcessGroup | None = None  # this rank's "cp" row of the mesh, None without
    store: dist.Store | None = None  # the rendezvous store, where a failing rank leaves its error for the others

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this rank is (its sequences); ranks of one "cp" row share it."""
        return self.rank // self.context_parallel

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.context_parallel

    @property
    def gradient_scale(self) -> float:
        """Each backward's factor: N under context parallelism (module docstring), else 1."""
        return float(self.context_parallel)

    def shard_sequence(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag part of (batch, seq_len) ``tokens``; all of them without context parallelism."""
        if self.context_parallel == 1:
            return tokens
        from ..context_parallel import zigzag_shard

        return zigzag_shard(tokens, self.rank % self.context_parallel, self.context_parallel, dim=1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def mean(self, value: float) -> float:
        """``value`` averaged over the ranks (itself when single-process)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor)
        return tensor.item() / self.world_size

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks, on every rank (so all ranks act alike: stop at the
        same step, with the same exit status)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _collective_device(self) -> torch.device:
        return self.device() if dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(strategy: str | None, context_parallel: int = 1) -> Distributed:
    """Joins the process group that torchrun set up (env:// rendezvous), if any, and with
    ``context_parallel`` > 1 builds the ("dp", "cp") device mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if context_parallel > 1 and world_size % context_parallel:
        raise ValueError(f"--context-parallel {context_parallel} needs a world size that it divides, under torchrun: "
                         f"torchrun --nproc_per_node {context_parallel} -m fused_remat.train --context-parallel "
                         f"{context_parallel} ...; the world size is {world_size}")
    if world_size == 1:
        if strategy is not None and "WORLD_SIZE" not in os.environ:
            raise ValueError(f"--distributed {strategy} needs torchrun, which starts one process per GPU: "
                             f"torchrun --nproc_per_node N -m fused_remat.train --distributed {strategy} ...; "
                             "leave --distributed out to train in this one process")
        return Distributed()
    strategy = strategy or "ddp"
    if strategy not in STRATEGIES:
        raise ValueError(f"--distributed must be one of {STRATEGIES}, got {strategy!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    store = None
    if not dist.is_initialized():
        store, rank, size = next(dist.rendezvous("env://"))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank, world_size=size)
    group = None
    if context_parallel > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu",
                                (world_size // context_parallel, context_parallel), mesh_dim_names=("dp", "cp"))
        group = mesh.get_group("cp")
    return Distributed(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), strategy=strategy,
                       context_parallel=context_parallel, context_parallel_group=group, store=store)


def shutdown(run: Distributed, timeout: timedelta = SHUTDOWN_TIMEOUT) -> None:
    """The end of a run that finished on this rank: waits at most ``timeout`` for every rank, then
    leaves the process group (module docstring). A RuntimeError when a rank hangs or has gone (rank
    0's names the ranks that did not arrive); the group is left either way. On NCCL the barrier is
    bounded by the group's own timeout (10 minutes unless set), after which its watchdog ends the
    process."""
    if run.world_size == 1 or not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier(device_ids=[run.local_rank])
    except RuntimeError as error:
        raise RuntimeError(f"rank {run.rank}: not every rank reached the end of the run within {timeout} "
                           f"({error})") from error
    finally:
        dist.destroy_process_group()


def leave_after_failure(run: Distributed, error: str) -> str | None:
    """After this rank failed with ``error``: the failure another rank left in the store before
    (then this rank's error is its consequence: a collective whose peer left), else None, and
    ``error`` is left there as the job's first failure. Then leaves the process group without
    waiting for the other ranks (module docstring)."""
    first = None
    if run.store is not None:
        note = f"rank {run.rank} failed: {error}"
        try:
            run.store.set_timeout(FAILURE_LOOKUP_TIMEOUT)
            # the first rank to fail sets the key; a later one reads the first one's note back
            stored = run.store.compare_set(FIRST_FAILURE_KEY, "", note).decode()
        except RuntimeError:  # the store went with the rank that hosted it: nothing to learn from it
            stored = note
        first = None if stored == note else stored
    leave(run)
    return first


def checkpoint_group(run: Distributed) -> dist.ProcessGroup | None:
    """A gloo group of every rank for background checkpoint writes (``--async-checkpoint``): DCP's
    collectives then run from its writer thread while training's run on the default group (NCCL on
    GPUs), never interleaved on one group. None in one process. Every rank must call it, at once."""
    if run.world_size == 1:
        return None
    return dist.new_group(backend="gloo")


def leave(run: Distributed) -> None:
    """Leaves the process group at once, if it is still joined."""
    if run.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, run: Distributed) -> nn.Module:
    """DDP replicates the model and averages gradients; FSDP2 shards every block's parameters (and
    the embedding, final norm and head at the root), gathering a block's weights just before its
    forward and backward, so the fused block's kernels see ordinary full tensors."""
    if run.strategy is None:
        return model
    if run.strategy == "ddp":
        device_ids = [run.local_rank] if torch.cuda.is_available() else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """With ``enabled=False``, backward inside accumulates gradients locally without communicating:
    for every micro-batch but the last of a gradient-accumulation step."""
    if enabled:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts keyed by parameter names, on CPU; under
    FSDP2 only rank 0 receives them."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(unwrap(model), optimizer, options=options)


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Loads what ``training_state`` produced into every rank's (possibly sharded) model and optimizer."""
    set_state_dict(unwrap(model), optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))


def sharded_training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of the model and optimizer state for a sharded checkpoint (DCP): FSDP2's
    DTensor shards, DDP's (or one process's) whole tensors, which DCP writes once, not per rank."""
    model_state, optimizer_state = get_state_dict(unwrap(model), optimizer, options=StateDictOptions())
    return dict(model=model_state, optimizer=optimizer_state)


def load_sharded_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder) -> None:
    """Loads the sharded checkpoint ``folder`` into this rank's model and optimizer, resharded by
    DCP for this world (any number of ranks, DDP, FSDP2 or one process, whatever wrote it): each
    rank reads only the pieces of its own shards."""
    import torch.distributed.checkpoint as dcp

    state = sharded_training_state(model, optimizer)  # the layout to fill (the optimizer's state initialized)
    from .checkpoint import quiet_dcp

    with quiet_dcp():
        dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    set_state_dict(unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions())
