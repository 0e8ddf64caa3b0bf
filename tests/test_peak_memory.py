"""The peak-memory meter: exact on plain PyTorch code, and what it says of our block and its peers."""

import json

import pytest
import torch

import fused_remat
from fused_remat import custom_ops, reference
from fused_remat.block import block_widths
from fused_remat.memory import peak_memory, saved_memory
from fused_remat.remat import peak_bytes_per_token

DIM, HEADS, TOKENS = 32, 2, 16


def test_exact_counts_on_plain_torch_code():
    before = torch.empty(1000)
    with peak_memory("cpu") as meter:
        a = torch.empty(256)  # 1024 B
        b = torch.empty(512)  # 2048 B: the peak, 3072 B, is here
        view = b[:10].unsqueeze(0)  # views allocate nothing
        del a
        c = torch.empty(128)  # 512 B
        transient = torch.empty(64)  # 256 B, freed inside
        del transient
    assert meter.peak_bytes == 3072, meter.report()
    assert meter.end_bytes == 2048 + 512, meter.report()
    assert [a.bytes for a in meter.allocations] == [1024, 2048, 512, 256]
    assert sorted(a.bytes for a in meter.live_at_peak) == [1024, 2048]
    assert sorted(a.bytes for a in meter.live_at_exit) == [512, 2048]
    assert all(a.frame and a.frame.startswith("tests/test_peak_memory.py:") and a.op == "aten::empty"
               for a in meter.allocations), meter.allocations
    lines = [int(a.frame.split(":")[1].split()[0]) for a in meter.allocations]
    assert lines == sorted(lines) and len(set(lines)) == 4, "each allocation names its own line"
    assert before.numel() == 1000 and c.numel() == 128 and view.shape == (1, 10)


def test_a_transient_counts_only_while_alive():
    with peak_memory("cpu") as meter:
        kept = torch.empty(100)  # 400 B
        for _ in range(3):
            torch.empty(1000).sum()  # 4000 B, alive while the sum makes its 4 B result; both freed at once
    assert meter.peak_bytes == 400 + 4000 + 4, meter.report()
    assert meter.end_bytes == 400 and kept.numel() == 100 and len(meter.allocations) == 1 + 3 * 2


def _call_in_helper():
    return torch.ones(8, 8)  # 256 B


def test_frames_name_the_innermost_function_and_the_op():
    with peak_memory("cpu") as meter:
        y = _call_in_helper()
    (allocation,) = meter.live_at_peak
    assert allocation.bytes == 256 and " _call_in_helper" in allocation.frame and y.shape == (8, 8)
    assert allocation.op.startswith("aten::") and "_call_in_helper" in allocation.where
    assert "256 B" in meter.report()


def _blocks(remat):
    ref = reference.TransformerBlock(DIM, HEADS, device="cpu")
    return ref, fused_remat.TransformerBlock.from_reference(ref, remat=remat)


def _step_under_meters(block, seq=TOKENS):
    x = torch.randn(1, seq, DIM, requires_grad=True)
    dy = torch.randn(1, seq, DIM)
    params = list(block.parameters())

    def step():
        return torch.autograd.grad(block(x), [x, *params], dy)

    step()  # first calls compile or autotune; the meters measure a warm call
    with saved_memory(params) as saved:
        block(x)
    with peak_memory("cpu") as peak:
        paths = custom_ops.traced(x.device)
        grads = step()
    return saved, peak, paths, grads


def test_the_meter_leaves_the_eager_path_alone(triton_backend):
    _, block = _blocks("cheap")
    _, peak, traced, grads = _step_under_meters(block)
    assert traced is False, "under the meter a call must take the direct eager path"
    # nothing the step made outlives it but its gradients: the interpreter's launches, which hold
    # their tensors in a reference cycle, are collected after each launch under the meter
    gradient_storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    assert peak.end_bytes == sum(gradient_storages.values()), peak.report()
    assert not peak.excluded, peak.report()


def test_block_peak_holds_what_it_saves_and_full_peaks_no_higher_than_none(triton_backend):
    peaks = {}
    for policy in ("none", "full"):
        _, block = _blocks(policy)
        saved, peak, _, _ = _step_under_meters(block)
        assert peak.peak_bytes >= saved.bytes > 0, (policy, saved.report(), peak.report())
        assert any("kernels/" in (a.frame or "") for a in peak.allocations), "launchers' allocations are seen"
        peaks[policy] = peak.peak_bytes
    assert peaks["full"] <= peaks["none"], peaks


def test_reference_block_and_its_checkpoint_measured_the_same_way():
    peaks = {}
    for remat in ("none", "full"):
        ref, _ = _blocks("none")
        ref.remat = remat
        saved, peak, _, _ = _step_under_meters(ref)
        assert peak.peak_bytes >= saved.bytes > 0, (remat, saved.report(), peak.report())
        peaks[remat] = (saved.bytes, peak.peak_bytes)
    assert peaks["full"][0] < peaks["none"][0], peaks


@pytest.mark.gpu
def test_peak_agrees_with_cuda_max_memory_allocated(triton_backend):
    """Both count the caching allocator's blocks (sizes rounded up to 512 B), so they agree to the
    byte; the tolerance, one 512 B round per live block, allows for a block split differently."""
    device = torch.device("cuda")
    ref = reference.TransformerBlock(DIM, HEADS, device=device)
    block = fused_remat.TransformerBlock.from_reference(ref, remat="cheap")
    x = torch.randn(1, 256, DIM, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(block.parameters())

    def step():
        return torch.autograd.grad(block(x), [x, *params], dy)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    at_entry = torch.cuda.memory_allocated()
    with peak_memory(device) as meter:
        grads = step()
        torch.cuda.synchronize()
    expected = torch.cuda.max_memory_allocated() - at_entry
    assert abs(meter.peak_bytes - expected) <= 512 * len(meter.live_at_peak), (expected, meter.report())
    assert meter.end_bytes == torch.cuda.memory_allocated() - at_entry and grads


def test_the_peak_generator_writes_json_and_markdown(tmp_path, monkeypatch):
    from bench import peak

    monkeypatch.setenv("FUSED_REMAT_BACKEND", "triton")
    assert peak.main(["--out", str(tmp_path), "--block", "gpt2-small", "--lengths", "8", "16",
                      "--variants", "cheap", "eager", "--model-layers", "2", "--model-tokens", "8"]) == 0
    data = json.loads((tmp_path / "peak.json").read_text())
    assert {row["variant"] for row in data["rows"]} == {"cheap", "eager"}
    assert [(row["layers"], row["variant"]) for row in data["model_steps"]] == [(2, "cheap"), (2, "eager")]
    assert all(row["peak_bytes"] > 0 for row in data["model_steps"])
    for row in data["rows"]:
        assert row["peak_bytes"] >= row["saved_bytes"] > 0
        assert row["transient_bytes"] == row["peak_bytes"] - row["saved_bytes"]
    table = (tmp_path / "peak.md").read_text()
    assert "| gpt2-small | 16 | cheap |" in table and data["environment"]["torch"] == torch.__version__


LLAMA = dict(n_kv_heads=1, norm="rmsnorm", activation="swiglu", rope_theta=10000.0, bias=False)


def _config_block(config: dict, remat: str):
    ref = reference.TransformerBlock(DIM, HEADS, device="cpu", **config)
    return ref, fused_remat.TransformerBlock.from_reference(ref, remat=remat)


@pytest.mark.parametrize("config", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("remat", ["none", "cheap", "full"])
def test_freeing_at_last_use_leaves_every_other_reader_whole(config, remat, triton_backend):
    """The backward frees kept activations at their last use only where nothing else reads them:
    a retained graph's second backward, a saved-tensor hook's packed copies and tensors a hook
    kept for itself all stay intact, and the gradients are bitwise the plain backward's."""
    _, block = _config_block(config, remat)
    x = torch.randn(2, TOKENS, DIM, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(block.parameters())

    def grads(y, **kwargs):
        return torch.autograd.grad(y, [x, *params], dy, **kwargs)

    expected = grads(block(x))
    y = block(x)
    for _ in range(2):  # retained: the second backward reads what the first did not free
        assert all(torch.equal(a, b) for a, b in zip(grads(y, retain_graph=True), expected))
    with torch.autograd.graph.save_on_cpu():
        y = block(x)
    assert all(torch.equal(a, b) for a, b in zip(grads(y), expected))

    packed = []  # a hook that keeps what it packs, and hands the same tensors back

    def pack(tensor):
        packed.append((tensor, tensor.clone()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = block(x)
    assert all(torch.equal(a, b) for a, b in zip(grads(y), expected))
    assert packed and all(torch.equal(kept, copy) for kept, copy in packed)


@pytest.mark.parametrize("config", [{}, LLAMA], ids=["gpt", "llama"])
def test_block_peaks_at_or_below_its_peers(config, triton_backend):
    """One block's forward + backward: cheap at or below eager PyTorch's peak, full at or below
    torch.utils.checkpoint's, none within 10% of eager's."""
    peaks = {}
    for variant in ("none", "cheap", "full", "eager", "checkpoint"):
        ref, block = _config_block(config, "cheap" if variant in ("eager", "checkpoint") else variant)
        if variant in ("eager", "checkpoint"):
            ref.remat = "full" if variant == "checkpoint" else "none"
            block = ref
        peaks[variant] = _step_under_meters(block, seq=2 * TOKENS)[1].peak_bytes
    assert peaks["cheap"] <= peaks["eager"] and peaks["full"] <= peaks["checkpoint"], peaks
    assert peaks["none"] <= 1.1 * peaks["eager"], peaks


FORMULA_CASES = [({}, "none"), ({}, "cheap"), ({}, "full"), (LLAMA, "none"), (LLAMA, "selective"),
                 (dict(LLAMA, qk_norm=True), "full")]


@pytest.mark.parametrize("config,remat", FORMULA_CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(["llama"] * ("activation" in v) + ["qk_norm"] * ("qk_norm" in v)) or "gpt")
def test_peak_is_the_formula_per_token(config, remat, triton_backend):
    """remat.peak_bytes_per_token is the meter's peak to the byte: with frozen parameters nothing
    that does not grow with the tokens is live (no weight gradients), so the peak is tokens times
    the formula, and a change that holds one more tensor anywhere in the step fails here."""
    _, block = _config_block(config, remat)
    block.requires_grad_(False)
    tokens = 2 * TOKENS
    x = torch.randn(1, tokens, DIM, requires_grad=True)
    dy = torch.randn_like(x)
    torch.autograd.grad(block(x), x, dy)  # warm
    with peak_memory("cpu") as peak:
        torch.autograd.grad(block(x), x, dy)
    widths = block_widths(DIM, HEADS, block.n_kv_heads, None, block.norm, block.activation)
    expected = peak_bytes_per_token(remat, widths, 4, 4, qk_norm=block.q_norm is not None)
    assert peak.peak_bytes == tokens * expected, peak.report()
