"""Train: one full training step of a GPT-2-small-shaped language model per remat policy of ours,
against the same model built from the plain-PyTorch reference block run eagerly, under
torch.utils.checkpoint and under torch.compile; and, in full mode, the longest sequence each of them
trains within a fixed memory budget.

The model is ``fused_remat.model.preset("gpt2-small")`` (12 layers, dim 768, 12 heads, tanh GELU,
LayerNorm, RoPE) with the byte vocabulary (256) that ``python -m fused_remat.train`` and
``--find-max-seq-len`` use by default. With GPT-2's 50304 tokens the head would add the same
7.6 TFLOP (at 32k tokens) and the same 0.6 GB of fp32 weights and AdamW moments to every provider,
diluting the differences that come from the blocks, which is what this suite compares; the loss is
``fused_remat.linear_cross_entropy`` (chunked, never all logits) in every provider alike.

One step is the trainer's own, ``fused_remat.training.step.train_step``: forward and loss under
bf16 autocast over fp32 master weights, backward, ``clip_grad_norm_`` to 1.0, the fused AdamW step
of ``step.make_optimizer`` (decay on matrices only; learning rate, decay and clipping those of
``TrainConfig.build`` for the preset), ``zero_grad(set_to_none=True)``. Batch 1 at N = 8192, 16384
and 32768 (quick: 16384), the tokens fresh random ids from INPUT_SETS rotating sets (harness.rotating), the
same sequence for every provider. Every provider starts from the same weights.

Providers:

    fused_remat          LanguageModel, fused blocks, remat="cheap" (the default policy)
    fused_remat-none     remat="none"
    fused_remat-full     remat="full"
    fused_remat-offload  remat="offload" (full's kept inputs in pinned host memory)
    fused_remat-auto     the per-layer plan of ``planner.plan_remat`` for a budget halfway between
                         the predicted peaks (kept + the largest layer transient) of ``full`` and
                         ``cheap`` on every layer (FLOP-model costs). In gpt2-small that is 10
                         layers that keep qkv and attention's results, one that keeps u too and
                         one ``cheap`` at 8k, 16k and 32k: a plan in between the policies, where
                         the planner has a choice to make (a budget of a fraction of the device
                         would simply give ``cheap`` at these lengths). The plan is recorded in
                         each result's ``extra``.
    eager                LanguageModel(block_impl="reference", remat="none")
    checkpoint           LanguageModel(block_impl="reference", remat="full"): every block under
                         torch.utils.checkpoint (use_reentrant=False)
    compile              torch.compile(the eager model, dynamic=False), forward and loss, compiled per
                         case (the loss's host sync in linear_cross_entropy is a graph break)

Timing: the first step (Triton JIT, torch.compile's compile, AdamW's moments) runs before anything is
timed, and its wall time is recorded as ``extra["first_step_s"]``; one more warm-up step; then the
median, 20th and 80th percentile of steps timed with CUDA events, as many as fill a window of 4 s
(quick: 1.5 s), at least 10 (quick: 5). triton.testing.do_bench sizes its loop from a short window
(its ``rep``), which holds one sample of a step this long, so this suite counts its own samples
(``extra["samples"]``).
The metric is tokens per second; ``extra["TFLOP/s"]`` gives the step's model FLOPs per second
(``planner.explain_policies(...).step_flops``: no remat, recomputation not counted).

Memory, per step:
- peak MiB: ``torch.cuda.max_memory_allocated()`` during one step minus what was allocated before it
  (harness.peak_memory_mib). Resident before the step, and recorded as ``extra["resident_mib"]``: the
  fp32 weights, the AdamW moments and the token sets. So the peak holds the activations, the step's
  transients and the gradients (freed by set_to_none between steps, as in training).
- saved MiB: the saved-memory meter over the forward and loss alone (what autograd keeps for
  backward when backward starts), parameters excluded. Under autocast that includes the bf16 copies
  of the weights. For fused providers ``extra["predicted_mib"]`` is what the planner predicts.
- OOM in any provider is recorded as "OOM" for that provider; its memory is released before the next.
The Markdown table gives each provider's time and peak memory as ratios to eager's.

Longest trainable sequence (full mode only; slow): ``fused_remat.training.capacity``'s probe (one
training step, fits unless CUDA runs out of memory; ``auto`` plans for the memory left at each length) and its
search ``largest_fitting`` (doubling, then bisection, here in steps of 1024 tokens), per provider,
within a budget of 16 GiB set with ``torch.cuda.set_per_process_memory_fraction``. A fixed budget
keeps the probes short (a step costs N^2, and near a whole card's capacity one probe is long) and
gives the same numbers on any card that has 16 GiB;
``python -m fused_remat.train --find-max-seq-len`` asks the question for a whole card. The compile
peer compiles with automatic dynamic shapes: its blocks compile twice, not once per probed length.

    python -m bench train                             # GPU: the suite CLI (JSON, Markdown, plots)
    pytest bench/bench_train.py --benchmark-only      # GPU: the quick case through pytest-benchmark
On CPU (``--smoke``, and pytest) the tiny preset trains at N = 32 in fp32 through the Triton
interpreter, every provider but compile, and the longest-sequence search runs with the capacity
module's CPU criterion (saved bytes plus 16 bytes per parameter within a budget) up to 256 tokens.
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass

import pytest
import torch

from bench import harness
from bench.harness import Case, Result, pytest_benchmark_case
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, ModelConfig, preset
from fused_remat.planner import Precision, RematPlan, explain_policies, plan_remat
from fused_remat.training import capacity
from fused_remat.training.config import TrainConfig
from fused_remat.training.step import forward_loss, make_optimizer, train_step

PRESET, SMOKE_PRESET, VOCAB = "gpt2-small", "tiny", 256
LENGTHS, QUICK_LENGTHS, SMOKE_LENGTHS = (8192, 16384, 32768), (16384,), (32,)
BATCH = 1
WEIGHT_SEED, INPUT_SEED = 0, 1
AUTO_BUDGET_FRACTION = 0.5  # fused_remat-auto: this far from full's predicted peak to cheap's
# Timed steps on a GPU: (window ms, least, most) in quick and full mode.
SAMPLES = {True: (1500, 5, 50), False: (4000, 10, 100)}
CPU_STEPS = 3  # on CPU the first step and two more: the pipeline runs, the timings mean nothing

# Longest trainable sequence: (budget bytes, granularity, limit) on a GPU; on CPU the budget is
# 16 B per parameter of the tiny preset plus CPU_CAPACITY_ACTIVATIONS of saved activations.
CAPACITY_GPU = (16 * 2**30, 1024, 1 << 19)
CPU_CAPACITY_ACTIVATIONS, CPU_CAPACITY_LIMIT = 2**20, 256


@dataclass(frozen=True)
class Provider:
    block_impl: str  # "fused" or "reference"
    remat: str  # a policy of that block, or "auto" (fused only)
    compiled: bool = False


PROVIDERS = {
    "fused_remat": Provider("fused", "cheap"),
    "fused_remat-none": Provider("fused", "none"),
    "fused_remat-full": Provider("fused", "full"),
    "fused_remat-offload": Provider("fused", "offload"),
    "fused_remat-auto": Provider("fused", "auto"),
    "eager": Provider("reference", "none"),
    "checkpoint": Provider("reference", "full"),
    "compile": Provider("reference", "none", compiled=True),
}


class TrainCase(Case):
    """A case whose metric is tokens per second (``work``: tokens per step)."""

    def metric(self, ms: float) -> float:
        return self.work / (ms * 1e-3)


def precision(device: str) -> Precision:
    """fp32 master weights; bf16 autocast on a GPU, fp32 throughout on CPU (the interpreter)."""
    return Precision(residual=torch.float32, compute=torch.bfloat16 if device == "cuda" else torch.float32)


def preset_name(device: str) -> str:
    return PRESET if device == "cuda" else SMOKE_PRESET


def model_config(device: str) -> ModelConfig:
    return preset(preset_name(device), vocab_size=VOCAB)


@functools.lru_cache(maxsize=1)
def initial_state(config: ModelConfig) -> dict:
    """The weights every provider starts from (on CPU, drawn once from WEIGHT_SEED; the global RNG
    is left as it was). Fused and reference models share parameter names, so it loads into both."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        return LanguageModel(config, "none", block_impl="reference", device="cpu").state_dict()


def auto_plan(config: ModelConfig, batch: int, seq_len: int, prec: Precision) -> RematPlan:
    """fused_remat-auto's plan: the least recompute within AUTO_BUDGET_FRACTION of the way from
    full's predicted peak to cheap's (the planner prices a plan at its peak)."""
    cheap, full = (explain_policies(config, batch, seq_len, prec, [policy] * config.n_layers).peak_bytes
                   for policy in ("cheap", "full"))
    return plan_remat(config, batch, seq_len, prec, int(full + AUTO_BUDGET_FRACTION * (cheap - full)))


def _plan_record(plan: RematPlan) -> dict:
    return {"policies": plan.policies, "budget_mib": None if plan.budget is None else plan.budget / 2**20,
            "predicted_mib": plan.predicted_bytes / 2**20, "peak_mib": plan.peak_bytes / 2**20,
            "extra_compute": plan.extra_compute, "cost_source": plan.cost_source}


class TrainStep:
    """One provider's model, optimizer and rotating token sets at one length. Calling it runs one
    training step on the next set and returns (loss, gradient norm before clipping)."""

    def __init__(self, provider: Provider, seq_len: int, batch: int, device: str):
        config = model_config(device)
        self.device, self.precision = torch.device(device), precision(device)
        self.info: dict = {}
        policies = provider.remat
        if provider.remat == "auto":
            plan = auto_plan(config, batch, seq_len, self.precision)
            policies = plan.policies
            self.info["plan"] = _plan_record(plan)
        if provider.block_impl == "fused":
            layers = [policies] * config.n_layers if isinstance(policies, str) else policies
            self.info["predicted_mib"] = explain_policies(config, batch, seq_len, self.precision, layers).predicted_bytes / 2**20
        self.model = LanguageModel(config, policies, block_impl=provider.block_impl, device=device)
        self.model.load_state_dict(initial_state(config))
        self.forward = self.model
        if provider.compiled:
            torch._dynamo.reset()  # each case compiles its own shapes: no recompile limit, no stale graphs
            self.forward = torch.compile(self.model, dynamic=False)
        settings = TrainConfig.build(device, preset=preset_name(device))  # the CLI's lr, weight decay, clipping
        self.optimizer = make_optimizer(self.model, lr=settings.lr, weight_decay=settings.weight_decay)
        self.grad_clip = settings.grad_clip
        generator = torch.Generator(device).manual_seed(INPUT_SEED)
        self.make_tokens = lambda: (torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=generator, device=device),)
        self._next = harness.rotating(self.make_tokens, self.step_on)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return forward_loss(self.forward, tokens[:, :-1], tokens[:, 1:], self.precision.compute)

    def step_on(self, tokens: torch.Tensor):
        return train_step(self.forward, self.optimizer, [(tokens[:, :-1], tokens[:, 1:])],
                          compute_dtype=self.precision.compute, grad_clip=self.grad_clip)

    def __call__(self):
        return self._next()

    def saved_bytes(self) -> int:
        """What autograd keeps for backward after the forward and loss on fresh tokens (meter)."""
        (tokens,) = self.make_tokens()
        with saved_memory(exclude=self.model.parameters()) as meter:
            loss = self.loss(tokens)
        del loss
        return meter.bytes


def _gpu_step_times(step, quick: bool) -> list[float]:
    """ms of each timed step after one more warm-up step; as many as fill the window (module docstring)."""
    window, least, most = SAMPLES[quick]
    step()
    torch.cuda.synchronize()
    estimate = harness.wall_ms(lambda: (step(), torch.cuda.synchronize()))
    count = min(most, max(least, round(window / max(estimate, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    for start, end in zip(starts, ends):
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def _is_oom(exc: BaseException | None) -> bool:
    """CUDA out of memory, also when wrapped (torch.compile's backend errors) or raised by cuBLAS."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _error(exc: Exception) -> str:
    if _is_oom(exc):
        return "OOM"
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _release(compiled: bool) -> None:
    """Give back what a provider held (its model, optimizer, graphs) before the next one is built."""
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _measure(case: Case, factory, quick: bool, result: Result) -> None:
    """Fill ``result`` from one provider. Everything it builds dies with this frame (or, on an
    error, with the exception's traceback) so that ``_release`` can free it."""
    on_gpu = case.params["device"] == "cuda"
    started = time.perf_counter()
    step = factory()
    result.extra.update(step.info)
    first = []
    first_ms = harness.wall_ms(lambda: first.append(step()))
    loss, grad_norm = first[0]
    result.extra.update(first_loss=float(loss), first_grad_norm=float(grad_norm),
                        first_step_s=time.perf_counter() - started)
    if on_gpu:
        times = _gpu_step_times(step, quick)
    else:
        times = [first_ms] + [harness.wall_ms(step) for _ in range(CPU_STEPS - 1)]
    quantiles = torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)  # as triton.testing.do_bench reports them
    median, p20, p80 = torch.quantile(torch.tensor(times, dtype=torch.float64), quantiles).tolist()
    result.ms, result.ms_p20, result.ms_p80 = median, p20, p80
    result.metric = case.metric(median)
    result.extra.update(samples=len(times), tokens_per_s=result.metric,
                        **{"TFLOP/s": case.params["step_flops"] / (median * 1e-3) / 1e12})
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        result.extra["resident_mib"] = torch.cuda.memory_allocated() / 2**20
        result.peak_mib = harness.peak_memory_mib(step)
    result.saved_mib = step.saved_bytes() / 2**20


def run_case(case: Case, quick: bool, measure_memory: bool = True) -> list[Result]:
    """The suite's runner (``python -m bench`` uses it instead of harness.run_case): timing cases
    get step times, tokens/s and memory per provider; the capacity case gets the longest sequence."""
    if case.params.get("part") == "capacity":
        return run_capacity(case)
    results = []
    for name, factory in case.providers.items():
        result = Result(case.suite, case.name, case.params, name, unit=case.unit)
        try:
            _measure(case, factory, quick, result)
        except Exception as exc:  # a failing provider is reported in the table, not fatal to the run
            result.error = _error(exc)
        _release(PROVIDERS[name].compiled)
        results.append(result)
    return results


def _probe(config: ModelConfig, provider: Provider, batch: int, budget: int, device: str):
    """fits(seq_len) -> bool: capacity's probe for the provider, out-of-memory while compiling included."""
    probe = capacity.TrainStepProbe(config, provider.block_impl, provider.remat, batch, precision(device),
                            torch.device(device), budget)
    if provider.compiled:
        torch._dynamo.reset()
        probe.model = torch.compile(probe.model)  # automatic dynamic shapes: the blocks compile twice

    def fits(seq_len: int) -> bool:
        try:
            return probe(seq_len)
        except Exception as exc:
            if _is_oom(exc):
                return False
            raise

    return fits


def run_capacity(case: Case) -> list[Result]:
    """The longest trainable sequence per provider (capacity.largest_fitting over capacity's probe)."""
    params = case.params
    on_gpu = params["device"] == "cuda"
    results = []
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, params["budget_bytes"] / total))
    try:
        for name, factory in case.providers.items():
            result = Result(case.suite, case.name, params, name, unit="tokens")
            started = time.perf_counter()
            try:
                longest = capacity.largest_fitting(factory(), params["granularity"], params["limit"])
                result.extra.update(max_seq_len=longest, at_limit=longest >= params["limit"])
            except Exception as exc:
                result.error = _error(exc)
            result.extra["search_s"] = time.perf_counter() - started
            _release(PROVIDERS[name].compiled)
            results.append(result)
    finally:
        if on_gpu:
            torch.cuda.set_per_process_memory_fraction(1.0)
    baseline = next((r.extra.get("max_seq_len") for r in results if r.provider == params["baseline"]), None)
    for result in results:
        if result.error:
            continue
        longest = result.extra["max_seq_len"]
        cell = f"{'>= ' if result.extra['at_limit'] else ''}{longest:,} tokens" if longest else "none fits"
        if baseline and result.provider != params["baseline"]:
            cell += f"; vs {params['baseline']}: {longest / baseline:.2f}x"
        result.extra["cell"] = cell
    return results


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    """One timing case per length (every provider), then in full mode the longest-sequence case."""
    config, prec = model_config(device), precision(device)
    on_gpu = device == "cuda"
    names = [name for name, p in PROVIDERS.items() if on_gpu or not p.compiled]  # compile: GPU only
    lengths = (QUICK_LENGTHS if quick else LENGTHS) if on_gpu else SMOKE_LENGTHS
    dtype = "bf16 autocast, fp32 weights" if on_gpu else "fp32"
    shape = {"config": PRESET if on_gpu else SMOKE_PRESET, "vocab": config.vocab_size, "layers": config.n_layers,
             "dim": config.dim, "heads": config.n_heads, "batch": BATCH, "dtype": dtype, "device": device,
             "baseline": "eager"}
    result = []
    for n in lengths:
        flops = explain_policies(config, BATCH, n, prec, ["none"] * config.n_layers).step_flops
        result.append(TrainCase(
            suite="train", name=f"train step {shape['config']} B{BATCH} N{n}",
            params={**shape, "n": n, "tokens": BATCH * n, "step_flops": flops,
                    "auto_budget": f"full's predicted peak + {AUTO_BUDGET_FRACTION} x (cheap's - full's)"},
            providers={name: functools.partial(TrainStep, PROVIDERS[name], n, BATCH, device) for name in names},
            unit="tokens/s", work=BATCH * n,
        ))
    if not quick:
        if on_gpu:
            budget, granularity, limit = CAPACITY_GPU
        else:
            parameters = sum(p.numel() for p in LanguageModel(config, device="meta").parameters())
            budget, granularity, limit = 16 * parameters + CPU_CAPACITY_ACTIVATIONS, capacity.GRANULARITY["cpu"], CPU_CAPACITY_LIMIT
        criterion = ("one training step without CUDA out-of-memory" if on_gpu
                     else "saved activations (meter) + 16 B/parameter within the budget")
        label = f"{budget / 2**30:g} GiB" if on_gpu else f"{budget / 2**20:.2f} MiB"
        result.append(Case(
            suite="train", name=f"longest trainable sequence {shape['config']} B{BATCH} within {label}",
            params={**shape, "part": "capacity", "budget_bytes": budget, "granularity": granularity, "limit": limit,
                    "criterion": criterion},
            providers={name: functools.partial(_probe, config, PROVIDERS[name], BATCH, budget, device) for name in names},
            unit="tokens", work=0.0,
        ))
    return result


def plots(folder, results, ceilings):
    """Step time, peak memory and saved bytes against N; the longest sequence per provider as bars.
    Titles say what the results record (their shared params: preset, dtype, batch, device)."""
    from bench.report import plot

    timed = [r for r in results if r.params.get("part") != "capacity"]
    for name, title, value, ylabel in (
        ("train", "training step time (ms, log scale; lower is better)", lambda r: r.ms, "ms"),
        ("train-peak", "peak memory above weights and AdamW state (MiB, log scale)", lambda r: r.peak_mib, "peak MiB"),
        ("train-saved", "bytes autograd keeps for backward (MiB, log scale, saved-memory meter)", lambda r: r.saved_mib, "saved MiB"),
    ):
        plot(folder, name, title, timed, x_key="n", group_keys=("config",), value=value, ylabel=ylabel, log_y=True)
    _capacity_plot(folder, [r for r in results if r.params.get("part") == "capacity" and not r.error])


def _capacity_plot(folder, results):
    """One bar per provider; a search that reached its limit is hatched and labelled ">=" (the
    true longest sequence is longer)."""
    from bench.report import pyplot, save_figure, shared_params

    plt = pyplot()
    if not results or plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(results) + 1.6), layout="constrained")
    names = [r.provider for r in results]
    lengths = [r.extra["max_seq_len"] for r in results]
    bars = ax.barh(names, lengths, color=["C0" if n.startswith("fused_remat") else "C7" for n in names])
    for bar, result, length in zip(bars, results, lengths):
        capped = result.extra.get("at_limit")
        if capped:
            bar.set_hatch("//")
        ax.annotate(f"{'>= ' if capped else ''}{length:,}{' (search limit)' if capped else ''}",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(lengths + [1]) * 1.35)  # room for the labels
    ax.set_xlabel("longest trainable sequence (tokens)")
    ax.set_title(f"{results[0].case}\n{shared_params(results, skip=('budget_bytes',))}", fontsize=9, wrap=True)
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, folder / "train-capacity.png")


SUITE = harness.Suite("train", cases, plots, run_case=run_case, measure_memory=True)


def test_smoke_on_cpu(triton_backend):
    """Every provider trains one step through the interpreter from the same weights and tokens, and
    gets eager's loss and gradient norm."""
    if harness.compiled_triton():
        pytest.skip("the GPU cases cover this")
    (case,) = cases(quick=True, device="cpu")
    assert set(case.providers) == set(PROVIDERS) - {"compile"}
    first = {name: factory()() for name, factory in case.providers.items()}
    loss, grad_norm = first.pop("eager")
    assert torch.isfinite(loss) and grad_norm > 0
    for name, (other_loss, other_norm) in first.items():
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n} loss: {m}")
        torch.testing.assert_close(other_norm, grad_norm, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n} grad norm: {m}")


def test_auto_plan_replays_within_its_budget_for_less_than_full():
    """At every benchmarked length the auto provider's budget forces layers to replay part of their
    forward, at less extra compute than replaying it all (full) on every layer."""
    config, prec = model_config("cuda"), precision("cuda")
    for n in LENGTHS:
        plan = auto_plan(config, BATCH, n, prec)
        assert plan.peak_bytes <= plan.budget
        assert any(policy.replays for policy in plan.policies), plan.policies
        full = explain_policies(config, BATCH, n, prec, ["full"] * config.n_layers)
        assert plan.extra_compute < full.extra_compute, plan.policies


def test_runner_records_oom_and_goes_on():
    """An out-of-memory provider is recorded as OOM; the providers after it still run."""
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    (case,) = cases(quick=True, device="cpu")
    case.providers = {"fused_remat-none": lambda: out_of_memory(), "eager": case.providers["eager"]}
    oom, eager = run_case(case, quick=True)
    assert oom.error == "OOM" and oom.ms is None
    assert not eager.error and eager.ms > 0 and eager.saved_mib > 0 and eager.extra["samples"] == CPU_STEPS


def test_capacity_search_on_cpu(triton_backend):
    """The longest-sequence case runs capacity's CPU criterion: remat lets longer sequences fit."""
    if harness.compiled_triton():
        pytest.skip("the GPU run covers this")
    case = cases(quick=False, device="cpu")[-1]
    assert case.params["part"] == "capacity"
    case.providers = {name: case.providers[name] for name in ("eager", "fused_remat-full")}
    eager, full = run_case(case, quick=False)
    assert not eager.error and not full.error, (eager.error, full.error)
    assert 0 < eager.extra["max_seq_len"] < full.extra["max_seq_len"]
    assert full.extra["cell"].endswith("x") and "tokens" in eager.extra["cell"]


@pytest.mark.gpu
@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("n", QUICK_LENGTHS, ids=lambda n: f"N{n}")
def test_gpu(n, provider, benchmark):
    """The quick case's providers through pytest-benchmark; the case is built here, when the test
    runs, not when pytest collects it."""
    (case,) = [case for case in cases(quick=True) if case.params["n"] == n]
    pytest_benchmark_case(benchmark, case, provider)


def test_plots_title_from_the_data_and_mark_capped_searches(tmp_path):
    """The figures are drawn from results alone: titles carry their shared params, a capped search is
    labelled as such (from ``at_limit``), and every provider gets a figure entry."""
    report = pytest.importorskip("bench.report")
    pytest.importorskip("matplotlib")
    params = {"config": "tiny", "batch": 1, "dtype": "fp32", "device": "cpu", "baseline": "eager"}
    timed = []
    for n in SMOKE_LENGTHS + (64,):
        for name in ("fused_remat", "fused_remat-none", "eager"):
            result = Result("train", f"N{n}", {**params, "n": n}, name, unit="tokens/s")
            result.ms, result.peak_mib, result.saved_mib = 1.0 * n, None, 0.5 * n  # ours and none overlap
            timed.append(result)
    capped = []
    for name, longest in (("eager", 64), ("fused_remat-full", 256)):
        result = Result("train", "longest", {**params, "part": "capacity", "limit": 256}, name, unit="tokens")
        result.extra.update(max_seq_len=longest, at_limit=longest >= 256)
        capped.append(result)
    plots(tmp_path, timed + capped, {})
    assert {p.name for p in tmp_path.iterdir()} == {"train.png", "train-saved.png", "train-capacity.png"}
    assert report.shared_params(timed, skip=("n", "config")) == "batch=1, dtype=fp32, device=cpu, baseline=eager"
