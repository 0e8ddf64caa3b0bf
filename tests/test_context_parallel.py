"""Context parallelism on CPU: gloo ranks in spawned processes, the kernels in Triton's interpreter.

Every rank builds the same full-sequence inputs from one seed, keeps its zigzag part, runs the ring
and checks its local outputs and gradients against the float64 reference of the full sequence
(sharded the same way) under the error rule. A hang fails the test after a timeout instead of
blocking CI.
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback

import pytest
import torch

from fused_remat import reference
from fused_remat.context_parallel import zigzag_positions, zigzag_shard, zigzag_unshard
from fused_remat.model import ModelConfig

TIMEOUT_S = 240
_METER_CONFIG = ModelConfig(vocab_size=32, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=48)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, errors, check, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            check(rank, world, *args)
            # Every rank done before any tears down: gloo aborts a process whose peer closed mid-transfer.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure goes to the parent with its traceback
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def run_ranks(world: int, check, *args) -> None:
    """Run ``check(rank, world, *args)`` on ``world`` gloo ranks; fail with the first rank's error."""
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world, port, errors, check, args)) for rank in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(TIMEOUT_S)
    hung = [p for p in processes if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if not errors.empty():
        pytest.fail(errors.get())
    assert not hung, f"{len(hung)} of {world} ranks still running after {TIMEOUT_S}s (a ring that never completes)"
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]


def _attention_check(rank, world, batch, q_heads, kv_heads, seq, head_dim, causal, dtype):
    from numerics import assert_error_rule
    from test_attention import _assert_lse, _reference64, manual_attention

    from fused_remat.context_parallel import ring_attention

    gen = torch.Generator().manual_seed(1234)
    q, k, v, do = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype)
                   for heads in (q_heads, kv_heads, kv_heads, q_heads))
    scale = head_dim**-0.5
    o64, lse64, grads64 = _reference64(q, k, v, do, causal, scale)
    same_o, _, *same_grads = manual_attention(q, k, v, do, causal, scale, dtype)

    def mine(t):
        return zigzag_shard(t.detach(), rank, world, dim=2)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    o, lse = ring_attention(*local, causal=causal, return_lse=True)
    o.backward(mine(do))
    assert_error_rule("o", o.detach(), mine(same_o), mine(o64), dtype)
    _assert_lse(lse, mine(lse64))
    for name, got, same, exact in zip(("dq", "dk", "dv"), (t.grad for t in local), same_grads, grads64):
        assert got.dtype == dtype
        assert_error_rule(name, got, mine(same), mine(exact), dtype)


@pytest.mark.parametrize("world, q_heads, kv_heads, causal, dtype", [
    (2, 2, 2, True, torch.float32),
    (2, 4, 2, False, torch.float16),
    (4, 2, 1, True, torch.float16),
    (4, 2, 2, False, torch.float32),
])
def test_ring_attention_matches_one_process(world, q_heads, kv_heads, causal, dtype):
    run_ranks(world, _attention_check, 1, q_heads, kv_heads, 8 * world, 16, causal, dtype)


def _overlap_check(rank, world):
    """Records the ring backward's order of events: which transfer is started and waited for, and
    when each block's gradients are computed."""
    import fused_remat.context_parallel as cp
    from fused_remat.kernels import attention as kernels

    events, compute = [], kernels.attention_bwd

    class LoggedShift(cp._Shift):
        def __init__(self, tensor, group, tag=cp._KV_TAG):
            self.name = "kv" if tag == cp._KV_TAG else "dkv"
            events.append(("start", self.name))
            super().__init__(tensor, group, tag)

        def wait(self):
            events.append(("wait", self.name))
            return super().wait()

    def logged_bwd(*args, **kwargs):
        events.append(("compute",))
        return compute(*args, **kwargs)

    cp._Shift, kernels.attention_bwd = LoggedShift, logged_bwd
    try:
        gen = torch.Generator().manual_seed(7)
        q, k, v, do = (torch.randn(1, 2, 4, 16, generator=gen) for _ in range(4))
        o, lse = cp.ring_attention_fwd(q, k, v, torch.distributed.group.WORLD, True, 0.25)
        events.clear()
        cp.ring_attention_bwd(do, q, k, v, o, lse, torch.distributed.group.WORLD, True, 0.25)
    finally:
        cp._Shift, kernels.attention_bwd = LoggedShift.__bases__[0], compute
    computes = [i for i, e in enumerate(events) if e == ("compute",)]
    dkv_starts = [i for i, e in enumerate(events) if e == ("start", "dkv")]
    dkv_waits = [i for i, e in enumerate(events) if e == ("wait", "dkv")]
    assert len(computes) == len(dkv_starts) == len(dkv_waits) == world, events
    for step in range(1, world):
        # The dK/dV buffer sent at the end of step - 1 is in flight while step's block is computed.
        assert dkv_starts[step - 1] < computes[step] < dkv_waits[step - 1], events
    kv_starts = [i for i, e in enumerate(events) if e == ("start", "kv")]
    assert len(kv_starts) == world - 1 and all(kv_starts[s] < computes[s] for s in range(world - 1)), events


@pytest.mark.parametrize("world", [2, 3])
def test_ring_backward_overlaps_the_dkdv_shift_with_the_next_blocks_compute(world):
    run_ranks(world, _overlap_check)


def test_zigzag_layout_round_trip_and_positions():
    seq, world = 24, 3
    x = torch.arange(seq).view(1, seq)
    parts = [zigzag_shard(x, rank, world) for rank in range(world)]
    assert torch.equal(zigzag_unshard(parts), x)
    for rank, part in enumerate(parts):
        first, second = zigzag_positions(seq, rank, world)
        chunk = seq // (2 * world)
        assert part[0, 0].item() == first and part[0, chunk].item() == second
    # Every rank holds the same number of causally visible (query, key) pairs: the load balance.
    visible = [sum(int(p) + 1 for p in part[0]) for part in parts]
    assert len(set(visible)) == 1


def test_layout_rejects_indivisible_length():
    with pytest.raises(ValueError, match="sequence length 10 must be divisible by 2 x the context-parallel size"):
        zigzag_shard(torch.zeros(1, 10), 0, 3)


def _model_check(rank, world, remat, n_kv_heads, seq):
    """The model's tolerances of tests/test_model.py (fused against its reference twin, fp32)."""
    import torch.distributed as dist

    from fused_remat.model import IGNORE_INDEX, LanguageModel, ModelConfig

    torch.manual_seed(7)
    config = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, n_kv_heads=n_kv_heads, ffn_dim=48)
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, 3] = IGNORE_INDEX  # the token count is reduced over the group too

    def loss_and_grads(model, inputs, targets):
        loss = model(inputs, targets)
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    whole = LanguageModel(config, remat)
    expected_loss, expected_grads = loss_and_grads(whole, inputs, targets)
    split = LanguageModel(config, remat, context_parallel=dist.group.WORLD)
    split.load_state_dict(whole.state_dict())
    loss, grads = loss_and_grads(split, zigzag_shard(inputs, rank, world), zigzag_shard(targets, rank, world))
    for grad in grads:
        dist.all_reduce(grad)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for (name, _), got, expected in zip(split.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)


# offload: the ring runs again in backward from the block input held in host memory.
@pytest.mark.parametrize("world, remat, n_kv_heads", [(2, "cheap", 1), (4, "full", 2), (2, "none", 2), (2, "offload", 1)])
def test_language_model_matches_one_process(world, remat, n_kv_heads):
    run_ranks(world, _model_check, remat, n_kv_heads, 8 * world)


def _meter_check(rank, world, remat, seq_per_rank, expected_bytes):
    import torch.distributed as dist

    from fused_remat.memory import saved_memory
    from fused_remat.model import LanguageModel

    model = LanguageModel(_METER_CONFIG, remat, context_parallel=dist.group.WORLD)
    tokens = torch.randint(0, _METER_CONFIG.vocab_size, (1, seq_per_rank))
    with saved_memory(exclude=model.parameters()) as meter:
        loss = model(tokens, tokens)
    loss.backward()
    assert (meter.bytes, meter.host_bytes) == expected_bytes, (f"rank {rank} saved {meter.bytes} bytes "
                                                              f"({meter.host_bytes} in host memory), one process at "
                                                              f"1/{world} the length {expected_bytes}")


@pytest.mark.parametrize("remat", ["cheap", "full", "offload"])
def test_per_rank_memory_at_n_times_the_sequence_equals_one_process(remat):
    """N ranks hold N times the sequence at the per-rank activation memory of one process at 1x
    (and one scalar)."""
    from fused_remat.memory import saved_memory
    from fused_remat.model import LanguageModel

    world, seq_per_rank = 2, 16
    model = LanguageModel(_METER_CONFIG, remat)
    tokens = torch.randint(0, _METER_CONFIG.vocab_size, (1, seq_per_rank))
    with saved_memory(exclude=model.parameters()) as meter:
        model(tokens, tokens)
    # plus, on a rank, the group mean's factor for its share of the loss (a 0-dim fp32 on the
    # device, so that no count is read on the host: mean_over_group)
    run_ranks(world, _meter_check, remat, seq_per_rank, (meter.bytes + 4, meter.host_bytes))


def _train(out, processes: int, *extra: str):
    import os
    import subprocess
    import sys

    from test_train import SHORT

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "-m", "fused_remat.train", *SHORT, "--steps", "2", "--eval-interval", "2", "--out", str(out), *extra]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return finished


def test_training_on_a_dp_by_cp_mesh_matches_data_parallel_alone(tmp_path, triton_backend):
    """4 ranks as 2 (dp, FSDP2) x 2 (cp) train as 2 DDP ranks holding whole sequences: the same
    batches per data-parallel replica, the same losses and gradient norms, step by step. Whole rows
    (the ring); tests/test_context_parallel_documents.py trains with documents."""
    from test_train import _metrics

    _train(tmp_path / "dp", 2, "--distributed", "ddp", "--document-boundary", "none")
    _train(tmp_path / "mesh", 4, "--distributed", "fsdp", "--context-parallel", "2", "--document-boundary", "none")
    plain, mesh = _metrics(tmp_path / "dp"), _metrics(tmp_path / "mesh")
    assert [r["step"] for r in mesh] == [0, 1]
    assert mesh[-1].keys() >= {"loss", "grad_norm", "val_loss"}
    for ours, theirs in zip(mesh, plain):
        for key in ("loss", "grad_norm", "val_loss"):
            assert (key in ours) == (key in theirs)
            if key in ours:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key


def test_context_parallel_flags_are_checked():
    from fused_remat.training.config import TrainConfig

    with pytest.raises(ValueError, match=r"--seq-len 36 must be divisible by 2 x --context-parallel = 8"):
        TrainConfig.build("cpu", seq_len=36, context_parallel=4)
    with pytest.raises(ValueError, match="--context-parallel needs the fused block"):
        TrainConfig.build("cpu", seq_len=32, context_parallel=2, block="reference")
    with pytest.raises(ValueError, match="--context-parallel must be at least 1"):
        TrainConfig.build("cpu", context_parallel=0)


def test_find_max_seq_len_answers_per_rank_for_context_parallel(tmp_path, triton_backend):
    import json

    from fused_remat.training import cli

    out = tmp_path / "run"
    assert cli.main(["--preset", "tiny", "--batch-size", "1", "--find-max-seq-len", "--memory-limit", "1.8MiB",
                     "--context-parallel", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "max_seq_len.json").read_text())["rows"]
    assert [row["remat"] for row in rows] == ["none", "cheap", "selective", "full", "offload", "auto"]  # ring attention: our block only
    lengths = {row["remat"]: row["max_seq_len"] for row in rows}
    assert all(row["context_parallel"] == 2 and row["max_seq_len"] % 64 == 0 for row in rows)
    assert 0 < lengths["none"] <= lengths["cheap"] < lengths["full"] <= lengths["offload"]
    assert lengths["auto"] <= lengths["offload"]


def test_rope_at_zigzag_positions_matches_the_full_sequence_sharded(triton_backend):
    """What each rank's block does to its q and k: the rotation of the full sequence, then sharded."""
    from fused_remat.kernels.rope import rope_

    seq, world, head_dim, theta = 24, 3, 16, 10000.0
    x = torch.randn(2, seq, 3, head_dim)
    expected = reference.rope(x.double(), theta)
    inv_freq = reference.rope_inverse_frequencies(head_dim, theta)
    for rank in range(world):
        local = zigzag_shard(x, rank, world)
        rope_(local, inv_freq, chunk_starts=zigzag_positions(seq, rank, world))
        torch.testing.assert_close(local.double(), zigzag_shard(expected, rank, world), rtol=0, atol=1e-5)


def _bad_input_check(rank, world):
    import os

    import torch.distributed as dist

    from fused_remat import TransformerBlock
    from fused_remat.backend import BACKEND_ENV
    from fused_remat.context_parallel import ring_attention

    q = torch.randn(1, 2, 6, 16)
    with pytest.raises(ValueError, match="q has 6 local positions but k/v have 4"):
        ring_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="local sequence length must be even .* got 5"):
        ring_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5])
    block = TransformerBlock(32, 2)
    block.context_parallel = dist.group.WORLD
    with pytest.raises(ValueError, match="local sequence length must be even"):
        block(torch.randn(1, 5, 32))
    os.environ[BACKEND_ENV] = "reference"  # this spawned rank's own environment
    with pytest.raises(RuntimeError, match="context parallelism runs the Triton kernels only"):
        block(torch.randn(1, 4, 32))


def test_bad_context_parallel_input_is_named():
    run_ranks(1, _bad_input_check)
