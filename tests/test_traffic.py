"""The row-wise kernels' global-memory traffic against what they must move (bench/traffic.py).

Every pick at every width 1k-32k, bf16 and fp32, forward and backward, plain and fused:

- must-move is what the op's tensors hold (each input once, each output once, the row statistics):
  the meter counts it from the accesses, and it must equal the sum written out here;
- rows held on chip (norms up to ``MAX_SINGLE_PASS_N``, every activation) move exactly that;
- streamed rows read their input once more: exactly one more row of x (or h) forward, of x and dy
  backward. Nothing else: a partial sum read back per row, a host-side copy or a third sweep fails.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from bench.traffic import ACTIVATIONS, NORMS, Tally, TrafficCase, cases, measure, tallied
from fused_remat.kernels.limits import triton_interpreting
from fused_remat.kernels.norm import MAX_SINGLE_PASS_N, STREAM_BLOCK_N

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="counts the loads and stores of Triton's interpreter")


def _row_tensors(case: TrafficCase) -> tuple[int, int]:
    """(inputs, outputs) of the op that are as large as its input, for must-move."""
    fused = int(case.fused)
    return {
        "layer_norm_fwd": (1 + fused, 1 + fused), "rms_norm_fwd": (1 + fused, 1 + fused),
        "layer_norm_bwd": (2 + fused, 1 + fused), "rms_norm_bwd": (2 + fused, 1 + fused),
        "gelu_fwd": (1, 1), "gelu_bwd": (2, 1 + fused), "swiglu_fwd": (2, 1), "swiglu_bwd": (3, 2 + fused),
    }[case.op]


def _expected_must(case: TrafficCase) -> float:
    itemsize = torch.finfo(getattr(torch, case.dtype)).bits // 8
    statistics = 0 if case.op in ACTIVATIONS else (4 if case.op.startswith("rms") else 8)  # fp32 rstd (and mean) a row
    return sum(_row_tensors(case)) * itemsize + statistics / case.width


def _expected_reread(case: TrafficCase) -> int:
    """Bytes per element a streamed row reads again: x (or h) forward, x and dy backward."""
    if case.op in ACTIVATIONS:
        return 0
    direction = "backward" if case.op.endswith("bwd") else "forward"
    if case.width <= MAX_SINGLE_PASS_N[direction]:
        return 0
    itemsize = torch.finfo(getattr(torch, case.dtype)).bits // 8
    return itemsize * (2 if direction == "backward" else 1)


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_kernel_moves_what_it_must(case):
    row = measure(case)
    assert row["must"] == pytest.approx(_expected_must(case), rel=1e-12), row
    beyond = (row["moved"] - row["must"] - _expected_reread(case)) * case.width  # bytes a row
    if not _expected_reread(case):
        assert beyond == pytest.approx(0, abs=1e-6), row
        assert row["ratio"] <= 1.1
    else:
        # per chunk of a streamed row, fp32 scalars: the statistics and the backward's two sums read again
        chunks = -(-case.width // STREAM_BLOCK_N["backward" if case.op.endswith("bwd") else "forward"])
        assert -1e-6 < beyond <= 16 * (chunks + 1), row


def test_every_op_and_width_is_measured():
    ops = {c.op for c in cases()}
    assert ops == set(NORMS + ACTIVATIONS)
    assert {c.width for c in cases()} == {1024, 2048, 4096, 8192, 16384, 32768}
    # both sides of each norm's single-pass limit
    for direction, limit in MAX_SINGLE_PASS_N.items():
        assert any(c.width <= limit for c in cases()) and any(c.width > limit for c in cases()), direction


@triton.jit
def _read_twice(X, Y, N, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < N
    first = tl.load(X + offsets, mask=mask)
    again = tl.load(X + offsets, mask=mask)
    tl.store(Y + offsets, first + again, mask=mask)


def test_the_tally_counts_a_second_read_and_masked_lanes():
    """A kernel that reads x twice moves 3 elements per must-move 2; lanes the mask turns off count nothing."""
    x, y = torch.randn(100), torch.empty(100)
    tally = Tally()
    with tallied(tally):
        _read_twice[(1,)](x, y, 100, BLOCK=128)
    counted = tally.bytes()
    assert counted == {"moved": 3 * 400, "must": 2 * 400, "cached": 0}
    assert torch.equal(y, 2 * x)
