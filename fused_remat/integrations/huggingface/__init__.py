"""Run a Hugging Face ``transformers`` causal LM on fused_remat's block.

    from fused_remat.integrations.huggingface import apply_fused_remat, revert_fused_remat

    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    apply_fused_remat(model, remat="cheap")   # in place; build the optimizer after this
    ...train with model(input_ids, attention_mask=mask, labels=labels).loss, or transformers.Trainer...
    model.save_pretrained(...)                # Hugging Face's own layout, patched or not

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
(with its per-head q/k RMSNorm: the block's ``qk_norm``), ``Phi3ForCausalLM`` (any ``config.model_type``
of llama, mistral, qwen2, qwen3, phi3) and ``GPT2LMHeadModel`` (gpt2). Every decoder layer
becomes a ``FusedDecoderLayer``, a ``fused_remat.TransformerBlock``, and the base model's forward
becomes fused_remat's (``_FusedBaseForward``): embeddings, the layers, the final norm.

Batches. The base model's forward turns what Hugging Face hands it into documents for the block's
variable-length attention, so each example attends only to itself, exactly:
- ``attention_mask`` (B, N) with padding (left, right, or holes): the masked tokens are dropped
  before the first layer and the outputs put back (zeros at the masked places: what the model
  computes there is nobody's prediction). Positions are the ``position_ids`` given, else 0..N-1 per
  row, as Hugging Face's.
- packed examples (``DataCollatorWithFlattening``, TRL's ``packing=True``): ``position_ids`` that
  restart (a position not above the one before it starts a new example), or FlashAttention's
  ``cu_seq_lens_q``/``cu_seq_lens_k`` (equal; batch 1); a ``seq_idx`` must mark the same examples.
- RoPE comes from the model's own rotary embedding, called as the model calls it (so dynamic and
  LongRoPE frequencies follow the sequence length): its ``inv_freq`` goes to the block per call and
  its ``attention_scaling`` s (YaRN, LongRoPE) becomes the block's softmax scale s^2 / sqrt(head_dim).
  Every ``rope_type`` the installed transformers has is therefore the model's own; RoPE over part of
  the head is refused.
- sliding windows (Mistral, Qwen2 ``use_sliding_window``, per-layer ``layer_types``) run as the
  block's window, ``sliding_window - 1`` keys back.
- ``num_items_in_batch`` (Hugging Face's ``Trainer``) and other loss-only keywords pass through to
  the loss.

Generation. ``generate()`` with its default cache (a ``DynamicCache``, with sliding-window layers
where the config has windows), or any call with ``use_cache=True`` or a cache: each fused layer
appends its keys and values to the cache and attends over all of them through fused_remat's
attention, the new tokens aligned to the bottom right; a left-padded batch attends as documents of
each row's real tokens (``attention_varlen``). The rest of the layer runs from the block's own
modules. Other caches (``StaticCache``: its preallocated slots are not keys) are refused. Without
a cache and without ``use_cache=True`` (left unset means False on a patched model) the model keeps
no cache.

Weights. The block keeps one packed qkv projection ([q heads | k heads | v heads]) and, for SwiGLU,
one packed fc1 ([gate | up]); separate Hugging Face tensors cannot be views of one packed tensor, so
``apply_fused_remat`` copies q/k/v and gate/up once, layer by layer, into packed tensors that become
the layer's parameters, and drops the Hugging Face layer, which frees the originals unless something
else (an optimizer built earlier) still holds them. GPT-2's Conv1D weights are stored (in, out) and
are copied transposed (c_attn is already packed qkv). Norm weights, o_proj and down_proj are taken
over without a copy. ``revert_fused_remat`` splits (and for GPT-2 transposes) them back the same way.
``state_dict()`` (hence ``save_pretrained`` and ``torch.save(model.state_dict())``) gives Hugging
Face's names and layouts, split into copies, and ``load_state_dict`` takes them back: a patched
model saves what ``from_pretrained`` of the unpatched class loads.

Biases. The block's ``bias`` switches all its biases together. Where the Hugging Face layer lacks
some (Qwen2: biases on q, k, v only; Llama with ``attention_bias=True``: on q, k, v, o), the block is
built with ``bias=True`` and the missing ones are zero tensors with ``requires_grad=False`` (2 x dim
+ 2 x ffn elements per layer for Qwen2): the function is exactly the Hugging Face layer's and the
real parameters get the same gradients. A forward refuses to run if one of them was made trainable
(``model.requires_grad_(True)``), and revert refuses if one is no longer zero.

Adapters. Each Hugging Face projection stays under its name as a ``_Slot`` whose weight is a view
of its packed rows, so PEFT finds it. PEFT LoRA (applied before patching: its LoRA layers move
around the slots; or after) runs inside the fused block as ``LowRankAdapter``s, ``lora_dropout``
included (training mode); ``merge_and_unload`` merges into the packed weights and the state dict
has PEFT's names. Anything else the block would bypass by reading the weights directly (a LoRA
variant such as DoRA or a LoRA bias, another wrapper, a quantized linear layer, hooks of any kind
on a projection, a norm or the layer) is refused when patching, or at the next forward when added
afterwards.

Refused with ``UnsupportedByFusedBlock`` (a ValueError naming the input), never silently wrong:
a cache other than a ``DynamicCache``; a 4-D ``attention_mask``;
``output_attentions`` and ``output_hidden_states``; dropout > 0 in training mode (attention or
residual dropout; GPT-2's embedding dropout is outside the layers and still applies); partial
rotary, a head dim above 256, activations other than SiLU (Llama family) or gelu / gelu_new / gelu_pytorch_tanh (GPT-2), GPT-2 cross-attention,
``scale_attn_by_inverse_layer_idx`` or unscaled attention; any other keyword the model is handed
that it does not know. A fused layer called on its own (not through the model) takes no arguments
but the hidden states, and only without RoPE (GPT-2): RoPE's frequencies come from the model.

Checkpointing. ``model.gradient_checkpointing_enable()`` (or ``activation_checkpointing_enable``)
sets every fused layer to ``remat="full"`` (keeps only the layer input; ``every_n_layers`` is not
honoured: every layer goes full, and a ``memory_budget`` is set aside), and disabling sets them back
to the ``remat`` and ``memory_budget`` given here. The
Hugging Face checkpoint wrapper never runs around a fused layer.

Whole-model operations: ``copy.deepcopy`` gives an independent patched model, ``torch.save(model)``
and pickle work (nothing patched is a closure), ``model.to()`` moves the fused layers with the rest.

Version: the layer's call signature and return value (a tensor, or a 1-tuple on older GPT-2) are read
from the installed ``transformers`` when patching; plain attributes of the layer that the model reads
(Qwen2's ``attention_type`` in 4.x) are carried over. Tested with transformers 4.57.6 and 5.24.0.
"""

from .layer import FusedDecoderLayer
from .patch import apply_fused_remat, revert_fused_remat
from .refusals import UnsupportedByFusedBlock

__all__ = ["FusedDecoderLayer", "UnsupportedByFusedBlock", "apply_fused_remat", "revert_fused_remat"]
