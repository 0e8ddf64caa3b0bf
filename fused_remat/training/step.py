"""One training step, written once: the training loop (``training/loop.py``), the capacity probe
(``training/capacity.py``) and the training benchmark (``bench/bench_train.py``) all step with
``train_step`` and build their optimizer with ``make_optimizer``.

    optimizer = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    loss, grad_norm = train_step(model, optimizer, [batch], compute_dtype=torch.bfloat16, grad_clip=1.0)

A micro-batch is a ``data.Batch`` or an (inputs, targets) pair. ``model(inputs, targets)`` returns
the mean loss (``fused_remat.model.LanguageModel`` does; a DDP/FSDP2 wrapper or a ``torch.compile``
of it too), and takes a batch's documents as ``cu_seqlens=`` and ``max_seqlen=``: attention then
stays within each document, and every target is still predicted. With ``compute_dtype`` bf16 or
fp16 the forward and loss run under autocast over the model's fp32 weights; with None or fp32,
without autocast.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import backend
from .data import Batch
from .distributed import gradient_sync


def forward_loss(model: Callable[..., torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor,
                 compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``model(inputs, targets)``, under autocast to ``compute_dtype`` unless it is None or fp32."""
    autocast = compute_dtype is not None and compute_dtype != torch.float32
    with torch.autocast(inputs.device.type, dtype=compute_dtype, enabled=autocast):
        return model(inputs, targets)


def batch_loss(model: Callable[..., torch.Tensor], batch: Batch | tuple[torch.Tensor, torch.Tensor],
               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``forward_loss`` of ``batch``, attending within its documents where it has them."""
    if not isinstance(batch, Batch):
        batch = Batch(*batch)
    # Bound to the model rather than passed through: forward_loss keeps the (model, inputs, targets)
    # form that the benchmark calls and the failure tests wrap.
    if batch.documents is not None:
        model = functools.partial(model, documents=batch.documents)
    elif batch.cu_seqlens is not None:
        model = functools.partial(model, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    return forward_loss(model, batch.inputs, batch.targets, compute_dtype)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: Sequence[Batch | tuple[torch.Tensor, torch.Tensor]], *,
               compute_dtype: torch.dtype | None = None, grad_clip: float = 0.0,
               finite_only: bool = False, gradient_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``micro_batches`` (on the model's device): forward and loss
    (``batch_loss``) and backward of loss / len(micro_batches) for each, with data-parallel
    gradient communication only on the last; then the gradient norm clipped to ``grad_clip`` (0:
    measured, not clipped), the optimizer's step and ``zero_grad(set_to_none=True)``.
    With ``finite_only`` a step whose loss or gradient norm is NaN or infinite changes nothing (its
    gradients are dropped, the weights and AdamW moments stay as they were): a fused torch optimizer
    (``make_optimizer``'s on CUDA) drops it on the device through its ``found_inf``, as under a
    GradScaler, and the step reads nothing on the host; any other optimizer costs one host sync
    before its step (and cannot be captured: ``graphs.GraphedTrainStep``).
    ``gradient_scale`` multiplies every backward (context parallelism: see ``training/distributed.py``).
    Returns the mean loss (detached) and the gradient norm before clipping (a DTensor under FSDP2)."""
    count = len(micro_batches)
    loss_sum = None
    for index, batch in enumerate(micro_batches):
        with gradient_sync(model, enabled=index == count - 1):
            loss = batch_loss(model, batch, compute_dtype)
            (loss * (gradient_scale / count)).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if finite_only and (_drops_on_device(optimizer, grad_norm) or backend.graph_capturing()):
        # The check stays on the device, where the optimizer drops the step if found_inf is 1: a
        # read on the host would wait for the whole backward before the optimizer's launches, and
        # a graph cannot read at all (graphs.check_capturable asks for such an optimizer).
        optimizer.found_inf = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm)).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not finite_only or is_finite(loss_sum, grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / count, grad_norm


def _drops_on_device(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> bool:
    """Whether ``optimizer`` takes ``found_inf`` (torch's fused optimizers: what a GradScaler asks)
    and the gradient norm is a plain tensor (FSDP2's is a DTensor, checked whole on the host)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False) and type(grad_norm) is torch.Tensor


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95, eps 1e-8) decaying the matrices only (not norms or biases), the fused
    implementation when the parameters are on CUDA or ``capturable`` (its step counts on the device,
    for a step captured in a CUDA graph: ``graphs.GraphedTrainStep``), foreach elsewhere."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in trainable if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in trainable if p.dim() < 2], weight_decay=0.0)]
    on_cuda = any(p.device.type == "cuda" for p in trainable)
    implementation = dict(fused=True) if on_cuda or capturable else dict(foreach=True)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, capturable=capturable, **implementation)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every param group's learning rate to ``lr``: in place where it is a tensor, which a captured
    step (``graphs.GraphedTrainStep``) reads at each replay."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def is_finite(*values: torch.Tensor) -> bool:
    """Whether every value (a tensor, or a DTensor such as FSDP2's gradient norm) is finite."""
    full = [value.full_tensor() if hasattr(value, "full_tensor") else value for value in values]
    return all(bool(torch.isfinite(value).all()) for value in full)
