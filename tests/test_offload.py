"""The ``offload`` policy: ``full``'s kept input in host memory. On CPU the copy is the tensor itself,
so these tests check the bookkeeping (what the meter counts where, the prefetch chain, gradients
bitwise equal to the other policies); the device memory, pinned host copies and copies on a side
stream are a GPU test. The step time against full's is bench/bench_memory.py's offload case."""

import gc

import pytest
import torch

from fused_remat import TransformerBlock, offload, reference
from fused_remat.block import block_widths
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, ModelConfig, preset
from fused_remat.offload import HostCopy, is_host_copy
from fused_remat.planner import (
    ASSUMED_HOST_BANDWIDTH, Precision, copy_seconds, explain_policies, flop_policy_costs, plan_remat,
)
from fused_remat.remat import kept_bytes_per_token

CONFIG = ModelConfig(vocab_size=120, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48)
AUTOCAST_BF16 = Precision(torch.float32, torch.bfloat16)


def _block_grads(block, x):
    y = block(x)
    return torch.autograd.grad((y * y.detach().sin()).sum(), [x, *block.parameters()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offload_gradients_are_bitwise_cheap_and_full(dtype, device, triton_backend):
    block = TransformerBlock(32, 4, n_kv_heads=2, norm="rmsnorm", activation="swiglu", rope_theta=10000.0,
                             device=device, dtype=dtype)
    x = torch.randn(2, 13, 32, device=device, dtype=dtype, requires_grad=True)
    grads = {}
    for policy in ("cheap", "full", "offload"):
        block.remat = policy
        grads[policy] = _block_grads(block, x)
    for policy in ("full", "offload"):
        assert all(torch.equal(a, b) for a, b in zip(grads["cheap"], grads[policy])), policy


def test_the_meter_counts_the_offloaded_input_as_host_memory(device, triton_backend):
    block = TransformerBlock(32, 2, remat="offload", device=device)
    x = torch.randn(3, 7, 32, device=device, requires_grad=True)
    with saved_memory(exclude=block.parameters()) as meter:
        y = block(x)
    assert meter.device_bytes == 0
    assert meter.host_bytes == x.numel() * x.element_size() == meter.bytes
    assert "offloaded to host memory" in meter.report()
    y.sum().backward()
    block.remat = "full"
    with saved_memory(exclude=block.parameters()) as meter:
        block(x)
    assert (meter.device_bytes, meter.host_bytes) == (x.numel() * x.element_size(), 0)


def test_offloaded_layers_keep_device_bytes_independent_of_the_layer_count(device, triton_backend):
    """The issue's goal: with offload the device keeps O(1) layer inputs; the host keeps them all."""
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 17), device=device)
    kept = {}
    for layers in (1, 2, 4):
        config = ModelConfig(**{**CONFIG.__dict__, "n_layers": layers})
        model = LanguageModel(config, "offload", device=device)
        with saved_memory(exclude=model.parameters()) as meter:
            model(tokens[:, :-1], tokens[:, 1:])
        kept[layers] = meter.device_bytes, meter.host_bytes
    assert kept[1][0] == kept[2][0] == kept[4][0]
    one_input = 2 * 16 * CONFIG.dim * 4
    assert [kept[n][1] for n in (1, 2, 4)] == [one_input, 2 * one_input, 4 * one_input]


def test_backward_prefetches_the_previous_layers_copy():
    first, second = HostCopy(torch.randn(4, 3)), HostCopy(torch.randn(4, 3))
    third = HostCopy(torch.randn(5))
    assert second.previous() is first and third.previous() is second
    assert is_host_copy(first.host) and not is_host_copy(torch.randn(2))
    assert torch.equal(third.fetch(), third.host)
    assert second._upload is not None and first._upload is None, "exactly one layer ahead"
    assert torch.equal(second.fetch(), second.host)
    assert first._upload is not None


def test_a_copy_does_not_keep_its_predecessor_alive():
    first = HostCopy(torch.randn(8))
    second = HostCopy(torch.randn(8))
    del first
    gc.collect()
    assert second.previous() is None
    assert torch.equal(second.fetch(), second.host)


def test_retained_graph_runs_backward_twice(device, triton_backend):
    block = TransformerBlock(32, 2, remat="offload", device=device)
    x = torch.randn(1, 9, 32, device=device, requires_grad=True)
    y = block(x).sum()
    first = torch.autograd.grad(y, x, retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(y, x)[0])


def _host_copies(output: torch.Tensor) -> list[HostCopy]:
    """The HostCopy of every offloaded block in ``output``'s graph."""
    copies, stack, seen = [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "host_copy", None) is not None:
            copies.append(node.host_copy)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return copies


def test_a_backward_frees_the_host_copies_while_its_loss_lives_and_a_retained_graph_keeps_them(device, triton_backend):
    """A training loop's ``loss = model(...)`` keeps last step's graph until the next forward
    returns: its pinned copies must not live that long (two steps pinned, the second allocated
    afresh), so they go with the backward's saved tensors; retain_graph keeps them."""
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), device=device)
    model = LanguageModel(CONFIG, "offload", device=device)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    copies = _host_copies(loss)
    assert len(copies) == CONFIG.n_layers and all(c.host is not None for c in copies)
    loss.backward(retain_graph=True)
    gc.collect()
    assert all(c.host is not None for c in copies)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss.backward()
    gc.collect()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))
    assert all(c.host is None for c in copies), "the host copies outlived their graph's backward"
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_offload_under_torch_compile_runs_eagerly_and_matches(device, triton_backend):
    block = TransformerBlock(32, 2, remat="offload", device=device)
    x = torch.randn(1, 8, 32, device=device, requires_grad=True)
    eager = torch.autograd.grad(block(x).sum(), x)[0]
    torch._dynamo.reset()
    assert torch._dynamo.explain(block)(x).graph_break_count >= 1
    compiled = torch.autograd.grad(torch.compile(block)(x).sum(), x)[0]
    assert torch.equal(eager, compiled)


def test_the_reference_block_refuses_offload():
    with pytest.raises(ValueError, match="remat must be one of"):
        reference.TransformerBlock(32, 2, remat="offload")
    with pytest.raises(ValueError, match="remat must be one of"):
        LanguageModel(CONFIG, "offload", block_impl="reference")


def test_offload_keeps_fulls_bytes_in_host_memory():
    widths = block_widths(4096, 32, 8, 14336, "rmsnorm", "swiglu")
    full = kept_bytes_per_token("full", widths, 4, 2)
    assert kept_bytes_per_token("offload", widths, 4, 2) == 0
    assert kept_bytes_per_token("offload", widths, 4, 2, memory="host") == full == 4 * 4096
    assert kept_bytes_per_token("full", widths, 4, 2, memory="host") == 0
    with pytest.raises(ValueError, match="memory must be"):
        kept_bytes_per_token("full", widths, 4, 2, memory="disk")


def test_offload_costs_what_full_costs_where_its_copies_hide():
    long = flop_policy_costs(preset("llama-1b"), 1, 32768, AUTOCAST_BF16)
    assert long["offload"] == long["full"]
    short = flop_policy_costs(preset("gpt2-small"), 1, 256, AUTOCAST_BF16)
    assert short["offload"] > short["full"]
    # The copy: one layer input, fp32 residual, over the assumed link.
    assert copy_seconds(preset("gpt2-small"), 1, 256, AUTOCAST_BF16, ASSUMED_HOST_BANDWIDTH) == \
        256 * 768 * 4 / ASSUMED_HOST_BANDWIDTH


def test_the_planner_offloads_where_copies_hide_and_reports_host_bytes():
    config = preset("llama-1b")
    batch, seq = 1, 32768
    full = explain_policies(config, batch, seq, AUTOCAST_BF16, ["full"] * config.n_layers)
    plan = plan_remat(config, batch, seq, AUTOCAST_BF16, budget=full.peak_bytes)
    # Hidden copies cost nothing over full, and take its layer inputs off the device (an offloaded
    # layer's backward holds two of them, its own and the one it prefetches).
    assert "offload" in plan.policies and "full" not in plan.policies
    assert plan.extra_compute <= full.extra_compute and plan.peak_bytes <= full.peak_bytes
    assert plan.host_bytes == plan.policies.count("offload") * seq * config.dim * 4
    assert "host memory" in plan.table() and "offload" in plan.table()


@pytest.mark.gpu
def test_gpu_offload_holds_less_device_memory_than_full_and_copies_on_a_side_stream(monkeypatch):
    """On a GPU: between forward and backward, offload holds about the layer inputs less than
    full; its host copies are pinned (so that copies can be asynchronous), and every copy, each
    layer's device -> host at forward and host -> device at backward, is enqueued on the side
    stream, not the compute stream (so that copies can overlap compute). Whether they do overlap,
    the step time against full's and against the link's measured bandwidth, is a benchmark, not
    asserted here: bench/bench_memory.py's offload case (``python -m bench memory``), beside the
    h2d_GBps and d2h_GBps ceilings."""
    device = torch.device("cuda")
    config = preset("gpt2-small", n_layers=8)
    tokens = torch.randint(0, config.vocab_size, (1, 16385), device=device)
    model = LanguageModel(config, "full", device=device)
    compute = torch.cuda.current_stream(device)
    entered, stream = [], torch.cuda.stream
    monkeypatch.setattr(torch.cuda, "stream", lambda s: entered.append(s) or stream(s))
    held = {}
    for policy in ("full", "offload"):
        model.set_remat(policy)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        torch.cuda.synchronize()
        held[policy] = torch.cuda.memory_allocated() - before
        if policy == "offload":  # this forward's copies: the latest, each naming the one before it
            copies, latest = [], offload._latest.copy()
            while latest is not None and len(copies) < config.n_layers:
                copies.append(latest)
                latest = latest.previous() if latest.previous is not None else None
            hosts = [(c.host.shape, c.host.device.type, c.host.is_pinned()) for c in copies]
        loss.backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
    inputs = config.n_layers * 16384 * config.dim * 4
    assert held["full"] - held["offload"] >= 0.8 * inputs, held
    assert hosts == [((1, 16384, config.dim), "cpu", True)] * config.n_layers
    assert all(c.host is None for c in copies), "the pinned copies outlived the backward"
    side = offload._side_stream(device)
    assert side != compute
    assert len(entered) == 2 * config.n_layers and all(s == side for s in entered), entered
