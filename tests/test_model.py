"""The language model and the remat planner: the model matches its reference twin, every policy
mix trains identically, the planner's predicted bytes are what the saved-memory meter measures, and
its plans fit their budget at their peak (kept + the largest layer transient)."""

import dataclasses
import itertools
import math
import re

import pytest
import torch

from fused_remat.block import block_widths
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, ModelConfig, preset, resolve_policies
from fused_remat.planner import (
    Precision, explain_policies, flop_policy_costs, layer_bytes_per_token, layer_transient_bytes_per_token,
    measure_policy_costs, plan_remat,
)
from fused_remat.remat import Remat, budget_points, kept_bytes_per_token, peak_bytes_per_token

# Three layers so that mixed plans have something to mix; GQA and RoPE as the LLaMA preset.
CONFIG = ModelConfig(vocab_size=200, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=48)
LLAMA_LIKE = ModelConfig(vocab_size=130, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, norm="rmsnorm",
                         activation="swiglu", bias=False, rope_theta=500000.0, tie_embeddings=False)
FP32 = Precision(torch.float32, torch.float32)
AUTOCAST_BF16 = Precision(torch.float32, torch.bfloat16)


def _tokens(config, batch, seq, device):
    return torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)


def _loss_and_grads(model, tokens, precision=FP32):
    model.zero_grad(set_to_none=True)
    autocast = precision.compute != precision.residual
    with torch.autocast(tokens.device.type, dtype=precision.compute, enabled=autocast):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("config", [CONFIG, LLAMA_LIKE], ids=["gpt", "llama"])
def test_fused_model_matches_the_reference_model(config, device, triton_backend):
    fused = LanguageModel(config, "cheap", device=device)
    ref = LanguageModel(config, "none", block_impl="reference", device=device)
    ref.load_state_dict(fused.state_dict())
    tokens = _tokens(config, 2, 19, device)
    loss, grads = _loss_and_grads(fused, tokens)
    ref_loss, ref_grads = _loss_and_grads(ref, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    logits = fused(tokens[:, :-1])
    assert logits.shape == (2, 19, config.vocab_size)
    torch.testing.assert_close(logits, ref(tokens[:, :-1]), rtol=1e-4, atol=1e-5)


def test_every_policy_mix_gives_bitwise_the_same_training(device, triton_backend):
    model = LanguageModel(CONFIG, "none", device=device)
    tokens = _tokens(CONFIG, 2, 13, device)
    baseline = _loss_and_grads(model, tokens)
    for policies in (["cheap"] * 3, ["full"] * 3, ["full", "cheap", "none"], ["offload"] * 3, ["offload", "full", "cheap"]):
        model.set_remat(policies)
        assert [block.remat for block in model.blocks] == policies
        loss, grads = _loss_and_grads(model, tokens)
        assert torch.equal(loss, baseline[0]), policies
        assert all(torch.equal(grads[n], baseline[1][n]) for n in grads), policies


def test_reference_model_under_checkpoint_matches_eager(device):
    model = LanguageModel(CONFIG, "none", block_impl="reference", device=device)
    tokens = _tokens(CONFIG, 2, 11, device)
    eager = _loss_and_grads(model, tokens)
    model.set_remat("full")
    checkpointed = _loss_and_grads(model, tokens)
    assert torch.equal(eager[0], checkpointed[0])
    assert all(torch.equal(eager[1][n], checkpointed[1][n]) for n in eager[1])


def test_tied_head_shares_the_embedding():
    tied = LanguageModel(CONFIG)
    assert tied.head is None and tied.head_weight is tied.embed.weight
    untied = LanguageModel(LLAMA_LIKE)
    assert untied.head.weight.shape == (LLAMA_LIKE.vocab_size, LLAMA_LIKE.dim)


def test_initialization_scales_the_residual_projections():
    torch.manual_seed(0)
    model = LanguageModel(preset("gpt2-small", n_layers=4), device="cpu")
    block = model.blocks[0]
    assert abs(block.qkv.weight.std().item() - 0.02) < 1e-3
    assert abs(block.fc2.weight.std().item() - 0.02 / math.sqrt(8)) < 1e-3
    assert torch.all(block.qkv.bias == 0) and torch.all(block.norm1.weight == 1)


def test_presets_build_on_the_meta_device():
    counts = {name: sum(p.numel() for p in LanguageModel(preset(name), device="meta").parameters())
              for name in ("tiny", "gpt2-small", "gpt2-medium", "llama-1b")}
    # Byte-level vocab: GPT-2 small's 124M minus the 50257-token embedding is about 85M.
    assert 84e6 < counts["gpt2-small"] < 87e6
    assert 300e6 < counts["gpt2-medium"] < 305e6
    assert 0.9e9 < counts["llama-1b"] < 1.0e9
    assert counts["tiny"] < 2e5


def test_bad_model_arguments_are_named():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=0)
    with pytest.raises(ValueError, match="preset must be one of"):
        preset("gpt5")
    with pytest.raises(ValueError, match="3 policies for 2 layers"):
        resolve_policies(["cheap"] * 3, 2)
    with pytest.raises(ValueError, match="'cheap'"):
        resolve_policies("cheap", 2, block_impl="reference")
    with pytest.raises(ValueError, match="block_impl"):
        LanguageModel(CONFIG, block_impl="jax")
    model = LanguageModel(CONFIG)
    with pytest.raises(TypeError, match="tokens"):
        model(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# The planner
# ------------------------------------------------------------------------------------------------

def _measured_bytes(model, tokens, precision):
    autocast = precision.compute != precision.residual
    inputs = tokens[:, :-1].contiguous()  # as the data loader gives them: the ids are kept, not the batch
    with saved_memory(exclude=model.parameters()) as meter:
        with torch.autocast(tokens.device.type, dtype=precision.compute, enabled=autocast):
            model(inputs, tokens[:, 1:])
    return meter.device_bytes, meter.host_bytes


@pytest.mark.parametrize("config", [CONFIG, LLAMA_LIKE], ids=["gpt", "llama"])
@pytest.mark.parametrize("precision", [FP32, AUTOCAST_BF16], ids=["fp32", "autocast-bf16"])
def test_predicted_bytes_match_the_meter(config, precision, device, triton_backend):
    batch, seq = 2, 24
    model = LanguageModel(config, "none", device=device)
    tokens = _tokens(config, batch, seq, device)
    mixes = [["none"] * config.n_layers, ["cheap"] * config.n_layers, ["full"] * config.n_layers,
             ["full"] + ["cheap"] * (config.n_layers - 1), ["offload"] + ["cheap"] * (config.n_layers - 1)]
    for policies in mixes:
        model.set_remat(policies)
        plan = explain_policies(config, batch, seq, precision, policies)
        measured, host = _measured_bytes(model, tokens, precision)
        assert abs(plan.predicted_bytes - measured) <= 0.1 * measured, (policies, plan.predicted_bytes, measured)
        assert host == plan.host_bytes, (policies, host, plan.host_bytes)


def test_plans_fit_their_budget_and_spend_the_least_recompute(device, triton_backend):
    batch, seq = 2, 24
    smallest = explain_policies(CONFIG, batch, seq, FP32, ["full"] * 3).peak_bytes
    largest = explain_policies(CONFIG, batch, seq, FP32, ["cheap"] * 3).peak_bytes
    model = LanguageModel(CONFIG, "cheap", device=device)
    tokens = _tokens(CONFIG, batch, seq, device)
    previous_extra = math.inf
    for budget in torch.linspace(smallest, largest + 1000, 7).long().tolist():
        plan = plan_remat(CONFIG, batch, seq, FP32, budget)
        assert plan.peak_bytes <= budget
        assert plan.layer_extra == sorted(plan.layer_extra, reverse=True), "replayed layers first"
        assert plan.extra_compute <= previous_extra
        previous_extra = plan.extra_compute
        model.set_remat(plan.policies)
        assert _measured_bytes(model, tokens, FP32)[0] + plan.transient_bytes <= budget
    assert plan.policies == ["cheap"] * 3 and plan.extra_compute == 0
    with pytest.raises(ValueError, match="budget: .* is below the smallest plan's peak"):
        plan_remat(CONFIG, batch, seq, FP32, smallest - 1, candidates=("cheap", "full"))
    everything_offloaded = explain_policies(CONFIG, batch, seq, FP32, ["offload"] * 3).peak_bytes
    # Below full's peak everywhere, offloading fits: an offloaded layer holds its input only while its
    # backward runs (and the one before it, prefetched), so with three layers only offloading all
    # of them peaks below full everywhere.
    assert everything_offloaded < smallest
    assert plan_remat(CONFIG, batch, seq, FP32, smallest - 1).policies == ["offload"] * 3
    with pytest.raises(ValueError, match="budget: .* is below the smallest plan's peak"):
        plan_remat(CONFIG, batch, seq, FP32, everything_offloaded - 1)


def test_a_plan_is_priced_at_its_peak_not_at_what_it_keeps():
    """A budget between what cheap everywhere keeps and its peak (kept + the largest layer
    transient) does not take cheap everywhere: the plan that fits replays something, and fits with
    its own transient; at cheap's peak, cheap everywhere fits."""
    batch, seq = 2, 24
    cheap = explain_policies(CONFIG, batch, seq, FP32, ["cheap"] * 3)
    assert cheap.transient_bytes == batch * seq * layer_transient_bytes_per_token(CONFIG, "cheap", FP32) > 0
    assert cheap.peak_bytes == cheap.predicted_bytes + cheap.transient_bytes
    between = cheap.predicted_bytes + cheap.transient_bytes // 2
    plan = plan_remat(CONFIG, batch, seq, FP32, between)
    assert plan.policies != ["cheap"] * 3 and plan.extra_compute > 0
    assert plan.predicted_bytes + plan.transient_bytes == plan.peak_bytes <= between
    assert plan_remat(CONFIG, batch, seq, FP32, cheap.peak_bytes).policies == ["cheap"] * 3
    named = plan_remat(CONFIG, batch, seq, FP32, between, candidates=("none", "cheap", "selective", "full"))
    assert "cheap" in named.policies and named.policies != ["cheap"] * 3 and named.peak_bytes <= between


@pytest.mark.parametrize("config", [CONFIG, LLAMA_LIKE], ids=["gpt", "llama"])
@pytest.mark.parametrize("precision", [FP32, AUTOCAST_BF16], ids=["fp32", "autocast-bf16"])
def test_a_layer_transient_is_its_peak_above_what_it_keeps(config, precision):
    """What a layer's step holds above what it keeps is remat.peak_bytes_per_token less what it keeps
    on the device (its output y counted there, its input x here, the same bytes), and for offload,
    which keeps nothing on the device, the layer input prefetched besides; the plan's peak adds the
    largest of its layers' to what they keep."""
    widths = block_widths(config.dim, config.n_heads, config.n_kv_heads, config.ffn_dim, config.norm,
                          config.activation)
    r, c = precision.residual_bytes, precision.compute_bytes

    def transient(point):
        return layer_transient_bytes_per_token(config, point, precision)

    for point in (*Remat, *budget_points()):
        kept = kept_bytes_per_token(point, widths, r, c)
        host = kept_bytes_per_token(point, widths, r, c, "host")
        assert transient(point) == peak_bytes_per_token(point, widths, r, c) - kept + host >= 0, point
    assert transient("offload") == transient("full") + 2 * config.dim * r
    plan = explain_policies(config, 2, 8, precision, ["offload", "full"] + ["cheap"] * (config.n_layers - 2))
    assert plan.layer_transient_bytes[:2] == [16 * transient("offload"), 16 * transient("full")]
    assert plan.peak_bytes == plan.predicted_bytes + 16 * max(transient("offload"), transient("cheap"))


def test_gpt2_layer_transients_in_fp32():
    """GPT-2's shapes (F = 4h) in fp32: none holds nothing beyond what it keeps, cheap the
    activation's input gradient, full besides that what cheap keeps beyond x (replayed)."""
    config = preset("gpt2-small")
    widths = block_widths(config.dim, config.n_heads, config.n_kv_heads, config.ffn_dim, config.norm,
                          config.activation)
    transient = {p: layer_transient_bytes_per_token(config, p, FP32) for p in ("none", "cheap", "full")}
    assert transient["none"] == 0
    assert transient["cheap"] == 4 * widths["pre_activation"] == 4 * 4 * config.dim
    assert transient["full"] == transient["cheap"] + kept_bytes_per_token("cheap", widths, 4, 4) - 4 * config.dim


@pytest.mark.parametrize("seed", range(3))
def test_plan_is_optimal_against_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    config = preset("gpt2-small", n_layers=6)
    batch, seq = 1, 4096
    costs = {"none": 0.0, "cheap": torch.rand((), generator=generator).item() * 0.05, "full": 0.3}
    bytes_of = {p: layer_bytes_per_token(config, p, AUTOCAST_BF16) * batch * seq for p in ("none", "cheap", "full")}
    transient = {p: layer_transient_bytes_per_token(config, p, AUTOCAST_BF16) * batch * seq for p in bytes_of}
    head = explain_policies(config, batch, seq, AUTOCAST_BF16, []).fixed_bytes

    def peak(assignment):
        return head + sum(bytes_of[p] for p in assignment) + max(transient[p] for p in assignment)

    for budget in (peak(["full"] * 6), peak(["cheap"] * 3 + ["full"] * 3), peak(["cheap"] * 3 + ["full"] * 3) - 1,
                   peak(["cheap"] * 6), peak(["cheap"] * 6) + 2 * (bytes_of["none"] - bytes_of["cheap"])):
        plan = plan_remat(config, batch, seq, AUTOCAST_BF16, budget, costs=costs,
                          candidates=("none", "cheap", "full"))
        best = min(sum(costs[p] for p in assignment)
                   for assignment in itertools.product(bytes_of, repeat=6) if peak(assignment) <= budget)
        assert sum(plan.layer_extra) == pytest.approx(best)
        assert plan.peak_bytes == peak(plan.policies) <= budget


def test_a_plan_per_layer_and_per_tensor_is_optimal_against_brute_force():
    """Every layer may take any keep-or-rebuild point (the FLOP model prices them all): the plan's
    extra compute is the least over every assignment of points to the 3 layers whose peak (kept +
    the largest layer transient) is within the budget."""
    config = preset("gpt2-small", n_layers=3)
    batch, seq = 1, 2048
    costs = flop_policy_costs(config, batch, seq, AUTOCAST_BF16)
    bytes_of = {p: layer_bytes_per_token(config, p, AUTOCAST_BF16) * batch * seq for p in costs}
    transient = {p: layer_transient_bytes_per_token(config, p, AUTOCAST_BF16) * batch * seq for p in costs}
    head = explain_policies(config, batch, seq, AUTOCAST_BF16, []).fixed_bytes
    cheap = 3 * bytes_of[Remat.CHEAP] + transient[Remat.CHEAP]
    full = 3 * bytes_of[Remat.FULL] + transient[Remat.FULL]
    totals = {}
    for assignment in itertools.combinations_with_replacement(costs, 3):
        nbytes = sum(bytes_of[p] for p in assignment) + max(transient[p] for p in assignment)
        extra = sum(costs[p] for p in assignment)
        totals[nbytes] = min(extra, totals.get(nbytes, math.inf))
    points_used = set()
    for fraction in (0.1, 0.3, 0.45, 0.6, 0.8, 0.95):
        budget = head + int(full + fraction * (cheap - full))
        plan = plan_remat(config, batch, seq, AUTOCAST_BF16, budget)
        best = min(extra for nbytes, extra in totals.items() if head + nbytes <= budget)
        assert sum(plan.layer_extra) == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert plan.peak_bytes <= budget
        points_used.update(plan.policies)
    assert any(str(point).startswith("keep:") for point in points_used), "the per-tensor points are planned"


def test_flop_model_prices_full_at_about_a_third_of_a_step():
    costs = flop_policy_costs(preset("gpt2-small"), 1, 8192)
    assert costs["cheap"] == 0 and 0.25 < costs["full"] < 0.4


def test_plan_table_lists_every_layer():
    plan = plan_remat(CONFIG, 1, 64, AUTOCAST_BF16, budget=None)
    table = plan.table()
    assert table.count("cheap") == 3 and "total" in table and "FLOP model" in table
    assert "transient" in table and "kept + the largest layer transient" in table
    assert re.search(r"^ +peak +[\d,.]+ MiB", table, re.MULTILINE)


@pytest.mark.gpu
def test_gpu_activation_memory_follows_the_plan():
    """On the GPU the bytes held between forward and backward are what the planner predicts, and
    each policy holds less than the one before it, all below the reference model eager."""
    device = torch.device("cuda")
    config = preset("gpt2-small", n_layers=4)
    batch, seq = 1, 16384
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def held_after_forward(model):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(inputs, targets)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        return held

    reference = LanguageModel(config, "none", block_impl="reference", device=device)
    eager = held_after_forward(reference)
    del reference
    model = LanguageModel(config, "none", device=device)
    held = {}
    for policy in ("none", "cheap", "full"):
        model.set_remat(policy)
        held[policy] = held_after_forward(model)
        predicted = explain_policies(config, batch, seq, AUTOCAST_BF16, [policy] * 4).predicted_bytes
        assert abs(held[policy] - predicted) <= 0.1 * predicted, (policy, held[policy], predicted)
    assert held["full"] < held["cheap"] < held["none"] <= eager * 1.1


def test_measured_policy_costs_are_relative_to_none(device, triton_backend):
    # On CPU the timings say nothing about a GPU; this checks the measurement's plumbing.
    costs = measure_policy_costs(CONFIG, 1, 16, FP32, device, repeats=1)
    assert set(costs) == set(Remat)
    assert costs["none"] == 0 and all(cost >= 0 for cost in costs.values())


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("inf"), float("nan"), True, "1e-5"], ids=repr)
def test_model_config_rejects_eps_that_is_not_finite_and_positive(eps):
    with pytest.raises(ValueError, match=rf"^ModelConfig: eps must be a finite number > 0, got {re.escape(repr(eps))}$"):
        ModelConfig(eps=eps)


def test_token_and_target_ids_out_of_range_are_named(device):
    model = LanguageModel(CONFIG, "none", block_impl="reference", device=device)  # vocab_size 200
    tokens = torch.zeros(2, 5, dtype=torch.long, device=device)
    for bad in (200, -1, -100):
        wrong = tokens.clone()
        wrong[1, 3] = bad
        with pytest.raises(ValueError, match=rf"^tokens must hold ids in 0\.\.199, got {bad}$"):
            model(wrong)
        if bad != -100:  # the loss's check
            with pytest.raises(ValueError, match=rf"^linear_cross_entropy: targets must be class ids in \[0, 200\) "
                                                 rf"or ignore_index=-100; 1 are not, e.g. {bad}$"):
                model(tokens, wrong)
    with pytest.raises(ValueError, match=r"^tokens must hold ids in 0\.\.199, got 200$"):
        model(tokens.int().index_fill(1, torch.tensor([0], device=device), 200))  # int32 too
    ignored = torch.full_like(tokens, -100)
    ignored[0, 0] = 199
    assert torch.isfinite(model(tokens, ignored))  # IGNORE_INDEX and the last id are valid targets


def test_on_a_gpu_a_token_out_of_range_is_a_nan_step_then_an_error_once_its_check_arrives(device, checked_later):
    """No forward waits for the check: the ids are clamped (the embedding stays in bounds), the step
    comes out NaN, and the next forward after the check reaches the host raises, naming the earlier one."""
    model = LanguageModel(CONFIG, "none", device=device)
    tokens = torch.randint(0, 200, (2, 5), device=device)
    wrong = tokens.clone()
    wrong[0, 2] = 200
    loss = model(wrong, tokens)
    assert loss.isnan()
    loss.backward()
    checked_later.append(True)
    with pytest.raises(ValueError, match=r"^tokens must hold ids in 0\.\.199, got 200 \(given to an earlier forward"):
        model(tokens, tokens)
    assert torch.isfinite(model(tokens, tokens))  # raised once


def test_on_a_gpu_a_training_step_reads_no_value_on_the_host(device, triton_backend, checked_later):
    """A LanguageModel's forward and backward on the fused blocks, loss included, outside capture and
    with its value checks on their GPU path (their pinned copies stood in for), under the guard that
    fails on any host read (``bench.host.host_read_guard``): nothing a step does waits for the GPU."""
    from bench.host import host_read_guard

    model = LanguageModel(CONFIG, "cheap", device=device)
    tokens = torch.randint(0, 200, (2, 6), device=device)
    targets = torch.randint(0, 200, (2, 6), device=device)
    targets[1, 2] = -100
    with host_read_guard(capturing=False):
        loss = model(tokens, targets)
        loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_documents_moved_by_batch_to_are_not_read_back(device, triton_backend, checked_later):
    """Offsets that ``Batch.to`` brings from host memory are checked there, from their values: a
    step on them reads no value on the host, where the same offsets made on the device are read
    once (each read a wait for the GPU). Bad offsets are refused by ``Batch.to``, naming them."""
    from bench.host import HostRead, host_read_guard
    from fused_remat.kernels.limits import known_offsets
    from fused_remat.training.data import Batch

    model = LanguageModel(CONFIG, "cheap", device=device)
    tokens = torch.randint(0, 200, (2, 7))
    offsets = [0, 3, 10, 14]
    moved = Batch(tokens, tokens, torch.tensor(offsets, dtype=torch.int32)).to(device)
    assert known_offsets(moved.cu_seqlens) == offsets
    with host_read_guard(capturing=False):
        loss = model(moved.inputs, moved.targets, cu_seqlens=moved.cu_seqlens, max_seqlen=moved.max_seqlen)
        loss.backward()
    made_there = torch.tensor(offsets, dtype=torch.int32, device=device)
    with host_read_guard(capturing=False), pytest.raises(HostRead):
        model(moved.inputs, moved.targets, cu_seqlens=made_there)
    moved.cu_seqlens.add_(0)  # an in-place change: the values kept are no longer the tensor's
    assert known_offsets(moved.cu_seqlens) is None
    with pytest.raises(ValueError, match=r"^Batch: cu_seqlens must end at the number of rows of x \(B N tokens\) \(14\)"):
        Batch(tokens, tokens, torch.tensor([0, 3, 10], dtype=torch.int32)).to(device)


@pytest.mark.gpu
def test_cuda_training_step_never_waits_for_the_gpu():
    """torch.cuda's sync debug mode raises on any call that waits for the GPU: a LanguageModel's
    forward and backward on the fused blocks make none, a token out of range included (its check
    raises at the next forward, once on the host)."""
    model = LanguageModel(CONFIG, "cheap", device="cuda")
    tokens = torch.randint(0, 200, (2, 64), device="cuda")
    wrong = tokens.clone()
    wrong[1, 7] = 200
    model(tokens, tokens).backward()  # the kernels compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in (tokens, wrong):
            loss = model(ids, tokens)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.isnan()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"got 200 \(given to an earlier forward"):
        model(tokens, tokens)


def test_documents_attend_only_within_themselves(device, triton_backend, monkeypatch):
    """Packed documents (cu_seqlens) reach every layer: each document's logits are those of the
    model on that document alone, RoPE restarting at its start; one document per row is bitwise the
    dense model; the offsets are read once for all layers."""
    config = dataclasses.replace(LLAMA_LIKE, window=(6, -1), softcap=20.0)
    model = LanguageModel(config, "cheap", device=device)
    tokens = _tokens(config, 2, 24, device)[:, :-1]
    lengths = [5, 11, 15, 0, 17]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    logits = model(tokens, cu_seqlens=cu_seqlens).reshape(-1, config.vocab_size)
    flat = tokens.reshape(-1)
    for start, end in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]):
        if end > start:
            alone = model(flat[start:end][None]).reshape(-1, config.vocab_size)
            torch.testing.assert_close(logits[start:end], alone, rtol=1e-4, atol=1e-5)
    rows = torch.tensor([0, 24, 48], dtype=torch.int32, device=device)
    from fused_remat.kernels import limits

    reads, check_offsets = [], limits._check_offsets
    monkeypatch.setattr(limits, "_check_offsets", lambda *args: reads.append(1) or check_offsets(*args))
    assert torch.equal(model(tokens, cu_seqlens=rows), model(tokens))
    assert len(reads) == 1, "the offsets are read once, not once per layer"
    with pytest.raises(ValueError, match="max_seqlen is given without cu_seqlens"):
        model(tokens, max_seqlen=4)
    with pytest.raises(ValueError, match=r"LanguageModel: cu_seqlens must end at the number of rows"):
        model(tokens, cu_seqlens=rows[:2])


def test_model_config_window_and_softcap_reach_every_layer():
    config = ModelConfig(n_layers=3, window=[16, 0], softcap=30.0)
    assert config.window == (16, 0)
    model = LanguageModel(config, device="meta")
    assert all(block.window == (16, 0) and block.softcap == 30.0 for block in model.blocks)
    with pytest.raises(ValueError, match="ModelConfig: window must be a pair"):
        ModelConfig(window=(1, 2, 3))


def test_masks_shrink_the_planned_attention_work_not_the_bytes():
    """A window or packed documents cut attention's FLOPs (and so what replaying it costs), while
    the bytes a policy keeps stay those of the contract."""
    from fused_remat.flops import visible_pairs
    from fused_remat.planner import flop_policy_costs, layer_bytes_per_token, layer_step_flops

    seq = 4096
    # FLOPs alone: at this tiny width the norm passes a replay adds, priced by bandwidth, would
    # weigh more against the smaller step of masked attention than the attention they save
    flops_only = dict(device_bandwidth=math.inf)
    dense = flop_policy_costs(CONFIG, 2, seq, **flops_only)
    documents = flop_policy_costs(CONFIG, 2, seq, attention_pairs=4 * visible_pairs(1024, 1024, True), **flops_only)
    windowed = dataclasses.replace(CONFIG, window=(255, 0))
    assert documents[Remat.FULL] < dense[Remat.FULL] and documents[Remat.SELECTIVE] > dense[Remat.SELECTIVE]
    assert flop_policy_costs(windowed, 2, seq, **flops_only)[Remat.FULL] < dense[Remat.FULL]
    _, _, step = layer_step_flops(windowed, 2, seq)
    assert step == layer_step_flops(CONFIG, 2, seq, attention_pairs=visible_pairs(seq, seq, True, (255, 0)))[2]
    for policy in Remat:
        assert layer_bytes_per_token(windowed, policy, FP32) == layer_bytes_per_token(CONFIG, policy, FP32)


def test_a_model_on_the_meta_device_infers_shapes_with_targets():
    """Built on "meta" to size it before allocating: the forward with targets and its backward run
    on shapes alone (meta has no autocast, which counts as off)."""
    model = LanguageModel(CONFIG, "cheap", device="meta")
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert model(tokens).shape == (2, 16, CONFIG.vocab_size)
    loss = model(tokens, tokens)
    assert loss.shape == () and loss.device.type == "meta"
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
