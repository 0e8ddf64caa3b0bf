"""Which implementation runs an op: compiled Triton, interpreted Triton, or the PyTorch reference.

CUDA tensors run the compiled Triton kernels. CPU tensors run the same kernels in Triton's
interpreter when ``TRITON_INTERPRET=1`` was set before triton was imported, and the plain-PyTorch
reference otherwise. ``FUSED_REMAT_BACKEND=auto|triton|reference`` overrides the choice.

The ops import ``fused_remat.kernels`` inside the functions that launch them: importing
fused_remat never imports triton, so ``TRITON_INTERPRET=1`` set after ``import fused_remat`` (as
``python -m fused_remat`` does) still takes effect.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from .kernels.limits import INTERPRET_ENV, triton_interpreting

BACKEND_ENV = "FUSED_REMAT_BACKEND"
BACKENDS = ("auto", "triton", "reference")


def requested_backend() -> str:
    name = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not one of {', '.join(BACKENDS)}")
    return name


@functools.cache
def triton_installed() -> bool:
    # asked by every op call, and finding the module costs more than the call itself
    return importlib.util.find_spec("triton") is not None


# The device type whose tensors take the kernels' path although Triton cannot launch there: set
# only inside ``stubbed_launches_on``, which a host-cost measurement enters.
_stubbed_device: str | None = None


@contextlib.contextmanager
def stubbed_launches_on(device_type: str):
    """Within: tensors of ``device_type`` run the ops' real path down to Triton's launch, for a
    host-cost measurement under a driver that launches nothing (``bench/host.py``)."""
    global _stubbed_device
    before, _stubbed_device = _stubbed_device, device_type
    try:
        yield
    finally:
        _stubbed_device = before


def triton_can_run_on(device: torch.device) -> bool:
    if not triton_installed():
        return False
    if device.type == _stubbed_device:
        return True
    if device.type == "cuda":
        return not triton_interpreting()
    return device.type == "cpu" and triton_interpreting()


def launches_kernels(device: torch.device) -> bool:
    """Whether tensors on ``device`` reach the launchers (not meta's: the fake kernels answer)."""
    return device.type != "meta" or _stubbed_device == "meta"


# os.environ's own table of the process environment, kept current by every write through os.environ
# (monkeypatch.setenv included): a dict lookup per op call where os.environ.get runs Python
# functions. None where os.environ has no such table; the ops then ask os.environ.
_ENVIRON = getattr(os.environ, "_data", None)
_ENVIRON_KEYS = tuple(os.environ.encodekey(name) for name in (BACKEND_ENV, INTERPRET_ENV)) if _ENVIRON is not None else ()

# use_triton's answers by what they depend on: the two variables as set, the device type and the
# stubbed device type. Errors are never kept: they are raised again at each call.
_USE_TRITON: dict[tuple, bool] = {}


def use_triton(op: str, device: torch.device) -> bool:
    """True when ``op`` on tensors of ``device`` should run the Triton kernels. Asked by every op call:
    the answer is kept per setting of the variables, which are read again at every call."""
    environment = (*map(_ENVIRON.get, _ENVIRON_KEYS),) if _ENVIRON is not None else None
    key = (environment, device.type, _stubbed_device)
    runnable = _USE_TRITON.get(key) if environment is not None else None
    if runnable is None:
        runnable = _decide_triton(op, device)
        if environment is not None:
            _USE_TRITON[key] = runnable
    return runnable


def _decide_triton(op: str, device: torch.device) -> bool:
    backend = requested_backend()
    if backend == "reference":
        return False
    runnable = triton_can_run_on(device)
    if backend == "triton" and not runnable:
        if not triton_installed():
            why = "triton is not installed"
        elif device.type == "cpu":
            why = f"CPU tensors need {INTERPRET_ENV}=1 set before triton is imported"
        elif device.type == "cuda":
            why = f"{INTERPRET_ENV}=1 is set, and the interpreter runs on CPU tensors only"
        else:
            why = f"Triton has no backend for device type {device.type!r}"
        raise RuntimeError(f"{op}: {BACKEND_ENV}=triton but the Triton kernels cannot run here: {why}")
    return runnable


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: never while CUDA is not initialized (a
    plain flag, so eager calls pay almost nothing), and it never initializes it; False while
    torch.compile traces (a custom operator asks again when it runs, which is when Inductor's CUDA
    graphs capture). A call that would read values on the host or keep a tensor across calls takes
    its capture-safe form then, and one that a graph cannot hold refuses; ``bench.host.host_read_guard``
    answers True here to check those forms on CPU tensors."""
    return (torch.cuda.is_initialized() and not torch.compiler.is_dynamo_compiling()
            and torch.cuda.is_current_stream_capturing())


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype torch.autocast computes in on ``device_type``, or None where it is off. A device
    without autocast (meta, for a model built to infer shapes) has it off rather than an error."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
