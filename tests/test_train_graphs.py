"""The training step as one CUDA graph (training/graphs.py): graphed steps give the eager steps'
losses and weights, nothing in a step reads values on the host (nor in an eager step with a fused
optimizer), and every change a replay would ignore is refused.

Without a GPU the graph itself is stood in for: ``CpuGraphs.capture`` returns a replay that runs
the captured step again under ``bench.host.host_read_guard`` (which fails on any host read, as
capture does, and answers True to ``graph_capturing`` so that every capture-safe form is the one
that runs). What only a GPU decides (that CUDA captures it, and replays it) is the ``gpu`` test.
"""

import contextlib
import dataclasses
import json
import math

import pytest
import torch

from bench.host import HostRead, host_read_guard
from fused_remat.model import LanguageModel, ModelConfig
from fused_remat.training import graphs
from fused_remat.training import step as step_module
from fused_remat.training.config import TrainConfig
from fused_remat.training.data import Batch
from fused_remat.training.step import make_optimizer, set_learning_rate, train_step
from conftest import DEVICE

CONFIG = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48)


class CpuGraphs(graphs.CudaGraphs):
    check_device = staticmethod(lambda device: None)
    side_stream = staticmethod(contextlib.nullcontext)
    captures = 0

    def capture(self, step):
        self.captures += 1

        def replay():
            with host_read_guard():
                return step()

        return replay


@pytest.fixture
def cpu_graphs(monkeypatch):
    stand_in = CpuGraphs()
    monkeypatch.setattr(graphs, "GRAPHS", stand_in)
    return stand_in


def _model_and_optimizer(seed=0, remat="cheap", device="cpu"):
    torch.manual_seed(seed)
    model = LanguageModel(CONFIG, remat, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device=device), fused=True,
                                  capturable=True)
    return model, optimizer


def _batches(steps, micro=2, seq=12, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (steps, micro, 2, seq + 1), generator=generator).to(device)
    return [[(t[:, :-1], t[:, 1:]) for t in step] for step in tokens]


def _run(step, optimizer, batches):
    losses = []
    for index, micro_batches in enumerate(batches):
        set_learning_rate(optimizer, 1e-2 / (index + 1))
        losses.append(step(micro_batches))
    return losses


def test_graphed_steps_give_the_eager_steps_losses_and_weights_and_read_nothing_on_the_host(cpu_graphs):
    batches = _batches(5)
    eager, eager_optimizer = _model_and_optimizer()
    expected = _run(lambda micro: train_step(eager, eager_optimizer, micro, grad_clip=0.5, finite_only=True),
                    eager_optimizer, batches)
    graphed, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(graphed, optimizer, grad_clip=0.5, finite_only=True, warmup=2)
    got = _run(step, optimizer, batches)
    assert step.replay is not None and step.steps == 5
    for (loss, norm), (want_loss, want_norm) in zip(got, expected):
        assert torch.equal(loss, want_loss) and torch.equal(norm, want_norm)
    for (name, ours), theirs in zip(graphed.named_parameters(), eager.parameters()):
        assert torch.equal(ours, theirs), name
        assert all(torch.equal(a, b) for a, b in zip(optimizer.state[ours].values(), eager_optimizer.state[theirs].values()))


def test_a_replayed_step_returns_fresh_tensors(cpu_graphs):
    model, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(model, optimizer, warmup=1)
    (first, _), (second, _), (third, _) = _run(step, optimizer, _batches(3))
    assert len({first.data_ptr(), second.data_ptr(), third.data_ptr()}) == 3 and not torch.equal(second, third)


@pytest.mark.parametrize("where, bad_id", [("targets", CONFIG.vocab_size), ("inputs", -1)])
def test_an_id_out_of_range_drops_the_replayed_step_on_the_device(cpu_graphs, where, bad_id):
    """Eager raises on it (test_model.py, test_loss.py); a graph cannot, so the step is NaN and makes
    no update."""
    model, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(model, optimizer, finite_only=True, warmup=1)
    good, bad = _batches(2)
    step(good)
    step(good)
    before = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    tokens = dict(zip(("inputs", "targets"), bad[0]))
    tokens[where] = tokens[where].clone()
    tokens[where][0, 3] = bad_id
    loss, _ = step([(tokens["inputs"], tokens["targets"]), bad[1]])
    assert torch.isnan(loss)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(torch.equal(optimizer.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments))


def test_an_eager_step_with_a_fused_optimizer_drops_a_nonfinite_step_on_the_device(checked_later):
    """Without a graph too, train_step(finite_only=True) with a fused optimizer (make_optimizer's on
    CUDA) leaves its check on the device: a step reads nothing on the host, and a step with NaN
    gradients (``gradient_scale`` NaN) changes the weights and AdamW's state as the host check's skip
    does, not at all. An optimizer without found_inf reads the check on the host."""
    batches = _batches(3)

    def run(on_device: bool):
        model = LanguageModel(CONFIG, "cheap", device="cpu")
        model.load_state_dict(start)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        results, weights = [], []
        with pytest.MonkeyPatch.context() as patch:
            if not on_device:
                patch.setattr(step_module, "_drops_on_device", lambda optimizer, grad_norm: False)
            for index, micro_batches in enumerate(batches):
                with host_read_guard(capturing=False) if on_device else contextlib.nullcontext():
                    results.append(train_step(model, optimizer, micro_batches, grad_clip=0.5, finite_only=True,
                                              gradient_scale=math.nan if index == 1 else 1.0))
                weights.append([p.detach().clone() for p in model.parameters()])
        return results, weights, [optimizer.state[p] for p in model.parameters()]

    start = LanguageModel(CONFIG, "cheap", device="cpu").state_dict()
    got, got_weights, got_state = run(on_device=True)
    want, want_weights, want_state = run(on_device=False)
    for (loss, norm), (want_loss, want_norm) in zip(got, want):
        torch.testing.assert_close((loss, norm), (want_loss, want_norm), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[1][1]) and all(map(torch.equal, got_weights[1], got_weights[0]))
    assert all(torch.equal(a, b) for after, expected in zip(got_weights, want_weights) for a, b in zip(after, expected))
    assert all(torch.equal(ours[key], theirs[key]) for ours, theirs in zip(got_state, want_state) for key in theirs)

    model = LanguageModel(CONFIG, "cheap", device="cpu")
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    with host_read_guard(capturing=False), pytest.raises(HostRead) as raised:
        train_step(model, foreach, batches[0], finite_only=True)
    assert any(entry.name == "is_finite" for entry in raised.traceback)  # the check, not the step, read


def _document_batches(counts, micro=2, seq=12, seed=2):
    """Steps of micro-batches (2 rows of ``seq`` tokens) with packed documents: ``counts[step]``
    documents in each micro-batch, cut at random inside the rows (every row starts one)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for count in counts:
        micro_batches = []
        for index in range(micro):
            extra = torch.randperm(2 * seq - 2, generator=generator)[:count - 2] + 1
            cuts = sorted({0, seq, 2 * seq, *(c + (c >= seq) for c in extra.tolist())})
            inputs = torch.randint(0, CONFIG.vocab_size, (2, seq), generator=generator)
            targets = torch.randint(0, CONFIG.vocab_size, (2, seq), generator=generator)
            offsets = torch.tensor(cuts, dtype=torch.int32)
            micro_batches.append(Batch(inputs, targets, offsets, int(offsets.diff().max())))
        steps.append(micro_batches)
    return steps


def _with_bound(steps, bound):
    """The same batches with max_seqlen ``bound`` (a bound, not the longest: the graphed step's form)."""
    return [[Batch(b.inputs, b.targets, b.cu_seqlens, bound) for b in micro] for micro in steps]


def test_packed_documents_are_graphed_in_one_fixed_form_with_the_eager_steps_values(cpu_graphs):
    """Every step's documents padded to one count with empty documents and bounded by the row length:
    the values of eager steps on the batches as given (with that bound), and a replay reads nothing
    on the host; a batch with more documents than the graph holds runs eagerly, and the next
    step captures a graph with room for it."""
    steps = _document_batches([3, 4, 2, 7, 3, 12, 5, 2])
    eager, eager_optimizer = _model_and_optimizer()
    expected = _run(lambda micro: train_step(eager, eager_optimizer, micro, grad_clip=0.5, finite_only=True),
                    eager_optimizer, _with_bound(steps, 12))
    graphed, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(graphed, optimizer, grad_clip=0.5, finite_only=True, warmup=2)
    got = []
    for index, micro in enumerate(steps):
        set_learning_rate(optimizer, 1e-2 / (index + 1))
        got.append(step(micro))
        if index == 4:  # twice the first step's 3 documents, as a power of two, held the next 4, 2, 7 and 3
            assert (step.documents.count, step.documents.longest, cpu_graphs.captures) == (8, 12, 1)
    assert (step.documents.count, cpu_graphs.captures) == (32, 2)  # the step with 12 ran eagerly
    for (loss, norm), (want_loss, want_norm) in zip(got, expected):
        assert torch.equal(loss, want_loss) and torch.equal(norm, want_norm)
    for (name, ours), theirs in zip(graphed.named_parameters(), eager.parameters()):
        assert torch.equal(ours, theirs), name


def test_graphed_documents_are_checked_on_the_host_and_a_longer_document_widens_the_bound(cpu_graphs):
    (first, second), = _document_batches([3])
    first, second = (Batch(b.inputs, b.targets, torch.tensor(offsets, dtype=torch.int32))
                     for b, offsets in ((first, [0, 5, 12, 18, 24]), (second, [0, 3, 12, 20, 24])))
    across_rows = [Batch(first.inputs, first.targets, torch.tensor([0, 3, 21, 24], dtype=torch.int32)), second]
    steps = [[first, second], [first, second], across_rows, [first, second]]
    bounds = [12, 12, 18, 18]  # the longest document or the row length, whichever is longer, since the first step
    eager, eager_optimizer = _model_and_optimizer()
    expected = [train_step(eager, eager_optimizer, _with_bound([micro], bound)[0]) for micro, bound in zip(steps, bounds)]

    model, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(model, optimizer, warmup=1, max_documents=4)
    bad = Batch(first.inputs, first.targets, torch.tensor([0, 5, 30], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^GraphedTrainStep: cu_seqlens must end at the number of rows of x .*\(24\)"):
        step([bad, second])
    assert step.steps == 0
    got = []
    for index, micro in enumerate(steps):
        got.append(step(micro))
        if index == 1:
            assert (step.documents.count, step.documents.longest, cpu_graphs.captures) == (4, 12, 1)
    assert (step.documents.count, step.documents.longest, cpu_graphs.captures) == (4, 18, 2)
    for (loss, norm), (want_loss, want_norm) in zip(got, expected):
        assert torch.equal(loss, want_loss) and torch.equal(norm, want_norm)


def test_a_graph_over_documents_refuses_rows_and_document_shards_are_refused(cpu_graphs):
    model, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(model, optimizer, warmup=1)
    for micro in _document_batches([3, 3]):
        step(micro)
    assert step.replay is not None
    inputs, targets = _batches(1)[0][0]
    with pytest.raises(ValueError, match=r"captured for micro-batches .*and whether it has documents"):
        step([(inputs, targets), (inputs, targets)])
    shards = Batch(inputs, targets, documents=object())  # refused before anything reads it
    with pytest.raises(ValueError, match=r"^GraphedTrainStep: a batch with context-parallel document shards"):
        step([shards, shards])


def test_a_capture_with_documents_reads_nothing_on_the_host(monkeypatch):
    """A CUDA capture runs the step's Python once (no kernel): the model's check of the graph's
    offsets must find them checked already, as a replay runs no Python at all."""

    class CapturingCpuGraphs(CpuGraphs):
        def capture(self, step):
            with host_read_guard():
                step()  # what capture runs; here its kernels run too, which the test does not mind
            return super().capture(step)

    monkeypatch.setattr(graphs, "GRAPHS", CapturingCpuGraphs())
    model, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(model, optimizer, warmup=1)
    for micro in _document_batches([3, 4, 3]):
        loss, _ = step(micro)
    assert step.replay is not None and torch.isfinite(loss)


def _captured(seq=12):
    model, optimizer = _model_and_optimizer()
    step = graphs.GraphedTrainStep(model, optimizer, warmup=1)
    _run(step, optimizer, _batches(2, seq=seq))
    return step, optimizer


def test_a_replay_refuses_what_it_would_ignore(cpu_graphs):
    step, optimizer = _captured()
    with pytest.raises(ValueError, match=r"^GraphedTrainStep: the graph was captured for micro-batches \(2, .*a graph "
                                         "replays one layout"):
        step(_batches(1, seq=13)[0])
    with pytest.raises(ValueError, match=r"captured for micro-batches"):
        step(_batches(1, micro=1)[0])
    optimizer.param_groups[0]["lr"] = 1e-3
    with pytest.raises(RuntimeError, match=r"param group 0's learning rate was replaced .*set_learning_rate"):
        step(_batches(1)[0])

    step, optimizer = _captured()
    optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(RuntimeError, match=r"param group 0's weight_decay changed after the capture"):
        step(_batches(1)[0])

    step, optimizer = _captured()
    optimizer.load_state_dict(optimizer.state_dict())
    with pytest.raises(RuntimeError, match=r"optimizer's state or parameter groups were replaced .*load_state_dict"):
        step(_batches(1)[0])


def test_steps_a_graph_cannot_hold_are_refused_before_any_step(cpu_graphs):
    model, optimizer = _model_and_optimizer()
    with pytest.raises(ValueError, match=r"the optimizer must be capturable .*make_optimizer\(\.\.\., capturable=True\)"):
        graphs.GraphedTrainStep(model, make_optimizer(model, lr=1e-3, weight_decay=0.0))
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)
    with pytest.raises(ValueError, match=r"finite_only drops a non-finite step on the device .*AdamW without fused"):
        graphs.GraphedTrainStep(model, foreach, finite_only=True)
    offloaded, optimizer = _model_and_optimizer(remat="offload")
    with pytest.raises(ValueError, match=r"blocks\.0 has remat 'offload', whose copies to and from host memory"):
        graphs.GraphedTrainStep(offloaded, optimizer)
    with pytest.raises(ValueError, match=r"warmup must be an int >= 1"):
        graphs.GraphedTrainStep(model, optimizer, warmup=0)
    with pytest.raises(ValueError, match=r"max_documents must be an int >= 1 or None, got 0"):
        graphs.GraphedTrainStep(model, optimizer, max_documents=0)


@pytest.mark.parametrize("device_type, options, message", [
    ("cpu", dict(document_boundary="none"), "needs a CUDA device"),
    ("cuda", dict(document_boundary="none", remat="cheap,offload"), "cannot hold --remat offload's copies"),
    ("cuda", dict(document_boundary="none", context_parallel=2, seq_len=64), "cannot capture --context-parallel"),
    ("cuda", dict(document_boundary="none", distributed="ddp"), "captures one process.s step: leave out --distributed"),
    ("cuda", dict(document_boundary="none", find_max_seq_len=True), "does not apply to --find-max-seq-len"),
])
def test_the_trainer_refuses_cuda_graphs_where_a_graph_cannot_hold_the_step(device_type, options, message):
    with pytest.raises(ValueError, match=f"^--cuda-graphs {message}"):
        TrainConfig.build(device_type, cuda_graphs=True, **options)
    assert TrainConfig.build("cuda", cuda_graphs=True, document_boundary="none").cuda_graphs
    assert TrainConfig.build("cuda", cuda_graphs=True).cuda_graphs  # the default corpus's documents


@pytest.mark.parametrize("documents", [[], ["--document-boundary", "none"]], ids=["documents", "rows"])
def test_the_trainer_replays_one_graph_after_its_warm_up(cpu_graphs, monkeypatch, tmp_path, documents):
    from fused_remat.training import cli, config

    monkeypatch.setattr(config, "_check_cuda_graphs", lambda *args: None)  # the stand-in graphs run on CPU
    assert cli.main(["--preset", "tiny", "--steps", "5", "--seq-len", "16", "--batch-size", "2", "--grad-accum", "2",
                     *documents, "--cuda-graphs", "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # rows: one capture; documents: another wherever a batch held more than the graph had room for
    assert [r["step"] for r in records] == list(range(5)) and (cpu_graphs.captures >= 1 if documents == [] else
                                                               cpu_graphs.captures == 1)
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["loss"] < records[0]["loss"]


def test_a_cpu_model_is_refused():
    model, optimizer = _model_and_optimizer()
    with pytest.raises(ValueError, match=r"^GraphedTrainStep: CUDA graphs need the model on a CUDA device, it is on cpu"):
        graphs.GraphedTrainStep(model, optimizer)


@pytest.mark.parametrize("policy", ["offload"])
def test_the_block_refuses_offload_under_capture(monkeypatch, policy):
    from fused_remat import TransformerBlock, backend

    block = TransformerBlock(32, 2, remat=policy)
    monkeypatch.setattr(backend, "graph_capturing", lambda: True)
    if not backend.use_triton("block", torch.device("cpu")):
        pytest.skip("the reference block runs where the kernels cannot")
    with pytest.raises(RuntimeError, match=r"remat 'offload' copies x to host memory .*a CUDA graph cannot hold"):
        block(torch.randn(1, 4, 32))


def test_lora_dropout_drawn_per_call_is_refused_under_capture(monkeypatch):
    """A mask drawn per call would be frozen into the graph: every replay the same mask."""
    from fused_remat import TransformerBlock, backend
    from fused_remat.reference import LowRankAdapter

    block = TransformerBlock(32, 2)
    adapter = LowRankAdapter("qkv", torch.randn(4, 32), torch.randn(96, 4), 1.0, dropout=0.1)
    x = torch.randn(1, 4, 32)
    monkeypatch.setattr(backend, "graph_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"adapters\[0\]: LoRA dropout draws a new mask for every call"):
        block(x, adapters=[adapter])
    block(x, adapters=[dataclasses.replace(adapter, seed=7)])  # a fixed mask is the caller's choice


def test_rope_frequencies_are_kept_for_eager_calls_but_never_from_a_capture(monkeypatch):
    """A tensor made while capturing holds nothing until the graph replays: it must not be kept."""
    from fused_remat import backend
    from fused_remat.block import _inverse_frequencies
    from fused_remat.reference import rope_inverse_frequencies

    cpu = torch.device("cpu")
    kept = _inverse_frequencies(16, 12345.0, cpu)
    assert _inverse_frequencies(16, 12345.0, cpu) is kept and torch.equal(kept, rope_inverse_frequencies(16, 12345.0))
    monkeypatch.setattr(backend, "graph_capturing", lambda: True)
    assert _inverse_frequencies(16, 12345.0, cpu) is not kept and _inverse_frequencies(16, 54321.0, cpu) is not \
        _inverse_frequencies(16, 54321.0, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_cuda_graph_steps_give_the_eager_steps_losses_and_weights(documents):
    if documents:  # the eager steps given the graph's bound (its padding adds empty documents only)
        batches = [[b.to(DEVICE) for b in micro] for micro in _with_bound(_document_batches([3, 4, 2, 7, 5, 2]), 12)]
    else:
        batches = _batches(6, device=DEVICE)
    eager, eager_optimizer = _model_and_optimizer(device=DEVICE)
    expected = _run(lambda micro: train_step(eager, eager_optimizer, micro, compute_dtype=torch.bfloat16, grad_clip=1.0,
                                             finite_only=True), eager_optimizer, batches)
    graphed, optimizer = _model_and_optimizer(device=DEVICE)
    step = graphs.GraphedTrainStep(graphed, optimizer, compute_dtype=torch.bfloat16, grad_clip=1.0, finite_only=True,
                                   warmup=2)
    got = _run(step, optimizer, batches)
    assert step.replay is not None
    for (loss, norm), (want_loss, want_norm) in zip(got, expected):
        assert torch.equal(loss, want_loss) and torch.equal(norm, want_norm)
    for ours, theirs in zip(graphed.parameters(), eager.parameters()):
        assert torch.equal(ours, theirs)


@pytest.mark.gpu
def test_an_eager_cuda_step_with_make_optimizers_optimizer_never_waits_for_the_gpu():
    """torch.cuda's sync debug mode raises on any call that waits for the GPU: train_step with
    finite_only and make_optimizer's fused AdamW makes none, a step with NaN gradients included."""
    model = LanguageModel(CONFIG, "cheap", device=DEVICE)
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.1)
    batches = _batches(3, device=DEVICE)
    train_step(model, optimizer, batches[0], finite_only=True)  # compiles, and makes AdamW's state, outside the check
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(model, optimizer, batches[1], grad_clip=1.0, finite_only=True, gradient_scale=math.nan)
        after_nan = [p.detach().clone() for p in model.parameters()]
        train_step(model, optimizer, batches[2], grad_clip=1.0, finite_only=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(map(torch.equal, after_nan, before)) and not torch.equal(next(model.parameters()), before[0])


@pytest.mark.gpu
@pytest.mark.parametrize("remat", ["cheap", "full"])
def test_a_block_graphed_by_make_graphed_callables_gives_the_eager_output_and_gradients(remat):
    """A user's own loop may graph each layer (torch.cuda.make_graphed_callables, as
    TransformerEngine and Megatron do) where it cannot graph the whole step."""
    import copy

    from fused_remat import TransformerBlock, reference

    torch.manual_seed(0)
    eager = TransformerBlock.from_reference(
        reference.TransformerBlock(dim=128, n_heads=4, n_kv_heads=2, norm="rmsnorm", activation="swiglu",
                                   rope_theta=10000.0, bias=False, device=DEVICE), remat=remat)
    graphed_block = copy.deepcopy(eager)
    x = torch.randn(2, 256, 128, device=DEVICE, requires_grad=True)
    dy = torch.randn(2, 256, 128, device=DEVICE)
    graphed = torch.cuda.make_graphed_callables(graphed_block, (x.detach().clone().requires_grad_(),),
                                                num_warmup_iters=3)
    for _ in range(2):  # the second replay reads the static buffers again
        want = torch.autograd.grad(eager(x), [x, *eager.parameters()], dy)
        got = torch.autograd.grad(graphed(x), [x, *graphed_block.parameters()], dy)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
