"""Low-rank adapters (LoRA) inside the fused block: forward and every gradient (the adapters' A
and B too) against the reference twin in float64 and fp32 for every policy, bitwise equal across
policies, nothing more kept for backward, the FLOP count, and the argument checks."""

import copy
import dataclasses

import pytest
import torch
from test_block import POLICIES, _config, _fused_block, _reference_block
from test_block_documents import assert_every_policy_matches
from torch.utils.flop_counter import FlopCounterMode

from fused_remat.flops import matmul_flops
from fused_remat.memory import saved_memory
from fused_remat.reference import LowRankAdapter, lora_dropout_scale

RANK = 3


def _adapters(block, dtype=None, dropout=0.0):
    """One adapter on each linear layer: the whole output of out_proj and fc2, the v heads of qkv
    and the up half of a SwiGLU fc1 (as LoRA on v_proj and up_proj of a model packed into it);
    with ``dropout``, each with its own fixed mask seed."""
    kv = block.n_kv_heads * block.head_dim
    qkv_rows = block.qkv.weight.shape[0]
    up = block.ffn_dim if block.activation == "swiglu" else 0
    places = [("qkv", qkv_rows - kv, kv), ("out_proj", 0, block.dim), ("fc1", up, block.ffn_dim), ("fc2", 0, block.dim)]
    dtype = dtype or block.qkv.weight.dtype
    device = block.qkv.weight.device
    return [LowRankAdapter(name, torch.randn(RANK, getattr(block, name).weight.shape[1], dtype=dtype, device=device) / 4,
                           torch.randn(rows, RANK, dtype=dtype, device=device) / 4, scale=0.7 + i, first_row=first,
                           dropout=dropout, seed=1000 + i if dropout else 0)
            for i, (name, first, rows) in enumerate(places)]


def _run(block, x, dy, adapters, **sequences):
    x = x.detach().clone().requires_grad_()
    adapters = [dataclasses.replace(a, a=a.a.detach().clone().requires_grad_(), b=a.b.detach().clone().requires_grad_())
                for a in adapters]
    y = block(x, adapters=adapters, **sequences)
    names, params = zip(*block.named_parameters())
    inputs = [x, *params, *(t for a in adapters for t in (a.a, a.b))]
    grads = torch.autograd.grad(y, inputs, dy)
    labels = ["x", *names, *(f"{a.linear}.lora_{t}" for a in adapters for t in "AB")]
    return y.detach(), dict(zip(labels, grads))


@pytest.mark.parametrize("options, dropout", [(dict(norm="rmsnorm", activation="swiglu", rope=True, kv_heads=1), 0.0),
                                              (dict(), 0.0), (dict(norm="rmsnorm", activation="swiglu"), 0.3)],
                         ids=["llama-like", "gpt-like", "dropout"])
def test_adapters_match_the_twin_for_every_policy(options, dropout, device, triton_backend):
    """With dropout, the twin draws the same masks from the same seeds: forward, replay and backward
    of every policy use one mask per adapter."""
    config = _config(**options)
    ref = _reference_block(config, device)
    adapters = _adapters(ref, dropout=dropout)
    x, dy = (torch.randn(2, 19, config["dim"], device=device) for _ in range(2))
    docs = dict(cu_seqlens=torch.tensor([0, 7, 30, 38], dtype=torch.int32, device=device))
    for sequences in ({}, docs):
        y64, grads64 = _run(copy.deepcopy(ref).double(), x.double(), dy.double(),
                            [dataclasses.replace(a, a=a.a.double(), b=a.b.double()) for a in adapters],
                            **sequences)
        y_same, grads_same = _run(ref, x, dy, adapters, **sequences)
        assert_every_policy_matches(lambda policy: _run(_fused_block(ref, config, policy), x, dy, adapters, **sequences),
                                    (y_same, grads_same), (y64, grads64), POLICIES)


@pytest.mark.parametrize("policy", POLICIES)
def test_adapters_keep_only_their_factors(policy, device, triton_backend):
    """The block keeps what it keeps without adapters, plus the factors themselves (parameters)."""
    config = _config(norm="rmsnorm", activation="swiglu", rope=True)
    block = _fused_block(_reference_block(config, device), config, policy)
    adapters = [LowRankAdapter(a.linear, torch.nn.Parameter(a.a), torch.nn.Parameter(a.b), a.scale, a.first_row)
                for a in _adapters(block)]
    x = torch.randn(2, 16, config["dim"], device=device, requires_grad=True)
    with saved_memory() as plain:
        block(x)
    with saved_memory() as adapted:
        block(x, adapters=adapters)
    assert adapted.device_bytes == plain.device_bytes


def test_flop_count_adds_the_low_rank_products(device, triton_backend):
    config = _config(norm="rmsnorm", activation="swiglu", rope=True)
    block = _fused_block(_reference_block(config, device), config, "cheap")
    x = torch.randn(2, 16, config["dim"], device=device, requires_grad=True)
    counts = []
    for adapters in ([], _adapters(block)):
        adapters = [LowRankAdapter(a.linear, a.a.requires_grad_(), a.b.requires_grad_(), a.scale, a.first_row)
                    for a in adapters]
        with FlopCounterMode(display=False) as counter:
            block(x, adapters=adapters).sum().backward()
        counts.append(counter.get_total_flops())
    tokens = 32
    expected = sum(matmul_flops(tokens, RANK, (a.a.shape[1] + a.b.shape[0]) + (3 * a.a.shape[1] + 2 * a.b.shape[0]))
                   for a in _adapters(block))
    assert counts[1] - counts[0] == expected


def test_lora_dropout_is_inverted_dropout_with_one_mask_per_seed(device):
    """The twin's definition: scale * ((x * m / (1 - p)) A^T) B^T with m drawn from the seed (about
    1 - p of it kept), the same seed the same mask, a new seed drawn per call when none is given."""
    factor = lora_dropout_scale(torch.empty(400, 64, device=device), 0.25, seed=3)
    kept = factor > 0
    assert torch.all(factor[kept] == torch.tensor(1 / 0.75)) and 0.7 < kept.float().mean() < 0.8
    assert torch.equal(factor, lora_dropout_scale(torch.empty(400, 64, device=device), 0.25, seed=3))
    assert not torch.equal(factor, lora_dropout_scale(torch.empty(400, 64, device=device), 0.25, seed=4))

    config = _config()
    block = _reference_block(config, device)
    x = torch.randn(3, 50, config["dim"], device=device)
    fc2 = dataclasses.replace(_adapters(block)[3], dropout=0.25, seed=3)  # its output is the block's
    inputs = []
    handle = block.fc2.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
    with torch.no_grad():
        delta = block(x, adapters=[fc2]) - block(x)
        handle.remove()
        a = inputs[0].reshape(-1, inputs[0].shape[-1])
        expected = ((a * lora_dropout_scale(a, 0.25, 3)) @ fc2.a.t()) @ fc2.b.t() * fc2.scale
        assert torch.allclose(delta.reshape(-1, config["dim"]), expected, atol=1e-5, rtol=0)
        unseeded = dataclasses.replace(fc2, seed=0)
        assert not torch.equal(block(x, adapters=[unseeded]), block(x, adapters=[unseeded]))


def test_adapter_arguments_are_checked(device):
    config = _config()
    block = _fused_block(_reference_block(config, device), config, "cheap")
    x = torch.randn(1, 4, config["dim"], device=device)
    good = _adapters(block)[1]
    with pytest.raises(ValueError, match=r"adapters\[0\].linear must be one of"):
        block(x, adapters=[LowRankAdapter("q_proj", good.a, good.b, 1.0)])
    with pytest.raises(ValueError, match=r"adapters\[0\]: A must be \(r, 32\) and B \(rows, r\) for out_proj"):
        block(x, adapters=[LowRankAdapter("out_proj", good.a[:, :5], good.b, 1.0)])
    with pytest.raises(ValueError, match=r"adapters\[0\]: rows 1..33 are outside out_proj's 32 outputs"):
        block(x, adapters=[LowRankAdapter("out_proj", good.a, good.b, 1.0, first_row=1)])
    with pytest.raises(TypeError, match=r"adapters\[0\]: A and B must be float tensors on out_proj.weight's device"):
        block(x, adapters=[LowRankAdapter("out_proj", good.a.int(), good.b.int(), 1.0)])
    with pytest.raises(ValueError, match=r"adapters\[0\].dropout must be a probability in \[0, 1\)"):
        block(x, adapters=[dataclasses.replace(good, dropout=1.0)])
    with pytest.raises(TypeError, match=r"adapters\[0\] must be a LowRankAdapter"):
        block(x, adapters=[(good.a, good.b)])
