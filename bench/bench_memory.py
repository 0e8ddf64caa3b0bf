"""Memory: peak CUDA memory of one attention forward+backward against sequence length, ours
(O(N): q, k, v, o and one fp32 log-sum-exp per row) against SDPA's math backend (O(N^2): it
materializes the N x N probabilities) and SDPA's flash backend, up to the largest N that fits.
The block's memory per remat policy is in the block suite (bench_block.py).

Offload against full (``what="offload"``): one forward+backward step (loss under bf16 autocast, fp32
weights, ``zero_grad(set_to_none=True)``) of an 8-layer gpt2-small at 16,384 tokens, batch 1, the
model of tests/test_offload.py's GPU test, under ``remat="full"`` and ``remat="offload"``, same
weights and tokens. Two warm-up steps first (the pinned host buffers of a step go back to the
host allocator's cache only when its graph dies), then OFFLOAD_SAMPLES steps timed with CUDA events,
nothing synchronized inside a step; median, 20th and 80th percentile. Per provider:

- TFLOP/s: the step's model FLOPs (``planner.explain_policies``, no remat) per second;
- peak MiB: harness.peak_memory_mib over one step;
- saved MiB: the saved-memory meter's *device* bytes after forward and loss (what autograd keeps
  on the GPU), parameters excluded; ``extra["host_saved_mib"]`` its host bytes (offload's inputs);
- ``extra["held_mib"]``: ``torch.cuda.memory_allocated()`` after forward and loss minus before, the
  device memory a step holds when backward starts (what the test asserts on).

Offload's ``extra`` also gives the bytes its copies move each way (``d2h_bytes``, ``h2d_bytes``:
every layer's input, fp32), the time they need at the run's measured pinned bandwidth
(``d2h_s``, ``h2d_s``, ``copies_s`` from harness.host_link_ceilings, recorded as ``h2d_GBps`` and
``d2h_GBps``) and ``over_full_s``, its median step minus full's: near ``copies_s``, the copies did not
hide behind compute (copy-bound or serialized); near 0, they did.

On a GPU, pytest checks that ours peaks below the math backend up to N = 16k; on CPU it runs one
tiny case through the Triton interpreter, and --smoke runs the offload case on the tiny preset (on
CPU offload moves no bytes: only the pipeline is tested).
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from bench import harness
from bench.harness import Case, Result, Suite, dtype_name, peak_memory_mib
from bench.providers import attention_inputs, attention_providers
from fused_remat.flops import attention_flops
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, preset
from fused_remat.planner import Precision, explain_policies, layer_bytes_per_token

HEADS, HEAD_DIM = 16, 128
# Offload against full: (preset, layers, tokens) on a GPU (tests/test_offload.py's GPU test) and in --smoke.
OFFLOAD, SMOKE_OFFLOAD = ("gpt2-small", 8, 16384), ("tiny", 2, 16)
OFFLOAD_POLICIES = {"fused_remat-full": "full", "fused_remat-offload": "offload"}
OFFLOAD_WARMUP, OFFLOAD_SAMPLES = 2, {True: 5, False: 15}  # steps; on CPU one warm-up and 3 steps
WEIGHT_SEED, INPUT_SEED = 0, 1


def lengths(quick: bool, device: str = "cuda") -> tuple[int, ...]:
    """N of every case, in the order the suite runs them."""
    if device != "cuda":
        return (48,)
    return (1024, 4096, 16384, 65536) if quick else (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def case(n: int, device: str = "cuda") -> Case:
    """Causal forward+backward at batch 1 and length ``n``: ours, SDPA's math and flash backends (GPU only)."""
    if device != "cuda":
        heads, head_dim, dtype, peers = 2, 32, torch.float32, {}
    else:
        heads, head_dim, dtype = HEADS, HEAD_DIM, torch.bfloat16
        peers = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION"}
    return Case(
        suite="memory", name=f"attention fwd+bwd causal B1 H{heads} D{head_dim} N{n}",
        params={"what": "attention", "n": n, "heads": heads, "d": head_dim, "dtype": dtype_name(dtype)},
        providers=attention_providers(peers, "fwd+bwd", True, attention_inputs(1, heads, n, head_dim, dtype, device)),
        unit="TFLOP/s", work=attention_flops(1, heads, n, n, head_dim, True, "fwd+bwd"), ceiling="matmul",
    )


class OffloadStep:
    """One policy's model and rotating token sets. Calling it runs one training step's forward, loss
    and backward and drops the graph (so its pinned host buffers can be reused by the next step)."""

    def __init__(self, policy: str, name: str, layers: int, n: int, device: str):
        self.config = preset(name, n_layers=layers)
        self.on_gpu = device == "cuda"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.on_gpu else []):
            torch.manual_seed(WEIGHT_SEED)
            self.model = LanguageModel(self.config, policy, device=device)
        generator = torch.Generator(device).manual_seed(INPUT_SEED)
        self.make_tokens = lambda: (torch.randint(0, self.config.vocab_size, (1, n + 1), generator=generator, device=device),)
        self._next = harness.rotating(self.make_tokens, self.step_on)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.on_gpu):
            return self.model(tokens[:, :-1], tokens[:, 1:])

    def step_on(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = self.loss(tokens)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return loss.detach()

    def __call__(self) -> torch.Tensor:
        return self._next()

    def memory(self) -> dict:
        """One step measured, not timed: device memory held when backward starts (GPU only) and the
        saved-memory meter's device and host bytes."""
        (tokens,) = self.make_tokens()
        held = None
        with saved_memory(exclude=self.model.parameters()) as meter:
            if self.on_gpu:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
            loss = self.loss(tokens)
            if self.on_gpu:
                torch.cuda.synchronize()
                held = (torch.cuda.memory_allocated() - before) / 2**20
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return {"held_mib": held, "device_saved_mib": meter.device_bytes / 2**20, "host_saved_mib": meter.host_bytes / 2**20}


def offload_case(device: str = "cuda") -> Case:
    """Offload against full, one training step of the test's model (module docstring)."""
    name, layers, n = OFFLOAD if device == "cuda" else SMOKE_OFFLOAD
    config = preset(name, n_layers=layers)
    precision = Precision(torch.float32, torch.bfloat16 if device == "cuda" else torch.float32)
    copied = layers * layer_bytes_per_token(config, "offload", precision, "host") * n  # batch 1, each way
    flops = explain_policies(config, 1, n, precision, ["none"] * layers).step_flops
    return Case(
        suite="memory", name=f"offload vs full, train step {name} L{layers} B1 N{n}",
        params={"what": "offload", "config": name, "layers": layers, "n": n, "dim": config.dim, "batch": 1,
                "dtype": "bf16 autocast, fp32 weights" if device == "cuda" else "fp32", "device": device,
                "baseline": "fused_remat-full", "copied_bytes_each_way": copied},
        providers={provider: functools.partial(OffloadStep, policy, name, layers, n, device)
                   for provider, policy in OFFLOAD_POLICIES.items()},
        unit="TFLOP/s", work=flops, ceiling="matmul",
    )


def _step_ms(step: OffloadStep, quick: bool) -> list[float]:
    """ms per step after the warm-up: CUDA events around each step, none synchronized inside it
    (on CPU, wall-clock: meaningless as speed)."""
    if not step.on_gpu:
        step()
        return [harness.wall_ms(step) for _ in range(3)]
    for _ in range(OFFLOAD_WARMUP):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(OFFLOAD_SAMPLES[quick])]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _measure_offload(case: Case, factory, quick: bool, result: Result) -> None:
    step = factory()
    times = torch.tensor(_step_ms(step, quick), dtype=torch.float64)
    median, p20, p80 = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    result.ms, result.ms_p20, result.ms_p80, result.metric = median, p20, p80, case.metric(median)
    memory = step.memory()
    result.saved_mib = memory.pop("device_saved_mib")
    result.extra.update(samples=len(times), **memory)
    result.peak_mib = peak_memory_mib(step)


def run_offload(case: Case, quick: bool) -> list[Result]:
    """Both policies' step time and memory, then offload's copies against the measured link."""
    results = {}
    for provider, factory in case.providers.items():
        result = results[provider] = Result(case.suite, case.name, case.params, provider, unit=case.unit)
        with harness.errors_reported(result):
            _measure_offload(case, factory, quick, result)
            gc.collect()  # the step's model and graphs, before the next provider's
    full, offload = results["fused_remat-full"], results["fused_remat-offload"]
    copied = case.params["copied_bytes_each_way"]
    offload.extra.update(d2h_bytes=copied, h2d_bytes=copied)
    link = harness.host_link_ceilings(quick) if case.params["device"] == "cuda" else {}
    if link:
        d2h_s, h2d_s = copied / (link["d2h_GBps"] * 1e9), copied / (link["h2d_GBps"] * 1e9)
        offload.extra.update(**link, d2h_s=d2h_s, h2d_s=h2d_s, copies_s=d2h_s + h2d_s)
    if full.ms is not None and offload.ms is not None:
        offload.extra["over_full_s"] = (offload.ms - full.ms) / 1e3
    return list(results.values())


def run_case(case: Case, quick: bool, measure_memory: bool = True) -> list[Result]:
    """The suite's runner: the offload case its own (run_offload), attention harness.run_case's."""
    if case.params["what"] == "offload":
        return run_offload(case, quick)
    return harness.run_case(case, quick, measure_memory)


def cases(quick: bool, device: str = "cuda") -> list[Case]:
    return [*(case(n, device) for n in lengths(quick, device)), offload_case(device)]


def plots(folder, results, ceilings):
    from bench.report import plot

    results = [r for r in results if r.params["what"] == "attention"]  # offload's one length: the table
    plot(folder, "memory", "attention forward+backward peak memory (MiB, log scale): O(N) against O(N^2)",
         results, x_key="n", group_keys=("what", "d"), value=lambda r: r.peak_mib, ylabel="peak MiB", log_y=True)
    plot(folder, "memory-saved", "bytes autograd keeps for backward (MiB, log scale, saved-memory meter)",
         results, x_key="n", group_keys=("what", "d"), value=lambda r: r.saved_mib, ylabel="saved MiB", log_y=True)


@pytest.mark.parametrize("n", lengths(quick=True, device="cpu"))
def test_smoke_on_cpu(n, triton_backend):
    grads = case(n, device="cpu").providers["fused_remat"]()()
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu  # conftest.py skips it without a CUDA device and compiled Triton
@pytest.mark.parametrize("n", [1024, 4096, 16384])
def test_gpu_peak_memory_below_math_backend(n):
    built = case(n)
    peaks = {}
    for provider in ("fused_remat", "sdpa-math"):
        try:
            peaks[provider] = peak_memory_mib(built.providers[provider]())
        except torch.cuda.OutOfMemoryError:
            peaks[provider] = float("inf")
        torch.cuda.empty_cache()
    assert peaks["fused_remat"] < peaks["sdpa-math"], peaks


def test_offload_case_on_cpu(triton_backend):
    """The offload case's runner end to end on the tiny preset: both policies, offload's copy bytes."""
    if harness.compiled_triton():
        pytest.skip("the GPU run covers this")
    results = {r.provider: r for r in run_offload(offload_case("cpu"), quick=True)}
    assert not any(r.error for r in results.values()), {p: r.error for p, r in results.items()}
    full, offload = results["fused_remat-full"], results["fused_remat-offload"]
    name, layers, n = SMOKE_OFFLOAD
    inputs = layers * n * preset(name).dim * 4
    assert offload.extra["d2h_bytes"] == offload.extra["h2d_bytes"] == inputs
    assert offload.extra["host_saved_mib"] * 2**20 == inputs and full.extra["host_saved_mib"] == 0
    assert full.saved_mib - offload.saved_mib == inputs / 2**20
    assert full.ms > 0 and offload.ms > 0 and "over_full_s" in offload.extra


SUITE = Suite("memory", cases, plots, run_case=run_case, measure_memory=True)
