"""Host-side helpers shared by the launchers."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver
from triton.runtime.jit import JITFunction

# Every launch asks for fused multiply-adds (FFMA): Triton 3.6 to 3.9 fuse a multiply feeding an add
# by default, 3.10 will not (3.9 warns where TRITON_DEFAULT_FP_FUSION is unset), and the hot loops
# were tuned on their fused compiled form. ``enable_fp_fusion`` is a compile option of Triton's
# NVIDIA and AMD backends (3.6 and 3.9): the autotuner passes launch keywords on to every
# configuration it compiles, and the interpreter drops them.
FP_FUSION = {"enable_fp_fusion": True}

# The row-wise kernels (norms, activations) ask for the opposite: every multiply and add rounds on
# its own. Their outputs are rebuilt by other kernels (a norm's or activation's backward rebuilds the
# forward's output for the next weight gradient), and every remat point must give the same bits;
# with fusion on, the compiler may contract the same source differently in the two kernels (what
# that broke on a GPU: docs/design.md, Triton portability facts). They are memory-bound, so the
# separate FMUL and FADD should cost instructions, not time (their compiled form is in
# bench/results/static; what has been timed: docs/tuning.md).
SEPARATE_ROUNDING = {"enable_fp_fusion": False}


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_program_count(device: torch.device, work_items: int, per_sm: int = 2) -> int:
    """Programs for a grid-stride kernel: enough to fill the GPU, few in the (serial) interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        budget = _cuda_sm_count(index) * per_sm
    else:
        budget = 4
    return max(1, min(work_items, budget))


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1), in plain integers: ``triton.next_power_of_2`` is
    a constexpr function in Triton 3.9 whose wrapper is slow to call on the host, and a block's step
    asks many times."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division in plain integers (``triton.cdiv`` is a constexpr function in Triton 3.9,
    slow to call on the host)."""
    return -(-a // b)


def _cuda_scratch(size: int, alignment: int, stream):
    """Global scratch for a launch on the current CUDA device (Triton asks when a kernel builds
    tensor descriptors on the device: 128 bytes per descriptor and program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for kernel scratch memory unless the caller set one.

    Triton keeps it in a context variable, which every new thread (autograd's backward threads
    among them) starts without: so this runs before every launch that needs it, not once."""
    if isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR):
        triton.set_allocator(_cuda_scratch)


# What ensure_scratch_allocator asks, for a launcher's hot path to ask without a Python call:
# ``isinstance(SCRATCH_ALLOCATOR.get(), NO_SCRATCH_ALLOCATOR)`` (this thread has none set)
SCRATCH_ALLOCATOR, NO_SCRATCH_ALLOCATOR = _allocation._allocator, _allocation.NullAllocator


# Triton 3.7 and later keep each launch hook as a chain of hooks, never None (empty when none is
# set); Triton 3.6 keeps None or one hook.
HOOK_CHAIN = getattr(knobs, "HookChain", None)


def no_launch_hook(hook) -> bool:
    """Whether a launch hook of Triton's knobs calls nothing: None, or an empty chain."""
    return hook is None or hook.__class__ is HOOK_CHAIN and not hook.calls


# A kernel keeps at most this many argument signatures; past it the oldest half is dropped (a
# long run whose sizes vary from batch to batch would otherwise grow it without bound).
KEPT_SIGNATURES = 256


class KeptKernel:
    """A ``@triton.jit`` or ``triton.autotune`` kernel launched as ``kernel[grid](*args, **kwargs)``,
    through the compiled kernel kept for the call's argument signature.

    Triton's own launch binds every argument to the signature, specializes each one, builds the
    cache key, looks the compiled kernel up and (autotuned) looks the configuration up, on every
    launch: most of an op's host time at short sequences. Here the first launch of a signature
    takes that path, and later launches with the same signature call the compiled kernel's launcher
    as ``JITFunction.run`` does, with the same arguments, stream and hooks.

    The signature is exact, never looser than Triton's specialization: every tensor's dtype and
    whether its address is 16-byte aligned (what Triton specializes a pointer on), every other
    argument's type and value (Triton specializes an integer on its value being 1 or a multiple of
    16; keeping the value also keys the autotuner's choice, which reads sizes), the keywords
    (constexprs, launch options), the active driver (a stand-in that compiles for another GPU
    never lends a kernel to the real one) and the current device. A grid given as a function gets
    the kernel's constexprs (its configuration's among them) as ``meta``. Left out of the key,
    as fixed for a process: Triton's check that a kernel's globals are unchanged since it compiled
    (ours are constants) and the debug and instrumentation knobs, which add checks or counters and
    change no result.

    In Triton's interpreter the signature and its cache are the same and a kept entry calls the
    interpreted function: the interpreter replaces the kernel body, not the launch path."""

    __slots__ = ("fn", "jit", "compiled", "_kept", "__weakref__")

    _instances = weakref.WeakSet()

    def __init__(self, fn):
        self.fn = fn
        jit = fn
        while not isinstance(jit, JITFunction) and hasattr(jit, "fn"):
            jit = jit.fn
        self.jit = jit
        self.compiled = isinstance(jit, JITFunction)  # else Triton's interpreter, which has no driver
        self._kept = {}
        KeptKernel._instances.add(self)

    @classmethod
    def forget_all(cls) -> None:
        """Every kernel's next launch of each signature takes Triton's own path again (and every
        launch plan, which holds kept launches, is made again)."""
        for kernel in cls._instances:
            kernel._kept.clear()
        for plans in LaunchPlans._instances:
            plans.clear()

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        active, device = launch_context(self.compiled)
        key = (active, device, tuple(map(type, args)),
               *[(a.dtype, not a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args],
               *kwargs.items())
        kept = self._kept.get(key)
        if kept is None:
            self._first_launch(key, grid, args, kwargs)
        else:
            kept(grid, active, device, args)
        return key

    def bind(self, grid, tensors: tuple, tail: tuple, **kwargs):
        """Launches ``kernel[grid](*tensors, *tail, **kwargs)`` and returns a launcher for later
        calls that differ only in the tensors: ``bound(*tensors)``. The caller keeps it under a key
        that fixes everything the kept signature holds (``LaunchPlans``): ``tail``, the keywords and
        grid, each tensor's dtype and address alignment, the driver and device. None where the
        signature is never kept (an autotuner's pre-hook), which the caller then launches each time."""
        args = (*tensors, *tail)
        kept = self._kept.get(self.launch(grid, *args, **kwargs))
        if kept is None:
            return None
        active, device = launch_context(self.compiled)
        return kept.bound(grid, active, device, tail)

    def _first_launch(self, key, grid, args, kwargs) -> None:
        """Launches through Triton's own path and keeps what later launches of ``key`` need."""
        if len(self._kept) >= KEPT_SIGNATURES:
            for stale in list(self._kept)[:KEPT_SIGNATURES // 2]:
                del self._kept[stale]
        if not self.compiled:
            _interpret(self.fn, grid, args, kwargs)
            self._kept[key] = _Interpreted(self.fn, kwargs)
            return
        kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        config = getattr(self.fn, "best_config", None)
        if config is not None and config.pre_hook is not None:
            return  # the autotuner runs a hook before each launch: never kept
        given = {**kwargs, **(config.all_kwargs() if config is not None else {})}
        parameters = self.jit.signature.parameters
        bound = self.jit.signature.bind(*args, **{name: v for name, v in given.items() if name in parameters})
        bound.apply_defaults()
        names, values = list(bound.arguments), tuple(bound.arguments.values())
        self._kept[key] = _Compiled(kernel, values[len(args):], dict(zip(names[len(args):], values[len(args):])))


def launch_context(compiled: bool) -> tuple:
    """(the active driver, its current device) that a kernel's kept launch is for; (None, None) in
    Triton's interpreter (``KeptKernel.compiled`` False), which has no driver."""
    if not compiled:
        return None, None
    active = driver.active
    return active, active.get_current_device()


# A new contiguous tensor of a tensor's shape, dtype and device (``torch.empty`` of a ``torch.Size``
# goes through Python's slower argument parsing)
new_like = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)


def launch_key(compiled: bool, tensors) -> tuple:
    """What a launch plan's key holds of the launch and the tensors: ``launch_context(compiled)``,
    then per tensor its shape, dtype, device, strides and address modulo 16 (Triton specializes a
    pointer on 16-byte alignment; tensor descriptors need it). In one Python frame, a tuple per
    tensor appended in a loop: it runs at every launch, and this form costs less than building it
    from maps of C callables."""
    active = driver.active if compiled else None
    key = [active, None if active is None else active.get_current_device()]
    for t in tensors:
        key.append((t.shape, t.dtype, t.device, t.stride(), t.data_ptr() & 15))
    return tuple(key)


class LaunchPlans:
    """A launcher's plans, one per call signature: the launches bound with everything but the
    tensors (``KeptKernel.bind``) and the sizes of what the call allocates, made at a signature's
    first call, so that the next calls only allocate and launch. A plan's key must fix everything
    its launches' arguments and kept signatures depend on (sizes, strides, dtypes, options, each
    tensor's address modulo 16, ``launch_context``); the oldest half goes past KEPT_SIGNATURES."""

    _instances = weakref.WeakSet()

    def __init__(self):
        self._plans = {}
        self.get = self._plans.get  # the plan for a key, or None
        LaunchPlans._instances.add(self)

    def keep(self, key, plan):
        if len(self._plans) >= KEPT_SIGNATURES:
            for stale in list(self._plans)[:KEPT_SIGNATURES // 2]:
                del self._plans[stale]
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()


class _Compiled:
    """One signature's compiled kernel and the arguments after the positional ones (constexprs,
    defaults), launched as ``JITFunction.run`` launches."""

    __slots__ = ("kernel", "tail", "meta")

    def __init__(self, kernel, tail: tuple, meta: dict):
        self.kernel, self.tail, self.meta = kernel, tail, meta

    def __call__(self, grid, active, device, args):
        if callable(grid):
            grid = grid(self.meta)
        self.bound(grid, active, device, ())(*args)

    def bound(self, grid, active, device, tail: tuple):
        """The launch with ``tail`` after the given arguments, as one function of the tensors: the
        grid resolved and the kernel's handles read once."""
        if callable(grid):
            grid = grid(self.meta)
        grid_0, grid_1, grid_2 = (*grid, 1, 1)[:3]
        kernel, tail = self.kernel, (*tail, *self.tail)
        run, launch_metadata, function, packed = (kernel.run, kernel.launch_metadata, kernel.function,
                                                  kernel.packed_metadata)
        hooks, chain = knobs.runtime, HOOK_CHAIN

        def launch(*given):
            stream = active.get_current_stream(device)
            full = (*given, *tail)
            enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
            # no_launch_hook of both, inline (two frames a launch): where no hook is set, no launch
            # metadata to build (Triton 3.9 builds it for an empty chain) and no empty chain for the
            # driver to call, as with Triton 3.6's None.
            if ((enter is None or enter.__class__ is chain and not enter.calls)
                    and (leave is None or leave.__class__ is chain and not leave.calls)):
                run(grid_0, grid_1, grid_2, stream, function, packed, None, None, None, *full)
            else:
                run(grid_0, grid_1, grid_2, stream, function, packed, launch_metadata(grid, stream, *full), enter,
                    leave, *full)

        return launch


# Triton's interpreter copies a launch's tensors through closures that refer to themselves (its
# GridExecutor), a reference cycle that keeps every storage the launch touched alive until the
# garbage collector runs; a compiled launch holds nothing. A memory meter collects after each
# interpreted launch, so tensors are freed where they would be on a GPU.
_collect_after_launch = False


@contextlib.contextmanager
def collecting_interpreter_cycles():
    """Within: the garbage collector runs after each interpreted launch (slow; for memory meters)."""
    global _collect_after_launch
    before, _collect_after_launch = _collect_after_launch, True
    try:
        yield
    finally:
        _collect_after_launch = before


def _interpret(fn, grid, args, kwargs) -> None:
    fn[grid](*args, **kwargs)
    if _collect_after_launch:
        gc.collect()


class _Interpreted:
    """One signature's launch in Triton's interpreter: the interpreted function with the keywords."""

    __slots__ = ("fn", "kwargs")

    def __init__(self, fn, kwargs: dict):
        self.fn, self.kwargs = fn, kwargs

    def __call__(self, grid, active, device, args):
        _interpret(self.fn, grid, args, self.kwargs)

    def bound(self, grid, active, device, tail: tuple):
        fn, kwargs = self.fn, self.kwargs
        return lambda *given: _interpret(fn, grid, (*given, *tail), kwargs)
