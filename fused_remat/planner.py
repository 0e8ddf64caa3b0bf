"""The remat planner: what each layer keeps so that activations fit a budget.

Per layer, the memory contract (``fused_remat.remat``, docs/design.md) gives the bytes each point
keeps for backward, and a cost model gives the extra compute each adds to the layer's training
step: ``cheap`` rebuilds only element-wise intermediates inside kernels that run anyway (no extra
matrix products); every other point replays a projection for each product it did not keep and
attention where it kept neither its output nor its log-sum-exp (``selective`` the projections up
to fc1, ``full`` those and attention: a quarter to a third of the layer's step). Either the FLOP
model below, which prices every keep-or-rebuild point (``remat.budget_points``), or timings
measured on the device for the named policies (``measure_policy_costs``) supply those costs.

The planner then picks, among all ways to give each layer a point, the one with the least extra
compute whose predicted peak fits the budget: adaptive checkpoint selection, per layer and per
tensor. The peak is what every layer keeps, plus what the rest of the model keeps (``head_bytes``),
plus the largest transient among the layers (``layer_transient_bytes_per_token``: a block step's
peak per token, ``remat.peak_bytes_per_token``, above what the block keeps): backward reaches the
layers last to first, and while one runs, the layers below it still hold what they keep. Not
counted: the loss's chunk of logits while the forward computes it. Chen et al.'s
checkpoint-every-sqrt(n)-layers is the degenerate case with two choices per layer (keep everything
or keep the input) and a budget fixed at about 2 sqrt(n) layers' worth.
The layers are identical, so only how many take each point matters (``_cheapest_mix``, once for
each transient a plan's largest may be: ``_cheapest_within_peak``).

``offload`` keeps what ``full`` keeps in host memory instead: its device bytes are zero and its
cost is ``full``'s plus whatever part of the copies does not hide behind compute. The block input
goes to the host during the layer's forward and comes back during the next layer's backward, so
each copy (T x dim residual-dtype bytes over the host link) hides when it is shorter than that
compute. With equal cost the planner prefers the plan with fewer device bytes, so ``offload``
replaces ``full`` wherever its copies hide. The host bytes are reported apart.

It places the costliest layers (``offload``, ``full``, ...) first (lowest indices): backward
reaches them last, when the later layers' saved activations are already freed, so their replay
does not add to the peak.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .block import TransformerBlock, block_widths
from .context_parallel_documents import attention_transient_bytes_per_token
from .flops import ATTENTION_BACKWARD_FACTOR, attention_flops, visible_pairs
from .model import ModelConfig
from .remat import (
    Remat, budget_points, kept_bytes_per_token, peak_bytes_per_token, replay_flops_per_token, replay_norm_passes,
)

_FP32 = 4

# Stated assumptions, used where nothing was measured (no GPU): not measurements.
ASSUMED_HOST_BANDWIDTH = 25e9  # bytes/s each way over PCIe Gen4 x16 with pinned memory
ASSUMED_DEVICE_FLOPS = 400e12  # bf16 FLOP/s an H100 sustains over a training step
ASSUMED_DEVICE_BANDWIDTH = 3.0e12  # bytes/s an H100's HBM3 sustains in a streaming kernel


@dataclass(frozen=True)
class Precision:
    """``residual``: the dtype of the residual stream (the parameters' dtype: fp32 master weights
    under autocast); ``compute``: the dtype of matmuls, attention and what they produce."""

    residual: torch.dtype
    compute: torch.dtype

    @property
    def residual_bytes(self) -> int:
        return torch.empty((), dtype=self.residual).element_size()

    @property
    def compute_bytes(self) -> int:
        return torch.empty((), dtype=self.compute).element_size()


def _widths(config: ModelConfig) -> dict[str, int]:
    """Elements per token of what one layer keeps (``block_widths``) for this model's blocks."""
    return block_widths(config.dim, config.n_heads, config.n_kv_heads, config.ffn_dim, config.norm, config.activation)


def layer_bytes_per_token(config: ModelConfig, policy: Remat, precision: Precision, memory: str = "device") -> int:
    """Bytes one fused block keeps for backward per token under ``policy`` in ``memory`` ("device"
    or "host"; the block's own table, ``fused_remat.remat.KEPT_FOR_BACKWARD``)."""
    return kept_bytes_per_token(policy, _widths(config), precision.residual_bytes, precision.compute_bytes, memory)


def layer_transient_bytes_per_token(config: ModelConfig, policy: Remat, precision: Precision,
                                    document_ranks: int = 1) -> int:
    """Bytes per token one fused block's forward + backward holds on the device above what it keeps
    there: ``remat.peak_bytes_per_token`` less ``layer_bytes_per_token``. The peak counts the block's
    output y and leaves out its input x, both dim residual-dtype elements per token, and what it
    keeps counts x, so the two cancel. For GPT-2's shapes in fp32 that is nothing for ``none``, the
    activation's input gradient for ``cheap`` and the replay besides for ``full``. A host-resident
    point (``offload``) keeps nothing on the device, and its backward also holds the input of the
    offloaded layer before it, which ``offload.HostCopy.fetch`` prefetches then: one more layer
    input (its host bytes), an upper bound where no earlier layer is offloaded. ``ModelConfig`` has
    no per-head q/k norm, so none is counted (``qk_norm=False``). ``document_ranks`` > 1: context
    parallelism over documents on that many ranks, whose attention gathers every rank's k and v
    (``context_parallel_documents.attention_transient_bytes_per_token``), counted on top of the
    block's peak: an upper bound, as that moment is attention's, not always the block's largest."""
    point = Remat.parse(policy, owner="policy")
    widths, r, c = _widths(config), precision.residual_bytes, precision.compute_bytes
    peak = peak_bytes_per_token(point, widths, r, c)
    documents = 0
    if document_ranks > 1:
        kv_width = (config.n_kv_heads or config.n_heads) * (config.dim // config.n_heads)
        documents = attention_transient_bytes_per_token(document_ranks, kv_width, c)
    return (peak - kept_bytes_per_token(point, widths, r, c) + kept_bytes_per_token(point, widths, r, c, "host")
            + documents)


def head_bytes(config: ModelConfig, tokens: int, precision: Precision) -> int:
    """What the rest of the model keeps: the token ids (embedding backward), the final norm's input
    and statistics, and the chunked loss's gradients (one per hidden state, one for the head, and
    its fp32 backward scale)."""
    statistics = 2 * _FP32 if config.norm == "layernorm" else _FP32
    per_token = 8 + precision.residual_bytes * config.dim + statistics + precision.residual_bytes * config.dim
    return tokens * per_token + _FP32 * config.vocab_size * config.dim + _FP32


def layer_step_flops(config: ModelConfig, batch: int, seq_len: int,
                     attention_pairs: float | None = None) -> tuple[float, float, float]:
    """(forward FLOPs up to fc1, forward FLOPs, FLOPs of one training step) of one layer.

    Matmuls cost 2 FLOPs per multiply-add forward and twice that backward; attention is
    4 B H N^2 D forward (half, causal) and 2.5x that backward (docs/design.md); with masks, 4 H D
    per visible (query, key) pair (``_forward_parts``)."""
    projections, attention, fc2 = _forward_parts(config, batch, seq_len, attention_pairs)
    forward = projections + fc2 + attention
    return projections + attention, forward, 3 * (projections + fc2) + (1 + ATTENTION_BACKWARD_FACTOR) * attention


def _forward_parts(config: ModelConfig, batch: int, seq_len: int,
                   attention_pairs: float | None = None) -> tuple[float, float, float]:
    """One layer's forward FLOPs: (the projections up to fc1, attention, fc2).

    Masks shrink attention's work, not the bytes a policy keeps: ``attention_pairs`` is the
    visible (query, key) pairs of one sequence (packed documents: the sum of n_i (n_i + 1) / 2 over
    a row's documents, ``visible_pairs`` per document); None counts the causal mask of the whole
    row, under the model's window where it has one."""
    widths = _widths(config)
    tokens = batch * seq_len
    head_dim = config.dim // config.n_heads
    projections = 2 * tokens * config.dim * (widths["qkv"] + widths["attention"] + widths["pre_activation"])
    if attention_pairs is None and config.window == (-1, -1):
        attention = attention_flops(batch, config.n_heads, seq_len, seq_len, head_dim, causal=True)
    else:
        pairs = visible_pairs(seq_len, seq_len, True, config.window) if attention_pairs is None else attention_pairs
        attention = 4.0 * batch * config.n_heads * head_dim * pairs
    return projections, attention, 2 * tokens * widths["ffn"] * config.dim


def replay_flops(config: ModelConfig, batch: int, seq_len: int, policy: Remat,
                 attention_pairs: float | None = None) -> float:
    """What ``policy``'s backward replays of one layer's forward (``remat.replay_flops_per_token``:
    a projection per rebuilt product, attention where its results are not kept), with attention
    counted as ``_forward_parts`` counts it."""
    _, attention, _ = _forward_parts(config, batch, seq_len, attention_pairs)
    widths, tokens = _widths(config), batch * seq_len
    pairs_per_token = attention / (4 * widths["attention"] * tokens)
    return replay_flops_per_token(Remat.parse(policy, owner="policy"), widths, pairs_per_token) * tokens


def offload_cost(full_cost: float, step_seconds: float, forward_seconds: float, copy_seconds: float) -> float:
    """``offload``'s extra time as a fraction of a layer's step: ``full``'s replay plus the parts of
    the two copies that do not hide, the copy out behind the layer's forward and the copy back
    behind a layer's backward (the prefetch runs one layer ahead)."""
    backward_seconds = step_seconds - forward_seconds
    exposed = max(0.0, copy_seconds - forward_seconds) + max(0.0, copy_seconds - backward_seconds)
    return full_cost + exposed / step_seconds


def copy_seconds(config: ModelConfig, batch: int, seq_len: int, precision: Precision, host_bandwidth: float) -> float:
    """Seconds to move one offloaded layer's kept bytes one way over the host link."""
    return layer_bytes_per_token(config, "offload", precision, "host") * batch * seq_len / host_bandwidth


def flop_policy_costs(config: ModelConfig, batch: int, seq_len: int, precision: Precision | None = None,
                      host_bandwidth: float = ASSUMED_HOST_BANDWIDTH,
                      device_flops: float = ASSUMED_DEVICE_FLOPS,
                      attention_pairs: float | None = None,
                      device_bandwidth: float = ASSUMED_DEVICE_BANDWIDTH) -> dict[Remat, float]:
    """Extra compute of each named policy and of every point a budget weighs
    (``remat.budget_points``) as a fraction of the layer's training step (FLOP model; a norm
    forward the replay runs again is priced by the bytes it streams at ``device_bandwidth``); for
    ``offload``, seconds from the FLOPs at ``device_flops`` against copies at ``host_bandwidth``
    (both assumptions unless measured; bf16 autocast over fp32 weights unless ``precision``).
    ``attention_pairs`` as in ``_forward_parts``: packed documents make attention, and so its
    replay, cheaper against the projections."""
    precision = Precision(torch.float32, torch.bfloat16) if precision is None else precision
    _, forward, step = layer_step_flops(config, batch, seq_len, attention_pairs)
    # A norm forward the replay adds moves the tokens' x in and y out: no FLOPs, but time, priced at
    # what the device computes while it streams those bytes
    norm_pass = (batch * seq_len * config.dim * (precision.residual_bytes + precision.compute_bytes)
                 * device_flops / device_bandwidth)
    costs = {point: (replay_flops(config, batch, seq_len, point, attention_pairs)
                     + replay_norm_passes(point) * norm_pass) / step
             for point in (*Remat, *budget_points())}
    copy = copy_seconds(config, batch, seq_len, precision, host_bandwidth)
    costs[Remat.OFFLOAD] = offload_cost(costs[Remat.FULL], step / device_flops, forward / device_flops, copy)
    return costs


def measure_policy_costs(config: ModelConfig, batch: int, seq_len: int, precision: Precision,
                         device: torch.device, repeats: int = 5) -> dict[Remat, float]:
    """Extra time of each policy over ``none``, as a fraction, from timing one block's forward and
    backward on ``device`` (median of ``repeats`` after a warm-up). ``offload``'s is ``full``'s
    plus the copies' exposed part, from the measured forward and step times and the host link's
    measured bandwidth (``measure_host_bandwidth``): one block alone has no neighbour for its
    copies to hide behind, so timing it would price them as never hidden."""
    block = TransformerBlock(config.dim, config.n_heads, **config.block_kwargs(), device=device, dtype=precision.residual)
    x = torch.randn(batch, seq_len, config.dim, device=device, dtype=precision.residual, requires_grad=True)
    autocast = precision.compute != precision.residual
    times, forward_times = {}, {}
    for policy in (p for p in Remat if not p.host_resident):
        block.remat = policy
        samples, forward_samples = [], []
        for _ in range(repeats + 1):
            start = _now(device)
            with torch.autocast(device.type, dtype=precision.compute, enabled=autocast):
                y = block(x)
            forward_samples.append(_now(device) - start)
            y.backward(torch.ones_like(y))
            samples.append(_now(device) - start)
        times[policy] = sorted(samples[1:])[repeats // 2]
        forward_times[policy] = sorted(forward_samples[1:])[repeats // 2]
    costs = {policy: max(0.0, t / times[Remat.NONE] - 1.0) for policy, t in times.items()}
    copy = copy_seconds(config, batch, seq_len, precision, measure_host_bandwidth(device))
    costs[Remat.OFFLOAD] = offload_cost(costs[Remat.FULL], times[Remat.NONE], forward_times[Remat.NONE], copy)
    return costs


def measure_host_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of the slower direction of a pinned host <-> ``device`` copy (median of ``repeats``);
    on CPU, where offload moves nothing, infinite."""
    if device.type != "cuda":
        return float("inf")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = []
    for source, target in ((host, on_device), (on_device, host)):
        samples = []
        for _ in range(repeats + 1):
            start = _now(device)
            target.copy_(source, non_blocking=True)
            samples.append(_now(device) - start)
        seconds.append(sorted(samples[1:])[repeats // 2])
    return nbytes / max(seconds)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class RematPlan:
    policies: list[Remat]
    layer_bytes: list[int]  # kept on the device for backward
    layer_host_bytes: list[int]  # offloaded to host memory
    layer_transient_bytes: list[int]  # held on the device above layer_bytes while the layer's step runs
    fixed_bytes: int
    layer_extra: list[float]  # extra compute of each layer, as a fraction of its step
    step_flops: float  # the whole model's training step without remat
    layer_step_flops: float
    budget: int | None
    cost_source: str
    tokens: int
    budget_fraction: float | None = None  # a per-layer memory_budget fraction instead of bytes

    @property
    def predicted_bytes(self) -> int:
        """What the model keeps for backward on the device (what the saved-memory meter measures)."""
        return self.fixed_bytes + sum(self.layer_bytes)

    @property
    def transient_bytes(self) -> int:
        """The largest layer transient: what one layer's step holds above what it keeps."""
        return max(self.layer_transient_bytes, default=0)

    @property
    def peak_bytes(self) -> int:
        """The step's predicted activation peak, what a byte budget bounds: what the model keeps
        plus the largest layer transient (backward reaches the layers last to first, and while one
        runs, those below it still hold what they keep). Not counted: the loss's chunk of logits
        while the forward computes it."""
        return self.predicted_bytes + self.transient_bytes

    @property
    def host_bytes(self) -> int:
        return sum(self.layer_host_bytes)

    @property
    def extra_compute(self) -> float:
        """Extra compute of the plan as a fraction of the model's training step."""
        return sum(self.layer_extra) * self.layer_step_flops / self.step_flops

    def table(self) -> str:
        if self.budget_fraction is not None:
            budget = f"memory_budget {self.budget_fraction:g} (each layer keeps at most that share of what none keeps)"
        else:
            budget = "no budget" if self.budget is None else f"budget {_mib(self.budget)} for the peak"
        width = max((len(policy) for policy in self.policies), default=6)
        lines = [
            f"remat plan for {self.tokens:,} tokens per step, {budget}; extra compute from the {self.cost_source}",
            f"{'layer':>6}  {'policy':<{width}} {'kept':>12} {'transient':>12} {'host memory':>12} {'extra compute':>14}",
        ]
        rows = zip(self.policies, self.layer_bytes, self.layer_transient_bytes, self.layer_host_bytes,
                   self.layer_extra)
        for i, (policy, nbytes, transient, host, extra) in enumerate(rows):
            lines.append(f"{i:>6}  {policy:<{width}} {_mib(nbytes):>12} {_mib(transient):>12} {_mib(host):>12} "
                         f"{extra:>+13.1%}")
        lines.append(f"{'head':>6}  {'':<{width}} {_mib(self.fixed_bytes):>12}")
        lines.append(f"{'total':>6}  {'':<{width}} {_mib(self.predicted_bytes):>12} {'':>12} "
                     f"{_mib(self.host_bytes):>12} {self.extra_compute:>+13.1%} of a step")
        lines.append(f"{'peak':>6}  {'':<{width}} {_mib(self.peak_bytes):>12}  kept + the largest layer transient "
                     f"(remat.peak_bytes_per_token): the step's predicted activation peak")
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def plan_remat(config: ModelConfig, batch: int, seq_len: int, precision: Precision, budget: int | None,
               costs: dict[Remat, float] | None = None, cost_source: str = "FLOP model",
               candidates: tuple[Remat, ...] | None = None, owner: str = "budget",
               attention_pairs: float | None = None, document_ranks: int = 1) -> RematPlan:
    """The per-layer points with the least extra compute whose predicted activation peak stays
    within ``budget``: the bytes the layers keep, plus what the embedding, final norm and loss keep,
    plus the largest transient among the points the plan uses (``layer_transient_bytes_per_token``;
    ``RematPlan.peak_bytes``). ``budget=None`` plans the cheapest points outright. ``candidates``
    (default: every point ``costs`` prices, which the FLOP model does for each tensor's
    keep-or-rebuild, measured costs for the named policies) are what a layer may take. Raises
    ValueError naming ``owner`` (the budget's argument or flag) when even the smallest plan's peak
    does not fit. ``attention_pairs``: see ``flop_policy_costs``; ``document_ranks``: see
    ``layer_transient_bytes_per_token``."""
    tokens = batch * seq_len
    if costs is None:
        costs = flop_policy_costs(config, batch, seq_len, precision, attention_pairs=attention_pairs)
    candidates = tuple(costs) if candidates is None else tuple(Remat.parse(p, owner="candidates") for p in candidates)
    per_layer = {p: layer_bytes_per_token(config, p, precision) * tokens for p in candidates}
    transient = {p: layer_transient_bytes_per_token(config, p, precision, document_ranks) * tokens for p in candidates}
    fixed = head_bytes(config, tokens, precision)
    counts = _cheapest_within_peak(config.n_layers, {p: (per_layer[p], transient[p], costs[p]) for p in candidates},
                                   None if budget is None else budget - fixed)
    if counts is None:
        smallest = fixed + min(limit + config.n_layers * min(per_layer[p] for p in candidates if transient[p] <= limit)
                               for limit in set(transient.values()))
        raise ValueError(f"{owner}: {_mib(budget)} is below the smallest plan's peak, {_mib(smallest)} "
                         f"({tokens:,} tokens, {config.n_layers} layers; kept + the largest layer transient); "
                         f"shorten the sequences or the batch")
    # Most expensive point first (``offload`` and ``full`` on the earliest layers), as the module docstring explains.
    order = sorted(counts.items(), key=lambda item: (-costs[item[0]], -per_layer[item[0]]))
    policies = [p for p, n in order for _ in range(n)]
    return explain_policies(config, batch, seq_len, precision, policies, costs, cost_source, budget, attention_pairs,
                            document_ranks=document_ranks)


def _cheapest_within_peak(layers: int, options: dict[Remat, tuple[int, int, float]],
                          budget: int | None) -> dict[Remat, int] | None:
    """How many of ``layers`` identical layers take each option (kept bytes, transient bytes, cost)
    for the least total cost (then the smallest peak) whose kept bytes plus the largest transient
    among the options it uses stay within ``budget`` (None: any), or None if nothing fits.

    The largest transient is not a sum, so ``_cheapest_mix`` runs once for each value t it may
    take, over the options whose transient is at most t, within ``budget`` - t. A plan whose largest
    transient is t is among that run's, and each run's answer fits, so the cheapest answer of all
    the runs is the cheapest plan: exact. Within a run, an option that another beats or ties on both
    bytes and cost is left out (swapping it for that one loses nothing)."""
    best = None
    for limit in sorted({transient for _, transient, _ in options.values()}):
        allowed = {p: (nbytes, cost) for p, (nbytes, transient, cost) in options.items() if transient <= limit}
        counts = _cheapest_mix(layers, _undominated(allowed), None if budget is None else budget - limit)
        if counts is None:
            continue
        cost = _rounded(sum(options[p][2] * n for p, n in counts.items()))
        peak = sum(options[p][0] * n for p, n in counts.items()) + max(options[p][1] for p in counts)
        if best is None or (cost, peak) < best[0]:
            best = ((cost, peak), counts)
    return None if best is None else best[1]


def _undominated(options: dict[Remat, tuple[int, float]]) -> dict[Remat, tuple[int, float]]:
    """``options`` (bytes, cost) less each that another has at no more bytes and no more cost (of
    options that tie on both, the first)."""
    kept, cheapest = {}, math.inf
    for point, (nbytes, cost) in sorted(options.items(), key=lambda item: (item[1][0], _rounded(item[1][1]))):
        if _rounded(cost) < cheapest:  # fewer bytes than none kept so far, so it must cost less
            kept[point], cheapest = (nbytes, cost), _rounded(cost)
    return kept


def _cheapest_mix(layers: int, options: dict[Remat, tuple[int, float]], budget: int | None) -> dict[Remat, int] | None:
    """How many of ``layers`` identical layers take each option (bytes, cost) for the least total
    cost (then the fewest bytes) within ``budget`` bytes, or None if nothing fits. Dynamic
    programming over layers that keeps, per layer count, only the mixes no other mix beats on both
    bytes and cost: exact, and small where a brute force over options ** layers is not. Without a
    budget, every layer takes the cheapest option (then the smallest)."""
    if budget is None:
        return {min(options, key=lambda point: (_rounded(options[point][1]), options[point][0])): layers}
    mixes = [(0, 0.0, {})]  # (bytes, cost, counts), cheapest first within each byte total
    for _ in range(layers):
        grown = {}
        for nbytes, cost, counts in mixes:
            for point, (more_bytes, more_cost) in options.items():
                total = nbytes + more_bytes
                if budget is not None and total > budget:
                    continue
                key = (total, _rounded(cost + more_cost))
                if key not in grown:
                    grown[key] = (total, cost + more_cost, {**counts, point: counts.get(point, 0) + 1})
        mixes, cheapest = [], math.inf
        for key in sorted(grown):  # by bytes, then cost: keep a mix only if it is cheaper than every smaller one
            if key[1] < cheapest:
                mixes.append(grown[key])
                cheapest = key[1]
    if not mixes:
        return None
    return min(mixes, key=lambda mix: (_rounded(mix[1]), mix[0]))[2]


def _rounded(cost: float) -> float:
    """Costs summed in another order differ in the last bits; plans that equal should tie."""
    return round(cost, 12)


def explain_policies(config: ModelConfig, batch: int, seq_len: int, precision: Precision, policies: list[Remat],
                     costs: dict[Remat, float] | None = None, cost_source: str = "FLOP model",
                     budget: int | None = None, attention_pairs: float | None = None,
                     budget_fraction: float | None = None, document_ranks: int = 1) -> RematPlan:
    """The plan table for given per-layer policies: the bytes each keeps, its transient and its
    extra compute, and the step's predicted peak (``RematPlan.peak_bytes``; ``attention_pairs``:
    see ``flop_policy_costs``); ``budget`` (bytes) or ``budget_fraction`` (``memory_budget``) is
    the budget they were chosen for, if any; ``document_ranks``: see ``layer_transient_bytes_per_token``."""
    tokens = batch * seq_len
    if costs is None:
        costs = flop_policy_costs(config, batch, seq_len, precision, attention_pairs=attention_pairs)
    layer_flops = layer_step_flops(config, batch, seq_len, attention_pairs)[2]
    step = config.n_layers * layer_flops + 6 * tokens * config.dim * config.vocab_size
    return RematPlan(
        policies=[Remat.parse(p, owner="policies") for p in policies], layer_bytes=[layer_bytes_per_token(config, p, precision) * tokens for p in policies],
        layer_host_bytes=[layer_bytes_per_token(config, p, precision, "host") * tokens for p in policies],
        layer_transient_bytes=[layer_transient_bytes_per_token(config, p, precision, document_ranks) * tokens
                               for p in policies],
        fixed_bytes=head_bytes(config, tokens, precision), layer_extra=[costs[p] for p in policies], step_flops=step,
        layer_step_flops=layer_flops, budget=budget, cost_source=cost_source, tokens=tokens,
        budget_fraction=budget_fraction,
    )
