"""Whole-model operations on a model patched by apply_fused_remat (tiny random Hugging Face causal
LMs built from configs: no downloads): copy.deepcopy, torch.save and pickle, state_dict /
load_state_dict / save_pretrained, model.to(dtype), PEFT LoRA before and after patching (what the
block cannot apply, and hooks, refused), num_items_in_batch, and transformers.Trainer out of the box."""

import copy
import io
import pickle
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
from numerics import assert_error_rule  # noqa: E402
from test_huggingface import SEQ, VOCAB, _model, _tokens  # noqa: E402

LAYERS = {"llama": "layers", "mistral": "layers", "qwen2": "layers", "qwen3": "layers", "phi3": "layers", "gpt2": "h"}


def _layers(model) -> torch.nn.ModuleList:
    return model.base_model.get_submodule(LAYERS[model.config.model_type])


def _fused(model) -> list:
    return [m for m in model.modules() if isinstance(m, FusedDecoderLayer)]


def _logits(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def _trainable(model) -> dict:
    """Parameters that train: everything but the fused layers' zero stand-in biases."""
    frozen = {f"{prefix}.{name}" for prefix, layer in model.named_modules() if isinstance(layer, FusedDecoderLayer)
              for name in layer._zero_biases}
    return {name: p for name, p in model.named_parameters() if name not in frozen}


def _sharing(state: dict) -> set:
    """The groups of state_dict keys whose tensors share storage (tied weights)."""
    groups = {}
    for name, tensor in state.items():
        if tensor.numel():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    return {tuple(sorted(names)) for names in groups.values() if len(names) > 1}


# --- copies -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_deepcopy_of_a_patched_model_is_independent(arch, triton_backend):
    original = apply_fused_remat(_model(arch))
    clone = copy.deepcopy(original)
    ids = _tokens()

    assert clone.base_model.forward.base is clone.base_model  # the copy's forward runs the copy's base model
    assert original.base_model.forward.base is original.base_model
    assert clone._fused_remat_patch.base is clone.base_model and clone._fused_remat_patch.layers is _layers(clone)
    assert not {id(p) for p in clone.parameters()} & {id(p) for p in original.parameters()}
    before = _logits(original, ids)
    assert torch.equal(_logits(clone, ids), before)

    with torch.no_grad():  # the copy's layer weights: the copy's logits change, the original's do not
        _layers(clone)[1].qkv.weight.add_(0.05 * torch.randn_like(_layers(clone)[1].qkv.weight))
    changed = _logits(clone, ids)
    assert (changed - before).abs().max() > 1e-3
    assert torch.equal(_logits(original, ids), before)

    clone.train()
    clone(ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in original.parameters())
    missing = [name for name, p in _trainable(clone).items() if p.grad is None]
    assert not missing, f"no gradient on the copy's {missing}"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for layer in _fused(clone) for p in layer.qkv.parameters())

    revert_fused_remat(clone)  # reverting the copy leaves the original patched
    assert all(isinstance(layer, FusedDecoderLayer) for layer in _layers(original))
    assert original._fused_remat_patch.layers is _layers(original) and original.base_model.forward.base is original.base_model
    assert torch.allclose(_logits(clone, ids), changed, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_torch_save_and_pickle_of_a_patched_model(arch, triton_backend):
    model = apply_fused_remat(_model(arch))
    ids = _tokens()
    expected = _logits(model, ids)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = {"torch.load": torch.load(buffer, weights_only=False), "pickle": pickle.loads(pickle.dumps(model))}
    for how, copy_ in loaded.items():
        assert all(isinstance(layer, FusedDecoderLayer) for layer in _layers(copy_)), how
        assert copy_.base_model.forward.base is copy_.base_model, how
        assert torch.equal(_logits(copy_, ids), expected), how
    reverted = revert_fused_remat(loaded["pickle"])  # the patch record survives: revert works on the loaded model
    assert not isinstance(_layers(reverted)[0], FusedDecoderLayer)
    assert torch.allclose(_logits(reverted, ids), expected, atol=1e-5, rtol=0)


# --- state dicts --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_state_dict_load_state_dict_and_save_pretrained(arch, tmp_path, triton_backend):
    """Qwen2's zero stand-in biases (o_proj, the MLP) stay out of the state dict; GPT-2's Conv1D
    weights come back (in, out); only the unpatched model's tied weights share storage."""
    reference = _model(arch)
    patched = apply_fused_remat(copy.deepcopy(reference))
    unpatched_state, state = reference.state_dict(), patched.state_dict()
    assert set(state) == set(unpatched_state)
    for name, tensor in unpatched_state.items():
        assert state[name].shape == tensor.shape and torch.equal(state[name], tensor), name
    assert _sharing(state) == _sharing(unpatched_state)  # GPT-2: wte and lm_head, tied; nothing else
    assert not any("layers." in name or ".h." in name for group in _sharing(state) for name in group)

    other = _model(arch)  # another unpatched model's weights, loaded strictly into the patched one
    result = patched.load_state_dict(other.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for layer in _fused(patched):  # the stand-ins stay zero and frozen
        assert all(not layer.get_parameter(n).requires_grad and not layer.get_parameter(n).count_nonzero()
                   for n in layer._zero_biases)
    ids = _tokens()
    logits = _logits(patched, ids)
    assert_error_rule("logits after load_state_dict", logits, _logits(other, ids), _logits(copy.deepcopy(other).double(), ids),
                      torch.float32)

    patched.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not isinstance(_layers(reloaded)[0], FusedDecoderLayer)
    reloaded_state = reloaded.state_dict()
    assert set(reloaded_state) == set(unpatched_state)
    assert all(torch.equal(reloaded_state[name], tensor) for name, tensor in other.state_dict().items())
    assert_error_rule("logits after save_pretrained", logits, _logits(reloaded, ids),
                      _logits(copy.deepcopy(reloaded).double(), ids), torch.float32)


# --- dtypes -------------------------------------------------------------------------------------

def test_to_dtype_moves_the_fused_layers(triton_backend, monkeypatch):
    """On Qwen2 (whose fused layers also hold zero stand-in biases and whose rotary embedding has a
    buffer): ``.to(float64)`` moves every parameter, fused layers' included; the block itself computes in
    fp16, bf16 or fp32 only, so a float64 forward is refused (on the Triton path and on the
    reference twin alike) rather than run; back in fp32 the logits are the original ones exactly,
    and in bf16 the patched model is as accurate as the unpatched one in bf16."""
    reference = _model("qwen2")
    patched = apply_fused_remat(copy.deepcopy(reference))
    ids = _tokens()
    before = _logits(patched, ids)

    assert patched.to(torch.float64) is patched
    assert {p.dtype for layer in _fused(patched) for p in layer.parameters()} == {torch.float64}
    assert {p.dtype for p in patched.parameters()} == {torch.float64}
    with pytest.raises(TypeError, match="fp16, bf16 or fp32, got torch.float64"):
        patched(ids)
    with monkeypatch.context() as env:
        env.setenv("FUSED_REMAT_BACKEND", "reference")
        with pytest.raises(TypeError, match="fp16, bf16 or fp32, got torch.float64"):
            patched(ids)

    patched.to(torch.float32)  # fp32 -> fp64 -> fp32 is exact
    assert {p.dtype for p in patched.parameters()} == {torch.float32}
    assert torch.equal(_logits(patched, ids), before)

    patched.to(torch.bfloat16)
    assert {p.dtype for layer in _fused(patched) for p in layer.parameters()} == {torch.bfloat16}
    assert all(not layer.get_parameter(n).requires_grad for layer in _fused(patched) for n in layer._zero_biases)
    logits = _logits(patched, ids)
    assert logits.dtype == torch.bfloat16
    assert_error_rule("bf16 logits", logits, _logits(copy.deepcopy(reference).bfloat16(), ids),
                      _logits(copy.deepcopy(reference).double(), ids), torch.bfloat16, metric="rms")


# --- adapters and hooks -------------------------------------------------------------------------

def _lora_grads(model) -> dict:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


LORA_TARGETS = {"llama": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], "gpt2": ["c_attn", "c_proj", "c_fc"],
                "phi3": ["qkv_proj", "gate_up_proj"]}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("arch", sorted(LORA_TARGETS))
def test_peft_lora_follows_the_unpatched_lora_model(arch, when, tmp_path, triton_backend):
    """PEFT LoRA on the projections packed into the fused layers (q and v inside qkv, gate inside
    fc1, GPT-2's Conv1D), applied before or after patching: logits and every adapter gradient equal
    the unpatched LoRA model's (float64 error rule), the base stays frozen, the state dict and the
    saved adapter are PEFT's own, merge_and_unload merges into the packed weights."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[arch], init_lora_weights=False)
    base = _model(arch)
    reference = peft.get_peft_model(copy.deepcopy(base), config)
    if when == "before":
        patched = peft.get_peft_model(copy.deepcopy(base), config)
        patched.load_state_dict(reference.state_dict())
        assert apply_fused_remat(patched) is patched  # a PeftModel: its model is patched, LoRA layers and all
    else:
        patched = peft.get_peft_model(apply_fused_remat(copy.deepcopy(base)), config)
        patched.load_state_dict(reference.state_dict())  # strict: the same names
    assert _fused(patched) and patched.state_dict().keys() == reference.state_dict().keys()
    ids = _tokens()
    results = {}
    for name, model in (("patched", patched), ("reference", reference), ("reference64", copy.deepcopy(reference).double())):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        results[name] = out.logits.detach(), _lora_grads(model)
    (logits, grads), (logits32, grads32), (logits64, grads64) = results["patched"], results["reference"], results["reference64"]
    assert_error_rule("logits", logits, logits32, logits64, torch.float32)
    assert grads.keys() == grads64.keys() and all("lora_" in name for name in grads)
    for name, grad in grads.items():
        assert_error_rule(f"d {name}", grad, grads32[name], grads64[name], torch.float32)

    patched.save_pretrained(tmp_path)  # the adapter loads into the unpatched model
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    assert torch.allclose(_logits(reloaded, ids), logits32, atol=1e-5, rtol=0)
    merged = patched.merge_and_unload()
    assert _fused(merged) and not any("lora_" in name for name, _ in merged.named_parameters())
    assert_error_rule("merged logits", _logits(merged, ids), logits32, logits64, torch.float32)


def test_lora_dropout_runs_inside_the_block(monkeypatch):
    """PEFT's lora_dropout in training mode: inverted dropout on each adapter's input, one mask per
    adapter and call, the same in forward and backward; the fused kernels and the reference twin
    draw the same masks from the same seed, and eval mode has none."""
    peft = pytest.importorskip("peft")
    ids = _tokens()
    model = apply_fused_remat(peft.get_peft_model(_model("llama"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "up_proj"], lora_dropout=0.3, init_lora_weights=False)))
    runs = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("FUSED_REMAT_BACKEND", backend)
        model.train().zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = model(ids, labels=ids).loss
        loss.backward()
        runs[backend] = loss.detach(), _lora_grads(model)
    (loss, grads), (loss_ref, grads_ref) = runs["triton"], runs["reference"]
    assert torch.allclose(loss, loss_ref, atol=1e-5, rtol=0)
    assert all(torch.allclose(grads[n], grads_ref[n], atol=1e-5, rtol=1e-4) for n in grads)
    with torch.no_grad():
        assert (model.eval()(ids, labels=ids).loss - loss).abs() > 1e-4  # training mode did drop


def test_lora_the_block_cannot_apply_is_refused(triton_backend):
    peft = pytest.importorskip("peft")
    ids = _tokens()
    dora = peft.get_peft_model(apply_fused_remat(_model("llama")), peft.LoraConfig(r=4, target_modules=["v_proj"],
                                                                                   use_dora=True))
    with pytest.raises(UnsupportedByFusedBlock, match=r"LoRA adapter 'default' on self_attn.v_proj with a variant \(DoRA"):
        dora(ids)
    with pytest.raises(ValueError, match=r"Target module _Packed\(\) is not supported"):  # the packed projection is no linear layer
        peft.get_peft_model(apply_fused_remat(_model("llama")), peft.LoraConfig(r=4, target_modules=["qkv"]))
    model = apply_fused_remat(_model("llama"))
    model.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 64)  # anything else in a slot
    with pytest.raises(UnsupportedByFusedBlock, match=r"self_attn.q_proj is a torch.nn.modules.linear.Linear"):
        model(ids)


def test_hooks_on_packed_modules_are_refused(triton_backend):
    ids = _tokens()
    model = apply_fused_remat(_model("llama"))
    expected = _logits(model, ids)
    for name, register in [("qkv", lambda m: m.register_forward_hook(lambda mod, args, out: out * 2)),
                           ("norm2", lambda m: m.register_forward_pre_hook(lambda mod, args: None))]:
        handle = register(getattr(model.model.layers[1], name))
        with pytest.raises(UnsupportedByFusedBlock, match=rf"{name} of a fused decoder layer is now a .* with hooks"):
            model(ids)
        handle.remove()
        assert torch.equal(_logits(model, ids), expected)

    model = _model("llama")  # a hook on layer 1: layer 0 is swapped, then put back when layer 1 is refused
    state = {name: t.clone() for name, t in model.state_dict().items()}
    expected = _logits(model, ids)
    model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(UnsupportedByFusedBlock, match=r"LlamaDecoderLayer: hooks on self_attn\.q_proj.*merge"):
        apply_fused_remat(model)
    assert all(type(layer) is transformers.models.llama.modeling_llama.LlamaDecoderLayer for layer in model.model.layers)
    assert getattr(model, "_fused_remat_patch", None) is None and "forward" not in model.model.__dict__
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[n], t) for n, t in state.items())
    assert all(p.requires_grad for p in model.parameters())
    assert torch.equal(_logits(model, ids), expected)


def test_a_refused_patch_keeps_the_original_layers_and_parameters():
    model = _model("llama")
    layers, params = list(model.model.layers), list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(UnsupportedByFusedBlock):
        apply_fused_remat(model)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    ids = _tokens()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    trained = not torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
    assert trained, "the optimizer built before the refused patch no longer trains layer 0"
    assert all(a is b for a, b in zip(model.model.layers, layers))
    assert all(a is b for a, b in zip(model.parameters(), params))


@pytest.mark.parametrize("where", ["decoder layer forward hook", "q_proj backward hook", "qkv backward hook"])
def test_other_hooks_are_refused_or_run(where, triton_backend):
    """Each hook must either be refused (UnsupportedByFusedBlock, at patching or at the forward) or run.
    On the Triton path: the reference twin calls its qkv module, so there a backward hook on qkv runs."""
    ids = _tokens()
    fired = []
    model = _model("llama")
    try:
        if where == "decoder layer forward hook":
            model.model.layers[0].register_forward_hook(lambda mod, args, out: fired.append(where))
        elif where == "q_proj backward hook":
            model.model.layers[0].self_attn.q_proj.register_full_backward_hook(lambda mod, gi, go: fired.append(where))
        apply_fused_remat(model)
        if where == "qkv backward hook":
            model.model.layers[0].qkv.register_full_backward_hook(lambda mod, gi, go: fired.append(where))
        model(ids, labels=ids).loss.backward()
    except UnsupportedByFusedBlock:
        return
    assert fired, f"the {where} was neither refused nor run"


# --- the loss -----------------------------------------------------------------------------------

def test_num_items_in_batch_reaches_the_loss(triton_backend):
    reference = _model("llama")
    patched = apply_fused_remat(copy.deepcopy(reference))
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    count = int((labels[:, 1:] != -100).sum())
    items = torch.tensor(7)
    with torch.no_grad():
        for kwargs in (dict(labels=ids), dict(attention_mask=mask, labels=labels)):
            expected = reference(ids, **kwargs, num_items_in_batch=items).loss
            loss = patched(ids, **kwargs, num_items_in_batch=items).loss
            mean = patched(ids, **kwargs).loss
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
            tokens = count if "attention_mask" in kwargs else ids.shape[0] * (SEQ - 1)
            assert loss.item() == pytest.approx(mean.item() * tokens / 7, rel=1e-5)  # summed, divided by the 7 given


# --- transformers.Trainer -----------------------------------------------------------------------

class _Examples(torch.utils.data.Dataset):
    """Six examples of 5..SEQ tokens: padded to SEQ on the right (attention_mask 0 and labels -100
    at the pads), or unpadded lists for DataCollatorWithFlattening."""

    def __init__(self, padded: bool):
        generator = torch.Generator().manual_seed(1)
        self.items = []
        for length in (SEQ, 5, 9, 7, SEQ - 1, 6):
            ids = torch.randint(1, VOCAB, (length,), generator=generator)
            if padded:
                mask = (torch.arange(SEQ) < length).long()
                full = torch.zeros(SEQ, dtype=torch.long)
                full[:length] = ids
                self.items.append(dict(input_ids=full, attention_mask=mask, labels=full.masked_fill(mask == 0, -100)))
            else:
                self.items.append(dict(input_ids=ids.tolist(), labels=ids.tolist()))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def _train(model, output_dir, padded: bool, collator=None) -> tuple[list, list]:
    """Three Trainer steps; the logged losses and the keyword arguments of every model call."""
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1, learning_rate=1e-3, seed=3, data_seed=3, disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Examples(padded), data_collator=collator)
        trainer.train()
    handle.remove()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    return losses, calls


def test_trainer_on_a_padded_dataset_follows_the_unpatched_model(tmp_path, triton_backend):
    reference = _model("llama")
    patched = apply_fused_remat(copy.deepcopy(reference))
    expected, _ = _train(reference, tmp_path / "reference", padded=True)
    losses, calls = _train(patched, tmp_path / "patched", padded=True)
    assert any(not bool(call["attention_mask"].all()) for call in calls)  # padded batches did reach the model
    assert all(call.get("num_items_in_batch") is not None for call in calls)
    assert losses == pytest.approx(expected, rel=1e-4)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in patched.model.layers)


def test_trainer_with_data_collator_with_flattening(tmp_path, triton_backend):
    """Packed batches (one row, position_ids restarting at each example, the first label of each
    example -100): the patched model attends within each example, so its first step's loss is the
    unpatched model's on the same examples run one at a time (summed over label tokens, divided by
    their number)."""
    initial = _model("llama")
    patched = apply_fused_remat(copy.deepcopy(initial))
    losses, calls = _train(patched, tmp_path, padded=False, collator=transformers.DataCollatorWithFlattening())
    first = calls[0]
    ids, positions = first["input_ids"], first["position_ids"]
    assert ids.shape[0] == 1 and "attention_mask" not in first
    starts = (positions[0] == 0).nonzero().squeeze(1).tolist()
    assert len(starts) == 2  # two examples packed into the first batch
    total, count = 0.0, 0
    with torch.no_grad():
        for start, end in zip(starts, starts[1:] + [ids.shape[1]]):
            example = ids[:, start:end]
            assert torch.equal(first["labels"][0, start + 1:end], example[0, 1:]) and first["labels"][0, start] == -100
            total += initial(example, labels=example).loss.item() * (end - start - 1)
            count += end - start - 1
        across = initial(ids, labels=first["labels"]).loss.item()  # one causal sequence over both examples
    assert losses[0] == pytest.approx(total / count, rel=1e-4)
    assert abs(across - total / count) > 1e-3  # attending across the examples would show


def test_trl_sft_trainer_with_packing(tmp_path, triton_backend):
    """TRL's SFTTrainer with packing=True (padding-free rows: restarting position_ids, FlashAttention's
    cu_seq_lens and seq_idx) runs on a patched model as is: its first step's loss is the unpatched
    model's on the same examples run one at a time."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", bos_token="t1",
                                                     eos_token="t2", unk_token="t3")
    examples = [torch.randint(4, VOCAB, (n,)) for n in (5, 9, 3)]
    initial = _model("llama")
    patched = apply_fused_remat(copy.deepcopy(initial))
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=3, packing=True,
                         max_length=64, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                         learning_rate=1e-3, seed=0)
    trainer = trl.SFTTrainer(model=patched, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list([{"input_ids": e.tolist()} for e in examples]))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1  # padding-free: one row, the examples one after another
    trainer.train()
    loss = next(record["loss"] for record in trainer.state.log_history if "loss" in record)
    restarts = (batch["position_ids"][0] == 0).nonzero().squeeze(1).tolist()
    starts = restarts + [batch["input_ids"].shape[1]]
    ids, labels = batch["input_ids"], batch["labels"]
    total, count = 0.0, 0
    with torch.no_grad():
        for start, end in zip(starts, starts[1:]):
            example = ids[:, start:end]
            terms = int((labels[0, start + 1:end] != -100).sum())
            total += initial(example, labels=labels[:, start:end]).loss.item() * terms
            count += terms
    assert loss == pytest.approx(total / count, rel=1e-4)
