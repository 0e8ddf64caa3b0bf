"""A patched Hugging Face model on the batches fine-tuning brings: padded (left or right), packed
(restarting position_ids or FlashAttention's cu_seq_lens), scaled RoPE of every type, sliding
windows. Loss and every gradient equal each example run alone in the unpatched model (the error
rule against float64), never what the unpatched SDPA model does across packed examples."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fused_remat.integrations.huggingface import UnsupportedByFusedBlock, apply_fused_remat  # noqa: E402
from numerics import assert_error_rule  # noqa: E402
from test_huggingface import VOCAB, _huggingface_grads, _model  # noqa: E402

LENGTHS = (12, 7, 3)
# Mistral's window is shorter than the longest example, so windows and documents meet.
ARCH_OPTIONS = {"llama": {}, "qwen2": {}, "mistral": dict(sliding_window=5), "gpt2": {}, "phi3": {}, "qwen3": {}}


def _examples(lengths=LENGTHS):
    return [torch.randint(0, VOCAB, (n,)) for n in lengths]


def _labels(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """ids as labels, -100 at padding and at each example's first token: no loss term then reads
    the prediction made at a padding position (which no example run alone has)."""
    labels = ids.masked_fill(~real, -100)
    first = real & ~torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], dim=1)
    return labels.masked_fill(first, -100)


def _padded(examples, side: str):
    seq = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), seq, dtype=torch.long)
    mask = torch.zeros(len(examples), seq, dtype=torch.long)
    for row, example in enumerate(examples):
        span = slice(seq - len(example), seq) if side == "left" else slice(0, len(example))
        ids[row, span], mask[row, span] = example, 1
    return ids, mask


def _run(model, **batch):
    """(loss, logits, gradients by Hugging Face name)."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), _huggingface_grads(model)


def _alone(model, examples, extra=None):
    """Each example run alone: the loss over all their label tokens (as one padded or packed batch
    averages it), its gradients, and each example's logits."""
    model.zero_grad(set_to_none=True)
    terms = sum(len(e) - 1 for e in examples)
    total, logits = 0.0, []
    for example in examples:
        out = model(example[None], labels=example[None], **(extra(example) if extra else {}))
        if len(example) > 1:  # a one-token example has nothing to predict
            (out.loss * (len(example) - 1) / terms).backward()
            total = total + out.loss.detach() * (len(example) - 1) / terms
        logits.append(out.logits.detach()[0])
    return total, logits, _huggingface_grads(model)


def _assert_matches_alone(arch, patched_run, reference, examples, extra=None):
    """patched_run: (loss, per-example logits, grads) of the patched model; the unpatched
    ``reference`` runs each example alone in fp32 and float64."""
    loss, logits, grads = patched_run
    loss32, logits32, grads32 = _alone(reference, examples, extra)
    loss64, logits64, grads64 = _alone(copy.deepcopy(reference).double(), examples, extra)
    assert_error_rule(f"{arch} loss", loss, loss32, loss64, torch.float32)
    for i, (ours, same, exact) in enumerate(zip(logits, logits32, logits64)):
        assert_error_rule(f"{arch} logits of example {i}", ours, same, exact, torch.float32)
    assert grads.keys() == grads64.keys()
    for name, grad in grads.items():
        assert_error_rule(f"{arch} d {name}", grad, grads32[name], grads64[name], torch.float32)


def _gpt2_positions(example):
    return dict(position_ids=torch.arange(len(example))[None])


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_padded_batches_equal_each_example_alone(arch, side, triton_backend):
    reference = _model(arch, **ARCH_OPTIONS[arch])
    patched = apply_fused_remat(copy.deepcopy(reference))
    examples = _examples()
    ids, mask = _padded(examples, side)
    batch = dict(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask.bool()))
    if arch == "gpt2":  # learned absolute positions: each example's own from 0, as alone
        batch["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    loss, logits, grads = _run(patched, **batch)
    real_logits = [logits[row][mask[row].bool()] for row in range(len(examples))]
    assert not logits[~mask.bool()].any(), "a padding position predicts nothing: its hidden state is zero"
    _assert_matches_alone(arch, (loss, real_logits, grads), reference, examples,
                          _gpt2_positions if arch == "gpt2" else None)


def _flattened(examples, flash: bool):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash, return_position_ids=not flash)
    return collator([{"input_ids": e.tolist()} for e in examples])


@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_examples_attend_only_within_themselves(arch, form, triton_backend):
    reference = _model(arch)
    patched = apply_fused_remat(copy.deepcopy(reference))
    examples = _examples((5, 9, 1, 6))
    batch = _flattened(examples, flash=form == "cu_seq_lens")
    if arch == "gpt2" and form == "cu_seq_lens":  # GPT-2's learned positions need the examples' own
        batch["position_ids"] = torch.cat([torch.arange(len(e)) for e in examples])[None]
    loss, logits, grads = _run(patched, **batch)
    starts = [0, *torch.tensor([len(e) for e in examples]).cumsum(0).tolist()]
    per_example = [logits[0, a:b] for a, b in zip(starts, starts[1:])]
    _assert_matches_alone(arch, (loss, per_example, grads), reference, examples,
                          _gpt2_positions if arch == "gpt2" else None)
    if form == "position_ids" and arch == "llama":
        with torch.no_grad():  # what the patch is for: unpatched SDPA attends across the packed examples
            across = reference(**batch).loss
        assert (across - loss).abs() > 1e-3


def _rope_model(**rope):
    """A tiny Llama with ``rope`` as its RoPE parameters, in the installed transformers' spelling."""
    if hasattr(transformers.LlamaConfig(), "rope_parameters"):
        return _model("llama", rope_parameters={"rope_theta": 10000.0, **rope}, max_position_embeddings=8)
    return _model("llama", rope_scaling=rope, rope_theta=10000.0, max_position_embeddings=8)


HALF_HEAD = 8  # head_dim 16 in the tiny models
ROPE_TYPES = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),  # 12 positions > max_position_embeddings=8: rescaled
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=4),
    "yarn": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4),  # cos/sin scaled by s != 1
    "longrope": dict(rope_type="longrope", short_factor=[1.0 + i / 10 for i in range(HALF_HEAD)],
                     long_factor=[2.0 + i / 10 for i in range(HALF_HEAD)], original_max_position_embeddings=4,
                     factor=2.0),  # 4.x needs it (5.x derives 8 / 4 = 2 itself)
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_scaled_rope_is_the_models_own(rope_type, triton_backend):
    reference = _rope_model(**ROPE_TYPES[rope_type])
    patched = apply_fused_remat(copy.deepcopy(reference))
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # RoPE positions with padding too
    batch = dict(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask.bool()))
    rotary = patched.model.rotary_emb
    initial = rotary.inv_freq.clone()
    loss, logits, grads = _run(patched, **batch)
    if rope_type in ("dynamic", "longrope"):  # the frequencies this call used are not the initial ones
        assert not torch.equal(rotary.inv_freq, initial)
    if rope_type in ("yarn", "longrope"):
        assert rotary.attention_scaling != 1.0
    loss32, logits32, grads32 = _run(reference, **batch)
    loss64, logits64, grads64 = _run(copy.deepcopy(reference).double(), **batch)
    assert_error_rule(f"{rope_type} loss", loss, loss32, loss64, torch.float32)
    real = mask.bool()
    assert_error_rule(f"{rope_type} logits", logits[real], logits32[real], logits64[real], torch.float32)
    for name, grad in grads.items():
        assert_error_rule(f"{rope_type} d {name}", grad, grads32[name], grads64[name], torch.float32)


def test_sliding_windows_follow_the_config(triton_backend):
    """Mistral's window on every layer and Qwen2's on the layers past max_window_layers, shorter
    than the sequence: the same function as the unpatched model's."""
    for arch, options, windows in [
        ("mistral", dict(sliding_window=4), [(3, 0), (3, 0)]),
        ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1), [(-1, -1), (2, 0)]),
    ]:
        reference = _model(arch, **options)
        patched = apply_fused_remat(copy.deepcopy(reference))
        assert [layer.window for layer in patched.model.layers] == windows
        ids = torch.randint(0, VOCAB, (2, 12))
        loss, logits, grads = _run(patched, input_ids=ids, labels=ids)
        loss32, logits32, grads32 = _run(reference, input_ids=ids, labels=ids)
        loss64, logits64, grads64 = _run(copy.deepcopy(reference).double(), input_ids=ids, labels=ids)
        assert_error_rule(f"{arch} logits", logits, logits32, logits64, torch.float32)
        for name, grad in grads.items():
            assert_error_rule(f"{arch} d {name}", grad, grads32[name], grads64[name], torch.float32)


def test_labels_read_from_a_padding_position_are_refused():
    """Left padding with labels = input_ids masked only at the padding: the first real token's label
    would be predicted at a padding position, where the patched and unpatched models differ."""
    patched = apply_fused_remat(_model("llama"))
    ids, mask = _padded(_examples(), "left")
    with pytest.raises(UnsupportedByFusedBlock, match=r"labels read the prediction at padding position 4 of row 1"):
        patched(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    patched(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask.bool()))  # the first real labels -100: fine
