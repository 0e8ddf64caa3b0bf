"""apply_fused_remat on tiny random Hugging Face causal LMs (built from configs: no downloads): the
patched model computes what the unpatched one does, refuses what the block cannot honour, and
reverts to Hugging Face layers with its weights."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fused_remat.integrations.huggingface import (  # noqa: E402
    FusedDecoderLayer,
    UnsupportedByFusedBlock,
    apply_fused_remat,
    revert_fused_remat,
)
from fused_remat.memory import saved_memory  # noqa: E402
from numerics import assert_error_rule  # noqa: E402

VOCAB, SEQ = 64, 12
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda **kw: transformers.LlamaConfig(**{**LLAMA_LIKE, **kw}),
    "mistral": lambda **kw: transformers.MistralConfig(**{**LLAMA_LIKE, "head_dim": 16, "sliding_window": 32, **kw}),
    "qwen2": lambda **kw: transformers.Qwen2Config(**{**LLAMA_LIKE, **kw}),
    "qwen3": lambda **kw: transformers.Qwen3Config(**{**LLAMA_LIKE, "head_dim": 32, **kw}),  # not 64 / 4, as Qwen3-0.6B
    "phi3": lambda **kw: transformers.Phi3Config(**{**LLAMA_LIKE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                                    "sliding_window": 6, **kw}),
    "gpt2": lambda **kw: transformers.GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=128,
                                                          resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0), **kw}),
}


def _model(arch: str, **config) -> torch.nn.Module:
    """A random model whose norm weights, norm biases and linear biases are away from their 1/0
    initialization, so that their gradients and the packing of biases are tested too."""
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn_like(param))
    return model


def _tokens(batch=2, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq))


def _huggingface_grads(model) -> dict:
    """Every parameter's gradient under its Hugging Face name; fused layers' gradients unpacked."""
    fused = {name: m for name, m in model.named_modules() if isinstance(m, FusedDecoderLayer)}
    grads = {n: p.grad for n, p in model.named_parameters() if n.rsplit(".", 2)[0] not in fused}
    for prefix, layer in fused.items():
        unpacked = layer.huggingface_tensors({n: p.grad for n, p in layer.named_parameters()})
        grads.update({f"{prefix}.{name}": grad for name, grad in unpacked.items()})
    return grads


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), _huggingface_grads(model)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_logits_and_every_gradient_match_the_unpatched_model(arch, triton_backend):
    model = _model(arch)
    model64 = copy.deepcopy(model).double()
    ids = _tokens()
    logits, grads = _loss_and_grads(model, ids)
    logits64, grads64 = _loss_and_grads(model64, ids)

    apply_fused_remat(model)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.base_model.get_submodule("layers" if arch != "gpt2" else "h"))
    fused_logits, fused_grads = _loss_and_grads(model, ids)
    assert_error_rule("logits", fused_logits, logits, logits64, torch.float32)
    assert fused_grads.keys() == grads64.keys()
    for name, grad in fused_grads.items():
        assert_error_rule(f"d {name}", grad, grads[name], grads64[name], torch.float32)
    for layer in model.base_model.modules():
        if isinstance(layer, FusedDecoderLayer):  # the stand-ins for biases the layer lacks stay out of training
            assert all(layer.get_parameter(n).grad is None for n in layer._zero_biases)


def test_training_steps_follow_the_unpatched_model(triton_backend):
    """AdamW steps on Qwen2 (its zero stand-in biases stay out) with transformers' own loss; the
    last step runs with Hugging Face's gradient checkpointing on, which makes the layers remat='full'."""
    reference = _model("qwen2")
    patched = apply_fused_remat(copy.deepcopy(reference))
    ids = _tokens(batch=1)
    losses = {}
    for name, model in (("reference", reference), ("patched", patched)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        losses[name] = []
        for step in range(3):
            if step == 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    model.gradient_checkpointing_enable()
            loss = model(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert {layer.remat for layer in patched.model.layers} == {"full"}
    assert losses["patched"][-1] < losses["patched"][0]
    assert losses["patched"] == pytest.approx(losses["reference"], rel=1e-4)


def test_gradient_checkpointing_switch_maps_onto_remat():
    model = apply_fused_remat(_model("llama"), remat="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
        assert [layer.remat for layer in model.model.layers] == ["full", "full"]
        assert model.is_gradient_checkpointing
        model.gradient_checkpointing_disable()
    assert [layer.remat for layer in model.model.layers] == ["none", "none"]


def test_a_memory_budget_reaches_every_layer_and_changes_no_gradient(triton_backend):
    """``memory_budget`` as torch.compile spells it: each fused layer keeps at most that fraction of
    what remat='none' keeps, and the gradients are bitwise those of remat='cheap'; gradient
    checkpointing sets it aside and gives it back."""
    reference = _model("llama")
    ids = _tokens()
    budgeted = apply_fused_remat(copy.deepcopy(reference), memory_budget=0.2)
    cheap = apply_fused_remat(copy.deepcopy(reference))
    assert [layer.memory_budget for layer in budgeted.model.layers] == [0.2, 0.2]
    with saved_memory() as kept_budgeted:
        budgeted_logits, budgeted_grads = _loss_and_grads(budgeted, ids)
    with saved_memory() as kept_cheap:
        cheap_logits, cheap_grads = _loss_and_grads(cheap, ids)
    assert kept_budgeted.bytes < kept_cheap.bytes
    assert torch.equal(budgeted_logits, cheap_logits)
    assert all(torch.equal(budgeted_grads[name], cheap_grads[name]) for name in cheap_grads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        budgeted.gradient_checkpointing_enable()
        assert [(layer.remat, layer.memory_budget) for layer in budgeted.model.layers] == [("full", None)] * 2
        budgeted.gradient_checkpointing_disable()
    assert [layer.memory_budget for layer in budgeted.model.layers] == [0.2, 0.2]
    with pytest.raises(ValueError, match=r"apply_fused_remat: memory_budget must be in \[0, 1\]"):
        apply_fused_remat(_model("llama"), memory_budget=2.0)


def test_an_all_ones_mask_and_explicit_positions_are_fine(triton_backend):
    reference = _model("llama")
    patched = apply_fused_remat(copy.deepcopy(reference))
    ids = _tokens()
    kwargs = dict(attention_mask=torch.ones_like(ids), position_ids=torch.arange(SEQ).expand(2, SEQ))
    with torch.no_grad():
        expected = reference(ids, **kwargs).logits
        assert torch.allclose(patched(ids, **kwargs).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("call, named", [
    (dict(attention_mask=torch.ones(2, 1, SEQ, SEQ)), "4-D attention_mask"),
    (dict(attention_mask=torch.zeros(2, SEQ)), "masks every token"),
    (dict(cu_seq_lens_q=torch.tensor([0, 5, SEQ])), "batches are one row"),
    (dict(seq_idx=torch.tensor([[0] * 6 + [1] * 6] * 2)), "seq_idx whose examples differ from where position_ids"),
    (dict(output_attentions=True), "output_attentions"),
    (dict(output_hidden_states=True), "output_hidden_states"),
])
def test_inputs_the_block_cannot_honour_are_refused(call, named):
    model = apply_fused_remat(_model("llama"))
    with pytest.raises(UnsupportedByFusedBlock, match=named):
        model(_tokens(), **call)


def test_configurations_the_block_cannot_honour_are_refused():
    for arch, config, named in [
        ("llama", dict(hidden_act="gelu"), "hidden_act"),
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        ("gpt2", dict(activation_function="relu"), "activation_function"),
    ]:
        model = _model(arch, **config)
        layers = list(model.base_model.children())
        with pytest.raises(UnsupportedByFusedBlock, match=named):
            apply_fused_remat(model)
        assert list(model.base_model.children()) == layers  # refused before anything changed
    partial = _model("llama")
    partial.model.rotary_emb.inv_freq = partial.model.rotary_emb.inv_freq[:4]  # as a partial_rotary_factor of 0.5 makes it
    with pytest.raises(UnsupportedByFusedBlock, match="RoPE over 8 of the head's 16 dims"):
        apply_fused_remat(partial)
    with pytest.raises(UnsupportedByFusedBlock, match="model_type 'bert'") as refused:
        apply_fused_remat(transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)))
    assert "revert_fused_remat" not in str(refused.value), "a model never patched has nothing to revert"


def test_a_layer_refused_on_its_weights_leaves_the_model_as_it_was():
    model = _model("llama", num_hidden_layers=3)
    model.model.layers[2].self_attn.k_proj.weight.requires_grad_(False)  # packed with trainable q and v
    before = {name: (param, param.requires_grad) for name, param in model.named_parameters()}
    classes = [type(layer) for layer in model.model.layers]
    with pytest.raises(UnsupportedByFusedBlock, match="frozen while others are not"):
        apply_fused_remat(model)
    assert [type(layer) for layer in model.model.layers] == classes
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, requires_grad) in before.items():
        assert torch.equal(after[name], param) and after[name].requires_grad == requires_grad, name
    assert getattr(model, "_fused_remat_patch", None) is None
    apply_fused_remat(model.requires_grad_(True))  # and it can be patched once the weights are consistent


def test_calls_the_layers_cannot_honour_are_refused():
    dropout = apply_fused_remat(_model("gpt2", attn_pdrop=0.1)).train()
    with pytest.raises(UnsupportedByFusedBlock, match="dropout 0.1 in training mode"):
        dropout(_tokens())
    qwen = apply_fused_remat(_model("qwen2"))
    qwen.requires_grad_(True)  # would train the zero stand-ins for o_proj's and the MLP's missing biases
    with pytest.raises(UnsupportedByFusedBlock, match="requires_grad on"):
        qwen(_tokens())
    layer = qwen.model.layers[0]
    x = torch.randn(1, SEQ, 64)
    with pytest.raises(UnsupportedByFusedBlock, match="attention_mask=<tensor .1, 1, 12, 12.> given to a fused decoder layer on its own"):
        layer(x, attention_mask=torch.zeros(1, 1, SEQ, SEQ))  # outside the model nothing says what the mask means
    with pytest.raises(UnsupportedByFusedBlock, match="RoPE's frequencies come from the patched model"):
        layer(x)
    gpt2 = _model("gpt2")
    alone = gpt2.transformer.h[0]
    expected = alone(x)
    apply_fused_remat(gpt2)
    got = gpt2.transformer.h[0](x)  # without RoPE a layer alone is the Hugging Face layer alone
    assert type(got) is type(expected) and torch.allclose(torch.as_tensor(got[0] if isinstance(got, tuple) else got),
                                                          torch.as_tensor(expected[0] if isinstance(expected, tuple) else expected), atol=1e-5)


@pytest.mark.parametrize("arch, options", [("llama", {}), ("mistral", dict(sliding_window=4)), ("gpt2", {}),
                                           ("qwen2", {}), ("phi3", {}), ("qwen3", {})],
                         ids=["llama", "mistral-window4", "gpt2", "qwen2", "phi3-window6", "qwen3"])
def test_generate_with_its_default_cache_follows_the_unpatched_model(arch, options, triton_backend):
    """Greedy generate() with its DynamicCache (a sliding-window one for Mistral, whose window is
    shorter than prompt plus answer): prefill and every decode step through the fused kernels give
    the unpatched model's logits and tokens, one prompt and a batch of left-padded prompts."""
    reference = _model(arch, **options)
    patched = apply_fused_remat(copy.deepcopy(reference))
    ids = torch.randint(1, VOCAB, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :5] = 0, 0
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    for prompt in (dict(inputs=ids[:1]), dict(inputs=ids.masked_fill(mask == 0, 0), attention_mask=mask)):
        expected, got = reference.generate(**prompt, **settings), patched.generate(**prompt, **settings)
        assert torch.equal(got.sequences, expected.sequences)
        for step, (ours, theirs) in enumerate(zip(got.logits, expected.logits)):
            assert torch.allclose(ours, theirs, atol=2e-5, rtol=0), f"step {step}: {(ours - theirs).abs().max():.2e}"
    with torch.no_grad():  # and the cache it returns continues exactly where the model left off
        out = patched(ids[:1], use_cache=True)
        cache = getattr(out, "past_key_values", None) or out.cache
        assert cache.get_seq_length() == 7
        step = patched(ids[:1, :1], past_key_values=cache, use_cache=True).logits[0, -1]
        assert torch.allclose(step, reference(torch.cat([ids[:1], ids[:1, :1]], 1)).logits[0, -1], atol=2e-5, rtol=0)


def test_caches_the_layers_cannot_append_to_are_refused():
    model = apply_fused_remat(_model("llama"))
    with pytest.raises(UnsupportedByFusedBlock, match="a StaticCache: the fused layers append to a DynamicCache"):
        model.generate(_tokens(1, 5), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static")


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_revert_restores_huggingface_layers_with_the_weights(arch):
    model = _model(arch)
    original = {name: p.detach().clone() for name, p in model.state_dict().items()}
    layer_class = type(model.base_model.get_submodule("h.0" if arch == "gpt2" else "layers.0"))
    apply_fused_remat(model)
    assert revert_fused_remat(model) is model
    assert type(model.base_model.get_submodule("h.0" if arch == "gpt2" else "layers.0")) is layer_class
    state = model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[name], value) for name, value in original.items())
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(storages) == len(set(storages))  # split pieces are copies: save_pretrained sees no shared tensors

    apply_fused_remat(model)  # trained weights come back unpacked
    with torch.no_grad():
        for layer in model.base_model.modules():
            if isinstance(layer, FusedDecoderLayer):
                for name, param in layer.named_parameters():
                    if name not in layer._zero_biases:
                        param.add_(torch.randn_like(param))
    expected = {f"{prefix}.{n}": t.clone() for prefix, layer in model.named_modules() if isinstance(layer, FusedDecoderLayer)
                for n, t in layer.huggingface_tensors(dict(layer.named_parameters())).items()}
    revert_fused_remat(model)
    state = model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in expected.items())
    with pytest.raises(ValueError, match="not patched"):
        revert_fused_remat(model)


def test_a_patched_model_compiles_whole(triton_backend):
    """torch.compile(fullgraph=True) traces the patched model with no graph break (the block's two
    operators are single nodes) and computes what it computes eagerly, gradients included."""
    model = apply_fused_remat(_model("llama"))
    ids = _tokens()
    expected_logits, expected_grads = _loss_and_grads(model, ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    out = compiled(ids, labels=ids)
    out.loss.backward()
    assert torch.allclose(out.logits, expected_logits, atol=1e-6, rtol=0)
    grads = _huggingface_grads(model)
    assert all(torch.allclose(grads[name], grad, atol=1e-6, rtol=0) for name, grad in expected_grads.items())


def test_a_base_model_and_a_sequence_classifier_patch_too(triton_backend):
    """LlamaModel (the base model itself) and LlamaForSequenceClassification (which pools the last
    real token) on a padded batch: what the unpatched model computes at the real tokens."""
    ids = _tokens(3, 9)
    mask = torch.ones_like(ids)
    mask[1, 6:], mask[2, 3:] = 0, 0  # right padding: the classifier reads each row's last real token
    ids = ids.masked_fill(mask == 0, 0)
    base = transformers.LlamaModel(CONFIGS["llama"]())
    patched = apply_fused_remat(copy.deepcopy(base))
    classifier = transformers.LlamaForSequenceClassification(CONFIGS["llama"](num_labels=3, pad_token_id=0))
    patched_classifier = apply_fused_remat(copy.deepcopy(classifier))
    with torch.no_grad():
        real = mask.bool()
        expected, got = (m(ids, attention_mask=mask).last_hidden_state for m in (base, patched))
        assert torch.allclose(got[real], expected[real], atol=2e-5, rtol=0)
        expected, got = (m(ids, attention_mask=mask).logits for m in (classifier, patched_classifier))
        assert torch.allclose(got, expected, atol=2e-5, rtol=0)
