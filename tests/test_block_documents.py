"""The block on packed documents, RoPE positions, sliding windows and softcap: against its twin in
float64 and in the same dtype (the error rule) for every policy, bitwise equal across policies and
to the dense block when each row is one document, the memory contract, and the errors."""

import copy

import pytest
import torch
from test_block import POLICIES, _config, _fused_block, _reference_block

from fused_remat.block import block_widths
from fused_remat.memory import saved_memory
from fused_remat.remat import kept_bytes_per_token
from numerics import assert_error_rule


def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _run(block, x, dy, **sequences):
    x = x.detach().clone().requires_grad_()
    y = block(x, **sequences)
    names, params = zip(*block.named_parameters())
    grads = torch.autograd.grad(y, [x, *params], dy)
    return y.detach(), dict(zip(("x", *names), grads))


# (block options, batch, seq, document lengths over the batch x seq tokens or None, position ids)
CASES = [
    (dict(rope=True), 2, 40, [10, 1, 29, 0, 40], None),  # a document crosses the row boundary
    (dict(rope=True, kv_heads=1), 1, 70, [33, 37], None),
    (dict(norm="rmsnorm", activation="swiglu", rope=True, window=(8, -1)), 2, 45, [45, 20, 25], None),
    (dict(window=(5, 5), softcap=4.0, causal=False), 2, 30, None, None),
    (dict(rope=True, softcap=3.0), 2, 24, [24, 24], "random"),
    # scaled RoPE (frequencies given, as Llama 3's or YaRN's) with YaRN's larger softmax scale
    (dict(rope=True, kv_heads=1, attention_scale=0.41), 2, 26, [9, 30, 13], "scaled"),
    # Qwen3: q and k heads normalized before RoPE
    (dict(norm="rmsnorm", activation="swiglu", rope=True, kv_heads=1, qk_norm=True), 2, 21, [9, 12, 21], None),
    (dict(rope=True, qk_norm=True), 1, 33, None, None),
    # heads wider than dim / n_heads (Qwen3-0.6B: 16 heads of 128 on a 1024 residual)
    (dict(rope=True, kv_heads=1, head_dim=24), 2, 17, [17, 5, 12], None),
]


def _case_id(case):
    options, batch, seq, lengths, positions = case
    text = "-".join(f"{k}{v}" for k, v in options.items())
    return f"{text}-{batch}x{seq}-{'docs' if lengths else 'dense'}{'-' + positions if positions else ''}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_block_on_documents_matches_its_twin_for_every_policy(case, device, triton_backend):
    options, batch, seq, lengths, positions = case
    options = dict(options)
    mask = {k: options.pop(k) for k in ("window", "softcap", "attention_scale", "qk_norm", "head_dim") if k in options}
    config = dict(_config(**options), **mask)
    sequences = {}
    if lengths:
        sequences["cu_seqlens"] = _offsets(lengths, device)
    if positions == "random":
        sequences["position_ids"] = torch.randint(0, 500, (batch, seq), device=device)
    if positions == "scaled":
        head_dim = config["dim"] // config["n_heads"]
        sequences["rope_inv_freq"] = torch.rand(head_dim // 2, device=device) ** 3
    ref = _reference_block(config, device)
    x, dy = (torch.randn(batch, seq, config["dim"], device=device) for _ in range(2))
    y64, grads64 = _run(copy.deepcopy(ref).double(), x.double(), dy.double(), **sequences)
    y_same, grads_same = _run(ref, x, dy, **sequences)
    assert_every_policy_matches(lambda policy: _run(_fused_block(ref, config, policy), x, dy, **sequences),
                                (y_same, grads_same), (y64, grads64), POLICIES + ("offload",))


def assert_every_policy_matches(run, same_dtype, float64, policies):
    """``run(policy)`` -> (y, gradients by name) within the error rule of the twin's (y, gradients)
    in the same dtype and in float64, and bitwise equal across ``policies``."""
    (y_same, grads_same), (y64, grads64) = same_dtype, float64
    results = []
    for policy in policies:
        y, grads = run(policy)
        assert_error_rule(f"{policy} y", y, y_same, y64, torch.float32)
        assert grads.keys() == grads64.keys()
        for name, grad in grads.items():
            assert_error_rule(f"{policy} d{name}", grad, grads_same[name], grads64[name], torch.float32)
        results.append((y, grads))
    for y, grads in results[1:]:
        assert torch.equal(y, results[0][0]) and all(torch.equal(grads[n], results[0][1][n]) for n in grads)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_document_per_row_is_bitwise_the_dense_block(policy, device, triton_backend):
    config = _config(rope=True, kv_heads=1)
    block = _fused_block(_reference_block(config, device), config, policy)
    x, dy = (torch.randn(3, 37, config["dim"], device=device) for _ in range(2))
    y, grads = _run(block, x, dy)
    y_docs, grads_docs = _run(block, x, dy, cu_seqlens=_offsets([37] * 3, device))
    assert torch.equal(y, y_docs)
    assert all(torch.equal(grads[name], grads_docs[name]) for name in grads)


@pytest.mark.parametrize("head_dim", [None, 40])
@pytest.mark.parametrize("policy", POLICIES)
def test_documents_keep_the_memory_contract(policy, head_dim, device, triton_backend):
    """Packed documents shrink attention's work, not what a policy keeps: the contract's bytes per
    token (with heads wider than dim / n_heads too), plus the document offsets (the model's input,
    shared by every layer)."""
    config = dict(_config(rope=True), head_dim=head_dim)
    block = _fused_block(_reference_block(config, device), config, policy)
    cu_seqlens = _offsets([30, 2, 32], device)
    x = torch.randn(2, 32, config["dim"], device=device, requires_grad=True)
    with saved_memory() as meter:
        block(x, cu_seqlens=cu_seqlens)
    widths = block_widths(config["dim"], config["n_heads"], config["n_kv_heads"], config["ffn_dim"], config["norm"],
                          config["activation"], head_dim)
    per_token = kept_bytes_per_token(policy, widths, residual_bytes=4, compute_bytes=4)
    assert meter.device_bytes == 64 * per_token + cu_seqlens.numel() * 4


def test_document_arguments_are_checked(device, triton_backend):
    config = _config(rope=True)
    block = _fused_block(_reference_block(config, device), config, "cheap")
    x = torch.randn(2, 8, config["dim"], device=device)
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the number of rows of x"):
        block(x, cu_seqlens=_offsets([8, 7], device))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype torch.int32"):
        block(x, cu_seqlens=_offsets([8, 8], device).long())
    with pytest.raises(ValueError, match="document 1 has length 8 in cu_seqlens, more than max_seqlen=4"):
        block(x, cu_seqlens=_offsets([4, 8, 4], device), max_seqlen=4)
    with pytest.raises(ValueError, match="max_seqlen is given without cu_seqlens"):
        block(x, max_seqlen=8)
    with pytest.raises(ValueError, match=r"position_ids must have shape \(B, N\) = \(2, 8\)"):
        block(x, position_ids=torch.zeros(2, 7, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="position_ids must be int32 or int64"):
        block(x, position_ids=torch.zeros(2, 8, device=device))
    with pytest.raises(ValueError, match="window must be a pair"):
        type(block)(32, 2, window=(3,))
    with pytest.raises(ValueError, match="softcap must be a finite real number >= 0"):
        type(block)(32, 2, softcap=-1.0)
    with pytest.raises(ValueError, match="attention_scale must be a finite real number > 0 or None"):
        type(block)(32, 2, attention_scale=0.0)
    head_dim = config["dim"] // config["n_heads"]
    with pytest.raises(ValueError, match=r"rope_inv_freq must have shape \(head_dim / 2,\) = \(8,\).*part of the head"):
        block(x, rope_inv_freq=torch.ones(head_dim // 4, device=device))
    with pytest.raises(TypeError, match="rope_inv_freq must be float32"):
        block(x, rope_inv_freq=torch.ones(head_dim // 2, device=device, dtype=torch.float64))
    no_rope = _config()
    with pytest.raises(ValueError, match=r"rope_inv_freq is given to a block without RoPE \(rope_theta=None\)"):
        _fused_block(_reference_block(no_rope, device), no_rope, "cheap")(x, rope_inv_freq=torch.ones(8, device=device))


@pytest.mark.parametrize("policy", POLICIES + ("offload",))
def test_qk_norm_keeps_what_the_block_keeps_without_it(policy, device, triton_backend):
    """With qk_norm the kept qkv is the projection's output (backward normalizes and rotates it
    again), so every policy keeps the same bytes as without the head norms."""
    kept = []
    for qk_norm in (False, True):
        config = dict(_config(norm="rmsnorm", activation="swiglu", rope=True), qk_norm=qk_norm)
        block = _fused_block(_reference_block(config, device), config, policy)
        x = torch.randn(2, 24, config["dim"], device=device, requires_grad=True)
        with saved_memory() as meter:
            block(x)
        kept.append((meter.device_bytes, meter.host_bytes))
    assert kept[0] == kept[1]
