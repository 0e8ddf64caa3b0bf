"""A stand-in for Triton's CUDA driver: Triton compiles for a named target and records each kernel
instead of launching it."""

from __future__ import annotations

import contextlib
import dataclasses

from bench.static.targets import ARCHS, Arch


@dataclasses.dataclass
class Compiled:
    """One kernel Triton compiled for a launch (or an autotuner trial)."""

    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int
    binary: object  # triton's CompiledKernel


class StandInDriver:
    """Enough of ``triton.runtime.driver.active`` for JIT compilation and the autotuner.

    Each target gets its own device index: Triton keeps its per-kernel binders and caches per
    device, so switching targets never reuses a binary compiled for another one."""

    def __init__(self, arch: Arch):
        import types

        self.arch = arch
        self.launched: list[Compiled] = []
        self.utils = types.SimpleNamespace(
            get_device_properties=self._properties,
            load_binary=lambda name, binary, shared, device: (None, binary, 0, 0, 1024),
            unload_module=lambda module: None,
        )

    # -- what the JIT and the compiler ask
    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch.capability, 32)

    def get_current_device(self) -> int:
        return list(ARCHS).index(self.arch.name)

    def set_current_device(self, device) -> None:
        pass

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.arch.capability, 10)

    def get_active_torch_device(self):
        import torch

        return torch.device("meta")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def _properties(self, device) -> dict:
        return {"max_shared_mem": self.arch.smem_per_block, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}

    # -- the autotuner: every configuration "runs" (and so compiles) once, all tie
    def get_benchmarker(self):
        def bench(kernel_call, quantiles=None, **_):
            kernel_call()
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench

    # -- launching: record the compiled kernel, run nothing
    def launcher_cls(self, src, metadata):
        fn = src.fn
        binary = next(k for k in fn.device_caches[self.get_current_device()][0].values()
                      if getattr(k, "hash", None) == metadata.hash)
        constants = getattr(src, "constants", None) or getattr(src, "constexprs", {})  # name differs across versions
        constexprs = {fn.arg_names[key[0]]: value for key, value in constants.items() if len(key) == 1}
        self.launched.append(Compiled(fn.__name__, constexprs, metadata.num_warps, metadata.num_stages, binary))
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def compiling_for(arch: Arch, stand_in: StandInDriver | None = None):
    """Within: Triton compiles for ``arch`` and launches nothing; yields the driver's record.
    ``stand_in``: a StandInDriver (or subclass) for ``arch`` to use instead of a new one."""
    from triton.runtime import driver

    stand_in = stand_in or StandInDriver(arch)
    driver.set_active(stand_in)
    _forget_autotuning()
    try:
        yield stand_in.launched
    finally:
        driver.set_active(_previous_driver())


def _forget_autotuning() -> None:
    """Clear the launchers' autotuner choices: a choice made for another target, or for another
    case sharing its key (the attention key leaves GQA out), would skip compiling the others."""
    from triton.runtime.autotuner import Autotuner

    from fused_remat.kernels import activations, attention_kernels, norm, rope

    for module in (attention_kernels, norm, activations, rope):
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                value.cache.clear()


def _previous_driver():
    """Triton's own driver where one is active (never on a machine without a GPU): None otherwise,
    so that a later ``driver.active`` builds it afresh."""
    from triton.runtime import driver

    try:
        return driver.default
    except RuntimeError:
        return None
