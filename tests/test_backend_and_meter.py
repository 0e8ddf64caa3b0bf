"""Backend selection (FUSED_REMAT_BACKEND), the saved-memory meter, and `python -m fused_remat`."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fused_remat
from fused_remat.backend import use_triton
from fused_remat.memory import saved_memory
from numerics import FLOOR


def _norm_output(device):
    x = torch.randn(4, 32, device=device, requires_grad=True)
    return x, fused_remat.layer_norm(x, torch.ones(32, device=device))


def _assert_is_layer_norm(x, y):
    """y = layer_norm(x) (unit weight, no bias), and so is its gradient, against float64."""
    x64 = x.detach().double().requires_grad_()
    y64 = F.layer_norm(x64, (x.shape[-1],))
    dy = torch.randn_like(y)
    (dx,), (dx64,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(y64, x64, dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=0, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=0, atol=1e-5)


def test_auto_runs_triton_where_it_can(device, monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "auto")
    x, y = _norm_output(device)
    # the Function itself, or its one-output twin where nothing traces the call
    assert type(y.grad_fn).__name__ in ("_NormFunctionBackward", "_NormFunctionFirstOutputBackward")
    _assert_is_layer_norm(x, y)


def test_reference_backend_is_plain_pytorch(device, monkeypatch):
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "reference")
    x, y = _norm_output(device)
    assert "_NormFunction" not in type(y.grad_fn).__name__
    _assert_is_layer_norm(x, y)


def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FUSED_REMAT_BACKEND", "auto")
    assert not use_triton("layer_norm", torch.device("cpu"))
    x, y = _norm_output("cpu")
    assert "_NormFunction" not in type(y.grad_fn).__name__
    _assert_is_layer_norm(x, y)


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


def _demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m fused_remat ARGS` with the Triton backend forced (a kernel that cannot run fails)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_REMAT_BACKEND")}
    env["FUSED_REMAT_BACKEND"] = "triton"
    return subprocess.run([sys.executable, "-m", "fused_remat", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_prints_usage_and_runs_no_demo():
    run = _demo("--help", timeout=60)  # the import of torch, not the demo's kernels
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python -m fused_remat [-h] [--seed SEED]")
    assert "fused_remat demo on" not in run.stdout


def test_bad_argument_prints_usage_and_fails():
    run = _demo("--rows", "8", timeout=60)
    assert run.returncode == 2
    assert "usage: python -m fused_remat" in run.stderr and "unrecognized arguments: --rows 8" in run.stderr


DEMO_HEADS, DEMO_HEAD_DIM = 4, 64  # the demo's attention: seq = rows x hidden / (heads x head dim)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _kept_by_contract(op: str, rows: int, hidden: int, size: int) -> int:
    """Bytes each op's docstring says backward keeps (parameters left out): x, or gate and up; the
    norms' fp32 statistics per row (mean and rstd; rstd); attention's q, k, v, out and fp32 lse."""
    x = rows * hidden * size
    if op == "attention (causal)":
        seq = rows * hidden // (DEMO_HEADS * DEMO_HEAD_DIM)
        return 4 * x + DEMO_HEADS * seq * 4
    return {"layer_norm": x + 2 * rows * 4, "rms_norm": x + rows * 4, "swiglu": 2 * x}.get(op, x)


def _number(cell: str) -> int:
    return int(cell.split(" B")[0].replace(",", ""))


def test_demo_runs_every_op_through_the_kernels():
    """The demo's figures: every op within the error rule against eager PyTorch (tests/numerics.py,
    here on the largest error over the op's tensors), keeping exactly what its contract says and no
    more than eager; the block keeping the design document's bytes per token."""
    run = _demo("--seed", "3")
    assert run.returncode == 0, run.stderr[-2000:]
    header = re.search(r"demo on .*: (\d+) rows x (\d+), (\w+)", run.stdout)
    rows, hidden, dtype = int(header.group(1)), int(header.group(2)), header.group(3)
    ops = {}
    for line in run.stdout.splitlines():
        m = re.fullmatch(r"(\w+(?: \(causal\))?)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+([\d,]+) B\s+([\d,]+) B", line)
        if m:
            ops[m.group(1)] = ([float(e) for e in m.group(2, 3, 4, 5)], _number(m.group(6)), _number(m.group(7)))
    assert ops.keys() == {"layer_norm", "rms_norm", "gelu", "gelu_tanh", "swiglu", "attention (causal)"}, run.stdout
    floor = FLOOR[getattr(torch, dtype)]  # the errors are relative to the reference's largest magnitude
    for op, ((y, y_eager, grads, grads_eager), saved, saved_eager) in ops.items():
        assert y <= 2 * y_eager + floor and grads <= 2 * grads_eager + floor, (op, y, y_eager, grads, grads_eager)
        assert saved == _kept_by_contract(op, rows, hidden, DTYPE_BYTES[dtype]), (op, saved)
        assert saved <= saved_eager, (op, saved, saved_eager)

    table = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ") and " B (" in line]
    policies = re.findall(r"remat=(\w+)", run.stdout)
    assert len(table) == 2 and {"none", "cheap", "full", "offload"} <= set(policies), run.stdout
    for cells in table:
        dim, heads, _ = (int(n) for n in re.search(r"\((\d+)/(\d+)/(\d+)\)", cells[0]).groups())
        kept = dict(zip(policies, (_number(c) for c in cells[2:])))
        for cell in cells[1:]:
            assert f"({_number(cell) / dim:.1f}h" in cell, cell
        assert kept["full"] == 2 * dim, cells  # x alone, bf16
        assert kept["offload"] == 0, cells  # x waits in host memory
        assert kept["full"] < kept["cheap"] < kept["none"], cells
        if cells[0].startswith("| GPT-2"):  # MHA, LayerNorm, GELU, F = 4h: the design figures (test_block)
            assert kept["none"] == 32 * dim + 4 * heads + 16 and kept["cheap"] == 20 * dim + 4 * heads + 16, cells
