"""The remat setting: what a block keeps for backward, and how backward gets the rest back.

One type, ``Remat``, one member per policy. A string becomes a ``Remat`` once, where it enters
(``Remat.parse``: the block's constructor and ``remat`` setter, the model, the training command
line, the Hugging Face entry point); everything below takes the member and asks it:

    policy     keeps for backward                                  replays                   kept input in
    none       x, y1, qkv, o, lse, h, y2, u, a, norm statistics    nothing                   device memory
    cheap      x, qkv, o, lse, h, u, norm statistics (default)     nothing                   device memory
    selective  x, o, lse                                           projections               device memory
    full       x                                                   projections, attention    device memory
    offload    x                                                   projections, attention    pinned host memory

(y1, y2: the norm outputs; u: fc1's output, the activation's input; a: the activation output.)
``cheap`` rebuilds y1, y2 and a inside the backward kernels that need them; ``full`` replays the
forward from x up to fc1 at the start of backward; ``offload`` is ``full`` whose x waits in host
memory (``fused_remat.offload``). ``selective`` keeps attention's output and log-sum-exp, as
torchtitan's selective activation checkpointing keeps SDPA's, and replays only the norms,
projections and RoPE around it: at long sequences attention is most of the forward, and its
results cost dim + heads values per token. The custom operators take the policy by name (an
operator's schema takes strings, not Python types) and turn it back into the member at once.

``KEPT_FOR_BACKWARD`` is the memory contract of docs/design.md, the one place it is written: the
block's forward saves exactly the tensors its policy keeps, in this order, and the planner prices
each policy from the same table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

RESIDUAL, COMPUTE, FP32 = "residual", "compute", "fp32"


@dataclass(frozen=True)
class Kept:
    """One tensor a block can keep for backward: ``width_key`` names its number of elements per
    token (a key of ``fused_remat.block.block_widths``), ``dtype`` says what its elements are (the
    residual dtype, the compute dtype or fp32)."""

    name: str
    width_key: str
    dtype: str


KEPT_FOR_BACKWARD = (
    Kept("x", "dim", RESIDUAL),
    Kept("qkv", "qkv", COMPUTE),
    Kept("o", "attention", COMPUTE),
    Kept("lse", "heads", FP32),
    Kept("h", "dim", RESIDUAL),
    Kept("u", "pre_activation", COMPUTE),
    Kept("mean1", "mean", FP32),
    Kept("rstd1", "rstd", FP32),
    Kept("mean2", "mean", FP32),
    Kept("rstd2", "rstd", FP32),
    Kept("y1", "dim", COMPUTE),
    Kept("y2", "dim", COMPUTE),
    Kept("a", "ffn", COMPUTE),
)
_OUTPUTS = ("y1", "y2", "a")  # what cheap rebuilds inside the backward kernels
_INPUT_ONLY = ("x",)
_ATTENTION = ("o", "lse")  # attention's results: what a replay needs to skip attention


class Remat(str, enum.Enum):
    """A remat policy. A ``str`` (``Remat.CHEAP == "cheap"``), so it prints, compares and serializes
    as its name; ``keeps`` (names of ``KEPT_FOR_BACKWARD``), ``replays`` (the forward up to fc1 runs
    again from x at the start of backward, for what is not kept) and ``host_resident`` say what it
    does."""

    keeps: frozenset[str]
    replays: bool
    host_resident: bool

    NONE = ("none", tuple(k.name for k in KEPT_FOR_BACKWARD), False, False)
    CHEAP = ("cheap", tuple(k.name for k in KEPT_FOR_BACKWARD if k.name not in _OUTPUTS), False, False)
    SELECTIVE = ("selective", (*_INPUT_ONLY, *_ATTENTION), True, False)
    FULL = ("full", _INPUT_ONLY, True, False)
    OFFLOAD = ("offload", _INPUT_ONLY, True, True)

    def __new__(cls, name: str, keeps: tuple[str, ...], replays: bool, host_resident: bool):
        member = str.__new__(cls, name)
        member._value_ = name
        member.keeps, member.replays, member.host_resident = frozenset(keeps), replays, host_resident
        return member

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def replays_attention(self) -> bool:
        """Whether the replay runs attention's forward again (it keeps neither o nor lse)."""
        return self.replays and not self.keeps.issuperset(_ATTENTION)

    @property
    def rebuilds_outputs(self) -> bool:
        """Whether the norm and activation outputs are left for the backward kernels to rebuild
        (kept otherwise): the one kernel-facing flag, ``rebuild_output`` in the launchers and
        operators and ``REBUILD_OUTPUT`` in the kernels."""
        return not self.keeps.issuperset(_OUTPUTS)

    def kept(self) -> tuple[Kept, ...]:
        """What this policy keeps for backward, in ``KEPT_FOR_BACKWARD``'s order."""
        return tuple(k for k in KEPT_FOR_BACKWARD if k.name in self.keeps)

    @classmethod
    def parse(cls, value, supported: tuple[Remat, ...] | None = None, *, owner: str = "remat") -> Remat:
        """``value`` (a policy's name or a member) as a member of ``supported`` (default: all);
        otherwise a ValueError that names ``owner`` (the argument or flag) and the choices."""
        choices = tuple(cls) if supported is None else supported
        if isinstance(value, str) and value in choices:
            return cls(value)
        names = ", ".join(choice.value for choice in choices)
        raise ValueError(f"{owner} must be one of {names}, got {value!r}")


def parse_per_layer(value, n_layers: int, supported: tuple[Remat, ...] | None = None, *,
                    owner: str = "remat") -> list[Remat]:
    """One policy for every layer: a name or member, or a sequence with one per layer, or a comma
    list ("full,cheap,cheap") as the command line gives it."""
    if isinstance(value, str) and "," in value:
        value = value.split(",")
    policies = [value] * n_layers if isinstance(value, str) else list(value)
    if len(policies) != n_layers:
        raise ValueError(f"{owner}: got {len(policies)} policies for {n_layers} layers")
    return [Remat.parse(policy, supported, owner=owner) for policy in policies]


def kept_bytes_per_token(policy: Remat, widths: dict[str, int], residual_bytes: int, compute_bytes: int,
                         memory: str = "device") -> int:
    """Bytes a block keeps for backward per token under ``policy`` in ``memory`` ("device" or
    "host"), from ``widths`` (``block_widths``): x and h in the residual dtype (the parameters'
    dtype, fp32 master weights under autocast), matmul and attention outputs in the compute dtype,
    statistics in fp32."""
    policy = Remat.parse(policy, owner="policy")
    if memory not in ("device", "host"):
        raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
    if (memory == "host") != policy.host_resident:
        return 0
    size = {RESIDUAL: residual_bytes, COMPUTE: compute_bytes, FP32: 4}
    return sum(widths[k.width_key] * size[k.dtype] for k in policy.kept())
