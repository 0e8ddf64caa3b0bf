"""`python -m bench host`: the host's share of every call, with the GPU's launches stubbed, beside
eager PyTorch doing the same job on the same machine. Runs without a GPU.

At short sequences a GPU waits for the Python between a user's call and its kernels: the time a
call costs the host is a fact of the CPU, measurable here. Every op and the block run their real
path on CPU tensors under a stand-in driver that tells Triton the current device is an sm_90a
(``bench.static.driver``; ``backend.stubbed_launches_on("cpu")`` sends CPU tensors down the kernels' path
without the interpreter): the checks, the autograd Function, our launchers, the autotuner's
lookup, Triton's binder and its compiled-kernel cache all run; the driver's launcher, the last
step before ``cuLaunchKernel``, is a no-op that counts. Compiles happen in a warm-up (the
stand-in's autotuner compiles one configuration a kernel: tile choice is not host cost). The
eager peers (``torch.nn.functional``'s norms, activations and SDPA; the plain-PyTorch reference
block) run on the same tensors.

Host cost does not depend on the sizes (a GPU call enqueues and returns), but a CPU tensor's
arithmetic does: every case is tiny (8 tokens; the block configurations keep GPT-2-small's and
Llama's structure, norms, activation, biases, GQA and RoPE, at widths of 32 and 64),
so that the CPU kernels both sides run (PyTorch's matrix products, eager's norms and SDPA, which
our side replaces with stubbed launches) cost little beside the dispatch. What they cost is in the
eager figures, not in ours: the ratio leans our way by that much.

Per case, forward + backward (``torch.autograd.grad`` of the output against a given gradient):

- host_us: the median wall time of one call over ``--repeats`` (garbage collection off while timed);
- launches: the stand-in launcher's calls (Triton kernels; cuBLAS and PyTorch's own kernels are
  not counted, ours or eager's);
- python_calls: Python function calls (``sys.setprofile``), Triton's own modules (and the stand-in
  driver, which stands where Triton's driver runs) excluded and counted apart (``triton_calls``):
  the launch path every Triton user pays; of them ``harness_calls``, those of the case's
  ``torch.autograd.grad`` outside the Functions it runs (the same for any op: the user's backward
  call), and ``own_calls``, the rest: what the op or block itself runs;
- dispatches: calls through a ``fused_remat::`` custom operator's dispatcher entry.

Results: ``bench/results/host/host.json`` and ``host.md`` (or ``--out``), the machine named.

``--capture-check`` instead runs each case's call once, then again under ``host_read_guard`` (no
``.item()``, ``.tolist()``, device-to-host copy or shape made from values, inside our operators
too): what CUDA graph capture needs after its warm-up. It writes ``capture.json``.
Host time is not GPU time: these figures say what a call costs before the GPU sees it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "host"
TARGET = "sm_90a"
DTYPE = "float32"  # a CPU without bf16 instructions is slow at even a tiny bf16 matrix product

DEVICE = "cpu"
TOKENS = 8
WIDTH = 32
BLOCKS = {  # bench_block's configurations at tiny widths
    "gpt2-small": dict(dim=WIDTH, n_heads=2, norm="layernorm", activation="gelu_tanh"),
    "llama": dict(dim=2 * WIDTH, n_heads=4, n_kv_heads=1, norm="rmsnorm", activation="swiglu", rope_theta=10000.0,
                  bias=False),
}
POLICIES = ("none", "cheap", "selective", "full")
MEMORY_BUDGET = 0.5
DOCUMENTS = 2  # packed documents of equal length in the documents case
LORA_RANK = 4


@dataclasses.dataclass(frozen=True)
class HostCase:
    """One job, ours and eager's: each a builder that makes the inputs and returns the call to
    measure (forward + backward)."""

    name: str
    kind: str  # "op" or "block"
    ours: Callable[[], Callable[[], object]]
    eager: Callable[[], Callable[[], object]]
    eager_note: str = ""
    # ``function_floor`` of ours' inputs, timed beside both: where ours runs a torch.autograd.Function
    floor: Callable[[], Callable[[], object]] | None = None


# --------------------------------------------------------------------------------------------
# The stand-in driver: compiles for sm_90a, counts launches, runs nothing
# --------------------------------------------------------------------------------------------


def _counting_driver():
    from bench.static import ARCHS, StandInDriver

    class CountingDriver(StandInDriver):
        """Every compiled kernel's launcher counts its calls; the autotuner "times" nothing (all
        configurations tie, so it takes the first, which compiles at its launch)."""

        def __init__(self, arch):
            super().__init__(arch)
            self.launches = 0
            self.recorded = None  # a list: every launch's launcher arguments are appended to it
            # a loaded module, as a GPU's driver gives: Triton then binds a kernel's launcher once,
            # not at every launch as it does for the recording stand-in's module None
            self.utils.load_binary = lambda name, binary, shared, device: (object(), binary, 0, 0, 1024)

        def get_benchmarker(self):
            return lambda kernel_call, quantiles=None, **_: [1.0] * len(quantiles) if quantiles else 1.0

        def launcher_cls(self, src, metadata):
            super().launcher_cls(src, metadata)
            driver = self

            def launch(*args, **kwargs):
                driver.launches += 1
                if driver.recorded is not None:
                    driver.recorded.append(args)

            return launch

    return CountingDriver(ARCHS[TARGET])


@contextlib.contextmanager
def stubbed_launches():
    """Within: the ops' real path runs on DEVICE tensors down to a launcher that counts; yields the driver."""
    from bench.static import ARCHS, compiling_for
    from fused_remat.backend import stubbed_launches_on

    stand_in = _counting_driver()
    with compiling_for(ARCHS[TARGET], stand_in), stubbed_launches_on(DEVICE):
        yield stand_in


# --------------------------------------------------------------------------------------------
# Measuring one call
# --------------------------------------------------------------------------------------------


def host_us(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The median wall time of each call in microseconds, the calls taking turns (a noisy machine
    slows both alike), garbage collection off while timed."""
    times = {name: [] for name in calls}
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, call in calls.items():
                start = time.perf_counter_ns()
                call()
                times[name].append(time.perf_counter_ns() - start)
    finally:
        gc.enable()
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def _triton_root() -> str:
    import triton

    return os.path.dirname(triton.__file__)


def counts(call: Callable[[], object], driver) -> dict:
    """One call's launches, Python calls (Triton's apart) and custom-operator dispatches.

    Triton's own calls include the stand-in driver's (``bench.static.driver``), which stands where
    Triton's driver module runs on a GPU. ``harness_calls`` are the Python calls of the case's own
    ``torch.autograd.grad`` outside the Functions it runs: what the user's backward call costs
    whichever op is differentiated; python_calls - harness_calls is what the op itself runs."""
    import torch
    from torch._ops import OpOverload
    from torch.autograd.function import BackwardCFunction

    import bench.static.driver

    triton_root, here, stand_in = _triton_root(), __file__, bench.static.driver.__file__
    overload_call = OpOverload.__call__.__code__
    grad_code, function_code = torch.autograd.grad.__code__, BackwardCFunction.apply.__code__
    tally = collections.Counter()
    depth = {grad_code: 0, function_code: 0}  # frames of each open

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "return":
            if code in depth:
                depth[code] -= 1
            return
        if event != "call":
            return
        if code.co_filename == here:
            return
        if code.co_filename.startswith(triton_root) or code.co_filename == stand_in:
            tally["triton_calls"] += 1
            return
        if code in depth:
            depth[code] += 1
        tally["python_calls"] += 1
        if depth[grad_code] and not depth[function_code]:
            tally["harness_calls"] += 1
        if code is overload_call and frame.f_locals["self"].namespace == "fused_remat":
            tally["dispatches"] += 1

    launches = driver.launches
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return {"launches": driver.launches - launches, "python_calls": tally["python_calls"],
            "harness_calls": tally["harness_calls"], "own_calls": tally["python_calls"] - tally["harness_calls"],
            "triton_calls": tally["triton_calls"], "dispatches": tally["dispatches"]}


def function_floor(inputs: list) -> Callable[[], object]:
    """forward + backward of the least a call on ``inputs`` can be as a Python
    ``torch.autograd.Function``: one that takes the call's inputs, keeps its tensors for backward,
    allocates an output like the first and a gradient for each input that needs one, and launches
    nothing, applied as every op applies its Function (``custom_ops.apply``) and differentiated as
    every case is (``_step``). What a call costs above it is its checks, launches, products and
    allocations; what the floor costs is what no trimming of those can reach while the call is a
    Python Function."""
    import torch

    from fused_remat import custom_ops

    @custom_ops.cached_forward_signature
    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(x, *rest):
            return torch.empty_like(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            # as a call keeps its inputs: None for those that are not tensors (and ``untraced``)
            ctx.save_for_backward(*(t if isinstance(t, torch.Tensor) else None for t in inputs[:-1]))

        @staticmethod
        def backward(ctx, dy):
            return (*(torch.empty_like(t) if need else None for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)),
                    None)

    return _step(lambda *given: custom_ops.apply(Floor, given[0].device, *given), inputs)


def measure(case: HostCase, driver, repeats: int, warmup: int = 3) -> dict:
    """One case's row: ours and eager's host time and counts, and where ours runs a Function the
    floor's (``function_floor``), the three timed in turns."""
    calls = {side: getattr(case, side)() for side in ("ours", "eager")}
    if case.floor is not None:
        calls["floor"] = case.floor()
    for call in calls.values():
        for _ in range(warmup):
            call()
    row = {"case": case.name, "kind": case.kind, "eager_note": case.eager_note}
    for side, us in host_us(calls, repeats).items():
        row[side] = {"host_us": us, **counts(calls[side], driver)}
    row["ratio"] = row["ours"]["host_us"] / row["eager"]["host_us"]
    return row


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def _tensor(*shape, dtype=None, grad=True):
    import torch

    t = torch.randn(*shape, device=DEVICE, dtype=dtype or getattr(torch, DTYPE))
    return t.requires_grad_(grad)


def _offsets():
    """DOCUMENTS equal documents in TOKENS tokens, int32."""
    import torch

    return torch.arange(0, TOKENS + 1, TOKENS // DOCUMENTS, device=DEVICE, dtype=torch.int32)


def _step(fn, inputs: list, grad_out=None):
    """forward + backward: the gradients of ``fn(*inputs)`` with respect to those that need them."""
    import torch

    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def call():
        out = fn(*inputs)
        return torch.autograd.grad(out, wrt, grad_out if grad_out is not None else torch.empty_like(out))

    return call


def op_cases() -> list[HostCase]:
    import torch
    import torch.nn.functional as F

    import fused_remat
    from fused_remat import custom_ops, reference

    rows, dim = TOKENS, WIDTH
    cases = []

    def norm_inputs(bias):
        return [_tensor(rows, dim), _tensor(dim, dtype=torch.float32), _tensor(dim, dtype=torch.float32) if bias else None]

    cases.append(HostCase(
        "layer_norm", "op",
        ours=lambda: _step(lambda x, w, b: fused_remat.layer_norm(x, w, b), norm_inputs(True)),
        eager=lambda: _step(lambda x, w, b: F.layer_norm(x, (dim,), w.to(x.dtype), b.to(x.dtype)), norm_inputs(True)),
        floor=lambda: function_floor(norm_inputs(True))))
    cases.append(HostCase(
        "rms_norm", "op",
        ours=lambda: _step(lambda x, w: fused_remat.rms_norm(x, w), norm_inputs(False)[:2]),
        eager=lambda: _step(lambda x, w: F.rms_norm(x, (dim,), w.to(x.dtype), 1e-6), norm_inputs(False)[:2]),
        floor=lambda: function_floor(norm_inputs(False)[:2])))
    cases.append(HostCase(
        "gelu", "op",
        ours=lambda: _step(lambda x: fused_remat.gelu(x, "tanh"), [_tensor(rows, 4 * dim)]),
        eager=lambda: _step(lambda x: F.gelu(x, approximate="tanh"), [_tensor(rows, 4 * dim)]),
        floor=lambda: function_floor([_tensor(rows, 4 * dim)])))
    cases.append(HostCase(
        "swiglu", "op",
        ours=lambda: _step(fused_remat.swiglu, [_tensor(rows, 4 * dim), _tensor(rows, 4 * dim)]),
        eager=lambda: _step(lambda g, u: F.silu(g) * u, [_tensor(rows, 4 * dim), _tensor(rows, 4 * dim)]),
        floor=lambda: function_floor([_tensor(rows, 4 * dim), _tensor(rows, 4 * dim)])))

    heads, seq, head_dim = 2, TOKENS, 16

    def qkv(batch=1):
        return [_tensor(batch, heads, seq, head_dim) for _ in range(3)]

    cases.append(HostCase(
        "attention", "op",
        ours=lambda: _step(lambda q, k, v: fused_remat.attention(q, k, v, causal=True), qkv()),
        eager=lambda: _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv()),
        floor=lambda: function_floor(qkv())))

    def packed():
        return [_tensor(seq, heads, head_dim) for _ in range(3)] + [_offsets()]

    cases.append(HostCase(
        "attention_varlen", "op",
        ours=lambda: _step(lambda q, k, v, cu: fused_remat.attention_varlen(
            q, k, v, cu, cu, seq // DOCUMENTS, seq // DOCUMENTS, causal=True), packed()),
        eager=lambda: _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            [t.view(1, DOCUMENTS * heads, seq // DOCUMENTS, head_dim).detach().requires_grad_()
                             for t in packed()[:3]]),
        eager_note=f"SDPA over the {DOCUMENTS} documents as one batch of equal lengths",
        floor=lambda: function_floor(packed())))

    def rope_case():
        theta = 10000.0
        q_heads, kv_heads = 4, 1
        x = _tensor(seq, (q_heads + 2 * kv_heads) * head_dim, grad=False)
        inv_freq = reference.rope_inverse_frequencies(head_dim, theta, DEVICE)

        def call():
            custom_ops.direct.rope_qk_(x, inv_freq, 1, q_heads, kv_heads, False)
            custom_ops.direct.rope_qk_(x, inv_freq, 1, q_heads, kv_heads, True)

        return call

    def eager_rope():
        q, k = _tensor(1, seq, 4, head_dim, grad=False), _tensor(1, seq, 1, head_dim, grad=False)

        def call():
            for inverse in (False, True):
                reference.rope(q, 10000.0, inverse=inverse)
                reference.rope(k, 10000.0, inverse=inverse)

        return call

    cases.append(HostCase("rope (forward and inverse)", "op", ours=rope_case, eager=eager_rope,
                          eager_note="the reference's rotate-half RoPE of q and k"))

    vocab = 256

    def loss_inputs():
        return [_tensor(rows, dim), _tensor(vocab, dim), torch.randint(0, vocab, (rows,), device=DEVICE)]

    cases.append(HostCase(
        "linear_cross_entropy", "op",
        ours=lambda: _step(fused_remat.linear_cross_entropy, loss_inputs()),
        eager=lambda: _step(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), loss_inputs()),
        floor=lambda: function_floor(loss_inputs())))
    return cases


def _block_pair(config: dict, seq: int, policy: str | None, budget: float | None = None, documents: bool = False,
                lora: bool = False):
    """(ours, eager, floor) builders for one block step: the floor (``function_floor``) takes the
    tensors ours' Function takes."""
    import torch

    from fused_remat import TransformerBlock, reference

    def build(side: str):
        fused = side != "eager"
        dtype = getattr(torch, DTYPE)
        block = reference.TransformerBlock(**config, device=DEVICE, dtype=dtype)
        if fused:
            block = TransformerBlock.from_reference(block, remat=policy or "cheap")
            block.memory_budget = budget
        x = _tensor(1, seq, config["dim"])
        kwargs = {}
        if documents and fused:
            kwargs = dict(cu_seqlens=_offsets(), max_seqlen=seq // DOCUMENTS)
        adapters = []
        if lora:
            for name in ("qkv", "out_proj"):
                layer = getattr(block, name)
                adapters.append(reference.LowRankAdapter(
                    name, _tensor(LORA_RANK, layer.in_features), _tensor(layer.out_features, LORA_RANK), 2.0))
            for p in block.parameters():
                p.requires_grad_(False)
            kwargs["adapters"] = adapters
        inputs = [x, *(t for a in adapters for t in (a.a, a.b)), *(p for p in block.parameters() if p.requires_grad)]
        if side == "floor":  # the frozen parameters too: the block's Function keeps every one
            return function_floor([*inputs, *(p for p in block.parameters() if not p.requires_grad),
                                   *(t for t in kwargs.values() if isinstance(t, torch.Tensor))])
        return _step(lambda x, *_: block(x, **kwargs), inputs)

    return tuple(functools.partial(build, side) for side in ("ours", "eager", "floor"))


def block_cases() -> list[HostCase]:
    cases = []
    seq = TOKENS
    for shape, config in BLOCKS.items():
        for policy in POLICIES:
            ours, eager, floor = _block_pair(config, seq, policy)
            cases.append(HostCase(f"block {shape} {policy}", "block", ours, eager, floor=floor))
        ours, eager, floor = _block_pair(config, seq, None, budget=MEMORY_BUDGET)
        cases.append(HostCase(f"block {shape} memory_budget={MEMORY_BUDGET}", "block", ours, eager, floor=floor))
        ours, eager, floor = _block_pair(config, seq, "cheap", lora=True)
        cases.append(HostCase(f"block {shape} cheap, LoRA r{LORA_RANK} on qkv and out_proj", "block", ours,
                              eager, floor=floor))
        ours, eager, floor = _block_pair(config, seq, "cheap", documents=True)
        cases.append(HostCase(f"block {shape} cheap, {DOCUMENTS} packed documents", "block", ours, eager,
                              eager_note="eager has no packed-document attention: its dense causal step",
                              floor=floor))
    return cases


def all_cases() -> list[HostCase]:
    return op_cases() + block_cases()


# --------------------------------------------------------------------------------------------
# Capture safety: what a CUDA graph cannot hold
# --------------------------------------------------------------------------------------------


def host_read_guard(capturing: bool = True):
    """A dispatch mode that raises where a call needs a tensor's values on the host (``.item()``,
    ``int()``/``bool()`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``: a device-to-host copy
    and a sync on a GPU, an error during CUDA graph capture) or makes a shape from them (nonzero,
    masked_select, unique, repeat_interleave without output_size). It looks inside our custom
    operators too: a ``fused_remat::`` operator runs its implementation under the guard. Within it
    ``fused_remat.backend.graph_capturing()`` answers True, as during a capture, so that a call with a
    capture-safe form takes it; with ``capturing`` False it answers as outside the guard, for a path
    that must read no value outside a capture either."""
    import torch
    from torch._library.custom_ops import OPDEFS
    from torch.utils._python_dispatch import TorchDispatchMode

    from fused_remat import backend

    def answer_capturing() -> bool:
        return True

    aten = torch.ops.aten
    value_reads = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.masked_select.default,
                   aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}

    def refuse(what):
        def method(*args, **kwargs):
            raise HostRead(f"{what} reads a tensor's values on the host")

        return method

    class HostReadGuard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in value_reads or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
                raise HostRead(f"{func} reads a tensor's values on the host")
            if func.namespace == "fused_remat":
                with self:
                    return OPDEFS[func.name()]._init_fn(*args, **kwargs)
            return func(*args, **kwargs)

        depth = 0  # entered again inside __torch_dispatch__: the methods are swapped at the outermost level

        def __enter__(self):
            if self.depth == 0:
                self.methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
                for name in self.methods:
                    setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
                self.capturing = backend.graph_capturing
                if capturing:
                    backend.graph_capturing = answer_capturing
            self.depth += 1
            return super().__enter__()

        def __exit__(self, *exc):
            self.depth -= 1
            if self.depth == 0:
                for name, method in self.methods.items():
                    setattr(torch.Tensor, name, method)
                backend.graph_capturing = self.capturing
            return super().__exit__(*exc)

    return HostReadGuard()


class HostRead(RuntimeError):
    """A call read a tensor's values on the host."""


def capture_check(cases: list[HostCase]) -> dict[str, str]:
    """Per case, "" where our forward + backward runs under ``host_read_guard`` after one warm-up
    call outside it (as a CUDA graph's capture follows its warm-up), else the first host read."""
    import traceback

    results = {}
    for case in cases:
        call = case.ours()
        call()
        try:
            with host_read_guard():
                call()
            results[case.name] = ""
        except HostRead as error:
            where = next((f"{frame.filename}:{frame.lineno} {frame.name}"
                          for frame in reversed(traceback.extract_tb(error.__traceback__))
                          if "fused_remat" in frame.filename or "/kernels/" in frame.filename), "")
            results[case.name] = f"{error} ({where})"
    return results


def _launch_summary(launcher_args: tuple) -> tuple:
    """What a launch hands the driver's launcher, comparable across calls: the grid, the stream,
    the kernel's function handle and metadata, the hooks, then each argument: anything but a tensor
    as itself; a tensor, of which the launcher reads only the address (its strides travel as the
    integer arguments), as where that address lies: its dtype, its offset in its storage, its
    storage's size and whether it is 16-byte aligned. (A planned launch may hand the buffer a view
    was made of, or a slice of it, at the view's address.) The launch metadata (a profiler's
    description, rebuilt at every launch) is left out, and a hook that calls nothing is None
    (Triton's path hands an empty chain of hooks, a kept launch None)."""
    import torch

    from fused_remat.kernels.launch import no_launch_hook

    grid_stream_function = launcher_args[:6]
    hooks = tuple(None if no_launch_hook(hook) else hook for hook in launcher_args[7:9])
    arguments = tuple((t.dtype, t.storage_offset(), t.untyped_storage().nbytes(), t.data_ptr() % 16 == 0)
                      if isinstance(t, torch.Tensor)
                      else t for t in launcher_args[9:])
    return (*grid_stream_function, *hooks, arguments)


def kept_launch_check(cases: list[HostCase], driver) -> dict[str, str]:
    """Per case, "" where the launches of a second call (each through its kept compiled kernel,
    ``launch.KeptKernel``) hand the driver exactly what the first call's launches did (each the
    first of its signature, through Triton's own path: every kept kernel is forgotten before it),
    and a third call, with a launch hook set, hands every launch the hook and its metadata; else
    the first difference."""
    from fused_remat.kernels.launch import KeptKernel, no_launch_hook

    def recorded(call) -> list[tuple]:
        driver.recorded = []
        try:
            call()
            return driver.recorded
        finally:
            driver.recorded = None

    results = {}
    for case in cases:
        call = case.ours()
        KeptKernel.forget_all()
        first = [_launch_summary(args) for args in recorded(call)]
        kept = [_launch_summary(args) for args in recorded(call)]
        with _launch_hook_set():  # asked within: the chain a launch hands is emptied again after it
            unhooked = [i for i, args in enumerate(recorded(call)) if args[6] is None or no_launch_hook(args[7])]
        if len(first) != len(kept):
            results[case.name] = f"{len(first)} launches through Triton's path, {len(kept)} kept"
            continue
        results[case.name] = next((_difference(i, a, b) for i, (a, b) in enumerate(zip(first, kept)) if a != b), "")
        if unhooked and not results[case.name]:
            results[case.name] = f"launch {unhooked[0]}: a launch hook is set, and the launch hands none"
    return results


@contextlib.contextmanager
def _launch_hook_set():
    """Within: a launch hook that does nothing is set (Triton 3.7 and later: added to the chain)."""
    from triton import knobs

    def hook(metadata):
        return None

    runtime = knobs.runtime
    before = runtime.launch_enter_hook
    if hasattr(before, "add"):
        before.add(hook)
    else:
        runtime.launch_enter_hook = hook
    try:
        yield
    finally:
        if hasattr(before, "remove"):
            before.remove(hook)
        else:
            runtime.launch_enter_hook = before


def _difference(launch: int, first: tuple, kept: tuple) -> str:
    if first[:-1] != kept[:-1]:
        return f"launch {launch}: the grid, stream, function, metadata or hooks differ"
    if len(first[-1]) != len(kept[-1]):
        return f"launch {launch}: {len(first[-1])} arguments through Triton's path, {len(kept[-1])} kept"
    argument = next(j for j, (a, b) in enumerate(zip(first[-1], kept[-1])) if a != b)
    return (f"launch {launch}: argument {argument} is {first[-1][argument]!r} through Triton's path, "
            f"{kept[-1][argument]!r} kept")


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    import torch
    import triton

    from bench.harness import _git_commit

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "target": TARGET, "dtype": DTYPE, "commit": _git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        "# Host time per call, launches stubbed",
        "",
        f"{env['cpu']}, {env['cores']} cores; Python {env['python']}, torch {env['torch']}, Triton "
        f"{env['triton']} (compiling for {env['target']}), {env['dtype']}; commit {env['commit']}, {env['date']}.",
        "",
        f"Forward + backward of each op and block on {DEVICE} tensors of {TOKENS} tokens, Triton's launcher a no-op "
        "(`python -m bench host`, bench/host.py): what a call costs the host before a GPU sees it, never GPU time. "
        "Python calls: the op's own, then in brackets those of the case's `torch.autograd.grad` outside the "
        "Functions it runs (the same for any op) and Triton's launch path (its driver's stand-in included). "
        "Function floor (timed in turns with each op and block, all but RoPE's in-place calls): a Python "
        "`torch.autograd.Function` that takes the call's tensors (a block's: x, its parameters, adapters and "
        "offsets), keeps them for backward, allocates an output like the first and each input's gradient, and "
        "launches nothing, applied and differentiated as ours are; in brackets over eager's time. A call cannot "
        "cost less than its floor while it is a Python Function: its checks, launches, products and "
        "allocations come on top.",
        "",
        "| case | ours us | eager us | ours / eager | Function floor us (/ eager) | launches "
        "| Python calls (autograd.grad, Triton) | dispatches | eager Python calls (autograd.grad) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ours, eager = row["ours"], row["eager"]
        floor = row.get("floor")
        floor = f"{floor['host_us']:.0f} ({floor['host_us'] / eager['host_us']:.2f})" if floor else "-"
        lines.append(f"| {row['case']} | {ours['host_us']:.0f} | {eager['host_us']:.0f} | {row['ratio']:.2f} | {floor} | "
                     f"{ours['launches']} | {ours['own_calls']} ({ours['harness_calls']}, {ours['triton_calls']}) | "
                     f"{ours['dispatches']} | {eager['own_calls']} ({eager['harness_calls']}) |")
    notes = [f"- {row['case']}: eager is {row['eager_note']}." for row in rows if row["eager_note"]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per case and side (median)")
    parser.add_argument("--case", action="append", help="run this case (by its exact name; repeatable)")
    parser.add_argument("--capture-check", action="store_true",
                        help="instead of timing: run each case's call under a guard that fails on host reads "
                        "(what CUDA graph capture cannot hold), after one warm-up, and check that kept "
                        "launches hand the driver what Triton's own launch path does; writes capture.json and "
                        "kept.json")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: the host path must be the compiled one (unset it)")
    cases = all_cases()
    if args.case:
        unknown = set(args.case) - {case.name for case in cases}
        if unknown:
            parser.error(f"--case: no case named {', '.join(sorted(unknown))}; the cases: "
                         f"{', '.join(case.name for case in cases)}")
        cases = [case for case in cases if case.name in args.case]
    if args.capture_check:
        with stubbed_launches() as driver:
            results = capture_check(cases)
            kept = kept_launch_check(cases, driver)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "capture.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "kept.json").write_text(json.dumps(kept, indent=1) + "\n")
        for name, error in results.items():
            print(f"{name}: {error or 'capture-safe'}; {kept[name] or 'kept launches as Triton launches'}")
        return 0
    rows = []
    with stubbed_launches() as driver:
        for case in cases:
            row = measure(case, driver, args.repeats)
            rows.append(row)
            print(f"{row['case']}: ours {row['ours']['host_us']:.0f} us, eager {row['eager']['host_us']:.0f} us "
                  f"({row['ratio']:.2f}x), {row['ours']['launches']} launches, {row['ours']['own_calls']} "
                  f"Python calls (+{row['ours']['harness_calls']} autograd.grad's, +{row['ours']['triton_calls']} "
                  f"Triton's), {row['ours']['dispatches']} dispatches",
                  flush=True)
    env = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    (args.out / "host.md").write_text(markdown(rows, env))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
