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
