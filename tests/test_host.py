"""The host path: what a call runs between the user and its launches (``python -m bench host``).

The counts are facts of the code, the same on every machine: the launches each call makes, the
Python calls on the way (Triton's own launch path apart) and the custom-operator dispatches, which
an eager call skips. Each case's ceiling is what the code runs today: a change that adds per-call
Python fails here. Times are the benchmark's business (bench/results/host), not a test's.

The measurement compiles for sm_90a (ptxas) outside the interpreter, so it runs in a subprocess
without TRITON_INTERPRET, as the compile-target tests do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_remat
from fused_remat import custom_ops
from fused_remat.backend import stubbed_launches_on

REPO = Path(__file__).resolve().parent.parent

# The ceilings on a call's own Python calls (outside Triton and outside the case's
# torch.autograd.grad), forward + backward: an op's and a block step's.
MOST_OP_CALLS, MOST_BLOCK_CALLS = 30, 200

# case: (Triton launches, most Python calls of the op's own) for one forward + backward: today's
# counts plus 3%, within the ceilings above. Every case of ``python -m bench host`` is here.
EXPECTED = {
    "layer_norm": (3, 29),
    "rms_norm": (3, 29),
    "gelu": (2, 26),
    "swiglu": (2, 29),
    "attention": (4, 28),
    "attention_varlen": (4, 30),
    "rope (forward and inverse)": (2, 9),
    "linear_cross_entropy": (2, 30),
    "block gpt2-small none": (12, 159),
    "block gpt2-small cheap": (12, 158),
    "block gpt2-small selective": (14, 170),
    "block gpt2-small full": (15, 176),
    "block gpt2-small memory_budget=0.5": (14, 169),
    "block gpt2-small cheap, LoRA r4 on qkv and out_proj": (12, 177),
    "block gpt2-small cheap, 2 packed documents": (12, 164),
    "block llama none": (14, 170),
    "block llama cheap": (14, 168),
    "block llama selective": (17, 186),
    "block llama full": (18, 191),
    "block llama memory_budget=0.5": (18, 191),
    "block llama cheap, LoRA r4 on qkv and out_proj": (14, 191),
    "block llama cheap, 2 packed documents": (14, 175),
}


def _bench_host(out: Path, *args: str) -> None:
    """``python -m bench host`` outside the interpreter (it compiles for sm_90a and launches nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "bench", "host", "--out", str(out), *args], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=1200)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(capture.json, host.json's rows by case) from one process each, one after the other, so that
    the second finds every kernel compiled (Triton's cache)."""
    out = tmp_path_factory.mktemp("host")
    _bench_host(out, "--capture-check")
    _bench_host(out, "--repeats", "1")
    rows = json.loads((out / "host.json").read_text())["rows"]
    checks = {name: json.loads((out / f"{name}.json").read_text()) for name in ("capture", "kept")}
    return checks, {row["case"]: row for row in rows}


@pytest.fixture(scope="module")
def host_rows(measured):
    return measured[1]


@pytest.fixture(scope="module")
def capture_results(measured):
    return measured[0]["capture"]


@pytest.fixture(scope="module")
def kept_results(measured):
    return measured[0]["kept"]


def _capture_cases():
    from bench.host import all_cases

    return [case.name for case in all_cases()]


@pytest.mark.parametrize("case", _capture_cases())
def test_every_op_and_block_case_runs_without_reading_values_on_the_host(capture_results, case):
    """What a CUDA graph needs of a step (after its warm-up): no .item(), .tolist(), device-to-host
    copy or value-dependent shape, in our Python or inside our operators; every policy, with
    memory_budget, LoRA and packed documents."""
    assert capture_results[case] == ""


def test_kept_launches_hand_the_driver_what_tritons_launch_path_does(kept_results):
    """Every op's and block case's second call, each launch through the compiled kernel kept for its
    signature (launch.KeptKernel), gives the driver's launcher the same grid, stream, function,
    metadata, hooks and arguments (a tensor, of which the launcher reads the address, by dtype,
    storage offset, storage size and alignment) as the first call's, each launch the first of its signature
    and so through Triton's own path; a hook that calls nothing may be handed as None, and a third
    call with a launch hook set hands each launch the hook and its metadata."""
    from bench.host import all_cases

    assert kept_results == {case.name: "" for case in all_cases()}


@pytest.mark.parametrize("case", EXPECTED)
def test_a_call_launches_what_it_should_and_runs_no_more_python_than_today(host_rows, case):
    launches, most_calls = EXPECTED[case]
    ours = host_rows[case]["ours"]
    assert ours["launches"] == launches
    assert ours["dispatches"] == 0, "an eager call goes straight to the operators' implementations"
    assert ours["own_calls"] <= most_calls
    assert host_rows[case]["eager"]["host_us"] > 0


def test_every_case_is_listed_within_the_ceilings():
    from bench.host import all_cases

    cases = {case.name: case.kind for case in all_cases()}
    assert set(EXPECTED) == set(cases)
    for name, (_, most_calls) in EXPECTED.items():
        assert most_calls <= (MOST_OP_CALLS if cases[name] == "op" else MOST_BLOCK_CALLS), name


def test_each_call_that_runs_a_function_is_timed_beside_the_function_floor(host_rows):
    """The floor (``bench.host.function_floor``: a Python autograd Function on the call's tensors
    that launches nothing) runs fewer calls of its own than the op or block and launches nothing;
    every op and block has one but RoPE (in-place calls, no Function)."""
    from bench.host import all_cases

    for case in all_cases():
        row = host_rows[case.name]
        if case.name == "rope (forward and inverse)":
            assert case.floor is None and "floor" not in row
            continue
        floor = row["floor"]
        assert floor["host_us"] > 0 and floor["launches"] == 0 and floor["dispatches"] == 0
        assert 0 < floor["own_calls"] < row["ours"]["own_calls"], case.name


def test_the_function_floor_returns_a_gradient_for_each_input_that_needs_one():
    """The floor takes the call's inputs as the op's Function does (tensors with and without
    gradients, None, plain values) and returns a gradient of each input's shape where one is needed."""
    from bench.host import function_floor

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    dx, dw = function_floor([x, w, None, offsets])()
    assert dx.shape == x.shape and dw.shape == w.shape


def test_the_backward_call_is_counted_apart_and_the_same_for_both_sides(host_rows):
    """The case's torch.autograd.grad runs the same Python for ours and eager's where their outputs
    have one shape (it compares a gradient's shape with its output's dim by dim in Python: the
    varlen case's eager peer returns one more dim); eager's F.rms_norm is one Python function over
    C++, whose backward runs none."""
    for row in host_rows.values():
        for side in ("ours", "eager"):
            counted = row[side]
            assert counted["own_calls"] + counted["harness_calls"] == counted["python_calls"]
        if row["case"] == "rope (forward and inverse)":  # two in-place calls, no torch.autograd.grad
            assert row["ours"]["harness_calls"] == row["eager"]["harness_calls"] == 0
        elif row["case"] != "attention_varlen":
            assert row["ours"]["harness_calls"] == row["eager"]["harness_calls"] > 0
    assert host_rows["rms_norm"]["eager"]["own_calls"] == 1


def test_host_results_name_the_machine(host_rows, tmp_path):
    from bench import host

    env = host.machine()
    assert env["cores"] and env["torch"] == torch.__version__ and env["target"] == host.TARGET
    text = host.markdown(list(host_rows.values()), env)
    assert env["cpu"] in text and "block llama cheap, 2 packed documents" in text


def test_traced_calls_go_through_the_operators():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert custom_ops.ops(meta) is custom_ops.dispatched
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):
        assert custom_ops.traced(cpu)
    with stubbed_launches_on("meta"):
        assert not custom_ops.traced(meta)


def test_an_eager_op_and_the_dispatched_one_agree():
    x = torch.randn(5, 24, dtype=torch.float32, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    y = fused_remat.rms_norm(x, w)
    y.backward(torch.ones_like(y))
    from torch.utils.flop_counter import FlopCounterMode

    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with FlopCounterMode(display=False):  # a dispatch mode: the custom operators run
        y2 = fused_remat.rms_norm(x2, w2)
        y2.backward(torch.ones_like(y2))
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_the_host_read_guard_sees_inside_the_operators(monkeypatch):
    """The guard fails on a host read in an operator's implementation, which a dispatch mode would
    otherwise never see (the dispatcher runs the implementation beneath it); here the norm's launcher
    is a torch function that reads a value."""
    from bench.host import HostRead, host_read_guard
    from fused_remat.kernels import norm

    def reading_launcher(x, weight, bias, residual, eps, rms, out_dtype=None):
        int(x.sum())
        return x.clone(), x.new_empty(0, dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32), None

    x, w = torch.randn(3, 8), torch.randn(8)
    monkeypatch.setattr(norm, "norm_fwd", reading_launcher)
    custom_ops.dispatched.norm_fwd(x, w, None, None, 1e-6, True, None)  # no guard, no error
    with pytest.raises(HostRead, match="item|_local_scalar_dense"):
        with host_read_guard():
            custom_ops.dispatched.norm_fwd(x, w, None, None, 1e-6, True, None)
    for read in (lambda: x.tolist(), lambda: x.cpu(), lambda: torch.nonzero(x > 0),
                 lambda: torch.repeat_interleave(torch.tensor([1, 2]))):
        with pytest.raises(HostRead):
            with host_read_guard():
                read()
    assert x.tolist() and torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([1, 1]), output_size=2).numel()


def test_a_kept_kernel_keys_every_launch_on_what_triton_specializes():
    """The signature that selects a kept launch separates what Triton compiles apart: a tensor's
    dtype and 16-byte alignment, an argument's type (True, 1 and 1.0) and value, the keywords; the
    same signature again reuses its entry, and the results are the kernel's every time."""
    import triton
    import triton.language as tl

    from fused_remat.kernels.launch import KEPT_SIGNATURES, KeptKernel

    @triton.jit
    def scale_rows(X, Y, n, factor, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        tl.store(Y + cols, tl.load(X + cols, mask=mask) * factor, mask=mask)

    kernel = KeptKernel(scale_rows)
    x = torch.randn(40)
    for source, factor in ((x[:20], 2.0), (x[:20], 3.0), (x[1:21], 2.0), (x[:20].double(), 2.0), (x[:20], 2)):
        y = torch.empty_like(source)
        kernel[(1,)](source, y, 20, factor, BLOCK=32)
        assert torch.equal(y, source * factor)
    assert len(kernel._kept) == 5  # two factors, a misaligned view, another dtype, an int factor
    y = torch.empty(20)
    kernel[(1,)](x[2:22], y, 20, 2.0, BLOCK=32)  # 8 bytes in: misaligned, as x[1:21] was
    assert torch.equal(y, x[2:22] * 2) and len(kernel._kept) == 5
    kernel[(1,)](x[:20], y, 20, 2.0, BLOCK=64)
    kernel[(1,)](x[:20], y, True, 2.0, BLOCK=32)
    assert len(kernel._kept) == 7 and torch.equal(y[:1], x[:1] * 2)
    for n in range(KEPT_SIGNATURES):
        kernel[(1,)](x[:20], y, 20, float(n), BLOCK=32)
    assert len(kernel._kept) <= KEPT_SIGNATURES and torch.equal(y, x[:20] * float(KEPT_SIGNATURES - 1))
    KeptKernel.forget_all()
    assert not kernel._kept
