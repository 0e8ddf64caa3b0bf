"""The remat setting: what a block keeps for backward, and how backward gets the rest back.

One type, ``Remat``: a point of the keep-or-rebuild space. Every tensor of the memory contract
(``KEPT_FOR_BACKWARD``) is either kept by the forward or rebuilt in backward from what is kept; a
``Remat`` says which. Five points have names:

    policy     keeps for backward                                  rebuilds by replay        kept input in
    none       x, y1, qkv, o, lse, h, y2, u, a, norm statistics    nothing                   device memory
    cheap      x, qkv, o, lse, h, u, norm statistics (default)     nothing                   device memory
    selective  x, o, lse                                           projections               device memory
    full       x                                                   projections, attention    device memory
    offload    x                                                   projections, attention    pinned host memory

(y1, y2: the norm outputs; u: fc1's output, the activation's input; a: the activation output.)
Any other subset is spelled ``"keep:"`` and the names it keeps besides x (``"keep:o,lse,h"``),
``Remat.keeping`` builds one, and a subset that is a named policy's is that policy. A string
becomes a ``Remat`` once, where it enters (``Remat.parse``: the block's constructor and ``remat``
setter, the model, the training command line, the Hugging Face entry point); everything below takes
the point and asks it.

What is not kept comes back two ways. The norm and activation outputs (y1, y2, a) are rebuilt
inside the backward kernels that need them, at no extra pass. The rest is replayed at the start of
backward from what is kept, running only what is missing (``replays``): norm 1 and the qkv
projection and RoPE for qkv, attention for its output and log-sum-exp, the output projection and
the second norm's residual add for h, norm 2 and fc1 for u, a norm's forward for its statistics.
The same kernels on the same inputs give bitwise the same tensors, so every point computes the same
gradients. q, k and v (and SwiGLU's gate and up) are one choice each, not three (two): a product
with part of a weight's rows is not bitwise that part of the whole product (the matmul library
picks its kernel by shape).

``memory_budget`` picks a point per call: the one with the least replay FLOPs whose bytes are at
most a fraction of what ``none`` keeps (``within_budget``), priced for the call's sequence length
(attention's replay grows with it, the projections' do not). ``KEPT_FOR_BACKWARD`` is the memory
contract of docs/design.md, the one place it is written: the block's forward saves exactly the
tensors its point keeps, in this order, and the planner prices each point from the same table.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from dataclasses import dataclass

import torch

from .flops import visible_pairs

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
_OUTPUTS = ("y1", "y2", "a")  # rebuilt inside the backward kernels that need them
_ATTENTION = ("o", "lse")  # attention's results: what a replay needs to skip attention
# Tensors that are kept or rebuilt together: attention writes its output and log-sum-exp at once,
# a norm its two statistics (mean is empty for RMSNorm).
_TOGETHER = (_ATTENTION, ("mean1", "rstd1"), ("mean2", "rstd2"))
# What a replay rebuilds; keeping all of it means backward replays nothing.
_REPLAYABLE = tuple(k.name for k in KEPT_FOR_BACKWARD if k.name != "x" and k.name not in _OUTPUTS)
KEEP_PREFIX = "keep:"
# Every unnamed point made so far, by name: one object per point, so that code traced by
# torch.compile finds the points a budget weighs already made (dynamo cannot trace making one).
_MADE: dict = {}
_BUDGET_POINTS: list = []


class _Points(type):
    """Iterating ``Remat`` gives its named points (the policies), in the order of the table above."""

    def __iter__(cls):
        return iter(cls._NAMED.values())

    def __len__(cls) -> int:
        return len(cls._NAMED)


class Remat(str, metaclass=_Points):
    """A point of the keep-or-rebuild space: which tensors of ``KEPT_FOR_BACKWARD`` the forward
    keeps (``keeps``, always x) and whether x waits in host memory (``host_resident``). A ``str``
    (``Remat.CHEAP == "cheap"``, ``Remat.keeping({"o", "lse", "h"}) == "keep:o,lse,h"``), so it
    prints, compares and serializes as its name; ``Remat(name)`` turns the name back."""

    keeps: frozenset[str]
    keeps_each: tuple[bool, ...]  # whether it keeps each tensor of KEPT_FOR_BACKWARD but x, in order
    host_resident: bool
    _NAMED: dict[str, Remat] = {}

    NONE: Remat
    CHEAP: Remat
    SELECTIVE: Remat
    FULL: Remat
    OFFLOAD: Remat

    def __new__(cls, value) -> Remat:
        if isinstance(value, Remat):
            return value
        if not isinstance(value, str):
            raise TypeError(f"a remat point is a name, got {type(value).__name__}")
        if value in cls._NAMED:
            return cls._NAMED[value]
        if value.startswith(KEEP_PREFIX):
            names = value[len(KEEP_PREFIX):]
            return cls.keeping(names.split(",") if names else ())
        raise ValueError(f"{value!r} is neither a remat policy ({', '.join(cls._NAMED)}) nor a "
                         f"{KEEP_PREFIX!r} list of kept tensors")

    @classmethod
    def _point(cls, name: str, keeps, host_resident: bool = False) -> Remat:
        point = str.__new__(cls, name)
        point.keeps, point.host_resident = frozenset(("x", *keeps)), host_resident
        point.keeps_each = tuple(k.name in point.keeps for k in KEPT_FOR_BACKWARD if k.name != "x")
        return point

    @classmethod
    def keeping(cls, names) -> Remat:
        """The point that keeps x and ``names`` (tensors of ``KEPT_FOR_BACKWARD``) in device memory:
        a named policy where one keeps exactly these."""
        known = [k.name for k in KEPT_FOR_BACKWARD]
        names = set(names) - {"x"}
        unknown = sorted(names - set(known))
        if unknown:
            raise ValueError(f"unknown kept tensor(s) {', '.join(unknown)}; choose among {', '.join(known[1:])}")
        for group in _TOGETHER:
            if 0 < len(names & set(group)) < len(group):
                raise ValueError(f"{' and '.join(group)} are kept or rebuilt together, got only "
                                 f"{', '.join(sorted(names & set(group)))}")
        for named in cls._NAMED.values():
            if not named.host_resident and named.keeps == names | {"x"}:
                return named
        name = KEEP_PREFIX + ",".join(name for name in known if name in names)
        if name not in _MADE:
            _MADE[name] = cls._point(name, names)
        return _MADE[name]

    def __reduce__(self):
        return Remat, (str(self),)

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(str(self))

    @property
    def value(self) -> str:
        return str(self)

    @property
    def replays(self) -> bool:
        """Whether backward first replays part of the forward from what is kept (anything but the
        norm and activation outputs is missing)."""
        return not self.keeps.issuperset(_REPLAYABLE)

    @property
    def replays_attention(self) -> bool:
        """Whether the replay runs attention's forward again (it keeps neither o nor lse)."""
        return not self.keeps.issuperset(_ATTENTION)

    @property
    def rebuilds_outputs(self) -> bool:
        """Whether any norm or activation output is left for its backward kernel to rebuild (the
        kernel-facing flag, ``rebuild_output`` in the launchers and ``REBUILD_OUTPUT`` in the
        kernels, is per output: ``rebuilds``)."""
        return not self.keeps.issuperset(_OUTPUTS)

    def rebuilds(self, name: str) -> bool:
        """Whether the tensor ``name`` of ``KEPT_FOR_BACKWARD`` is rebuilt in backward (not kept)."""
        return name not in self.keeps

    def kept(self) -> tuple[Kept, ...]:
        """What this point keeps for backward, in ``KEPT_FOR_BACKWARD``'s order."""
        return tuple(k for k in KEPT_FOR_BACKWARD if k.name in self.keeps)

    @classmethod
    def parse(cls, value, supported: tuple[Remat, ...] | None = None, *, owner: str = "remat") -> Remat:
        """``value`` (a policy's name, a ``"keep:..."`` list or a point) as a point, one of
        ``supported`` where given (default: any); otherwise a ValueError that names ``owner`` (the
        argument or flag) and the choices."""
        names = ", ".join(choice.value for choice in (tuple(cls) if supported is None else supported))
        try:
            point = cls(value)
        except (TypeError, ValueError) as error:
            if isinstance(value, str) and value.startswith(KEEP_PREFIX):
                raise ValueError(f"{owner} {value!r}: {error}") from None
            point = None
        if point is None or (supported is not None and point not in supported):
            subsets = "" if supported is not None else f", or {KEEP_PREFIX!r} and the tensors to keep besides x"
            raise ValueError(f"{owner} must be one of {names}{subsets}, got {value!r}")
        return point


Remat._NAMED = {point: point for point in (
    Remat._point("none", (k.name for k in KEPT_FOR_BACKWARD)),
    Remat._point("cheap", _REPLAYABLE),
    Remat._point("selective", _ATTENTION),
    Remat._point("full", ()),
    Remat._point("offload", (), host_resident=True),
)}
Remat.NONE, Remat.CHEAP, Remat.SELECTIVE, Remat.FULL, Remat.OFFLOAD = Remat._NAMED.values()


def parse_per_layer(value, n_layers: int, supported: tuple[Remat, ...] | None = None, *,
                    owner: str = "remat") -> list[Remat]:
    """One point for every layer: a name or point, or a sequence with one per layer, or a comma
    list ("full,cheap,cheap", "keep:o,lse,h,cheap": a kept tensor's name continues the "keep:"
    before it) as the command line gives it."""
    if isinstance(value, str) and "," in value:
        tensors = {k.name for k in KEPT_FOR_BACKWARD}
        layers = []
        for piece in value.split(","):
            if layers and layers[-1].startswith(KEEP_PREFIX) and piece in tensors:
                layers[-1] += "," + piece
            else:
                layers.append(piece)
        value = layers if len(layers) > 1 else layers[0]
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


def peak_bytes_per_token(policy: Remat, widths: dict[str, int], residual_bytes: int, compute_bytes: int,
                         qk_norm: bool = False) -> int:
    """The most bytes per token one block's forward + backward holds at once under ``policy``, on
    the eager path where the backward frees each activation at its last use (``block._backward_pass``),
    from ``widths`` (``block_widths``) and the dtypes as in ``kept_bytes_per_token``. Counted: what
    the point keeps, the block's output y (held by the caller until the backward is done) and each
    moment's transients; left out: x and the incoming gradient dy (the caller's), and what does not
    grow with the tokens (the weights' gradients, the norms' per-program partial sums). Exact for
    the named points; for a ``keep:`` point whose replay stops before fc1 an upper bound. The
    step's peak is the largest of these moments:

    - forward, attention (with qk_norm, its normalized copy of qkv), norm 2 beside out_proj's
      output, fc2's output beside the activation's (and y beside it, in another dtype);
    - the replay (a point that replays): all of ``cheap``'s tensors and norm 2's output, at fc1;
    - backward, the activation's (its input gradient; both outputs go into buffers that are done);
      norm 2's (its input and output gradients, its rebuilt output); attention's (do, dqkv and two
      fp32 rows per head); norm 1's (its input and output gradients, its rebuilt output).
    """
    policy = Remat.parse(policy, owner="policy")
    c = compute_bytes
    width = widths["dim"] * c  # norm outputs, the dim-wide products and their gradients
    residual = widths["dim"] * residual_bytes  # h, y, and the residual stream's gradients
    qkv, o, u, a = (widths[key] * c for key in ("qkv", "attention", "pre_activation", "ffn"))
    lse = 4 * widths["heads"]
    stats = 4 * (widths["mean"] + widths["rstd"])  # one norm's
    copy = qkv if qk_norm else 0
    cast = 0 if residual_bytes == c else width  # dy and dh in the compute dtype
    kept = {name: width if name in policy.keeps else 0 for name in ("y1", "y2")}
    kept_a = a if "a" in policy.keeps else 0
    attention_half = qkv + o + lse + stats + kept["y1"]
    cheap = qkv + o + lse + residual + u + 2 * stats  # what backward starts from, kept or replayed
    fc2 = attention_half + stats + residual + u + kept["y2"] + width
    forward = [  # fc2's output becomes y (written over it; beside it in another dtype)
        attention_half + copy,
        attention_half + 2 * width + stats + residual,
        fc2 + a,
        fc2 + kept_a + residual if cast else 0,
    ]
    backward = [  # beside y
        cheap + kept["y1"] + kept["y2"] + width if policy.replays else 0,
        cheap + kept["y1"] + kept["y2"] + a + cast,
        cheap + kept["y1"] + width + residual + width - kept["y2"],
        attention_half + residual + cast + o + qkv + copy + 8 * widths["heads"],
        stats + residual + qkv + width + residual + width - kept["y1"],
    ]
    return max(max(forward), residual + max(backward))


def replay_flops_per_token(point: Remat, widths: dict[str, int], attention_pairs_per_token: float) -> float:
    """Matrix-product FLOPs per token that ``point``'s replay runs, from ``widths``
    (``block_widths``): the qkv projection for qkv, attention's forward for its output and
    log-sum-exp (4 D per visible (query, key) pair and head; ``attention_pairs_per_token``: the
    visible keys per query, which grow with the sequence), the output projection for h, fc1 for u.
    Norms, RoPE and activations are element-wise and not counted (``replay_norm_passes``); nor are
    low-rank adapters."""
    point = Remat.parse(point, owner="point")
    dim = widths["dim"]
    parts = {"qkv": 2 * dim * widths["qkv"], "o": 4 * widths["attention"] * attention_pairs_per_token,
             "h": 2 * widths["attention"] * dim, "u": 2 * dim * widths["pre_activation"]}
    return float(sum(flops for name, flops in parts.items() if point.rebuilds(name)))


def replay_norm_passes(point: Remat) -> int:
    """Norm forwards the replay runs: norm 1 for qkv or norm 1's statistics, norm 2 for h, u or
    norm 2's statistics (each reads the tokens once more, which matters where no product does)."""
    first = point.rebuilds("qkv") or point.rebuilds("rstd1")
    second = any(point.rebuilds(name) for name in ("h", "u", "rstd2"))
    return int(first) + int(second)


# What a budget weighs, one choice each: the norm and activation outputs are never worth their bytes
# (their backward kernels rebuild them without an extra pass), so no budget keeps them.
_BUDGET_CHOICES = (("qkv",), _ATTENTION, ("h",), ("u",), ("mean1", "rstd1"), ("mean2", "rstd2"))


def budget_points() -> tuple[Remat, ...]:
    """Every device point a memory budget chooses among (the named ones with device-resident x,
    but ``none``, among them). Made on the first call and kept: a block given a budget calls this
    when the budget is set, so that a compiled forward only reads them."""
    if not _BUDGET_POINTS:
        _BUDGET_POINTS.extend(
            Remat.keeping(name for group, keep in zip(_BUDGET_CHOICES, chosen) if keep for name in group)
            for chosen in itertools.product((False, True), repeat=len(_BUDGET_CHOICES)))
    return tuple(_BUDGET_POINTS)


def within_budget(fraction: float, widths: dict[str, int], residual_bytes: int, compute_bytes: int,
                  attention_pairs_per_token: float) -> Remat:
    """The point that keeps at most ``fraction`` of what ``none`` keeps per token with the least
    replay FLOPs (then the fewest norm passes, then the fewest bytes), torch.compile's
    ``activation_memory_budget`` in our terms: 1 gives ``cheap`` (no replay), and a fraction below
    x's share, which every device point keeps, gives ``offload`` (x in host memory).

    The answer is kept per argument set (a block asks on every call, with the same shape and
    sequence length); ``search_budget`` searches every time, for torch.compile to trace."""
    return _kept_budget_choice(fraction, tuple(widths.items()), residual_bytes, compute_bytes,
                               attention_pairs_per_token)


@functools.lru_cache(maxsize=1024)
def _kept_budget_choice(fraction, width_items, residual_bytes, compute_bytes, attention_pairs_per_token) -> Remat:
    return search_budget(fraction, dict(width_items), residual_bytes, compute_bytes, attention_pairs_per_token)


def search_budget(fraction: float, widths: dict[str, int], residual_bytes: int, compute_bytes: int,
                  attention_pairs_per_token: float) -> Remat:
    """``within_budget``'s search."""
    # a fraction computed as bytes over none's bytes must admit those bytes, whatever its last bit
    limit = fraction * kept_bytes_per_token(Remat.NONE, widths, residual_bytes, compute_bytes) * (1 + 1e-12)
    best = None
    for point in budget_points():
        nbytes = kept_bytes_per_token(point, widths, residual_bytes, compute_bytes)
        if nbytes > limit:
            continue
        key = (replay_flops_per_token(point, widths, attention_pairs_per_token), replay_norm_passes(point), nbytes)
        if best is None or key < best[0]:
            best = (key, point)
    return Remat.OFFLOAD if best is None else best[1]


def point_for_call(fraction: float, widths: dict[str, int], residual_bytes: int, compute_bytes: int, seq_len: int,
                   causal: bool = True, window: tuple[int, int] = (-1, -1)) -> Remat:
    """The point a block under ``memory_budget = fraction`` runs for a call whose attention spans
    ``seq_len`` tokens (the longest packed document, or the whole sequence: documents are priced as
    if each were as long as the longest). The one place this choice is made: the block asks it on
    every call, the trainer for the plan it prints. Kept per argument set (``within_budget``);
    searched afresh while torch.compile traces, which cannot trace the table."""
    pairs_per_token = visible_pairs(seq_len, seq_len, causal, window) / seq_len
    choose = search_budget if torch.compiler.is_dynamo_compiling() else within_budget
    return choose(fraction, widths, residual_bytes, compute_bytes, pairs_per_token)


def check_memory_budget(value, owner: str = "memory_budget") -> float | None:
    """``value`` as a fraction in [0, 1] (None: no budget); otherwise an error naming ``owner``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner} must be a number in [0, 1] (a fraction of what remat='none' keeps), "
                        f"got {type(value).__name__}")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner} must be in [0, 1] (a fraction of what remat='none' keeps), got {value}")
    return float(value)
