"""FLOP formulas of the custom operators: FlopCounterMode sees the ops and the block as it sees SDPA,
and counts what they run, checked against the analytic count."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fused_remat
from fused_remat import Remat, TransformerBlock
from fused_remat.flops import attention_flops, visible_pairs
from fused_remat.model import preset
from fused_remat.planner import layer_step_flops


def _counted(run) -> tuple[int, dict[str, int]]:
    with FlopCounterMode(display=False) as counter:
        run()
    per_op = {str(op).removeprefix("fused_remat."): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), per_op


def test_visible_pairs_count_the_bottom_right_causal_mask():
    for q_len, k_len, causal in itertools.product((0, 1, 3, 7, 16, 113), (0, 1, 3, 7, 16, 113), (False, True)):
        rows = torch.arange(q_len)[:, None]
        keys = torch.arange(k_len)[None, :]
        mask = keys <= rows + (k_len - q_len) if causal else torch.ones(q_len, k_len, dtype=torch.bool)
        assert visible_pairs(q_len, k_len, causal) == int(mask.sum()), (q_len, k_len, causal)


@pytest.mark.parametrize("causal,q_len,k_len", [(True, 37, 37), (True, 19, 50), (True, 50, 19), (False, 23, 41)])
def test_attention_counts_its_visible_pairs_forward_and_backward(causal, q_len, k_len, triton_backend):
    batch, q_heads, kv_heads, head_dim = 2, 4, 2, 16
    q = torch.randn(batch, q_heads, q_len, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, k_len, head_dim, requires_grad=True) for _ in range(2))
    total, per_op = _counted(lambda: fused_remat.attention(q, k, v, causal=causal).sum().backward())
    pairs = visible_pairs(q_len, k_len, causal)
    forward = 4 * batch * q_heads * head_dim * pairs
    assert per_op == {"attention_fwd": forward, "attention_bwd": 7 * forward // 2}
    assert total == forward * 9 // 2


def _block(remat, **kwargs):
    return TransformerBlock(48, 4, n_kv_heads=2, norm="rmsnorm", activation="swiglu", ffn_dim=80, bias=False,
                            rope_theta=10000.0, remat=remat, **kwargs)


def _analytic(batch, seq, weight_grads=True):
    """Forward, backward without replay, and the replays of the block above: the projections up
    to fc1, and attention's forward."""
    tokens, dim, qkv, ffn, head_dim = batch * seq, 48, (4 + 2 * 2) * 12, 80, 12
    before_fc2 = 2 * tokens * dim * (qkv + dim + 2 * ffn)
    fc2 = 2 * tokens * ffn * dim
    attention = 4 * batch * 4 * head_dim * visible_pairs(seq, seq, True)
    backward = (2 if weight_grads else 1) * (before_fc2 + fc2) + 7 * attention // 2
    return before_fc2 + fc2 + attention, backward, (before_fc2, attention)


@pytest.mark.parametrize("remat", list(Remat))
def test_the_block_counts_its_matmuls_and_causal_attention_and_the_replay(remat, triton_backend):
    batch, seq = 2, 33
    block = _block(remat)
    x = torch.randn(batch, seq, 48, requires_grad=True)
    forward, _ = _counted(lambda: block(x))
    y = block(x)
    backward, per_op = _counted(lambda: y.backward(torch.randn_like(y)))
    expected_forward, expected_backward, (projections, attention) = _analytic(batch, seq)
    replay = {"selective": projections, "full": projections + attention, "offload": projections + attention}
    assert forward == expected_forward
    assert backward == expected_backward + replay.get(remat, 0)
    assert set(per_op) == {"block_bwd"}, "the block is one operator: nothing inside it is counted twice"


@pytest.mark.parametrize("remat", ["none", "full", "keep:o,lse,h"])
def test_the_block_on_meta_tensors_counts_what_it_counts_on_real_ones(remat, triton_backend):
    """A model sized on the meta device before it is allocated is counted as it will run: the
    block's custom operators, their fake kernels and FLOP formulas, not the reference math."""
    counts = []
    for device in ("cpu", "meta"):
        block = _block(remat).to(device)
        x = torch.randn(2, 33, 48, device=device, requires_grad=True)
        forward, _ = _counted(lambda: block(x))
        y = block(x)
        backward, per_op = _counted(lambda: y.backward(torch.ones_like(y)))
        counts.append((forward, backward, set(per_op)))
    assert counts[0] == counts[1] and counts[1][2] == {"block_bwd"}


def test_frozen_weights_are_not_counted_in_backward(triton_backend):
    block = _block("cheap").requires_grad_(False)
    x = torch.randn(1, 17, 48, requires_grad=True)
    y = block(x)
    backward, _ = _counted(lambda: y.backward(torch.randn_like(y)))
    assert backward == _analytic(1, 17, weight_grads=False)[1]


def test_the_block_forward_agrees_with_the_planner_convention_within_a_percent(triton_backend):
    """The planner and the benchmarks count causal attention as N^2/2 pairs (FlashAttention's
    convention); the formula counts the N(N+1)/2 the kernels compute."""
    config = preset("tiny", n_layers=1)
    seq = 256
    block = TransformerBlock(config.dim, config.n_heads, **config.block_kwargs())
    x = torch.randn(1, seq, config.dim)
    with torch.no_grad():
        counted, _ = _counted(lambda: block(x))
    planned = layer_step_flops(config, 1, seq)[1]
    assert counted > planned
    assert counted == pytest.approx(planned, rel=0.01)
    head_dim = config.dim // config.n_heads
    assert counted - planned == 4 * config.n_heads * head_dim * seq / 2  # exactly the diagonal
    assert attention_flops(1, config.n_heads, seq, seq, head_dim, True) == 4 * config.n_heads * head_dim * seq**2 / 2


def test_the_loss_counts_the_logits_and_the_gradient_products_it_makes():
    tokens, dim, vocab = 70, 24, 50
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    total, _ = _counted(lambda: fused_remat.linear_cross_entropy(hidden, weight, targets).backward())
    assert total == 3 * 2 * tokens * dim * vocab
    with torch.no_grad():
        forward_only, _ = _counted(lambda: fused_remat.linear_cross_entropy(hidden, weight, targets))
    assert forward_only == 2 * tokens * dim * vocab


@pytest.mark.parametrize("first,second", [("fused_remat", "torch.utils.flop_counter"),
                                          ("torch.utils.flop_counter", "fused_remat")])
def test_formulas_register_whether_the_counter_is_imported_before_or_after(first, second):
    """Importing fused_remat must not import the counter (it imports triton): the formulas reach it
    when it is imported, before or after fused_remat."""
    code = f"""
import sys
import {first}
assert ("triton" in sys.modules) == ({first!r} == "torch.utils.flop_counter")
import {second}
import torch, fused_remat
from torch.utils.flop_counter import FlopCounterMode
q = torch.randn(1, 2, 8, 16)
with FlopCounterMode(display=False) as counter:
    fused_remat.attention(q, q, q, causal=True)
print(counter.get_total_flops())
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSED_REMAT_BACKEND": "triton"}
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert int(printed) == 4 * 2 * 16 * visible_pairs(8, 8, True)


def test_packed_documents_count_as_each_document_alone(device, triton_backend):
    """attention_varlen's forward and backward count the sum of each document attended alone
    (its own bottom-right corner, window and all), which is what its kernels run."""
    q_lengths, k_lengths = [5, 0, 17, 9], [7, 3, 17, 2]
    offsets = [torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device)
               for n in (q_lengths, k_lengths)]
    q = torch.randn(sum(q_lengths), 4, 16, device=device, requires_grad=True)
    k, v = (torch.randn(sum(k_lengths), 2, 16, device=device, requires_grad=True) for _ in range(2))
    mask = dict(causal=True, window=(4, -1))
    with FlopCounterMode(display=False) as packed:
        fused_remat.attention_varlen(q, k, v, *offsets, 17, 17, **mask).sum().backward()
    with FlopCounterMode(display=False) as alone:
        for i in range(len(q_lengths)):
            rows = slice(offsets[0][i], offsets[0][i + 1])
            keys = slice(offsets[1][i], offsets[1][i + 1])
            if q_lengths[i] and k_lengths[i]:
                heads = [t[r].transpose(0, 1)[None] for t, r in ((q, rows), (k, keys), (v, keys))]
                fused_remat.attention(*heads, **mask).sum().backward()
    assert packed.get_total_flops() == alone.get_total_flops() > 0
