"""FLOP counts: the conventions of the planner's cost model and the benchmarks' TFLOP/s, and what
each custom operator runs, for ``torch.utils.flop_counter.FlopCounterMode``.

A matrix product costs 2 FLOPs per multiply-add; its backward twice the forward. Attention's
forward is 4 B H Nq Nk D (the two products), half of it when causal; its backward is 2.5x the
forward (docs/design.md, as FlashAttention reports it): the useful work, ``attention_flops``.

The operators' formulas (``register_flop_formula`` beside each operator) count what the kernels
run instead, as PyTorch's formula for SDPA does: the (query, key) pairs the causal mask leaves
(``visible_pairs``; N(N+1)/2 for a square causal mask, not N^2/2), and the backward's seven products
of the forward's size (the dK/dV pass recomputes S and dP, and the dQ pass, which keeps dQ free of
atomics, recomputes them again), 3.5x the forward. Norms, activations and RoPE are not counted, as
PyTorch counts no element-wise op.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

import torch

ATTENTION_BACKWARD_FACTOR = 2.5
ATTENTION_BACKWARD_PRODUCTS = 7  # S and dP twice, dV, dK, dQ: each 2 D FLOPs per visible pair


def visible_pairs(q_len: int, k_len: int, causal: bool, window=(-1, -1)) -> int:
    """(query, key) pairs attention computes: all, or those the bottom-right-aligned mask leaves:
    query i sees keys j with i + d - left <= j <= i + d + right, d = k_len - q_len (causal: right
    = 0; -1: that side unbounded)."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return q_len * k_len
    if left < 0:
        return _pairs_up_to_diagonal(q_len, k_len, k_len - q_len + right)
    # the keys between the two bounds: those up to the right one less those left of the left one
    right_pairs = _pairs_up_to_diagonal(q_len, k_len, k_len if right < 0 else k_len - q_len + right)
    return right_pairs - _pairs_up_to_diagonal(q_len, k_len, k_len - q_len - left - 1)


def document_pairs(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool, window=(-1, -1)) -> int:
    """``visible_pairs`` summed over the documents that the offsets pack (each aligned to its own
    bottom-right corner). Reads the offsets on the host."""
    lengths = zip(torch.diff(cu_seqlens_q).tolist(), torch.diff(cu_seqlens_k).tolist())
    return sum(visible_pairs(q_len, k_len, causal, window) for q_len, k_len in lengths)


def _pairs_up_to_diagonal(q_len: int, k_len: int, offset: int) -> int:
    """Pairs (i, j), i < q_len, j < k_len, with j <= i + offset."""
    first = offset + 1  # keys row 0 sees, before clamping to [0, k_len]
    empty_rows = min(max(1 - first, 0), q_len)  # rows that see no key
    full_from = min(max(k_len - first, empty_rows), q_len)  # rows that see every key
    partial = full_from - empty_rows  # rows that see first + i keys
    return partial * first + (empty_rows + full_from - 1) * partial // 2 + (q_len - full_from) * k_len


def attention_op_flops(batch: int, q_heads: int, head_dim: int, pairs: int, backward: bool = False) -> int:
    """FLOPs the attention kernels run over ``pairs`` visible (query, key) pairs per head."""
    products = ATTENTION_BACKWARD_PRODUCTS if backward else 2
    return 2 * products * batch * q_heads * head_dim * pairs


def matmul_flops(rows: int, inner: int, cols: int) -> int:
    return 2 * rows * inner * cols


def attention_flops(batch: int, q_heads: int, q_len: int, k_len: int, head_dim: int, causal: bool,
                    pass_: str = "fwd") -> float:
    """FLOPs of attention for ``pass_`` "fwd", "bwd" or "fwd+bwd"."""
    forward = 4.0 * batch * q_heads * q_len * k_len * head_dim / (2 if causal else 1)
    factor = {"fwd": 1.0, "bwd": ATTENTION_BACKWARD_FACTOR, "fwd+bwd": 1.0 + ATTENTION_BACKWARD_FACTOR}
    if pass_ not in factor:
        raise ValueError(f"pass_ must be one of {tuple(factor)}, got {pass_!r}")
    return forward * factor[pass_]


# Importing torch.utils.flop_counter imports triton, which importing fused_remat must not do (Triton
# fixes the interpreter when it is imported), so the formulas are registered when someone imports
# the counter: at once if it already is, else from an import hook that runs after it loads.
_FLOP_COUNTER = "torch.utils.flop_counter"
_formulas: list[tuple[str, Callable, bool]] = []


def flop_formula(op_name: str, *, get_raw: bool = False):
    """Decorator: the FLOP formula of ``torch.ops.fused_remat.<op_name>`` (as
    ``torch.utils.flop_counter.register_flop_formula`` takes it), registered without importing the
    counter. Place it after the operator's definition."""
    def decorate(formula: Callable) -> Callable:
        _formulas.append((op_name, formula, get_raw))
        counter = sys.modules.get(_FLOP_COUNTER)
        if counter is not None:
            _register(counter, op_name, formula, get_raw)
        elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
        return formula
    return decorate


def _register(counter, op_name: str, formula: Callable, get_raw: bool) -> None:
    op = getattr(torch.ops.fused_remat, op_name)
    if op not in counter.flop_registry:
        counter.register_flop_formula(op, get_raw=get_raw)(formula)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds torch.utils.flop_counter the usual way, then registers the formulas once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _FLOP_COUNTER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for op_name, formula, get_raw in _formulas:
                _register(module, op_name, formula, get_raw)

        spec.loader.exec_module = exec_module
        return spec
