"""Activation offload: what a layer keeps for backward, held in pinned host memory between its
forward and its backward.

The ``offload`` policy keeps what ``full`` keeps (the block input x), but not on the GPU:

- forward: x is copied device -> host on a side stream. The compute stream does not wait for the
  copy; x's memory is handed back to the allocator only once the copy has read it
  (``record_stream``), so the next layer's forward overlaps the copy.
- backward: the copy back (host -> device) of the layer that backward reaches next is started one
  layer ahead, when the current layer's backward starts, on the same side stream; the compute
  stream waits for a layer's upload only when that layer's backward begins.

The host memory lives as long as the graph keeps it, no longer: the block saves the host tensor
for backward, and a ``HostCopy`` holds it only until its first ``fetch``, then weakly. A backward
that does not retain the graph frees the pinned memory with the graph's other saved tensors, so
a loop's next forward reuses it from the caching host allocator even while the last step's loss
is still referenced (which would otherwise keep two steps of copies pinned, the second allocated
afresh); a retained graph keeps it for its next backward.

Copies are made in creation order per thread: each ``HostCopy`` remembers the one created just
before it, which is, in a model, the previous layer's (prefetching it is only a hint: every
``fetch`` starts its own upload when none was prefetched, so gradient accumulation, several
forwards before one backward, or a copy whose graph is never run backward stay correct).

On CPU the host is where the tensor already is: the copy is the tensor itself (no bytes move),
and only the bookkeeping runs (the saved-memory meter counts it as host memory).
"""

from __future__ import annotations

import threading
import weakref

import torch

# The host tensors of live copies by id, for the saved-memory meter: the tensor objects, not their
# storage (on CPU a copy shares its storage with the tensor it copies), and not a WeakSet (which
# would compare tensors with ==, element-wise).
_registry: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_latest = threading.local()  # the HostCopy this thread made last (weakly)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def is_host_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the host memory of an offloaded activation."""
    return _registry.get(id(tensor)) is tensor


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device, shared by every offloaded layer, so uploads run in order."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class HostCopy:
    """One tensor's trip to host memory at forward and back to its device at backward."""

    def __init__(self, tensor: torch.Tensor):
        self.device = tensor.device
        previous = getattr(_latest, "copy", None)
        self.previous = previous  # a weak reference (or None): never keeps another layer's copy alive
        _latest.copy = weakref.ref(self)
        self._upload: torch.Tensor | None = None
        self._uploaded: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            stream = _side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # x is written by then
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                self._stored = torch.cuda.Event()
                self._stored.record(stream)
            tensor.record_stream(stream)
        else:
            host = tensor.detach()
            self._stored = None
        self._held: torch.Tensor | None = host  # until the first fetch; then the graph's saved tensors hold it
        self._host = weakref.ref(host)
        _registry[id(host)] = host

    @property
    def host(self) -> torch.Tensor | None:
        """The host copy, or None once the graph that saved it was freed."""
        return self._host()

    def prefetch(self) -> None:
        """Start the copy back to the device unless it is under way (or the host copy is gone:
        a prefetch is only a hint)."""
        host = self.host
        if self._upload is not None or host is None:
            return
        if self.device.type != "cuda":
            self._upload = host
            return
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self._stored)
            self._upload = host.to(self.device, non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(stream)

    def fetch(self) -> torch.Tensor:
        """The tensor back on its device, ready for the current stream; then prefetches the copy
        made before this one (the layer backward reaches next). From here on only the graph holds
        the host copy: a retained graph runs backward again, a freed one frees the pinned memory."""
        self.prefetch()
        if self._upload is None:
            raise RuntimeError("offload: the host copy of this activation was freed with its graph; a second "
                               "backward through a graph needs retain_graph=True on the first")
        self._held = None
        tensor, self._upload = self._upload, None
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self._uploaded)
            tensor.record_stream(current)
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.prefetch()
        return tensor


__all__ = ["HostCopy", "is_host_copy"]
