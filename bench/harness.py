"""What every suite shares: cases, suites, timing, ceilings and the run's metadata.

A suite module defines ``SUITE = Suite(name, cases, plots, ...)``, where ``cases(quick, device)``
returns its list of ``Case``. A ``Case`` holds, per provider, a factory that builds fresh inputs
and returns the zero-argument callable to time; ``work`` turns a median time into the case's
metric (GB/s from bytes moved, or TFLOP/s from FLOPs). What the providers of several suites share
is in bench/providers.py.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import platform
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def device_folder(device_name: str) -> Path:
    """Where a device's results go: bench/results/<its name, with anything but [A-Za-z0-9._-] as '-'>."""
    return RESULTS / re.sub(r"[^A-Za-z0-9._-]+", "-", device_name).strip("-")
INPUT_SETS = 3  # inputs rotate through this many fresh random sets, so no call sees warm inputs twice


@dataclass
class Case:
    suite: str
    name: str
    params: dict
    providers: dict[str, Callable[[], Callable[[], object]]]
    unit: str  # "GB/s" or "TFLOP/s"
    work: float  # bytes moved or FLOPs per call
    ceiling: str = ""  # which device ceiling the metric is a fraction of: "copy" or "matmul"

    def metric(self, ms: float) -> float:
        per_second = self.work / (ms * 1e-3)
        return per_second / 1e9 if self.unit == "GB/s" else per_second / 1e12


@dataclass
class Result:
    suite: str
    case: str
    params: dict
    provider: str
    ms: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    metric: float | None = None
    unit: str = ""
    peak_mib: float | None = None
    saved_mib: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


def rotating(make_inputs: Callable[[], tuple], run: Callable[..., object]) -> Callable[[], object]:
    """A zero-argument callable that runs ``run(*inputs)`` on the next of INPUT_SETS fresh input sets."""
    sets = itertools.cycle([make_inputs() for _ in range(INPUT_SETS)])
    return lambda: run(*next(sets))


def time_ms(fn: Callable[[], object], quick: bool) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) ms over repeated synchronized calls after warm-up.

    triton.testing.do_bench synchronizes around the timed region and flushes the L2 cache between
    calls, so a memory-bound kernel is measured from DRAM. Without CUDA (the CLI's --smoke mode,
    which only proves the pipeline runs) three wall-clock calls stand in: meaningless as speed.
    """
    import triton.testing

    if not torch.cuda.is_available():
        times = sorted(wall_ms(fn) for _ in range(3))
        return times[1], times[0], times[2]

    warmup, rep = (10, 40) if quick else (25, 100)
    median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return median, p20, p80


HOST_CALLS = 10  # few enough that their kernels never fill the launch queue


def host_ms(fn: Callable[[], object]) -> float | None:
    """The host's time per call (ms): HOST_CALLS calls issued back to back after a synchronize,
    without waiting for the GPU. Where it reaches the median (``do_bench`` flushes the L2 before
    each call, which hides only a short host time), the call is host-bound: the GPU waits on the
    host. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e3


def wall_ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def peak_memory_mib(fn: Callable[[], object]) -> float | None:
    """Peak CUDA memory allocated while ``fn`` runs, above what was allocated before it."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def saved_memory_mib(fn: Callable[[], object]) -> float:
    """MiB that autograd keeps for backward during one call (fused_remat's saved-memory meter)."""
    from fused_remat.memory import saved_memory

    with saved_memory() as meter:
        fn()
    return meter.bytes / 2**20


@contextlib.contextmanager
def errors_reported(result: Result):
    """Within: a failure is recorded in ``result.error`` (a failing peer is reported in the table,
    not fatal to the run); after: the CUDA cache emptied for the next provider."""
    try:
        yield
    except torch.OutOfMemoryError:
        result.error = "out of memory"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(case: Case, quick: bool, measure_memory: bool = False) -> list[Result]:
    results = []
    for provider, factory in case.providers.items():
        result = Result(case.suite, case.name, case.params, provider, unit=case.unit)
        with errors_reported(result):
            fn = factory()
            result.ms, result.ms_p20, result.ms_p80 = time_ms(fn, quick)
            result.metric = case.metric(result.ms)
            host = host_ms(fn)
            if host is not None:
                result.extra["host_ms"] = host
            if measure_memory:
                result.peak_mib = peak_memory_mib(fn)
                result.saved_mib = saved_memory_mib(fn)
            del fn
        results.append(result)
    return results


@dataclass(frozen=True)
class Suite:
    """One benchmark suite as ``python -m bench`` runs it.

    ``cases(quick, device)`` builds the cases (only when the suite runs: each provider builds its
    inputs later still); ``plots(folder, results, ceilings)`` draws them; ``run_case`` times one
    case's providers (a suite may bring its own, as train does); ``measure_memory`` adds peak and
    saved memory to every result.
    """

    name: str
    cases: Callable[..., list[Case]]
    plots: Callable[[Path, list[Result], dict], object]
    run_case: Callable[..., list[Result]] = run_case
    measure_memory: bool = False

    def run(self, quick: bool, device: str) -> list[Result]:
        results = []
        for case in self.cases(quick=quick, device=device):
            results += self.run_case(case, quick, measure_memory=self.measure_memory)
        return results


def compiled_triton() -> bool:
    """Whether Triton compiles for a CUDA device here rather than interpreting: where the suites'
    GPU tests run (conftest.py skips those marked ``gpu`` otherwise) and their CPU smoke tests skip."""
    from fused_remat.kernels.limits import triton_interpreting

    return torch.cuda.is_available() and not triton_interpreting()


def dtype_name(dtype: torch.dtype) -> str:
    """How results record a dtype: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def pytest_benchmark_case(benchmark, case: Case, provider: str) -> None:
    """Time one provider of ``case`` with pytest-benchmark, synchronizing the GPU in every round."""
    fn = case.providers[provider]()

    def synchronized():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(synchronized, warmup_rounds=5, rounds=30)
    if benchmark.stats is not None:
        benchmark.extra_info[case.unit] = case.metric(benchmark.stats.stats.median * 1e3)


def check_smoke_outputs(case: Case) -> None:
    """Run every provider of ``case`` once (a CPU smoke run: the interpreter or the reference) and
    check that ours gives what eager gives in shape, and finite values."""
    outputs = {name: factory()() for name, factory in case.providers.items()}
    ours, eager = (out if isinstance(out, tuple) else (out,) for out in (outputs["fused_remat"], outputs["eager"]))
    assert len(ours) == len(eager), f"{case.name}: {len(ours)} outputs, eager {len(eager)}"
    for a, b in zip(ours, eager):
        assert a.shape == b.shape and torch.isfinite(a).all(), f"{case.name}: {tuple(a.shape)} vs eager {tuple(b.shape)}"


def grid_suite(grid: Callable[..., list], case: Callable[..., Case], name: Callable[..., str]):
    """What a suite whose cases are the points of ``grid`` (``case(*point, device=...)``, named
    ``name(*point)``) defines beside them: ``cases(quick, device)``; its CPU smoke test, every
    provider through the interpreter on the CPU grid (so the suite cannot rot without CI noticing);
    and its pytest-benchmark test, each quick-grid point with ours, eager and torch.compile on a GPU."""
    import pytest

    def cases(quick: bool, device: str = "cuda") -> list[Case]:
        return [case(*point, device=device) for point in grid(quick, device)]

    @pytest.mark.parametrize("point", grid(quick=True, device="cpu"), ids=lambda point: name(*point))
    def test_smoke_on_cpu(point, triton_backend):
        check_smoke_outputs(case(*point, device="cpu"))

    @pytest.mark.gpu
    @pytest.mark.parametrize("provider", ["fused_remat", "eager", "torch.compile"])
    @pytest.mark.parametrize("point", grid(quick=True), ids=lambda point: name(*point))
    def test_gpu(point, provider, benchmark):
        pytest_benchmark_case(benchmark, case(*point), provider)

    return cases, test_smoke_on_cpu, test_gpu


def _git_commit() -> str:
    """HEAD's short hash, marked where tracked files outside bench/results differ from it: the code
    measured is then not that commit's."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit} with uncommitted changes" if changed else commit


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version as nvidia-smi gives it, or None without one."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "driver": _nvidia_driver(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
    }


HOST_LINK_BYTES = 1 << 28  # 256 MiB: a pinned host buffer and a device buffer, copied whole


@functools.cache
def host_link_ceilings(quick: bool) -> dict:
    """The measured pinned host -> device and device -> host copy bandwidth (GB/s, bytes moved one
    way), one HOST_LINK_BYTES buffer copied with ``non_blocking=True`` on the current stream and
    timed as the other ceilings are (time_ms: CUDA events, median). Measured once per process, so
    the ceilings a run records and the offload case (bench_memory.py) read the same figures; {}
    without CUDA."""
    if not torch.cuda.is_available():
        return {}
    host = torch.empty(HOST_LINK_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(HOST_LINK_BYTES, dtype=torch.uint8, device="cuda")
    ceilings = {}
    for key, target, source in (("h2d_GBps", on_device, host), ("d2h_GBps", host, on_device)):
        ms, _, _ = time_ms(lambda target=target, source=source: target.copy_(source, non_blocking=True), quick)
        ceilings[key] = HOST_LINK_BYTES / (ms * 1e-3) / 1e9
    torch.cuda.synchronize()
    return ceilings


def measure_ceilings(quick: bool) -> dict:
    """The device's measured copy bandwidth (GB/s, read + write), dense bf16 matmul rate (TFLOP/s)
    and pinned host <-> device bandwidth each way (GB/s, host_link_ceilings)."""
    if not torch.cuda.is_available():
        return {}
    elements = 2**28  # 512 MiB of bf16: far beyond L2
    src = torch.randn(elements, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms, _, _ = time_ms(lambda: dst.copy_(src), quick)
    copy_gbs = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms, _, _ = time_ms(lambda: torch.matmul(a, b), quick)
    matmul_tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    del a, b
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": matmul_tflops, **host_link_ceilings(quick)}


def optional_import(module: str):
    """A module when it is installed (Liger-Kernel, for instance), else None: never required."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        return None
