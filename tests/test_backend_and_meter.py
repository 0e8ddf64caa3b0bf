"""Backend selection (FUSED_REMAT_BACKEND) and the saved-memory meter."""

import os
import subprocess
import sys

import pytest
import torch

import fused_remat
from fused_remat.backend import use_triton
from fused_remat.memory import saved_memory


def _norm_output(device):
    x = torch.randn(4, 32, device=device, requires_grad=True)
    return fused_remat.layer_norm(x, torch.ones(32, device=device))


def test_auto_runs_triton_where_it_can(device, monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "auto")
    assert type(_norm_output(device).grad_fn).__name__ == "_NormFunctionBackward"


def test_reference_backend_is_plain_pytorch(device, monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    assert "_NormFunction" not in type(_norm_output(device).grad_fn).__name__


def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "auto")
    assert not use_triton("layer_norm", torch.device("cpu"))
    assert "_NormFunction" not in type(_norm_output("cpu").grad_fn).__name__


def test_forced_triton_that_cannot_run_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="layer_norm: FUSED_REMAT_BACKEND=triton.*TRITON_INTERPRET=1"):
        _norm_output("cpu")
    with pytest.raises(RuntimeError, match="no backend for device type 'meta'"):
        use_triton("gelu", torch.device("meta"))


def test_unknown_backend_name(monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="FUSED_REMAT_BACKEND='cudnn' is not one of auto, triton, reference"):
        use_triton("gelu", torch.device("cpu"))


def test_meter_counts_each_storage_once_and_leaves_out_parameters():
    linear = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(10, 16, requires_grad=True)
    with saved_memory() as meter:
        y = linear(x)  # saves x and the weight (a parameter)
        z = (y * y[:, :1]).sum()  # saves y and a view of y: one storage
    assert meter.bytes == x.numel() * 4 + y.numel() * 4
    assert meter.excluded_count == 1
    assert meter.breakdown() == {(torch.float32, (10, 16)): 640, (torch.float32, (10, 8)): 320}
    assert "960 bytes in 2 storages" in meter.report()
    z.backward()
    assert x.grad is not None


def test_meter_excludes_listed_tensors_and_their_views():
    weight = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(10, 16, requires_grad=True)
    with saved_memory(exclude=[weight]) as meter:
        torch.matmul(x, weight.t().t())
    assert meter.bytes == x.numel() * 4


def test_meter_sees_nothing_without_autograd():
    x = torch.randn(10, 16)
    weight = torch.ones(16)
    with saved_memory() as meter:
        fused_remat.layer_norm(x, weight)
        with torch.no_grad():
            fused_remat.gelu(x.requires_grad_())
    assert meter.bytes == 0 and not meter.records


def test_importing_fused_remat_does_not_import_triton():
    """So TRITON_INTERPRET set after `import fused_remat` (as `python -m fused_remat` does) still works."""
    code = "import sys, fused_remat; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_runs_every_op_through_the_kernels():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_REMAT_BACKEND")}
    env["FUSED_REMAT_BACKEND"] = "triton"
    run = subprocess.run([sys.executable, "-m", "fused_remat"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for op in ("layer_norm", "rms_norm", "gelu", "swiglu", "attention"):
        assert op in run.stdout
