"""FLOP counts by the usual conventions, for the planner's cost model and the benchmarks' TFLOP/s.

A matrix product costs 2 FLOPs per multiply-add; its backward twice the forward. Attention's
forward is 4 B H Nq Nk D (the two products), half of it when causal; its backward is 2.5x the
forward (docs/design.md, as FlashAttention reports it).
"""

from __future__ import annotations

ATTENTION_BACKWARD_FACTOR = 2.5


def attention_flops(batch: int, q_heads: int, q_len: int, k_len: int, head_dim: int, causal: bool,
                    pass_: str = "fwd") -> float:
    """FLOPs of attention for ``pass_`` "fwd", "bwd" or "fwd+bwd"."""
    forward = 4.0 * batch * q_heads * q_len * k_len * head_dim / (2 if causal else 1)
    factor = {"fwd": 1.0, "bwd": ATTENTION_BACKWARD_FACTOR, "fwd+bwd": 1.0 + ATTENTION_BACKWARD_FACTOR}
    if pass_ not in factor:
        raise ValueError(f"pass_ must be one of {tuple(factor)}, got {pass_!r}")
    return forward * factor[pass_]
