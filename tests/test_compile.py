"""torch.compile, custom operators and the limits of differentiation.

Every op and the block reach the kernels through custom operators (``torch.ops.fused_remat.*``),
so ``torch.compile(..., fullgraph=True)`` traces them without a graph break, gives eager's values,
and cannot change what the block keeps for backward.
"""

import pytest
import torch
from torch.func import functional_call

import fused_remat
from fused_remat import custom_ops
from fused_remat.block import block_widths
from fused_remat.memory import saved_memory
from fused_remat.model import LanguageModel, ModelConfig
from fused_remat.flops import visible_pairs
from fused_remat.remat import Remat, kept_bytes_per_token, within_budget

DIM, HEADS, KV_HEADS, FFN = 32, 4, 2, 48


def _block(device, remat="cheap", **kwargs):
    """The test's block: ``remat``, or the ``memory_budget`` given instead."""
    return fused_remat.TransformerBlock(DIM, HEADS, n_kv_heads=KV_HEADS, ffn_dim=FFN, norm="rmsnorm",
                                        activation="swiglu", rope_theta=10000.0,
                                        remat=None if "memory_budget" in kwargs else remat, device=device, **kwargs)


def _leaves(device, *shapes):
    return [torch.randn(*shape, device=device, requires_grad=True) for shape in shapes]


def _op_cases(device):
    """(name, function, differentiable inputs); built inside the tests, not at collection."""
    x, w, b = _leaves(device, (3, 5, DIM), (DIM,), (DIM,))
    q, k, v = _leaves(device, (2, HEADS, 7, 16), (2, KV_HEADS, 7, 16), (2, KV_HEADS, 7, 16))
    hidden, head = _leaves(device, (2, 6, DIM), (50, DIM))
    targets = torch.randint(0, 50, (2, 6), device=device)
    offsets = torch.tensor([0, 6, 6, 14], dtype=torch.int32, device=device)
    return {
        "layer_norm": (lambda x, w, b: fused_remat.layer_norm(x, w, b), (x, w, b)),
        "rms_norm": (lambda x, w: fused_remat.rms_norm(x, w), (x, w)),
        "gelu": (lambda x: fused_remat.gelu(x, "tanh"), (x,)),
        "swiglu": (fused_remat.swiglu, (x, x.detach().clone().requires_grad_())),
        "attention": (lambda q, k, v: fused_remat.attention(q, k, v, causal=True, return_lse=True), (q, k, v)),
        "attention_window_softcap": (lambda q, k, v: fused_remat.attention(q, k, v, window=(3, 1), softcap=4.0),
                                     (q, k, v)),
        # under compile the offsets are not read on the host: their checks need eager mode
        "attention_varlen": (lambda q, k, v: fused_remat.attention_varlen(q, k, v, offsets, offsets, 8, 8, causal=True),
                             _leaves(device, (14, HEADS, 16), (14, KV_HEADS, 16), (14, KV_HEADS, 16))),
        "linear_cross_entropy": (lambda h, w: fused_remat.linear_cross_entropy(h, w, targets, chunk_tokens=5),
                                 (hidden, head)),
    }


OPS = ("layer_norm", "rms_norm", "gelu", "swiglu", "attention", "attention_window_softcap", "attention_varlen",
       "linear_cross_entropy")


def _run(fn, inputs):
    """Outputs and the gradient of every input for a fixed random cotangent."""
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(1)
    total = sum((o.float() * torch.randn(o.shape, generator=generator).to(o.device)).sum() for o in outputs)
    grads = torch.autograd.grad(total, inputs)
    return [o.detach() for o in outputs], grads


def _assert_same(eager, compiled):
    for a, b in zip([*eager[0], *eager[1]], [*compiled[0], *compiled[1]]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_ops_compile_without_graph_breaks_and_match_eager(name, device, triton_backend):
    fn, inputs = _op_cases(device)[name]
    assert torch._dynamo.explain(fn)(*inputs).graph_break_count == 0
    torch._dynamo.reset()
    _assert_same(_run(fn, inputs), _run(torch.compile(fn, fullgraph=True), inputs))


# An offloaded block runs eagerly under compile, by design (tests/test_offload.py). A memory budget
# chooses its point while the forward is traced.
@pytest.mark.parametrize("remat", [*(p for p in Remat if not p.host_resident), "keep:o,lse,h", 0.3])
def test_block_compiles_whole_and_keeps_its_policy(remat, device, triton_backend):
    block = _block(device, **({"memory_budget": remat} if isinstance(remat, float) else {"remat": remat}))
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 9, DIM, device=device, requires_grad=True)
    assert torch._dynamo.explain(block)(x).graph_break_count == 0
    _assert_same(_run(block, [x]), _run(compiled, [x]))
    widths = block_widths(DIM, HEADS, KV_HEADS, FFN, "rmsnorm", "swiglu")
    if isinstance(remat, float):  # the point for this test's lengths (8 and 20: the same one)
        remat = within_budget(remat, widths, 4, 4, visible_pairs(8, 8, True) / 8)
        assert remat == within_budget(block.memory_budget, widths, 4, 4, visible_pairs(20, 20, True) / 20)
        assert remat not in tuple(Remat), "a point the named policies do not cover"
    expected = kept_bytes_per_token(remat, widths, residual_bytes=4, compute_bytes=4)
    for fn in (block, compiled):
        per_length = []
        for seq in (8, 20):
            with saved_memory(exclude=block.parameters()) as meter:
                fn(torch.randn(2, seq, DIM, device=device, requires_grad=True))
            per_length.append(meter.bytes)
        assert (per_length[1] - per_length[0]) / (2 * 12) == expected, (fn, per_length)


def test_language_model_compiles_without_graph_breaks(device, triton_backend):
    config = ModelConfig(vocab_size=64, dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS, ffn_dim=FFN,
                         norm="rmsnorm", activation="swiglu")
    model = LanguageModel(config, ["full", "cheap"], device=device)
    tokens = torch.randint(0, 64, (2, 11), device=device)
    assert torch._dynamo.explain(model)(tokens[:, :-1], tokens[:, 1:]).graph_break_count == 0
    eager_loss = model(tokens[:, :-1], tokens[:, 1:])
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled_loss = torch.compile(model, fullgraph=True)(tokens[:, :-1], tokens[:, 1:])
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for eager, compiled in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("remat", ["cheap", "full"])
def test_reduce_overhead_captures_the_block_without_a_cudagraph_skip(remat):
    """torch.compile(mode="reduce-overhead") replays our operators in its CUDA graphs: no skip
    (a host read, a CPU tensor or an input mutation would make Inductor run the graph eagerly)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block = _block("cuda", remat)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x = torch.randn(2, 64, DIM, device="cuda", requires_grad=True)
        _assert_same(_run(block, [x]), _run(compiled, [x]))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("name", (*OPS, "block"))
def test_second_derivatives_are_refused_clearly(name, device, triton_backend):
    if name == "block":
        fn, inputs = _block(device), (torch.randn(1, 5, DIM, device=device, requires_grad=True),)
    else:
        fn, inputs = _op_cases(device)[name]
    outputs = fn(*inputs)
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    grads = torch.autograd.grad(first.square().sum(), inputs, create_graph=True)
    penalty = sum(g.square().sum() for g in grads)
    with pytest.raises(RuntimeError, match="second derivatives .* are not supported"):
        penalty.backward()


def test_functional_call_reads_the_parameters_it_is_given(device, triton_backend):
    block = _block(device)
    x = torch.randn(2, 6, DIM, device=device)
    params = {name: p.detach().clone().requires_grad_() for name, p in block.named_parameters()}
    functional_call(block, params, (x,)).square().sum().backward()
    block(x).square().sum().backward()
    for name, p in block.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=0, atol=0)


def test_custom_ops_fake_implementations_agree_with_the_kernels(device, triton_backend):
    """torch.library.opcheck: schema, fake tensors (shapes, dtypes, strides) and autograd registration."""
    q, k, v = (torch.randn(2, h, 7, 16, device=device) for h in (HEADS, KV_HEADS, KV_HEADS))
    qkv = torch.randn(14, (HEADS + 2 * KV_HEADS) * 16, device=device)
    rows, weight, u = (torch.randn(*shape, device=device) for shape in ((6, DIM), (DIM,), (6, 2 * FFN)))
    _, mean, rstd, _ = custom_ops.norm_fwd(rows, weight, weight, None, 1e-5, False, None)
    o, lse = custom_ops.attention_fwd(q, k, v, True, 0.25, [3, -1], 0.0)
    # three documents (one empty) of q rows and key rows, packed
    cu_q, cu_k = (torch.tensor(offsets, dtype=torch.int32, device=device) for offsets in ([0, 5, 5, 14], [0, 4, 9, 14]))
    q_docs, k_docs, v_docs = (t.transpose(1, 2).reshape(14, t.shape[1], 16) for t in (q, k, v))
    o_docs, lse_docs = custom_ops.attention_varlen_fwd(q_docs, k_docs, v_docs, cu_q, cu_k, 9, 5, True, 0.25, [-1, -1], 5.0)
    o_packed, lse_packed = custom_ops.attention_packed_fwd(qkv, 2, HEADS, KV_HEADS, True, 0.25, [-1, -1], 0.0, None, 0)
    o_docs_packed, lse_docs_packed = custom_ops.attention_packed_fwd(qkv, 2, HEADS, KV_HEADS, True, 0.25, [4, -1], 3.0,
                                                                     cu_k, 5)
    cases = [
        (custom_ops.norm_fwd, (rows, weight, weight, rows.clone(), 1e-5, False, torch.bfloat16)),
        (custom_ops.norm_bwd, (rows.clone(), rows, weight, weight, mean, rstd, rows.clone(), False, True, True, None)),
        (custom_ops.attention_fwd, (q, k, v, True, 0.25, [3, -1], 0.0)),
        (custom_ops.attention_bwd, (torch.randn_like(o), q, k, v, o, lse, None, True, 0.25, [3, -1], 0.0)),
        (custom_ops.attention_varlen_fwd, (q_docs, k_docs, v_docs, cu_q, cu_k, 9, 5, True, 0.25, [-1, -1], 5.0)),
        (custom_ops.attention_varlen_bwd, (torch.randn_like(o_docs), q_docs, k_docs, v_docs, o_docs, lse_docs, None,
                                           cu_q, cu_k, 9, 5, True, 0.25, [-1, -1], 5.0)),
        (custom_ops.attention_packed_fwd, (qkv, 2, HEADS, KV_HEADS, True, 0.25, [-1, -1], 0.0, None, 0)),
        (custom_ops.attention_packed_fwd, (qkv, 2, HEADS, KV_HEADS, True, 0.25, [4, -1], 3.0, cu_k, 5)),
        (custom_ops.attention_packed_bwd, (torch.randn_like(o_docs_packed), qkv, o_docs_packed, lse_docs_packed, 2, HEADS,
                                           KV_HEADS, True, 0.25, [4, -1], 3.0, cu_k, 5)),
        (custom_ops.attention_packed_bwd, (torch.randn_like(o_packed), qkv, o_packed, lse_packed, 2, HEADS, KV_HEADS,
                                           True, 0.25, [-1, -1], 0.0, None, 0)),
        (custom_ops.rope_qk_, (qkv.clone(), torch.rand(8, device=device), 2, HEADS, KV_HEADS, False)),
        (custom_ops.rope_qk_, (qkv.clone(), torch.rand(8, device=device), 2, HEADS, KV_HEADS, False, None,
                               torch.randint(0, 50, (2, 7), device=device))),
        (custom_ops.rope_qk_, (qkv.clone(), torch.rand(8, device=device), 2, HEADS, KV_HEADS, True, None, None, cu_q)),
        (custom_ops.gelu_bwd, (u.clone(), u, "none", True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
