"""linear_cross_entropy against a float64 reference and plain PyTorch in the same dtype; what it keeps."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fused_remat
from fused_remat.loss import default_chunk_tokens
from fused_remat.memory import saved_memory
from numerics import assert_error_rule

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (leading shape, vocab, dim, chunk_tokens): single token and single class, odd and even widths
# (wide enough that the largest error is not one rounding of a handful of elements),
# chunks that divide T (100 | 1000) and that do not (7 in 113, 2 in 3), one-row chunks (kept to
# T = 113: one-row 16-bit matmuls are slow on CPU), and the default heuristic on a vocabulary larger than T.
CASES = [
    ((1,), 1, 8, None),
    ((1,), 7, 37, None),
    ((3,), 7, 16, 2),
    ((3,), 256, 33, None),
    ((113,), 1000, 33, 7),
    ((113,), 5003, 64, None),
    ((1000,), 256, 128, 100),
    ((113,), 1000, 63, 1),
    ((1000,), 5003, 64, None),
]


def _inputs(leading, vocab, dim, dtype, weight_dtype=None, ignore_fraction=0.1):
    """Logits of standard deviation ~2 (peaked softmax rows) and some ignored targets once T >= 8."""
    hidden = torch.randn(*leading, dim).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim) * 2 / math.sqrt(dim)).to(weight_dtype or dtype).requires_grad_()
    targets = torch.randint(0, vocab, leading)
    if math.prod(leading) >= 8:
        targets[torch.rand(leading) < ignore_fraction] = -100
    return hidden, weight, targets


def _leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _eager(hidden, weight, targets, **kwargs):
    """What linear_cross_entropy computes, in eager PyTorch: the matmul in the inputs' dtype, the
    softmax in fp32 (or fp64 for the reference). It is the stricter peer: PyTorch's cross-entropy
    on 16-bit logits adds a rounding, which on a handful of tokens now and then cancels the logits'
    rounding by luck, but on average only loses digits."""
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten().long(), **kwargs)


def _loss_and_grads(fn, hidden, weight, targets, grad_loss, **kwargs):
    loss = fn(hidden, weight, targets, **kwargs)
    return (loss, *torch.autograd.grad(loss, [hidden, weight], grad_loss))


def _assert_matches_references(hidden, weight, targets, dtype, grad_loss, **kwargs):
    """Ours vs float64, within 2x of eager PyTorch on the same inputs (leaves cast as given)."""
    ours = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, grad_loss, **kwargs)
    kwargs.pop("chunk_tokens", None)
    torch_same_dtype = _loss_and_grads(_eager, *_leaves(hidden, weight), targets, grad_loss, **kwargs)
    reference64 = _loss_and_grads(_eager, *_leaves(hidden, weight, dtype=torch.float64), targets, grad_loss, **kwargs)
    assert ours[0].dtype == torch.float32 and ours[0].shape == ()
    assert ours[1].dtype == hidden.dtype and ours[2].dtype == weight.dtype
    for name, a, b, r in zip(["loss", "dhidden", "dweight"], ours, torch_same_dtype, reference64):
        assert_error_rule(name, a, b, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("leading, vocab, dim, chunk_tokens", CASES)
def test_matches_float64_reference(leading, vocab, dim, chunk_tokens, dtype):
    hidden, weight, targets = _inputs(leading, vocab, dim, dtype)
    _assert_matches_references(hidden, weight, targets, dtype, torch.tensor(1.0), chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_incoming_gradient_scales_the_gradients(dtype):
    """A power of two (a loss scale) scales exactly: no second rounding. Only where the unscaled
    gradient is subnormal (fp16) does it differ, having lost digits: what a loss scale is for.
    Any other factor stays within the error rule."""
    hidden, weight, targets = _inputs((300,), 700, 48, dtype)
    at_one = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0))
    at_loss_scale = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1024.0))
    for unscaled, scaled in zip(at_one[1:], at_loss_scale[1:]):
        normal = unscaled.abs() > torch.finfo(dtype).tiny  # at tiny itself it may have been rounded up to it
        assert torch.equal(unscaled[normal] * 1024, scaled[normal])
    _assert_matches_references(hidden, weight, targets, dtype, torch.tensor(0.3))


def test_ignore_index_inside_the_vocabulary():
    hidden, weight, targets = _inputs((200,), 50, 24, torch.float32, ignore_fraction=0.0)
    targets[::3] = 7  # a real class id used as ignore_index: those rows must not count
    _assert_matches_references(hidden, weight, targets, torch.float32, torch.tensor(1.0), ignore_index=7, chunk_tokens=16)
    dhidden, = torch.autograd.grad(fused_remat.linear_cross_entropy(hidden, weight, targets, ignore_index=7), hidden)
    assert (dhidden[targets == 7] == 0).all()


def test_every_target_ignored_gives_zero_loss_and_zero_gradients():
    """A deliberate difference: PyTorch's mean over no targets is 0/0 = NaN."""
    hidden, weight, _ = _inputs((17,), 30, 8, torch.float32)
    targets = torch.full((17,), -100)
    assert torch.isnan(_eager(hidden, weight, targets))
    loss, dhidden, dweight = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0))
    assert loss.item() == 0.0
    assert not dhidden.any() and not dweight.any()
    with torch.no_grad():
        assert fused_remat.linear_cross_entropy(hidden, weight, targets).item() == 0.0


def _capturing(monkeypatch):
    """What the loss sees while a CUDA graph is being captured (bench.host.host_read_guard does the same)."""
    from fused_remat import backend

    monkeypatch.setattr(backend, "graph_capturing", lambda: True)


@pytest.mark.parametrize("leading, ignored", [((113,), 0.1), ((2, 9), 0.0), ((17,), 1.0)])
def test_capture_form_gives_the_eager_loss_and_gradients_bit_for_bit(monkeypatch, leading, ignored):
    """Under capture the counts and scales stay on the device; the values must not move."""
    hidden, weight, targets = _inputs(leading, 300, 24, torch.float32, ignore_fraction=ignored)
    grad_loss = torch.tensor(0.75)
    eager = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, grad_loss, chunk_tokens=8)
    _capturing(monkeypatch)
    captured = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, grad_loss, chunk_tokens=8)
    for name, a, b in zip(["loss", "dhidden", "dweight"], eager, captured):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bad", [11, -1])
def test_capture_form_makes_an_out_of_range_target_a_nan_step_not_an_error(monkeypatch, bad):
    """A graph cannot raise on replay: the loss and every gradient are NaN (a loud step that a trainer
    skipping non-finite steps drops), and no id out of range reaches gather."""
    hidden, weight, _ = _inputs((6,), 11, 4, torch.float32)
    targets = torch.tensor([0, 1, bad, 2, -100, 4])
    _capturing(monkeypatch)
    loss, dhidden, dweight = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets,
                                             torch.tensor(1.0))
    assert torch.isnan(loss) and torch.isnan(dhidden).all() and torch.isnan(dweight).all()


@pytest.mark.parametrize("valid, ignored, outside", [
    (0, 0, 0), (0, 5, 0), (1, 0, 0), (3, 2, 0), (7, 0, 0), (1000, 13, 0), (4097, 1, 0), (12345, 0, 0),
    (5, 3, 1), (4100, 0, 2),
])
def test_target_statistics_are_the_hosts_count_and_scales_bit_for_bit(valid, ignored, outside):
    """The kernel's count, scales and divisor are what the host computes from the count (in
    Python's doubles, rounded to fp32 where used), past one 4096-target step too; a target outside
    the vocabulary makes them NaN and raises the flag."""
    from fused_remat.custom_ops import kernels
    from fused_remat.loss import _split_mean_scale

    step, vocab = kernels.cross_entropy, 97
    targets = torch.cat([torch.randint(0, vocab, (valid,)), torch.full((ignored,), -100),
                         torch.tensor([vocab, -3])[:outside]])
    targets = targets[torch.randperm(len(targets))]
    stats, backward_scale = torch.full((step.STATISTICS,), 7.0), torch.tensor(7.0)
    step.target_statistics_(targets, vocab, -100, stats, backward_scale)
    if outside:
        assert stats[step.OUT_OF_RANGE] == 1.0
        assert stats[[step.FORWARD_SCALE, step.DIVISOR]].isnan().all() and backward_scale.isnan()
        return
    forward, backward = _split_mean_scale(valid + outside, torch.device("cpu"))
    assert stats[step.OUT_OF_RANGE] == 0.0
    assert stats[step.FORWARD_SCALE] == torch.tensor(forward, dtype=torch.float32)
    assert torch.equal(backward_scale, backward)
    assert stats[step.DIVISOR] == torch.tensor(max(valid, 1), dtype=torch.float32)


def test_on_a_gpu_an_out_of_range_target_is_a_nan_step_then_an_error_once_its_check_arrives(checked_later):
    """No call waits for the check: the step comes out NaN, and the next call (or backward) after the
    check reaches the host raises, naming the earlier call; a check that passed is dropped silently."""
    hidden, weight, targets = _inputs((12,), 50, 8, torch.float32)
    bad = targets.clone()
    bad[3] = 50
    loss = fused_remat.linear_cross_entropy(hidden, weight, bad)
    assert loss.isnan()
    loss.backward()  # the check has not arrived
    assert hidden.grad.isnan().all() and weight.grad.isnan().all()
    checked_later.append(True)
    with pytest.raises(ValueError, match=r"^linear_cross_entropy: targets must be class ids in \[0, 50\) or "
                                         r"ignore_index=-100; 1 are not, e.g. 50 \(given to an earlier call"):
        fused_remat.linear_cross_entropy(hidden, weight, targets)
    assert torch.isfinite(fused_remat.linear_cross_entropy(hidden, weight, targets))  # raised once


def test_on_a_gpu_the_backward_raises_for_a_check_that_arrived_before_it(checked_later):
    hidden, weight, targets = _inputs((12,), 50, 8, torch.float32)
    fused_remat.linear_cross_entropy(hidden, weight, targets)  # passes, whenever it arrives
    targets[5] = -7
    loss = fused_remat.linear_cross_entropy(hidden, weight, targets)
    checked_later.append(True)
    with pytest.raises(ValueError, match=r"1 are not, e.g. -7 \(given to an earlier call"):
        loss.backward()
    assert hidden.grad is None and weight.grad is None


def test_on_a_gpu_the_loss_reads_no_value_on_the_host_outside_capture_either(checked_later):
    """The CUDA path outside capture (its pinned copy stood in for) runs forward and backward under
    the guard that fails on any host read (``bench.host.host_read_guard``), valid targets or not."""
    from bench.host import host_read_guard

    hidden, weight, targets = _inputs((40,), 50, 8, torch.float32)
    bad = targets.clone()
    bad[9] = 50
    for ids in (targets, bad):
        with host_read_guard(capturing=False):
            loss = fused_remat.linear_cross_entropy(hidden, weight, ids, chunk_tokens=16)
            loss.backward()
    assert loss.isnan()


def test_no_tokens_give_zero_loss_and_zero_gradients():
    hidden, weight, targets = _inputs((0,), 11, 8, torch.float32)
    loss, dhidden, dweight = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0))
    assert loss.item() == 0 and dhidden.shape == (0, 8) and torch.equal(dweight, torch.zeros_like(weight))


def test_strided_targets_give_the_contiguous_result():
    hidden, weight, targets = _inputs((37,), 300, 24, torch.float32)
    strided = torch.stack((targets, torch.zeros_like(targets)), dim=1)[:, 0]  # stride 2
    assert strided.stride() == (2,)
    ours = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, strided, torch.tensor(1.0))
    contiguous = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0))
    for a, b in zip(ours, contiguous):
        assert torch.equal(a, b)


def test_int32_targets_give_the_same_result():
    hidden, weight, targets = _inputs((300,), 100, 32, torch.float32)
    as_int64 = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0))
    as_int32 = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets.int(), torch.tensor(1.0))
    for a, b in zip(as_int64, as_int32):
        assert torch.equal(a, b)


def test_leading_batch_dims():
    hidden, weight, targets = _inputs((2, 3, 37), 257, 48, torch.bfloat16)
    _assert_matches_references(hidden, weight, targets, torch.bfloat16, torch.tensor(1.0), chunk_tokens=20)
    flat = _loss_and_grads(fused_remat.linear_cross_entropy, *_leaves(hidden.reshape(-1, 48), weight),
                           targets.flatten(), torch.tensor(1.0), chunk_tokens=20)
    batched = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0), chunk_tokens=20)
    assert batched[1].shape == hidden.shape
    assert torch.equal(batched[0], flat[0])
    assert torch.equal(batched[1].reshape(-1, 48), flat[1])
    assert torch.equal(batched[2], flat[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_size_does_not_change_the_result(dtype):
    hidden, weight, targets = _inputs((97,), 300, 40, dtype)
    results = [_loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0), chunk_tokens=c)
               for c in (1, 10, 97, 1000, None)]
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item())


def test_gradients_are_deterministic():
    hidden, weight, targets = _inputs((150,), 400, 32, torch.bfloat16)
    first = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0), chunk_tokens=16)
    second = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0), chunk_tokens=16)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_autocast_bf16_with_fp32_master_weights():
    hidden, weight, targets = _inputs((2, 150), 1000, 64, torch.float32)
    grad_loss = torch.tensor(1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, grad_loss)
        torch_autocast = _loss_and_grads(_eager, *_leaves(hidden, weight), targets, grad_loss)
    reference64 = _loss_and_grads(_eager, *_leaves(hidden, weight, dtype=torch.float64), targets, grad_loss)
    assert [t.dtype for t in ours] == [torch.float32] * 3
    for name, a, b, r in zip(["loss", "dhidden", "dweight"], ours, torch_autocast, reference64):
        assert_error_rule(name, a, b, r, torch.bfloat16)


def test_16bit_hidden_with_fp32_weight_computes_in_hiddens_dtype():
    hidden, weight, targets = _inputs((120,), 500, 32, torch.bfloat16, weight_dtype=torch.float32)
    ours = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, torch.tensor(1.0))
    assert ours[1].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    torch_bf16 = _loss_and_grads(_eager, *_leaves(hidden, weight, dtype=torch.bfloat16), targets, torch.tensor(1.0))
    reference64 = _loss_and_grads(_eager, *_leaves(hidden, weight, dtype=torch.float64), targets, torch.tensor(1.0))
    for name, a, b, r in zip(["loss", "dhidden", "dweight"], ours, torch_bf16, reference64):
        assert_error_rule(name, a, b, r, torch.bfloat16)


def test_tied_weights_get_both_gradients():
    vocab, dim = 120, 24
    ids = torch.randint(0, vocab, (3, 40))
    targets = torch.randint(0, vocab, (3, 40))
    embedding = (torch.randn(vocab, dim) * 0.5).requires_grad_()

    def model_loss(weight, head):
        hidden = torch.tanh(F.embedding(ids, weight)) * 1.5
        return head(hidden, weight, targets)

    ours_weight, eager_weight = _leaves(embedding, embedding)
    model_loss(ours_weight, lambda h, w, t: fused_remat.linear_cross_entropy(h, w, t, chunk_tokens=13)).backward()
    model_loss(eager_weight, _eager).backward()
    head_only, = _leaves(embedding)
    _eager(torch.tanh(F.embedding(ids, embedding.detach())) * 1.5, head_only, targets).backward()
    assert (eager_weight.grad - head_only.grad).abs().max() > 1e-3  # the embedding's share is really there
    torch.testing.assert_close(ours_weight.grad, eager_weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hidden_dtype, weight_dtype, autocast", [
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.float32, False),
    (torch.float16, torch.float32, False),
    (torch.float32, torch.float32, True),  # the bf16 copy of the weight is not kept either
], ids=str)
@pytest.mark.parametrize("needs", ["both", "hidden", "weight"])
def test_saved_memory_is_dhidden_and_fp32_dweight_never_logits(hidden_dtype, weight_dtype, autocast, needs):
    tokens, vocab, dim = 96, 700, 40
    hidden, weight, targets = _inputs((tokens,), vocab, dim, hidden_dtype, weight_dtype)
    hidden.requires_grad_(needs in ("both", "hidden"))
    weight.requires_grad_(needs in ("both", "weight"))
    with saved_memory(exclude=[weight]) as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fused_remat.linear_cross_entropy(hidden, weight, targets, chunk_tokens=32)
    expected = {(torch.float32, ()): 4}  # the power-of-two backward scale, a 0-dim device tensor
    if hidden.requires_grad:
        expected[(hidden_dtype, (tokens, dim))] = tokens * dim * hidden_dtype.itemsize
    if weight.requires_grad:
        expected[(torch.float32, (vocab, dim))] = vocab * dim * 4
    assert meter.breakdown() == expected, meter.report()
    assert meter.bytes == sum(expected.values()) < tokens * vocab * 2
    loss.backward()


def test_nothing_saved_without_grad():
    hidden, weight, targets = _inputs((64,), 300, 16, torch.float32)
    with_grad = fused_remat.linear_cross_entropy(hidden, weight, targets)
    with torch.no_grad(), saved_memory(exclude=[weight]) as meter:
        loss = fused_remat.linear_cross_entropy(hidden, weight, targets)
    assert meter.bytes == 0 and loss.grad_fn is None
    assert torch.equal(loss, with_grad.detach())
    with saved_memory() as meter:
        loss = fused_remat.linear_cross_entropy(hidden.detach(), weight.detach(), targets)
    assert meter.bytes == 0 and loss.grad_fn is None


def test_default_chunk_tokens():
    assert default_chunk_tokens(4096, 50257, 768) == 64        # ceil(4096 / 66) = 63, rounded up to 64
    assert default_chunk_tokens(65536, 128256, 4096) == 2048   # ceil(V / dim) = 32
    assert default_chunk_tokens(1000, 256, 128) == 512         # V / dim = 2: 500 rows, rounded up to 512
    assert default_chunk_tokens(100, 64, 128) == 100           # a vocabulary narrower than hidden: one chunk
    assert default_chunk_tokens(5, 50257, 768) == 5            # never more than T
    assert default_chunk_tokens(0, 10, 10) == 1                # never less than 1


def _bad(**overrides):
    hidden, weight, targets = _inputs((6,), 11, 4, torch.float32, ignore_fraction=0.0)
    args = {"hidden": hidden, "weight": weight, "targets": targets}
    args.update(overrides)
    return args


ERRORS = [
    (lambda: _bad(hidden=[1.0, 2.0]), TypeError, "hidden must be a torch.Tensor"),
    (lambda: _bad(hidden=torch.ones(6, 4, dtype=torch.int64)), TypeError, "hidden must be a floating-point tensor"),
    (lambda: _bad(hidden=torch.ones(6, 4, dtype=torch.float64)), TypeError, "hidden has dtype torch.float64"),
    (lambda: _bad(hidden=torch.tensor(1.0), targets=torch.tensor(1)), ValueError, "hidden must have shape (..., dim)"),
    (lambda: _bad(weight=None), TypeError, "weight must be a torch.Tensor, got NoneType"),
    (lambda: _bad(weight=torch.ones(11, 4, dtype=torch.int32)), TypeError, "weight must be a floating-point tensor"),
    (lambda: _bad(weight=torch.ones(11 * 4)), ValueError, "weight must be 2-D"),
    (lambda: _bad(weight=torch.ones(0, 4)), ValueError, "weight must have at least one row"),
    (lambda: _bad(weight=torch.ones(11, 5)), ValueError, "weight's dim 5"),
    (lambda: _bad(targets=[1, 2, 3, 4, 5, 6]), TypeError, "targets must be a torch.Tensor"),
    (lambda: _bad(targets=torch.ones(6)), TypeError, "targets must be an integer tensor"),
    (lambda: _bad(targets=torch.ones(6, dtype=torch.bool)), TypeError, "targets must be an integer tensor"),
    (lambda: _bad(targets=torch.ones(3, 2, dtype=torch.int64)), ValueError, "targets must have hidden's leading shape (6,)"),
    (lambda: _bad(targets=torch.ones(6, 1, dtype=torch.int64)), ValueError, "targets must have hidden's leading shape (6,)"),
    (lambda: _bad(weight=torch.ones(11, 4, device="meta")), ValueError, "weight is on meta but hidden is on cpu"),
    (lambda: _bad(targets=torch.ones(6, dtype=torch.int64, device="meta")), ValueError, "targets is on meta but hidden is on cpu"),
    (lambda: _bad(targets=torch.tensor([0, 1, 11, 2, 3, 4])), ValueError, "targets must be class ids in [0, 11) or ignore_index=-100; 1 are not, e.g. 11"),
    (lambda: _bad(targets=torch.tensor([0, -1, 1, 2, -100, 4])), ValueError, "1 are not, e.g. -1"),
    (lambda: _bad(targets=torch.tensor([0, -100, 1, 2, 3, 4]), ignore_index=0), ValueError, "1 are not, e.g. -100"),
    (lambda: _bad(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (lambda: _bad(chunk_tokens=0), ValueError, "chunk_tokens must be a positive int or None, got 0"),
    (lambda: _bad(chunk_tokens=-4), ValueError, "chunk_tokens must be a positive int or None, got -4"),
    (lambda: _bad(chunk_tokens=2.0), TypeError, "chunk_tokens must be a positive int or None, got 2.0"),
]


@pytest.mark.parametrize("make_args, error, message", ERRORS, ids=[f"{i}-{e[2][:40]}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument(make_args, error, message):
    with pytest.raises(error, match=f"^linear_cross_entropy: .*{re.escape(message)}"):
        fused_remat.linear_cross_entropy(**make_args())


@pytest.mark.gpu
def test_cuda_loss_never_waits_for_the_gpu_and_reports_a_bad_target_once_checked():
    """torch.cuda's sync debug mode raises on any call that waits for the GPU (``.item()``, a
    blocking copy to the host): the loss's forward and backward make none, valid targets or not."""
    hidden, weight, targets = (t.cuda() for t in _inputs((300,), 1000, 64, torch.bfloat16))
    hidden, weight = _leaves(hidden, weight)
    bad = targets.clone()
    bad[7] = 1000
    fused_remat.linear_cross_entropy(hidden, weight, targets).backward()  # its kernels compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in (targets, bad):
            loss = fused_remat.linear_cross_entropy(hidden, weight, ids)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.isnan() and hidden.grad.isnan().any()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"1 are not, e.g. 1000 \(given to an earlier call"):
        fused_remat.linear_cross_entropy(hidden, weight, targets)


@pytest.mark.gpu
def test_cuda_bf16_gpt2_head_matches_reference_and_never_holds_the_logits():
    tokens, vocab, dim = 4096, 50257, 768
    hidden = torch.randn(tokens, dim, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, dim, device="cuda") * 2 / math.sqrt(dim)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    targets[torch.rand(tokens, device="cuda") < 0.05] = -100
    grad_loss = torch.tensor(1.0, device="cuda")

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours = _loss_and_grads(fused_remat.linear_cross_entropy, hidden, weight, targets, grad_loss)
    torch.cuda.synchronize()
    peak_above_baseline = torch.cuda.max_memory_allocated() - baseline
    logits_bytes = tokens * vocab * 4
    # What stays is weight-sized (fp32 dweight, one 16-bit partial product, the returned bf16
    # dweight) plus one chunk of logits: about a third of the fp32 logits at GPT-2's shape.
    assert peak_above_baseline < logits_bytes / 2, f"peak {peak_above_baseline / 2**20:.0f} MiB vs logits {logits_bytes / 2**20:.0f} MiB"

    torch_bf16 = _loss_and_grads(_eager, *_leaves(hidden, weight), targets, grad_loss)
    reference64 = _loss_and_grads(_eager, *_leaves(hidden, weight, dtype=torch.float64), targets, grad_loss)
    for name, a, b, r in zip(["loss", "dhidden", "dweight"], ours, torch_bf16, reference64):
        assert_error_rule(name, a, b, r, torch.bfloat16)
