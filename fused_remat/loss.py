"""The LM head and its cross-entropy in one step that never holds the (tokens x vocab) logits.

``linear_cross_entropy(hidden, weight, targets)`` is ``F.cross_entropy(F.linear(hidden, weight).float(),
targets)`` computed ``chunk_tokens`` rows at a time. An eager LM head keeps the logits (and autograd
keeps them, or their log-softmax, for backward): T x V elements, which at long sequences dwarf
every block activation (GPT-2's vocabulary is 65x its width).

Per chunk of rows the forward pass computes the logits in the compute dtype; one kernel
(``kernels.cross_entropy``) reads them in fp32, takes the log-sum-exp and the loss, and, while the
chunk's logits are at hand, turns them in place into ``softmax - onehot`` in the compute dtype,
which two matmuls multiply out into both gradients (the approach of Liger-Kernel's fused linear
cross-entropy). Where the kernels do not run (the reference backend, a device Triton cannot run
on), PyTorch's operations do the kernel's step on an fp32 copy of the chunk. Nothing is recomputed
in backward.

Saved for backward, in ``_setup_loss_context`` only (the autograd of the custom operator
``fused_remat::linear_cross_entropy_fwd``):

- ``dhidden``: hidden's shape and dtype (when hidden requires grad);
- ``dweight``: (V, dim) in fp32 whatever weight's dtype (when weight requires grad): the fp32
  accumulator itself. Kept in a 16-bit weight's dtype it would be rounded twice, and its values,
  on the summed loss's scale (below), could overflow fp16.

The mean's 1/n_valid (n_valid: the targets that count) is split in two. The forward bakes
``2**k / n_valid``, in (0.5, 1], into the softmax - onehot terms, and the backward multiplies by
the incoming gradient times ``2**-k`` (then casts dweight to weight's dtype). Baking all of
1/n_valid in would push the softmax terms of a large batch below fp16's smallest subnormal before
a loss scale (the incoming gradient) could lift them, as it does in eager PyTorch; baking none in
would round 16-bit dhidden twice. This way the saved values keep the summed loss's range, and an
incoming gradient of 1 or any power of two (loss scales) costs no second rounding.

Under ``torch.no_grad()``, or when neither hidden nor weight requires grad, only the loss is
computed and nothing is saved.

Transient memory: one chunk of logits in the compute dtype (with PyTorch's step, one more in fp32),
and under autocast the weight cast once to the compute dtype. With 16-bit compute, dweight is the fp32 sum of
per-chunk 16-bit products (no portable matmul writes fp32 from 16-bit inputs): one rounding per
chunk where eager PyTorch rounds once. At training sizes the errors average out to eager's; on a
few tokens split into a few chunks they can reach about twice eager's.
"""

from __future__ import annotations

import math

import torch

from . import backend, value_checks
from .backend import autocast_dtype, use_triton
from .custom_ops import first_order_only, first_output_twin, kernels, traced
from .flops import flop_formula, matmul_flops
from .kernels.limits import check_same_device, check_tensor

_OP = "linear_cross_entropy"

# Default chunks are rounded up to whole multiples of this many rows: GPU matmul tiles are 64 or
# 128 rows tall, so a partial last tile costs a full one anyway.
CHUNK_ROW_MULTIPLE = 64


def default_chunk_tokens(tokens: int, vocab: int, dim: int) -> int:
    """Rows per chunk such that one fp32 chunk of logits holds about as many elements as hidden.

    The transient of the LM head is then the size of one activation (hidden in fp32), not T x V:
    ceil(V / dim) times smaller (66x at GPT-2's 50257 x 768), small next to what the blocks keep.
    Smaller chunks would save memory nobody notices and pay for it in more, thinner matmuls and
    more element-wise launches per token; the matmuls stay large because their other side is the
    whole vocabulary.
    """
    logits_per_hidden_element = math.ceil(vocab / max(dim, 1))
    rows = math.ceil(tokens / logits_per_hidden_element)
    rows = math.ceil(rows / CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE
    return max(1, min(rows, tokens))


def _split_mean_scale(n_valid: int | torch.Tensor, device: torch.device) -> tuple[float | torch.Tensor, torch.Tensor]:
    """1/n_valid as (forward part 2**k / n_valid in (0.5, 1], backward part 2**-k); see the module
    docstring. Every target ignored: (1, 1), as the gradients are zero whatever the scale.

    A count known on the host (``n_valid`` an int) gives the forward part as a float, rounded to
    fp32 where it is used; a count on the device (while a graph is captured: no host sync) gives
    it as a 0-dim fp32 device tensor, computed without leaving the device, to the same bits. The
    backward part is a 0-dim fp32 device tensor either way (it is saved for backward)."""
    if isinstance(n_valid, int):
        _, exponent = math.frexp(max(n_valid, 1))  # count = m * 2**exponent, m in [0.5, 1)
        power_of_two = 2.0 ** (exponent - 1)
        return power_of_two / max(n_valid, 1), torch.full((), 1 / power_of_two, dtype=torch.float32, device=device)
    count = n_valid.clamp(min=1).double()  # exact below 2**53 targets
    _, exponent = torch.frexp(count)
    power_of_two = torch.ldexp(torch.ones_like(count), exponent - 1)
    return (power_of_two / count).float(), power_of_two.reciprocal().float()


def _chunked_loss_and_grads(hidden_rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            counted: torch.Tensor, chunk_tokens: int, compute_dtype: torch.dtype,
                            want_dhidden: bool, want_dweight: bool, gradient_scale: float | torch.Tensor,
                            kernel_ignore_index: int | None):
    """Per-row losses (fp32, 0 on rows that do not count), and when wanted the gradients of the summed
    loss times ``gradient_scale``: dhidden in hidden's dtype, dweight in fp32.

    ``targets``: int64 class per row (the kernel's step: as given; PyTorch's: ``_count_targets``'
    ids); ``counted``: bool per row (PyTorch's step; None for the kernel's); ``gradient_scale``: a
    0-dim fp32 tensor, or for the kernel's step one holding it first (``target_statistics_``'s).
    ``kernel_ignore_index``: each chunk's softmax step by the Triton kernel, which skips the rows of
    this id and those outside the vocabulary; None: by PyTorch's operations.
    """
    tokens, dim = hidden_rows.shape
    # One cast per call (none without autocast when dtypes agree); dropped on return, never saved.
    weight_c = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
    weight_t = weight_c.t()
    # Per-row losses summed once at the end (pairwise inside torch.sum), as PyTorch's mean does: a
    # running fp32 scalar over thousands of one-row chunks would lose digits.
    row_losses = torch.empty(tokens, dtype=torch.float32, device=hidden_rows.device)
    dhidden = torch.empty(tokens, dim, dtype=hidden_rows.dtype, device=hidden_rows.device) if want_dhidden else None
    # written by the first chunk's product; zeros where there is no chunk
    dweight = (torch.empty if tokens else torch.zeros)(weight.shape, dtype=torch.float32, device=weight.device) \
        if want_dweight else None
    want_grads = want_dhidden or want_dweight
    whole = chunk_tokens >= tokens  # one chunk: the tensors themselves, no views of rows
    for start in range(0, tokens, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        hidden_c = hidden_rows if whole else hidden_rows[rows]
        if hidden_c.dtype != compute_dtype:
            hidden_c = hidden_c.to(compute_dtype)
        logits_c = torch.mm(hidden_c, weight_t)
        losses_c = row_losses if whole else row_losses[rows]
        if kernel_ignore_index is not None:
            kernels.cross_entropy.cross_entropy_rows_(logits_c, targets if whole else targets[rows], losses_c,
                                                      kernel_ignore_index, gradient_scale if want_grads else None)
            dlogits = logits_c if want_grads else None
        else:
            losses_c[:], dlogits = _chunk_loss_and_dlogits(logits_c, targets[rows], counted[rows], want_grads,
                                                           gradient_scale)
        if dhidden is not None:
            dhidden_c = dhidden if whole else dhidden[rows]
            if dhidden.dtype == dlogits.dtype:
                torch.mm(dlogits, weight_c, out=dhidden_c)
            else:
                dhidden_c[:] = dlogits @ weight_c
        if dweight is not None:
            if dlogits.dtype == torch.float32:
                if start == 0:
                    torch.mm(dlogits.t(), hidden_c, out=dweight)
                else:
                    dweight.addmm_(dlogits.t(), hidden_c)
            elif start == 0:
                dweight.copy_(dlogits.t() @ hidden_c)
            else:
                # addmm_ needs one dtype: the 16-bit partial product (fp32-accumulated inside the
                # matmul) is rounded once per chunk and summed over the chunks in fp32.
                dweight += dlogits.t() @ hidden_c
    return row_losses, dhidden, dweight


def _chunk_loss_and_dlogits(logits_c: torch.Tensor, targets_c: torch.Tensor, counted_c: torch.Tensor,
                            want_grads: bool, gradient_scale: torch.Tensor):
    """Losses of one chunk's rows from its logits (in the compute dtype), and gradient_scale *
    d(summed loss)/d(logits) in the compute dtype (None unless wanted), by PyTorch's operations:
    what ``kernels.cross_entropy`` does in one launch, where the kernels do not run.

    Returning the low-precision dlogits from here lets the fp32 logits buffer die before the two
    gradient matmuls, so about one fp32 chunk (plus one chunk in the compute dtype) is live at a time.
    """
    logits = logits_c.float()  # the same tensor as logits_c when computing in fp32
    lse = torch.logsumexp(logits, dim=1)
    target_logit = logits.gather(1, targets_c[:, None]).squeeze(1)
    row_losses = torch.where(counted_c, lse - target_logit, 0.0)
    if not want_grads:
        return row_losses, None
    # gradient_scale * (softmax - onehot), in place: exp(logit - (lse - log scale)) = scale * softmax,
    # so the scale costs no pass of its own. Shifting rows that do not count by +inf makes their
    # softmax exactly 0 and saves a masking pass; their onehot term is masked to 0 as well.
    shift = torch.where(counted_c, lse - gradient_scale.log(), torch.inf)
    dlogits = logits.sub_(shift[:, None]).exp_()
    dlogits.scatter_add_(1, targets_c[:, None], counted_c[:, None].float().mul_(-gradient_scale))
    if dlogits.dtype != logits_c.dtype:
        dlogits = logits_c.copy_(dlogits)  # reuse the compute-dtype buffer of this chunk's logits
    return row_losses, dlogits


def _loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                    chunk_tokens: int, compute_dtype: torch.dtype, want_dhidden: bool,
                    want_dweight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, dhidden and dweight short of the factor backward_scale (empty unless wanted),
    backward_scale) for hidden (..., dim) and targets (T,) int64, T the rows of hidden; dhidden in
    hidden's shape.

    A custom operator, so that torch.compile treats the loss as one node: the target check and the
    chunk loop stay inside it instead of breaking the graph. hidden comes as the caller has it and
    is seen as rows here: a reshape outside would be a view node of its own in autograd."""
    vocab = weight.shape[0]
    hidden_rows = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    if use_triton(_OP, hidden.device):
        # The targets' count, check and the mean's scales by one kernel, read on the device
        step, targets = kernels.cross_entropy, targets.contiguous()
        # zeros: the out-of-range flag is read on the host (launches stubbed, it reads no garbage)
        stats = torch.zeros(step.STATISTICS, dtype=torch.float32, device=hidden.device)
        backward_scale = torch.empty((), dtype=torch.float32, device=hidden.device)
        step.target_statistics_(targets, vocab, ignore_index, stats, backward_scale)
        value_checks.check_later(stats[step.OUT_OF_RANGE:], lambda later: _out_of_range(
            targets, vocab, ignore_index, value_checks.found_later("call") if later else ""))
        args = (hidden_rows, weight, targets, None, chunk_tokens, compute_dtype, want_dhidden, want_dweight, stats,
                ignore_index)
        divisor, poison = stats[step.DIVISOR], None
    else:
        counted, step_targets, n_valid, poison = _count_targets(targets, vocab, ignore_index)
        forward_scale, backward_scale = _split_mean_scale(n_valid, hidden.device)
        if not isinstance(forward_scale, torch.Tensor):
            forward_scale = torch.full((), forward_scale, dtype=torch.float32, device=hidden.device)
        args = (hidden_rows, weight, step_targets, counted, chunk_tokens, compute_dtype, want_dhidden, want_dweight,
                forward_scale, None)
        divisor = max(n_valid, 1) if isinstance(n_valid, int) else n_valid.clamp(min=1)
    if torch.is_autocast_enabled(hidden.device.type):
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen by compute_dtype
            row_losses, dhidden, dweight = _chunked_loss_and_grads(*args)
    else:
        row_losses, dhidden, dweight = _chunked_loss_and_grads(*args)
    loss = row_losses.sum() / divisor
    if poison is not None:
        loss, backward_scale = loss + poison, backward_scale + poison
    if dhidden is not None and hidden.dim() != 2:
        dhidden = dhidden.view(hidden.shape)
    return (loss, hidden.new_empty(0) if dhidden is None else dhidden,
            hidden.new_empty(0, dtype=torch.float32) if dweight is None else dweight, backward_scale)


_loss_and_grads_op = torch.library.custom_op("fused_remat::linear_cross_entropy_fwd", mutates_args=())(_loss_and_grads)


@_loss_and_grads_op.register_fake
def _(hidden, weight, targets, ignore_index, chunk_tokens, compute_dtype, want_dhidden, want_dweight):
    scalar = hidden.new_empty((), dtype=torch.float32)
    dhidden = torch.empty_like(hidden) if want_dhidden else hidden.new_empty(0)
    dweight = weight.new_empty(weight.shape, dtype=torch.float32) if want_dweight else hidden.new_empty(0, dtype=torch.float32)
    return scalar, dhidden, dweight, torch.empty_like(scalar)


@flop_formula("linear_cross_entropy_fwd")
def _(hidden_shape, weight_shape, targets_shape, ignore_index, chunk_tokens, compute_dtype, want_dhidden,
      want_dweight, **_) -> int:
    """The logits, and the two gradient products the forward makes while it has them (the backward
    only scales what the forward made)."""
    logits = matmul_flops(math.prod(hidden_shape[:-1]), hidden_shape[-1], weight_shape[0])
    return logits * (1 + want_dhidden + want_dweight)


def _setup_loss_context(ctx, inputs, output):
    hidden, weight, *_, want_dhidden, want_dweight = inputs
    _, dhidden, dweight, backward_scale = output
    # Everything kept for backward, in one place: the wanted gradients, short of the factor
    # backward_scale (module docstring), and that factor.
    ctx.save_for_backward(backward_scale, *((dhidden,) if want_dhidden else ()), *((dweight,) if want_dweight else ()))
    ctx.wants, ctx.weight_dtype = (want_dhidden, want_dweight), weight.dtype
    ctx.mark_non_differentiable(dhidden, dweight, backward_scale)


def _loss_backward(ctx, grad_loss, *_):
    if value_checks.PENDING:
        value_checks.raise_arrived()  # before any weight sees a step's NaN gradients
    backward_scale, *kept = ctx.saved_tensors
    scale = grad_loss * backward_scale  # exact (a power of two), and a 0-dim device tensor: no host sync
    want_dhidden, want_dweight = ctx.wants
    dhidden_kept = kept[0] if want_dhidden else None
    dweight_kept = kept[-1] if want_dweight else None
    dhidden = dweight = None
    if dhidden_kept is not None:
        dhidden = dhidden_kept * scale  # computed in fp32, rounded to hidden's dtype
    if dweight_kept is not None:
        if torch.is_grad_enabled():  # create_graph=True: out= cannot record, and first_order_only refuses anyway
            dweight = (dweight_kept * scale).to(ctx.weight_dtype)
        else:  # straight into weight's dtype: one rounding, no second (V, dim) fp32 buffer
            dweight = torch.empty_like(dweight_kept, dtype=ctx.weight_dtype)  # dweight_kept: contiguous
            torch.mul(dweight_kept, scale, out=dweight)
    # The kept gradients are constants: a second derivative through them would be wrong.
    return first_order_only(_OP, dhidden, dweight, None, None, None, None, None, None)


_loss_and_grads_op.register_autograd(_loss_backward, setup_context=_setup_loss_context)


class _Loss(torch.autograd.Function):
    """The operator and its autograd as an eager call runs them, without the dispatcher: the same
    forward, setup and backward, through ``first_output_twin`` (the loss alone is an output;
    ``custom_ops.traced`` calls take the operator)."""

    forward = staticmethod(_loss_and_grads)
    setup_context = staticmethod(_setup_loss_context)
    backward = staticmethod(_loss_backward)


def _validate(hidden, weight, targets, ignore_index, chunk_tokens) -> None:
    check_tensor(_OP, "hidden", hidden)
    check_tensor(_OP, "weight", weight)
    if hidden.dim() == 0:
        raise ValueError(f"{_OP}: hidden must have shape (..., dim), got a scalar")
    if weight.dim() != 2:
        raise ValueError(f"{_OP}: weight must be 2-D (vocab, dim), got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"{_OP}: weight must have at least one row (one vocabulary entry), got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{_OP}: weight's dim {weight.shape[1]} (shape {tuple(weight.shape)}) does not match hidden's last dim "
            f"{hidden.shape[-1]} (shape {tuple(hidden.shape)})"
        )
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{_OP}: targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"{_OP}: targets must be an integer tensor (int64 or int32 class ids), got {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{_OP}: targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    check_same_device(_OP, "hidden", hidden, weight=weight, targets=targets)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{_OP}: ignore_index must be an int, got {ignore_index!r}")
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
            raise TypeError(f"{_OP}: chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
        if chunk_tokens <= 0:
            raise ValueError(f"{_OP}: chunk_tokens must be a positive int or None, got {chunk_tokens}")


def _count_targets(targets: torch.Tensor, vocab: int,
                   ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor, torch.Tensor | None]:
    """PyTorch's step (where the kernels do not run): (the rows that count: bool, not ignore_index
    and in [0, vocab); the ids gather and scatter read, which need one in range on every row: 0
    where a row does not count; how many rows are not ignored; poison or None).

    Outside capture an id out of range raises here, at the cost of one host sync, which also brings
    the count to the host: it would otherwise trip a device-side assert in gather, which leaves the
    CUDA context unusable for the rest of the process. A graph can neither sync nor raise on
    replay, so there the count stays a 0-dim device tensor and the poison is a 0-dim fp32 tensor,
    NaN where some id that is not ignored lies outside [0, vocab), else 0: the loss and every
    gradient are made NaN instead, loud, never silently wrong (the kernels' step does the same with
    ``target_statistics_``, everywhere, and raises once the flag is on the host).
    """
    counted = targets != ignore_index
    if backend.graph_capturing():
        in_range = (targets >= 0) & (targets < vocab)
        poison = torch.where((counted & ~in_range).any(), torch.nan, 0.0)
        n_valid, counted = counted.sum(), counted & in_range
        return counted, torch.where(counted, targets, 0), n_valid, poison
    safe_targets = torch.where(counted, targets, 0)
    if not targets.numel():
        return counted, safe_targets, 0, None
    low, high, n_valid = torch.stack((*safe_targets.aminmax(), counted.sum())).tolist()  # the one host sync
    if low < 0 or high >= vocab:
        raise _out_of_range(targets, vocab, ignore_index)
    return counted, safe_targets, n_valid, None


def _out_of_range(targets: torch.Tensor, vocab: int, ignore_index: int, when: str = "") -> ValueError:
    """The error for targets with ids outside [0, vocab) that are not ignore_index."""
    bad = targets[(targets != ignore_index) & ((targets < 0) | (targets >= vocab))]
    return ValueError(f"{_OP}: targets must be class ids in [0, {vocab}) or ignore_index={ignore_index}; "
                      f"{bad.numel()} are not, e.g. {bad[0].item()}{when}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, without the full logits.

    hidden: (..., dim) fp32, bf16 or fp16; weight: (V, dim), the LM head (tied or not; fp32 master
    weights under autocast are fine); targets: hidden's leading shape, integer class ids in [0, V)
    or ``ignore_index``. Returns a 0-dim fp32 tensor: the mean over targets != ignore_index, the
    value of ``F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=...)``.

    The logits matmuls run in the autocast dtype when autocast is on for hidden's device, else in
    hidden's dtype (weight is cast to it); softmax and loss in fp32. ``chunk_tokens`` rows are done
    at a time (default: ``default_chunk_tokens``). Backward keeps dhidden (hidden's size) and an fp32
    dweight (V x dim), never anything of size T x V; see the module docstring.

    If every target is ignored the loss is 0 with zero gradients, where PyTorch returns NaN (0/0):
    a batch of nothing but padding then leaves the weights alone instead of poisoning them.

    Never waits for the GPU: the target ids are counted and checked by a kernel. An id out of range
    makes the loss and every gradient NaN at once and raises a ValueError as soon as the check's
    flag is on the host: on a CPU tensor in the call itself; on CUDA in the next call, or a backward,
    made once the GPU has done the check (the first step with such an id is NaN, which a trainer
    skipping non-finite steps drops). While a CUDA graph is captured it is NaN only. Where the
    kernels do not run, PyTorch's step costs one host sync instead and raises in the call.
    """
    _validate(hidden, weight, targets, ignore_index, chunk_tokens)
    vocab, dim = weight.shape
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(targets.numel(), vocab, dim)  # targets: hidden's leading shape
    compute_dtype = autocast_dtype(hidden.device.type) or hidden.dtype
    grad = torch.is_grad_enabled()
    args = (hidden, weight, targets.reshape(-1).long(), ignore_index, chunk_tokens, compute_dtype,
            grad and hidden.requires_grad, grad and weight.requires_grad)
    if traced(hidden.device):
        return _loss_and_grads_op(*args)[0]
    return first_output_twin(_Loss).apply_untraced(*args)
