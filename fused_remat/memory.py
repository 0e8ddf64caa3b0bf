"""The saved-memory meter: how many bytes autograd keeps for backward.

    with fused_remat.memory.saved_memory() as meter:
        y = layer_norm(x, w, b)
    meter.bytes          # activation bytes held for backward (device_bytes + host_bytes)
    print(meter.report())

Every tensor that an autograd node saves while the meter is active passes through a
``saved_tensors_hooks`` pack hook. The meter counts each underlying storage once (two views of one
buffer cost one buffer) and leaves out parameters, views of parameters, and any tensor whose
storage is shared with a tensor passed in ``exclude`` (weights are not activations).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .offload import is_host_copy


@dataclass
class SavedTensorRecord:
    dtype: torch.dtype
    shape: tuple[int, ...]
    storage_bytes: int
    host: bool  # an offloaded activation's host memory (``fused_remat.offload``)


@dataclass
class SavedMemoryMeter:
    """What autograd saved while the meter was active. ``bytes`` counts each storage once: the
    ``device_bytes`` that stay where the computation runs plus the ``host_bytes`` of offloaded
    activations (on CPU the offload copy is the tensor itself; it is still counted as host)."""

    excluded_storages: set[int] = field(default_factory=set)
    records: dict[int, SavedTensorRecord] = field(default_factory=dict)
    excluded_count: int = 0

    @property
    def bytes(self) -> int:
        return sum(r.storage_bytes for r in self.records.values())

    @property
    def device_bytes(self) -> int:
        return sum(r.storage_bytes for r in self.records.values() if not r.host)

    @property
    def host_bytes(self) -> int:
        return sum(r.storage_bytes for r in self.records.values() if r.host)

    def breakdown(self) -> dict[tuple[torch.dtype, tuple[int, ...]], int]:
        """Bytes per (dtype, shape of the largest tensor seen on each storage)."""
        totals: dict[tuple[torch.dtype, tuple[int, ...]], int] = defaultdict(int)
        for record in self.records.values():
            totals[(record.dtype, record.shape)] += record.storage_bytes
        return dict(totals)

    def report(self) -> str:
        lines = [f"saved for backward: {self.bytes} bytes in {len(self.records)} storages "
                 f"({self.device_bytes} on the device, {self.host_bytes} offloaded to host memory)"]
        for (dtype, shape), nbytes in sorted(self.breakdown().items(), key=lambda item: -item[1]):
            lines.append(f"  {nbytes:>14,d} B  {str(dtype).removeprefix('torch.'):<9} {list(shape)}")
        if self.excluded_count:
            lines.append(f"  ({self.excluded_count} saved parameter tensors left out)")
        return "\n".join(lines)

    def _is_parameter(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter) or isinstance(getattr(tensor, "_base", None), torch.nn.Parameter):
            return True
        return _storage_key(tensor) in self.excluded_storages

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._is_parameter(tensor):
            self.excluded_count += 1
        else:
            key = _storage_key(tensor)
            seen = self.records.get(key)
            # A storage saved both as itself and as an offload copy (on CPU) is on the device.
            host = is_host_copy(tensor) and (seen is None or seen.host)
            if seen is None or tensor.numel() > math.prod(seen.shape):
                storage_bytes = tensor.untyped_storage().nbytes()
                self.records[key] = SavedTensorRecord(tensor.dtype, tuple(tensor.shape), storage_bytes, host)
            else:
                seen.host = host
        return tensor


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def saved_memory(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedMemoryMeter]:
    """Count the bytes autograd saves for backward inside the ``with`` block.

    ``exclude``: tensors (typically ``model.parameters()``) whose storages are not activations.
    ``nn.Parameter`` objects and their views are always left out.
    """
    meter = SavedMemoryMeter(excluded_storages={_storage_key(t) for t in exclude})
    with torch.autograd.graph.saved_tensors_hooks(meter._pack, _identity):
        yield meter


# ------------------------------------------------------------------------------------------------
# The peak-memory meter: the high-water mark of what a call allocates, transients included.
# ------------------------------------------------------------------------------------------------

_OURS, _TRITON, _OTHER = "ours", "triton", "other"
MARKER_PREFIX = "fused_remat.peak_memory:"
NO_FRAME = -1  # a marker index: no frame of ours or the user's is on the stack
IN_TRITON = -2  # a marker index: a frame of the Triton package is innermost (the interpreter)


@dataclass(frozen=True)
class PeakAllocation:
    """One storage allocation: its bytes, the innermost frame of fused_remat, kernels, bench or user
    code that made it (``frame``: ``path:line function``, or None), and the aten op that made it
    (``op``, or None)."""

    bytes: int
    frame: str | None
    op: str | None

    @property
    def where(self) -> str:
        if self.frame is not None:
            return f"{self.frame} ({self.op})" if self.op else self.frame
        return f"{self.op or 'unknown op'} (no Python frame)"


@dataclass
class PeakMemoryMeter:
    """What a call allocated on ``device`` while the meter was active, in allocation order.

    ``peak_bytes``: the high-water mark of live bytes above what was live at entry; ``end_bytes``:
    live at exit above entry; ``live_at_peak``: the allocations live at the high-water mark, largest
    first; ``live_at_exit`` likewise at exit. ``excluded``: allocations made while a Triton frame was innermost under the interpreter
    (host bookkeeping, not device memory), never counted."""

    device: torch.device
    allocations: list[PeakAllocation] = field(default_factory=list)
    peak_bytes: int = 0
    end_bytes: int = 0
    live_at_peak: list[PeakAllocation] = field(default_factory=list)
    live_at_exit: list[PeakAllocation] = field(default_factory=list)
    excluded: list[PeakAllocation] = field(default_factory=list)

    def report(self, top: int = 10) -> str:
        lines = [f"peak on {self.device}: {self.peak_bytes:,d} bytes above entry ({self.end_bytes:,d} still live at "
                 f"exit); {len(self.live_at_peak)} allocations live at the peak, of {len(self.allocations)} made"]
        for allocation in self.live_at_peak[:top]:
            lines.append(f"  {allocation.bytes:>14,d} B  {allocation.where}")
        if len(self.live_at_peak) > top:
            rest = sum(a.bytes for a in self.live_at_peak[top:])
            lines.append(f"  {rest:>14,d} B  in {len(self.live_at_peak) - top} more")
        if self.excluded:
            lines.append(f"  ({len(self.excluded)} allocations inside Triton's interpreter left out, "
                         f"{sum(a.bytes for a in self.excluded):,d} B)")
        return "\n".join(lines)


class _FrameMarkers:
    """Marks, in the profiler's own event stream, which frame of ours or the user's is innermost.

    A ``sys.settrace`` function follows only the frames that are ours or the user's (line and
    return events) and the outermost Triton frame; at each change it records a zero-length
    profiler annotation whose name indexes ``locations``. An allocation event then belongs to the
    latest marker before it on its thread. Annotations are ordered by the same clock as
    allocations, which Python timestamps taken beside them would not be."""

    def __init__(self, exclude_triton: bool):
        import importlib.util
        import sysconfig

        self.exclude_triton = exclude_triton
        self.locations: list[str] = []
        self._index: dict[tuple[object, int], int] = {}
        self._kinds: dict[object, str] = {}
        triton = importlib.util.find_spec("triton")  # its folder, without importing it
        self._triton_root = os.path.dirname(triton.origin) + os.sep if triton and triton.origin else "\0"
        self._ours_root = os.path.dirname(__file__) + os.sep
        self._library_roots = tuple({sysconfig.get_paths()[key] + os.sep
                                     for key in ("stdlib", "platstdlib", "purelib", "platlib")})
        self._in_triton = False
        self._previous = None
        from torch._C._profiler import _RecordFunctionFast  # torch's private profiler API: imported when used

        self._record = _RecordFunctionFast

    def _kind(self, code) -> str:
        kind = self._kinds.get(code)
        if kind is None:
            path = code.co_filename
            if path.startswith(self._triton_root):
                kind = _TRITON
            elif path == __file__ or path.startswith("<"):
                kind = _OTHER
            elif path.startswith(self._ours_root) or not path.startswith(self._library_roots):
                kind = _OURS
            else:
                kind = _OTHER
            self._kinds[code] = kind
        return kind

    def _mark(self, index: int) -> None:
        with self._record(f"{MARKER_PREFIX}{index}"):
            pass

    def _mark_frame(self, frame) -> None:
        key = (frame.f_code, frame.f_lineno)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.locations)
            self.locations.append(f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        self._mark(index)

    def _mark_innermost(self, frame) -> None:
        while frame is not None and self._kind(frame.f_code) != _OURS:
            frame = frame.f_back
        if frame is None:
            self._mark(NO_FRAME)
        else:
            self._mark_frame(frame)

    def _call(self, frame, event, arg):
        if self._in_triton:
            return None
        kind = self._kind(frame.f_code)
        if kind == _OURS:
            return self._follow
        if kind == _TRITON and self.exclude_triton:
            self._in_triton = True
            self._mark(IN_TRITON)
            return self._leave_triton
        return None

    def _follow(self, frame, event, arg):
        if event == "line":
            self._mark_frame(frame)
        elif event == "return":
            self._mark_innermost(frame.f_back)
        return self._follow

    def _leave_triton(self, frame, event, arg):
        if event == "return":
            self._in_triton = False
            self._mark_innermost(frame.f_back)
        return self._leave_triton

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        # Frames already running get no call event: they are followed from here on.
        self._followed = []
        frame = sys._getframe(1)
        while frame is not None:
            if self._kind(frame.f_code) == _OURS:
                self._followed.append((frame, frame.f_trace))
                frame.f_trace = self._follow
            frame = frame.f_back
        self._mark_innermost(sys._getframe(1))
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        for frame, trace in self._followed:
            frame.f_trace = trace
        self._followed = []


def _short_path(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _same_device(event_device: torch.device, device: torch.device) -> bool:
    if event_device.type != device.type:
        return False
    return device.type == "cpu" or event_device.index == device.index


def _timeline(nodes) -> Iterator:
    """The profiler's events, depth first: each allocation with the innermost op around it."""
    from torch._C._profiler import _EventType

    stack = [(node, None) for node in reversed(nodes)]
    while stack:
        node, op = stack.pop()
        if node.tag == _EventType.Allocation:
            yield node, op
            continue
        if node.tag == _EventType.TorchOp:
            if node.name.startswith(MARKER_PREFIX):
                yield node, None
                continue
            op = node.name
        stack.extend((child, op) for child in reversed(node.children))


def _fill(meter: PeakMemoryMeter, tree, locations: list[str]) -> None:
    """Replays the allocation events. Frees of storage allocated before entry are not reported on
    every device (the CPU allocator does not know their size), so none is credited on any."""
    from torch._C._profiler import _EventType

    marker: dict[int, int] = {}
    live: dict[int, int] = {}  # address -> allocation order
    made_at: list[int] = []  # per allocation: the event's position
    freed_at: dict[int, int] = {}  # allocation order -> the free's position
    live_bytes, peak_at = 0, -1
    for position, (node, op) in enumerate(_timeline(tree)):
        if node.tag == _EventType.TorchOp:
            marker[node.start_tid] = int(node.name.removeprefix(MARKER_PREFIX))
            continue
        fields = node.typed[1]
        if not _same_device(fields.device, meter.device):
            continue
        if fields.alloc_size < 0:
            order = live.pop(fields.ptr, None)
            if order is not None:
                live_bytes -= meter.allocations[order].bytes
                freed_at[order] = position
            continue
        index = marker.get(node.start_tid, NO_FRAME)
        allocation = PeakAllocation(fields.alloc_size, locations[index] if index >= 0 else None, op)
        if index == IN_TRITON:
            meter.excluded.append(allocation)
            continue
        live[fields.ptr] = len(meter.allocations)
        meter.allocations.append(allocation)
        made_at.append(position)
        live_bytes += allocation.bytes
        if live_bytes > meter.peak_bytes:
            meter.peak_bytes, peak_at = live_bytes, position
    meter.end_bytes = live_bytes
    meter.live_at_exit = sorted((meter.allocations[order] for order in live.values()), key=lambda a: -a.bytes)
    at_peak = [a for order, a in enumerate(meter.allocations)
               if made_at[order] <= peak_at < freed_at.get(order, len(made_at) + position + 1)] if peak_at >= 0 else []
    meter.live_at_peak = sorted(at_peak, key=lambda a: -a.bytes)


def _interpreter_frees():
    """Under Triton's interpreter, tensors a launch touched freed after it, as on a GPU
    (``kernels.launch.collecting_interpreter_cycles``); elsewhere nothing to do."""
    from .kernels.limits import triton_interpreting

    if not triton_interpreting():
        return contextlib.nullcontext()
    from .kernels.launch import collecting_interpreter_cycles

    return collecting_interpreter_cycles()


@contextlib.contextmanager
def peak_memory(device: torch.device | str | None = None) -> Iterator[PeakMemoryMeter]:
    """Record every storage allocation and free on ``device`` (default: the current CUDA device if
    there is one, else the CPU) inside the ``with`` block; the meter is filled at exit.

    The events are the allocator's own, as ``torch.profiler`` (``profile_memory=True``) receives
    them from c10's memory reporting: the CPU allocator and CUDA's caching allocator report every
    allocation with its address and size and every free, from any thread and from inside custom
    operators and Triton launchers. Neither the profiler nor the frame tracer is a dispatch or
    function mode, so ``fused_remat`` takes its direct eager path, as for a user. The frame of each
    allocation comes from ``_FrameMarkers`` (a ``sys.settrace`` function on the entering thread,
    which suspends any tracer active at entry, such as coverage); an allocation on another thread
    (CUDA's autograd worker) is named by its aten op alone. A CUDA allocation is counted at the
    caching allocator's block size, as ``torch.cuda.max_memory_allocated`` counts it.

    Exclusion: under Triton's interpreter (``TRITON_INTERPRET=1``), allocations made while a frame
    of the ``triton`` package is the innermost frame that is not the interpreted kernel's are host
    bookkeeping, not device memory; they are kept apart in ``excluded``. With compiled Triton
    nothing is excluded. Another ``torch.profiler`` session cannot run at the same time.
    """
    from .kernels.limits import triton_interpreting

    meter = PeakMemoryMeter(torch.device(device) if device is not None else _default_device())
    markers = _FrameMarkers(exclude_triton=triton_interpreting())
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler, _interpreter_frees(), markers:
        yield meter
    _fill(meter, profiler.profiler.kineto_results.experimental_event_tree(), markers.locations)
