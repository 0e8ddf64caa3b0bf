"""Context parallelism over packed documents on CPU: gloo ranks, the kernels in Triton's interpreter.

Every rank builds the same whole batch from one seed, keeps its share (``shard_documents``), runs
``document_attention`` and compares its local outputs and gradients with one process's
``attention_varlen`` of the whole batch, sharded the same way.
"""

from __future__ import annotations

import pytest
import torch

from fused_remat.context_parallel_documents import shard_documents, unshard_documents
from test_context_parallel import run_ranks

# Every size class: documents shorter than a piece (1, 2, 3 tokens), one longer than a rank's share,
# and documents that cross the pieces' borders anywhere (lengths not divisible by 2W).
MIXED = [1, 3, 29, 2, 13]  # 48 tokens: divisible by 2W for 2 and 3 ranks
ONE_DOCUMENT = [48]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _documents_check(rank, world, lengths, q_heads, kv_heads, causal, window, softcap, dtype):
    from numerics import FLOOR, error, interpreter_dots_by_row

    import fused_remat
    from fused_remat import reference
    from fused_remat.context_parallel_documents import document_attention

    gen = torch.Generator().manual_seed(4321)
    total, head_dim = sum(lengths), 16
    q, k, v, do = (torch.randn(total, heads, head_dim, generator=gen).to(dtype)
                   for heads in (q_heads, kv_heads, kv_heads, q_heads))
    cu = _offsets(lengths)
    mask = dict(causal=causal, window=window, softcap=softcap)

    def one_process(module, inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o, lse = module.attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), return_lse=True, **mask)
        o.backward(do.to(o.dtype))
        return [o.detach(), lse, *(t.grad for t in leaves)]

    same = one_process(fused_remat, (q, k, v))
    exact = one_process(reference, (t.double() for t in (q, k, v)))

    shards = shard_documents(cu, world, rank, causal=causal, window=window)
    assert shards.local == total // world
    local = [shards.shard(t).requires_grad_() for t in (q, k, v)]
    o, lse = document_attention(*local, shards, softcap=softcap, return_lse=True)
    o.backward(shards.shard(do))
    ours = [o.detach(), lse, *(t.grad for t in local)]
    for name, got, one, truth in zip(("o", "lse", "dq", "dk", "dv"), ours, same, exact):
        dim = 1 if name == "lse" else 0
        assert got.dtype == one.dtype, name
        one, truth = shards.shard(one, dim), shards.shard(truth, dim)
        if name in ("o", "lse", "dq") and window[0] < 0 and interpreter_dots_by_row():
            # Each local piece is its own varlen sequence whose keys start where its document does:
            # the same keys in the same tiles as one process, so these are one process's bits (a
            # piece's query rows sit elsewhere in their tile: the same bits where a row's dot
            # products do not depend on its place, as on a GPU; numerics.interpreter_dots_by_row)
            assert torch.equal(got, one), name
            continue
        # dK and dV sum each piece's share over the ranks (fp32, rounded once) in another order than
        # one process's kernel; under a window the pieces' keys start at its left edge, so the tiles
        # differ too. Either way: as close to one process as one process is to the truth.
        finite = torch.isfinite(truth)
        assert torch.equal(finite, torch.isfinite(got)), name
        scale = max(truth[finite].abs().max().item(), 1e-6)
        bound = error(one[finite], truth[finite]) + FLOOR[dtype] * scale
        assert error(got[finite], one[finite]) <= bound, f"{name}: {error(got[finite], one[finite]):.3e} > {bound:.3e}"


@pytest.mark.parametrize("world, lengths, q_heads, kv_heads, causal, window, softcap, dtype", [
    (2, MIXED, 2, 1, True, (-1, -1), 0.0, torch.float32),
    (3, MIXED, 2, 2, True, (-1, -1), 0.0, torch.float16),
    (3, MIXED, 4, 2, True, (5, 0), 0.0, torch.float32),
    (2, ONE_DOCUMENT, 2, 1, True, (7, -1), 3.0, torch.float32),
    (2, MIXED, 2, 1, False, (-1, -1), 0.0, torch.float32),
])
def test_document_attention_matches_one_process(world, lengths, q_heads, kv_heads, causal, window, softcap, dtype):
    run_ranks(world, _documents_check, lengths, q_heads, kv_heads, causal, window, softcap, dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_token_is_held_once_and_every_rank_holds_as_many(world):
    lengths = [1, 3, 29, 2, 13, 0, 7, 1, 6]  # 62: padded below to a multiple of 2W
    lengths.append(-sum(lengths) % (2 * world) + 2 * world)
    cu = _offsets(lengths)
    shards = [shard_documents(cu, world, r) for r in range(world)]
    held = torch.cat([s.global_index for s in shards])
    assert sorted(held.tolist()) == list(range(sum(lengths)))
    assert {s.local for s in shards} == {sum(lengths) // world}
    batch = torch.randn(sum(lengths), 3)
    assert torch.equal(unshard_documents([s.shard(batch) for s in shards], shards), batch)
    starts = cu[:-1].long()
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for s in shards:  # each token's position is its offset in its own document
        assert torch.equal(s.positions, s.global_index - starts[document[s.global_index]])


def test_one_document_is_the_dense_zigzag_layout():
    from fused_remat.context_parallel import zigzag_shard

    tokens = torch.arange(48)
    for rank in range(3):
        shards = shard_documents(_offsets([48]), 3, rank)
        assert torch.equal(shards.global_index, zigzag_shard(tokens[None], rank, 3)[0])


def test_causal_work_is_balanced_over_the_ranks():
    # the benchmark's mix at a real scale: many short documents, some long ones
    lengths = [4096, 17, 900, 2500, 33, 1, 12000, 640, 70, 3000, 8, 5000, 260, 1200]
    lengths.append(-sum(lengths) % 8)
    cu = _offsets(lengths)
    for world in (2, 4):
        pairs = [shard_documents(cu, world, r).keys.pairs() for r in range(world)]
        one_process = shard_documents(cu, 1, 0).keys.pairs()
        assert sum(pairs) == one_process  # nothing masked is computed, nothing visible missed
        assert max(pairs) <= 1.1 * min(pairs), pairs


@pytest.mark.parametrize("make, match", [
    (lambda: shard_documents(_offsets([5, 6]), 2, 0), "divisible by 2 x the context-parallel size"),
    (lambda: shard_documents(_offsets([8]), 2, 2), "rank must be in"),
    (lambda: shard_documents(torch.tensor([0, 5, 3, 8], dtype=torch.int32), 2, 0), "not decrease"),
    (lambda: shard_documents(_offsets([8]), 2, 0, causal=False, window=(2, 2)), "window"),
    (lambda: shard_documents(_offsets([8]), 2, 0, causal=True, window=(2, 3)), "window"),
    (lambda: shard_documents(torch.tensor([0.0, 8.0]), 2, 0), "cu_seqlens must be"),
])
def test_bad_layouts_are_refused_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _model_check(rank, world, remat, n_kv_heads, window, lengths):
    """A whole model under context parallelism over documents: the loss and every gradient equal one
    process's with the same documents (the tolerances of test_context_parallel's dense check)."""
    import torch.distributed as dist

    from fused_remat.model import IGNORE_INDEX, LanguageModel, ModelConfig

    torch.manual_seed(11)
    config = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, n_kv_heads=n_kv_heads, ffn_dim=48,
                         window=window)
    total = sum(lengths)
    tokens = torch.randint(0, config.vocab_size, (total + 1,))
    inputs, targets = tokens[:-1], tokens[1:].clone()
    targets[5] = IGNORE_INDEX
    cu = _offsets(lengths)

    def loss_and_grads(model, inputs, targets, **documents):
        loss = model(inputs, targets, **documents)
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    whole = LanguageModel(config, remat)
    expected_loss, expected_grads = loss_and_grads(whole, inputs.view(2, -1), targets.view(2, -1), cu_seqlens=cu)
    split = LanguageModel(config, remat, context_parallel=dist.group.WORLD)
    split.load_state_dict(whole.state_dict())
    shards = shard_documents(cu, world, rank, causal=True, window=split.blocks[0].window)
    loss, grads = loss_and_grads(split, shards.shard(inputs).view(2, -1), shards.shard(targets).view(2, -1),
                                 documents=shards)
    for grad in grads:
        dist.all_reduce(grad)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for (name, _), got, expected in zip(split.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("world, remat, n_kv_heads, window", [
    (2, "cheap", 1, (-1, -1)), (3, "full", 2, (-1, -1)), (2, "none", 1, (6, 0))])
def test_language_model_over_documents_matches_one_process(world, remat, n_kv_heads, window):
    run_ranks(world, _model_check, remat, n_kv_heads, window, MIXED)


@pytest.mark.parametrize("corpus", ["default", "mixed documents"])
def test_training_with_documents_on_two_ranks_matches_one_process(corpus, tmp_path, triton_backend):
    """--context-parallel 2 with documents: the losses, gradient norms and validation losses of three
    steps equal one process's with the same documents. The default corpus (its files are its
    documents, longer than a row) and a token file whose documents of 1 to 40 tokens start anywhere."""
    from test_context_parallel import _train
    from test_train import _metrics

    data = []
    if corpus == "mixed documents":
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(1, 1000, (6000,), generator=gen, dtype=torch.int32)
        tokens[torch.randint(0, 6000, (400,), generator=gen)] = 0  # token 0 begins a document
        (tmp_path / "tokens.bin").write_bytes(tokens.to(torch.uint16).numpy().tobytes())
        data = ["--data", str(tmp_path / "tokens.bin"), "--vocab-size", "1000", "--document-boundary", "0"]
    one = _train(tmp_path / "one", 1, *data, "--steps", "3", "--eval-interval", "3")
    assert "document masking on" in one.stdout
    _train(tmp_path / "cp", 2, *data, "--context-parallel", "2", "--steps", "3", "--eval-interval", "3")
    ours, theirs = _metrics(tmp_path / "cp"), _metrics(tmp_path / "one")
    assert [r["step"] for r in ours] == [0, 1, 2]
    for split, whole in zip(ours, theirs):
        for key in ("loss", "grad_norm", "val_loss"):
            assert (key in split) == (key in whole)
            if key in split:
                assert split[key] == pytest.approx(whole[key], rel=1e-5), key


@pytest.mark.parametrize("world", [2, 4])
def test_attention_transient_memory_is_the_formulas(world, monkeypatch, triton_backend):
    """The peak meter on one rank's forward and backward, its collectives stood in for by copies
    that allocate nothing (what a backend allocates inside a collective is its own: gloo copies the
    buffers, NCCL does not): the largest moment above inputs and outputs is the formula's."""
    import fused_remat.context_parallel_documents as cp_documents
    from fused_remat.memory import peak_memory

    rank = world - 1
    monkeypatch.setattr(cp_documents, "_all_gather",
                        lambda out, local, group: out.view(world, *local.shape).copy_(local.expand(world, *local.shape)))
    monkeypatch.setattr(cp_documents, "_reduce_scatter",
                        lambda out, full, group: out.copy_(full.view(world, *out.shape)[rank]))
    total, heads, kv_heads, head_dim, dtype = sum(MIXED), 2, 1, 16, torch.float32
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(total // world, h, head_dim, generator=gen, dtype=dtype)
                   for h in (heads, kv_heads, kv_heads, heads))
    keys = shard_documents(_offsets(MIXED), world, rank).keys
    bound = cp_documents.attention_transient_bytes(world, total // world, keys.keys, kv_heads * head_dim,
                                                   dtype.itemsize)
    o, dq, dk, dv = (torch.empty_like(t) for t in (q, q, k, v))  # the outputs, made before the meters
    with peak_memory("cpu") as forward:
        _, lse = cp_documents.document_attention_fwd(q, k, v, keys, None, head_dim**-0.5, out=o)
    with peak_memory("cpu") as backward:
        cp_documents.document_attention_bwd(do, q, k, v, o, lse, keys, None, head_dim**-0.5, out=(dq, dk, dv))

    def transient(meter):
        # the kernels' own outputs and scratch (lse, dQ's row sums) are one process's too: the block's formula has them
        kernels = sum(a.bytes for a in meter.live_at_peak if a.frame and a.frame.startswith("kernels/attention.py"))
        return meter.peak_bytes - kernels

    moments = [transient(forward), transient(backward)]
    assert max(moments) == bound, (moments, bound, forward.report(), backward.report())


def test_the_planner_prices_the_gathered_keys():
    from fused_remat.context_parallel_documents import attention_transient_bytes_per_token
    from fused_remat.model import ModelConfig
    from fused_remat.planner import Precision, layer_transient_bytes_per_token, plan_remat

    config = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=4)
    precision = Precision(torch.float32, torch.bfloat16)
    for world in (2, 8):
        extra = attention_transient_bytes_per_token(world, 2 * 16, 2)
        # forward's gather: W rows of k and v gathered and W + 1 copied; backward's: W + 1 rows of fp32
        # gradients and the W-row fp32 buffer
        assert extra == max((2 * world + 1) * 2 * 32 * 2, (world + 1) * 2 * 32 * (2 + 4),
                            (2 * world + 1) * 2 * 32 * 4, (world + 1) * 2 * 32 * 4)
        assert (layer_transient_bytes_per_token(config, "cheap", precision, world)
                == layer_transient_bytes_per_token(config, "cheap", precision) + extra)
        one, split = (plan_remat(config, 1, 1024, precision, None, document_ranks=ranks) for ranks in (1, world))
        assert split.peak_bytes == one.peak_bytes + 1024 * extra


def test_the_benchmark_reports_every_rank_balanced(tmp_path):
    import json

    from bench import context_parallel

    assert context_parallel.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "context_parallel.json").read_text())
    for world in context_parallel.WORLDS:
        rows = [r for r in report["rows"] if r["world"] == world]
        assert [r["rank"] for r in rows] == list(range(world))
        pairs = [r["pairs"] for r in rows]
        assert sum(pairs) == report["one_process_pairs"] and max(pairs) <= 1.1 * min(pairs)
        assert all(r["pairs"] < r["ring_pairs"] for r in rows)  # masked tiles skipped
    assert "| 4 | 3 |" in (tmp_path / "context_parallel.md").read_text()


def _meter_check(rank, world):
    """Per rank, a model keeps what one process keeps for the same local tokens as documents (the
    pieces, at their positions), plus the keys' layout: cu_seqlens_k and key_rows, once for all layers,
    and one scalar."""
    import torch.distributed as dist

    from fused_remat.memory import saved_memory
    from fused_remat.model import LanguageModel, ModelConfig

    config = ModelConfig(vocab_size=32, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=48)
    shards = shard_documents(_offsets(MIXED), world, rank)
    tokens = torch.randint(0, config.vocab_size, (2, shards.local // 2))
    split = LanguageModel(config, "cheap", context_parallel=dist.group.WORLD)
    with saved_memory(exclude=split.parameters()) as meter:
        split(tokens, tokens, documents=shards)
    one = LanguageModel(config, "cheap")
    with saved_memory(exclude=one.parameters()) as one_meter:
        one(tokens, tokens, cu_seqlens=shards.keys.cu_seqlens_q, position_ids=shards.positions.view(2, -1))
    keys = shards.keys
    factor = 4  # the group mean's factor for this rank's share of the loss (mean_over_group), on the device
    assert meter.bytes == one_meter.bytes + keys.cu_seqlens_k.nbytes + keys.key_rows.nbytes + factor, (
        meter.bytes, one_meter.bytes)


def test_per_rank_saved_memory_is_one_process_s_plus_the_keys_layout():
    run_ranks(2, _meter_check)
