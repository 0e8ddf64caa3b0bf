"""Keep or rebuild, per kept tensor: every point of the space (``fused_remat.remat``) computes the
gradients of ``none`` bitwise, keeps the bytes the contract prices it at, and is counted by
FlopCounterMode with exactly the replay it runs; ``memory_budget`` picks the point with the least
replay within a fraction of ``none``'s bytes."""

import itertools
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fused_remat import Remat, TransformerBlock
from fused_remat.block import block_widths
from fused_remat.flops import visible_pairs
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, preset
from fused_remat.remat import (budget_points, check_memory_budget, kept_bytes_per_token, replay_flops_per_token,
                               replay_norm_passes, within_budget)

DIM, HEADS, KV_HEADS, FFN = 32, 4, 2, 40
# Each way to keep or rebuild the four products (qkv, attention's results, h, u), the norm
# statistics dropped from a few, and outputs kept on top of others: every branch of the replay.
_PRODUCTS = (("qkv",), ("o", "lse"), ("h",), ("u",))
POINTS = [
    *(Remat.keeping(["mean1", "rstd1", "mean2", "rstd2",
                     *(name for product, keep in zip(_PRODUCTS, keeps) if keep for name in product)])
      for keeps in itertools.product((False, True), repeat=len(_PRODUCTS))),
    Remat.keeping(["qkv", "o", "lse", "h", "u"]), Remat.keeping(["qkv", "mean2", "rstd2"]), Remat.keeping(["h", "u"]),
    Remat.keeping(["y1", "a"]), Remat.keeping(["o", "lse", "h", "y2"]), Remat.FULL, Remat.NONE,
]


def _block(device, remat="none", **kwargs) -> TransformerBlock:
    """The test's block: ``remat``, or the ``memory_budget`` given instead."""
    torch.manual_seed(0)
    return TransformerBlock(DIM, HEADS, n_kv_heads=KV_HEADS, ffn_dim=FFN, norm="rmsnorm", activation="swiglu",
                            bias=False, rope_theta=10000.0, remat=None if "memory_budget" in kwargs else remat,
                            device=device, **kwargs)


def _widths() -> dict[str, int]:
    return block_widths(DIM, HEADS, KV_HEADS, FFN, "rmsnorm", "swiglu")


def _output_and_grads(block, x) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    y = block(x)
    y.backward(torch.cos(3 * y.detach()))
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_point_computes_the_gradients_of_none_bitwise(qk_norm, device, triton_backend):
    block = _block(device, qk_norm=qk_norm)
    x = torch.randn(2, 13, DIM, device=device)
    expected = _output_and_grads(block, x)
    # with qk_norm the kept qkv is the projection's output and attention reads a rebuilt copy
    for point in POINTS if not qk_norm else (Remat.SELECTIVE, Remat.keeping(["qkv"]), Remat.keeping(["qkv", "h"])):
        block.remat = point
        got = _output_and_grads(block, x)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), point


def _saved_bytes_per_token(block, lengths=(8, 20), batch=2) -> int:
    device = next(block.parameters()).device
    saved = []
    for n in lengths:
        x = torch.randn(batch, n, DIM, device=device, requires_grad=True)
        with saved_memory() as meter:
            block(x)
        saved.append(meter.bytes)
    per_token, remainder = divmod(saved[1] - saved[0], batch * (lengths[1] - lengths[0]))
    assert remainder == 0
    return per_token


@pytest.mark.parametrize("point", [Remat.keeping(names) for names in (
    ["qkv", "o", "lse", "h", "mean1", "rstd1", "mean2", "rstd2"], ["qkv", "o", "lse", "u", "mean1", "rstd1"],
    ["o", "lse", "h"], ["qkv", "u", "mean2", "rstd2"], ["h", "y2"])])
def test_each_point_keeps_the_bytes_the_contract_prices(point, device, triton_backend):
    assert _saved_bytes_per_token(_block(device, point)) == kept_bytes_per_token(point, _widths(), 4, 4)


def _counted(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def test_the_backward_counts_exactly_the_replay_each_point_runs(device, triton_backend):
    """Backward's FLOPs exceed ``none``'s by the point's replay: a linear layer per rebuilt product,
    attention where its results were not kept."""
    seq = 13
    x = torch.randn(1, seq, DIM, device=device, requires_grad=True)

    def backward_flops(point):
        block = _block(device, point)
        y = block(x)
        return _counted(lambda: y.backward(torch.ones_like(y)))

    baseline = backward_flops(Remat.NONE)
    # forward pairs as the operators count them (N(N+1)/2 causal), per token
    pairs_per_token = visible_pairs(seq, seq, True) / seq
    for point in POINTS[::4]:
        replay = replay_flops_per_token(point, _widths(), pairs_per_token) * seq
        assert backward_flops(point) - baseline == pytest.approx(replay, abs=0.5), point


def _brute_force(fraction, widths, pairs_per_token) -> Remat:
    none = kept_bytes_per_token(Remat.NONE, widths, 4, 4)
    fits = [p for p in budget_points() if kept_bytes_per_token(p, widths, 4, 4) <= fraction * none]
    if not fits:
        return Remat.OFFLOAD
    return min(fits, key=lambda p: (replay_flops_per_token(p, widths, pairs_per_token), replay_norm_passes(p),
                                    kept_bytes_per_token(p, widths, 4, 4)))


def test_a_budget_picks_the_least_replay_that_fits_and_prices_attention_by_the_sequence():
    """A Llama-shaped layer (dim 256, 4 heads / 2 KV heads, SwiGLU 688, fp32)."""
    widths = block_widths(256, 4, 2, 688, "rmsnorm", "swiglu")
    none = kept_bytes_per_token(Remat.NONE, widths, 4, 4)
    chosen = {}
    for seq in (256, 1024, 8192):
        pairs = (seq + 1) / 2
        for fraction in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 0.8, 1.0):
            point = within_budget(fraction, widths, 4, 4, pairs)
            assert point == _brute_force(fraction, widths, pairs)
            assert point.host_resident or kept_bytes_per_token(point, widths, 4, 4) <= fraction * none
            chosen[seq, fraction] = point
    assert chosen[256, 1.0] == chosen[256, 0.75] == Remat.CHEAP, "no replay while cheap fits"
    assert chosen[256, 0.0] == chosen[256, 0.05] == Remat.OFFLOAD, "below x's share only host memory is left"
    # At selective's bytes the choice turns on N: short sequences replay attention and keep h
    # (its output projection costs more than attention there), long ones keep attention's results.
    fraction = kept_bytes_per_token(Remat.SELECTIVE, widths, 4, 4) / none
    assert within_budget(fraction, widths, 4, 4, (64 + 1) / 2) == Remat.keeping(["h"])
    assert within_budget(fraction, widths, 4, 4, (256 + 1) / 2) == Remat.SELECTIVE
    assert within_budget(fraction, widths, 4, 4, (8192 + 1) / 2) == Remat.SELECTIVE


@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.2])
def test_the_block_honours_its_memory_budget_as_the_meter_measures_it(fraction, device, triton_backend):
    block = _block(device, memory_budget=fraction)
    lengths = (16, 24)  # lengths at which each budget picks one point (0.5 picks another below 16)
    none = _saved_bytes_per_token(_block(device, "none"), lengths)
    kept = _saved_bytes_per_token(block, lengths)
    assert kept <= fraction * none
    seq = 20
    expected = within_budget(fraction, _widths(), 4, 4, visible_pairs(seq, seq, True) / seq)
    assert kept == kept_bytes_per_token(expected, _widths(), 4, 4)
    x = torch.randn(2, seq, DIM, device=device)
    assert all(torch.equal(a, b) for a, b in zip(_output_and_grads(block, x), _output_and_grads(_block(device), x)))


def test_remat_and_a_memory_budget_are_one_choice_not_two():
    """A budget chooses the point, so a remat given beside it would go unused: the constructors
    refuse both, and a block or model under a budget refuses a new remat until the budget is None."""
    both = r"remat='full' and memory_budget=0.3 are two ways to say what"
    with pytest.raises(ValueError, match="^TransformerBlock: " + both):
        TransformerBlock(DIM, HEADS, remat="full", memory_budget=0.3, device="meta")
    with pytest.raises(ValueError, match="^" + both):
        LanguageModel(preset("tiny"), "full", memory_budget=0.3, device="meta")
    block = _block("meta", memory_budget=0.3)
    assert block.remat == "cheap", "the default, unused while the budget holds"
    with pytest.raises(ValueError, match=r"remat='full' would not be used: memory_budget 0.3 chooses each call's point"):
        block.remat = "full"
    block.memory_budget = None
    block.remat = "full"
    model = LanguageModel(preset("tiny"), memory_budget=0.3, device="meta")
    with pytest.raises(ValueError, match=r"set_remat\('full'\) would not be used: memory_budget 0.3"):
        model.set_remat("full")
    assert model.remat == ["cheap"] * preset("tiny").n_layers and model.memory_budget == 0.3
    assert LanguageModel(preset("tiny"), block_impl="reference", device="meta").remat == ["none"] * preset("tiny").n_layers


def test_the_point_under_a_budget_is_priced_at_the_longest_document():
    """``budget_point`` is the one owner of the choice: a call with packed documents prices
    attention's replay at its longest document, a dense call at its row."""
    block = _block("meta", memory_budget=0.3)
    x = torch.empty(1, 8192, DIM, device="meta")
    widths = _widths()
    for longest in (0, 512):
        seq = longest or 8192
        expected = within_budget(0.3, widths, 4, 4, visible_pairs(seq, seq, True) / seq)
        assert block._call_remat(x, longest, torch.float32) == block.budget_point(seq, torch.float32, torch.float32) \
            == expected


@pytest.mark.parametrize("value,error,match", [
    (1.5, ValueError, r"memory_budget must be in \[0, 1\].*got 1.5"),
    (-0.1, ValueError, r"memory_budget must be in \[0, 1\]"),
    (math.nan, ValueError, r"memory_budget must be in \[0, 1\].*got nan"),
    ("0.5", TypeError, r"memory_budget must be a number in \[0, 1\].*got str"),
    (True, TypeError, r"memory_budget must be a number.*got bool"),
])
def test_a_bad_memory_budget_names_the_argument(value, error, match, device):
    with pytest.raises(error, match="^TransformerBlock: " + match):
        _block(device, memory_budget=value)
    block = _block(device, memory_budget=0.5)
    with pytest.raises(error, match=match):
        block.memory_budget = value
    assert block.memory_budget == 0.5, "a refused setting leaves the block as it was"
    assert check_memory_budget(None) is None and check_memory_budget(1) == 1.0
