"""Checks of tensor values that never make the host wait for the GPU.

Some inputs can only be checked by their values: a token or target id outside the vocabulary.
Reading a value on the host (``.item()``, ``.tolist()``) waits for everything queued on the GPU
before it, once per call, and a training step that does so cannot run ahead of the GPU. So a check
is made on the device, into a flag, and the step goes on (the caller keeps it safe and loud: the
ids clamped, the step's values made NaN); the flag is read on the host where that costs no wait:

- on a CPU tensor (the interpreter, a stand-in launch) at once: the call itself raises;
- on CUDA, ``check_later`` copies it into pinned host memory behind the queued work with an event
  after the copy, and ``raise_arrived`` (which ``check_later`` runs first, and backward passes call)
  raises for it once the event has passed: at the latest a step later, before that step's
  gradients reach a weight.

While a CUDA graph is captured nothing is sent or read (a replay cannot raise): the caller's NaN
stays the only sign.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import torch

from . import backend

# Checks on their way to the host, oldest first: (the flag in host memory, whether it has arrived,
# the error to raise where it is set, given True: found after its call returned)
PENDING: collections.deque[tuple] = collections.deque()
_PENDING_LOCK = threading.Lock()  # autograd runs a CUDA backward on a thread of its own

# Devices where reading a tensor's value on the host waits for the device; elsewhere it is on the
# host when the kernel that wrote it returns, and is read at once
READ_LATER_ON = frozenset({"cuda"})


def _on_host(flag: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
    """``flag`` on its way to host memory, and whether it has arrived: a copy into pinned memory
    behind the queued work and an event after it, so that reading it never waits for the GPU."""
    copy = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
    copy.copy_(flag, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return copy, copied.query


def found_later(call: str) -> str:
    """What an error raised by ``raise_arrived`` adds to its message: the ``call`` it was found in."""
    return (f" (given to an earlier {call}, whose loss and gradients came out NaN: on a GPU the check is read once "
            "the GPU has made it, never waited for)")


def check_later(flag: torch.Tensor, error: Callable[[bool], Exception]) -> None:
    """First ``raise_arrived``; then raises ``error(False)`` now where the one-element ``flag`` is
    set and reading it waits for nothing; on a device where it would wait (``READ_LATER_ON``), sends
    it to the host for ``raise_arrived`` to raise ``error(True)`` once there. ``error`` builds the
    exception when it is raised (it may read values then: the step is over). Nothing while a CUDA
    graph is captured."""
    if PENDING:
        raise_arrived()
    if backend.graph_capturing():
        return
    if flag.device.type not in READ_LATER_ON:
        if flag.item():
            raise error(False)
        return
    on_host = _on_host(flag)
    with _PENDING_LOCK:
        PENDING.append((*on_host, error))


def raise_arrived() -> None:
    """Drops every pending check that has reached the host, oldest first, and raises for the first
    that was set (dropping every other pending check with it: they are about the same or later
    steps, whose values are NaN already); nothing while a CUDA graph is captured. Callers may ask
    ``if PENDING`` first: an empty queue then costs no call."""
    if backend.graph_capturing():
        return
    while True:
        with _PENDING_LOCK:
            if not PENDING or not PENDING[0][1]():
                return
            flag, _, error = PENDING.popleft()
            failed = bool(flag.item())  # host memory: no wait
            if failed:
                PENDING.clear()
        if failed:
            raise error(True)
