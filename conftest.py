"""Test set-up for tests/ and bench/: without CUDA the Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at the top of the
first module pytest loads. With CUDA present the kernels compile for the GPU instead.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    from fused_remat.kernels.limits import triton_interpreting

    if torch.cuda.is_available() and not triton_interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device with compiled Triton")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton backend so a test fails instead of silently checking the reference."""
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "triton")


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A different but reproducible seed per test: fresh inputs everywhere, replayable failures."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def checked_later(monkeypatch):
    """The GPU's way with value checks (fused_remat.value_checks) on CPU tensors: each flag copied on
    its way to the host, arriving when the test appends to the list this returns (on CUDA: a pinned
    copy and an event)."""
    from fused_remat import value_checks

    arrived = []
    monkeypatch.setattr(value_checks, "PENDING", type(value_checks.PENDING)())
    monkeypatch.setattr(value_checks, "READ_LATER_ON", frozenset({DEVICE.type}))
    monkeypatch.setattr(value_checks, "_on_host", lambda flag: (flag.clone(), lambda: bool(arrived)))
    return arrived
