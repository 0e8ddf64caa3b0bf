"""The fused TransformerBlock against the plain-PyTorch reference block, and its memory contract."""

import copy
import itertools
import re

import pytest
import torch

import fused_remat
from fused_remat import reference
from fused_remat.block import block_widths
from fused_remat.memory import saved_memory
from fused_remat.remat import kept_bytes_per_token
from numerics import assert_error_rule

POLICIES = ("none", "cheap", "selective", "full")
DIM, HEADS, FFN = 32, 2, 48  # head dim 16: the smallest the attention kernels tile without padding


def _config(norm="layernorm", activation="gelu", bias=True, kv_heads=HEADS, rope=False, causal=True, dim=DIM, heads=HEADS, ffn=FFN):
    return dict(norm=norm, activation=activation, bias=bias, n_kv_heads=kv_heads, causal=causal,
                rope_theta=10000.0 if rope else None, ffn_dim=ffn, dim=dim, n_heads=heads)


def _reference_block(config, device, dtype=torch.float32):
    config = dict(config)
    block = reference.TransformerBlock(config.pop("dim"), config.pop("n_heads"), device=device, **config)
    with torch.no_grad():  # norm weights and biases away from their 1/0 defaults, so their gradients matter
        for name, param in block.named_parameters():
            if name.startswith("norm"):
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn_like(param))
    return block.to(dtype)


def _fused_block(ref_block, config, remat):
    config = dict(config)
    block = fused_remat.TransformerBlock(
        config.pop("dim"), config.pop("n_heads"), remat=remat, device=ref_block.qkv.weight.device,
        dtype=ref_block.qkv.weight.dtype, **config,
    )
    block.load_state_dict(ref_block.state_dict())
    return block


def _run(block, x, dy):
    """Output and gradients of (x, every parameter) for output gradient dy."""
    x = x.detach().clone().requires_grad_()
    y = block(x)
    params = [p for _, p in block.named_parameters()]
    grads = torch.autograd.grad(y, [x, *params], dy)
    names = ["x"] + [name for name, _ in block.named_parameters()]
    return y.detach(), dict(zip(names, grads))


def _check_block(config, batch, seq, dtype, device, policies=POLICIES):
    ref32 = _reference_block(config, device)
    x = torch.randn(batch, seq, config["dim"], device=device)
    dy = torch.randn(batch, seq, config["dim"], device=device)

    y64, grads64 = _run(copy.deepcopy(ref32).double(), x.double(), dy.double())
    same = ref32.to(dtype)
    y_same, grads_same = _run(same, x.to(dtype), dy.to(dtype))
    metric = "max" if dtype == torch.float32 else "rms"  # see numerics.assert_error_rule
    results = {}
    for policy in policies:
        y, grads = _run(_fused_block(same, config, policy), x.to(dtype), dy.to(dtype))
        assert y.dtype == dtype and y.shape == x.shape
        assert_error_rule(f"{policy} y", y, y_same, y64, dtype, metric)
        assert grads.keys() == grads64.keys()
        for name, grad in grads.items():
            assert grad.dtype == dtype, name
            assert_error_rule(f"{policy} d{name}", grad, grads_same[name], grads64[name], dtype, metric)
        results[policy] = (y, grads)
    return results


def _assert_policies_agree(results):
    """Same kernels on the same inputs: rebuilt intermediates equal kept ones, so every policy gives
    the same bits."""
    (first, (y0, grads0)), *others = results.items()
    for policy, (y, grads) in others:
        assert torch.equal(y, y0), f"{policy} output differs from {first}"
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), f"{policy} d{name} differs from {first}"


SWEEP = [
    dict(norm=norm, activation=act, bias=bias, kv_heads=kv, rope=rope, causal=causal, batch=b, seq=n)
    for norm, act, bias, kv, rope, causal, (b, n) in itertools.product(
        ("layernorm", "rmsnorm"), ("gelu", "gelu_tanh", "swiglu"), (True, False), (HEADS, 1), (False, True),
        (True, False), ((3, 1), (2, 17), (1, 130)),
    )
]


def _sweep_id(case):
    kv = "mha" if case["kv_heads"] == HEADS else "gqa"
    return (f"{case['norm']}-{case['activation']}-{'bias' if case['bias'] else 'nobias'}-{kv}-"
            f"{'rope' if case['rope'] else 'norope'}-{'causal' if case['causal'] else 'full'}-{case['batch']}x{case['seq']}")


@pytest.mark.parametrize("case", SWEEP, ids=_sweep_id)
def test_block_matches_reference_for_every_policy(case, device, triton_backend):
    case = dict(case)
    batch, seq = case.pop("batch"), case.pop("seq")
    results = _check_block(_config(**case), batch, seq, torch.float32, device)
    _assert_policies_agree(results)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [
    dict(norm="layernorm", activation="gelu", kv_heads=HEADS, rope=False),
    dict(norm="rmsnorm", activation="swiglu", kv_heads=1, rope=True, bias=False),
], ids=["gpt", "llama"])
def test_block_in_half_precision(case, dtype, device, triton_backend):
    results = _check_block(_config(**case), 2, 33, dtype, device)
    _assert_policies_agree(results)


# ------------------------------------------------------------------------------------------------
# Memory contract (docs/design.md, fused_remat.remat): bytes autograd keeps per token, from the difference of two lengths.
# ------------------------------------------------------------------------------------------------

MEMORY_DIM, MEMORY_HEADS, MEMORY_KV, MEMORY_FFN = 64, 4, 2, 96


def _saved_bytes(block, batch, seq, dtype, device):
    x = torch.randn(batch, seq, block.dim, device=device, dtype=dtype, requires_grad=True)
    with saved_memory() as meter:
        block(x)
    return meter.bytes


def _bytes_per_token(block, dtype, device, batch=2, lengths=(16, 40)):
    short, long = (_saved_bytes(block, batch, n, dtype, device) for n in lengths)
    per_token, remainder = divmod(long - short, batch * (lengths[1] - lengths[0]))
    assert remainder == 0, "saved bytes must grow by whole tokens"
    return per_token


def test_the_block_table_is_design_md_contract():
    """docs/design.md's figures for a GPT-style block (MHA, LayerNorm, GELU, F = 4h, bf16): 32h bytes per
    token for ``none``, 20h for ``cheap``, 4h for ``selective`` (x and the attention output), 2h for
    ``full``, plus the fp32 lse (4 per head) and the statistics (8 per LayerNorm)."""
    h, heads = 768, 12
    widths = block_widths(h, heads, None, None, "layernorm", "gelu")
    kept = {policy: kept_bytes_per_token(policy, widths, residual_bytes=2, compute_bytes=2) for policy in POLICIES}
    assert kept == {"none": 32 * h + 4 * heads + 16, "cheap": 20 * h + 4 * heads + 16, "selective": 4 * h + 4 * heads,
                    "full": 2 * h}
    # Under autocast x and h stay in fp32: two more bytes each, and only those.
    assert kept_bytes_per_token("cheap", widths, residual_bytes=4, compute_bytes=2) == kept["cheap"] + 2 * 2 * h
    with pytest.raises(ValueError, match="policy must be one of"):
        kept_bytes_per_token("some", widths, 2, 2)


def _contract(policy, norm, activation):
    widths = block_widths(MEMORY_DIM, MEMORY_HEADS, MEMORY_KV, MEMORY_FFN, norm, activation)
    return kept_bytes_per_token(policy, widths, residual_bytes=2, compute_bytes=2)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("norm,activation", [("layernorm", "gelu"), ("rmsnorm", "swiglu")])
def test_saved_bytes_per_token_follow_the_contract(policy, norm, activation, device, triton_backend):
    dtype = torch.bfloat16
    config = _config(norm=norm, activation=activation, kv_heads=MEMORY_KV, rope=activation == "swiglu",
                     dim=MEMORY_DIM, heads=MEMORY_HEADS, ffn=MEMORY_FFN)
    block = _fused_block(_reference_block(config, device, dtype), config, policy)
    assert _bytes_per_token(block, dtype, device) == _contract(policy, norm, activation)


def test_policy_none_keeps_what_the_reference_block_keeps(device, triton_backend):
    dtype = torch.bfloat16
    config = _config(kv_heads=MEMORY_KV, dim=MEMORY_DIM, heads=MEMORY_HEADS, ffn=MEMORY_FFN)
    ref = _reference_block(config, device, dtype)
    ours = _bytes_per_token(_fused_block(ref, config, "none"), dtype, device)
    theirs = _bytes_per_token(ref, dtype, device)
    assert abs(ours - theirs) <= 0.1 * theirs, (ours, theirs)


def test_no_grad_and_frozen_blocks_save_nothing(device, triton_backend):
    config = _config()
    block = _fused_block(_reference_block(config, device), config, "cheap")
    x = torch.randn(2, 9, DIM, device=device)
    with saved_memory() as meter, torch.no_grad():
        block(x.requires_grad_())
    assert meter.bytes == 0, meter.report()
    block.requires_grad_(False)
    with saved_memory() as meter:
        y = block(x.detach())
    assert meter.bytes == 0 and not y.requires_grad, meter.report()


# ------------------------------------------------------------------------------------------------
# Precision modes, gradient flow, state dicts
# ------------------------------------------------------------------------------------------------


def _autocast_case(device_type, device):
    """fp32 parameters and input under bf16 autocast, ours against the reference under the same
    autocast, both against float64."""
    config = _config(norm="rmsnorm", activation="swiglu", kv_heads=1, rope=True)
    ref = _reference_block(config, device)
    x = torch.randn(2, 21, DIM, device=device)
    dy = torch.randn_like(x)
    y64, grads64 = _run(copy.deepcopy(ref).double(), x.double(), dy.double())
    with torch.autocast(device_type, dtype=torch.bfloat16):
        y_same, grads_same = _run(ref, x, dy)
        for policy in POLICIES:
            y, grads = _run(_fused_block(ref, config, policy), x, dy)
            assert y.dtype == y_same.dtype == torch.float32
            assert_error_rule(f"{policy} y", y, y_same, y64, torch.bfloat16, "rms")
            for name, grad in grads.items():
                assert grad.dtype == torch.float32, name
                assert_error_rule(f"{policy} d{name}", grad, grads_same[name], grads64[name], torch.bfloat16, "rms")


def test_autocast_with_fp32_parameters(device, triton_backend):
    _autocast_case(device.type, device)


def test_every_parameter_gets_a_gradient(device, triton_backend):
    """.backward() fills every parameter's .grad with the reference block's gradient (same state
    dict), within the error rule against float64."""
    config = _config(norm="layernorm", activation="swiglu", kv_heads=1, rope=True)
    ref = _reference_block(config, device)
    block = _fused_block(ref, config, "cheap")
    x = torch.randn(2, 7, DIM, device=device)
    dy = torch.randn_like(x)
    block(x).backward(dy)
    _, grads_same = _run(ref, x, dy)
    _, grads64 = _run(copy.deepcopy(ref).double(), x.double(), dy.double())
    assert {name for name, _ in block.named_parameters()} == grads64.keys() - {"x"}
    for name, param in block.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert_error_rule(f"d{name}", param.grad, grads_same[name], grads64[name], torch.float32)


def test_frozen_parameters_get_no_gradient_and_the_rest_still_match(device, triton_backend):
    config = _config()
    ref = _reference_block(config, device)
    ours = _fused_block(ref, config, "cheap")
    for block in (ref, ours):
        block.qkv.requires_grad_(False)
        block.norm2.requires_grad_(False)
    x = torch.randn(2, 5, DIM, device=device, requires_grad=True)
    ours(x).sum().backward()
    assert ours.qkv.weight.grad is None and ours.norm2.weight.grad is None
    expected = torch.autograd.grad(ref(x).sum(), [ref.fc1.weight, x])
    torch.testing.assert_close(ours.fc1.weight.grad, expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, expected[1], rtol=1e-4, atol=1e-5)


def test_the_output_is_its_own_tensor_and_takes_in_place_ops(device, triton_backend):
    """y is a (B, N, dim) tensor of its own, not a view of the block's (T, dim) product (a view
    returned by an autograd Function refuses in-place ops): an op in place on it differentiates as on
    any tensor. A non-contiguous x gives what its contiguous copy gives."""
    config = _config()
    block = _fused_block(_reference_block(config, device), config, "cheap")
    x = torch.randn(2, 5, DIM, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    y = block(x)
    assert y._base is None and y.shape == x.shape and y.is_contiguous()
    (dx,) = torch.autograd.grad(y, x, 3.0 * dy)
    scaled = block(x)
    scaled.mul_(3.0)
    assert torch.equal(scaled, 3.0 * y)
    (dx_scaled,) = torch.autograd.grad(scaled, x, dy)
    assert torch.equal(dx_scaled, dx)

    rows_first = torch.randn(5, 2, DIM, device=device, requires_grad=True)
    transposed = rows_first.transpose(0, 1)
    assert not transposed.is_contiguous()
    copied = rows_first.detach().transpose(0, 1).contiguous().requires_grad_()
    y_transposed, y_copied = block(transposed), block(copied)
    assert torch.equal(y_transposed, y_copied)
    (d_rows_first,) = torch.autograd.grad(y_transposed, rows_first, dy)
    (d_copied,) = torch.autograd.grad(y_copied, copied, dy)
    assert torch.equal(d_rows_first.transpose(0, 1), d_copied)


def test_state_dicts_move_both_ways(device):
    config = _config(norm="rmsnorm", activation="swiglu", kv_heads=1, rope=True, bias=False)
    ref = _reference_block(config, device)
    ours = _fused_block(ref, config, "full")
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, ref.state_dict()[key]) and value.shape == ref.state_dict()[key].shape
    back = _reference_block(config, device)
    back.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))


def test_from_reference_shares_weights_and_computes_the_same(device, triton_backend):
    config = _config(norm="rmsnorm", activation="swiglu", kv_heads=1, rope=True)
    ref = _reference_block(config, device)
    ref.fc2.requires_grad_(False)
    ours = fused_remat.TransformerBlock.from_reference(ref, remat="full")
    assert ours.remat == "full" and ours.config() == ref.config()
    for (name, mine), theirs in zip(ours.named_parameters(), ref.parameters()):
        assert mine.data_ptr() == theirs.data_ptr() and mine.requires_grad == theirs.requires_grad, name
    x = torch.randn(2, 9, DIM, device=device)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-5)


def test_default_widths():
    assert fused_remat.TransformerBlock(64, 4, device="meta").ffn_dim == 256
    llama = fused_remat.TransformerBlock(4096, 32, activation="swiglu", device="meta")
    assert llama.ffn_dim == 11008 and llama.fc1.weight.shape == (2 * 11008, 4096)


def test_reference_backend_runs_the_reference_math(device, monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    config = _config(rope=True)
    ref = _reference_block(config, device)
    x = torch.randn(2, 6, DIM, device=device)
    for policy in POLICIES:
        torch.testing.assert_close(_fused_block(ref, config, policy)(x), ref(x), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Bad configuration and input
# ------------------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(dim=30, n_heads=4), "dim=30 is not divisible by n_heads=4"),
    (dict(dim=32, n_heads=4, n_kv_heads=3), "multiple of n_kv_heads=3"),
    (dict(dim=1024, n_heads=2), "head dim"),
    (dict(dim=32, n_heads=4, norm="batchnorm"), "norm must be one of"),
    (dict(dim=32, n_heads=4, activation="relu"), "activation must be one of"),
    (dict(dim=32, n_heads=4, remat="some"), "remat must be one of"),
    (dict(dim=24, n_heads=8, rope_theta=10000.0), "even head dim"),
    (dict(dim=0, n_heads=4), "dim must be a positive int"),
    (dict(dim=32, n_heads=4, eps=-1.0), "eps must be"),
]


@pytest.mark.parametrize("kwargs,match", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_configuration_names_the_argument(kwargs, match):
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_remat.TransformerBlock(kwargs.pop("dim"), kwargs.pop("n_heads"), device="meta", **kwargs)


def test_remat_is_checked_whenever_it_is_set():
    fused = fused_remat.TransformerBlock(32, 4, remat="full")
    plain = reference.TransformerBlock(32, 4, remat="full")
    for block, wrong in ((fused, "auto"), (plain, "cheap")):
        with pytest.raises(ValueError, match=f"remat must be one of .*got '{wrong}'"):
            block.remat = wrong
        assert block.remat == "full"


def test_bad_input_names_the_argument(device, triton_backend):
    block = fused_remat.TransformerBlock(DIM, HEADS, ffn_dim=FFN, device=device)
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, dim=32\)"):
        block(torch.randn(2, 5, DIM + 1, device=device))
    with pytest.raises(ValueError, match="x must have shape"):
        block(torch.randn(5, DIM, device=device))
    with pytest.raises(TypeError, match="parameter norm1.weight has torch.float32"):
        block(torch.randn(2, 5, DIM, device=device, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        block.double()(torch.randn(2, 5, DIM, device=device, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        block([[1.0] * DIM])


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

GPU_CASES = [
    dict(norm="layernorm", activation="gelu", kv_heads=HEADS, rope=False),
    dict(norm="rmsnorm", activation="swiglu", kv_heads=2, rope=True, bias=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=["gpt", "llama"])
@pytest.mark.parametrize("seq", [1, 130, 1000])
def test_block_on_gpu_bf16(case, seq, device):
    config = _config(**case, dim=256, heads=4, ffn=704)
    results = _check_block(config, 2, seq, torch.bfloat16, device)
    _assert_policies_agree({p: results[p] for p in ("cheap", "full")})


@pytest.mark.gpu
def test_cuda_autocast_with_fp32_parameters(device):
    _autocast_case("cuda", device)


# eps has one check (kernels/limits.py check_eps) with one message, on both block classes.
BAD_EPS = [0, 0.0, -1e-5, float("inf"), float("nan"), True, "1e-5", None]


@pytest.mark.parametrize("block_class", [fused_remat.TransformerBlock, reference.TransformerBlock], ids=["fused", "plain"])
@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
def test_block_rejects_eps_that_is_not_finite_and_positive(block_class, eps):
    with pytest.raises(ValueError, match=rf"^TransformerBlock: eps must be a finite number > 0, got {re.escape(repr(eps))}$"):
        block_class(DIM, HEADS, eps=eps, device="meta")


def test_block_keeps_a_valid_eps_as_a_float():
    assert fused_remat.TransformerBlock(DIM, HEADS, eps=1, device="meta").eps == 1.0


def test_reference_backend_names_the_parameter_of_another_dtype(device, monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    block = fused_remat.TransformerBlock(DIM, HEADS, ffn_dim=FFN, device=device)
    x = torch.randn(2, 5, DIM, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"x has dtype torch.bfloat16 but parameter norm1.weight has torch.float32; "
                                        r"convert the block \(block.to\(dtype\)\) or run under torch.autocast"):
        block(x)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        assert block(x).shape == x.shape  # autocast casts for the reference math: no error
    # The plain reference block is unchanged: PyTorch's own error.
    plain = reference.TransformerBlock(DIM, HEADS, ffn_dim=FFN, device=device)
    with pytest.raises(RuntimeError):
        plain(x)
