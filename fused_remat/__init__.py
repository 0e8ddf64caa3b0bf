"""fused_remat: Transformer ops on Triton kernels that keep minimal state for backward.

Public ops (autograd-aware; CUDA runs compiled Triton, CPU runs the Triton interpreter when
TRITON_INTERPRET=1, otherwise the plain-PyTorch reference in ``fused_remat.reference``):

- ``layer_norm(x, weight, bias=None, eps=1e-5)`` and ``rms_norm(x, weight, eps=1e-6)``
- ``gelu(x, approximate="none")`` and ``swiglu(gate, up)``
- ``attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, return_lse=False)``
  (FlashAttention-style, GQA, sliding windows, softcapping) and ``attention_varlen(q, k, v,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` (packed documents)
- ``linear_cross_entropy(hidden, weight, targets, *, ignore_index=-100, chunk_tokens=None)``: the LM
  head and its loss in row chunks, never holding the (tokens x vocab) logits

and the block they make, ``TransformerBlock(dim, n_heads, ..., remat="cheap")`` (the policies:
``Remat``, ``fused_remat.remat``), a drop-in for the
plain-PyTorch ``fused_remat.reference.TransformerBlock`` with the same parameters; the language
model built from it, ``LanguageModel(ModelConfig(...), remat=...)`` (``fused_remat.model``) and
its remat planner (``fused_remat.planner``).

Where things are: the kernels in ``fused_remat.kernels`` (torch tensors in and out, no autograd),
reached only through the custom operators of ``fused_remat.custom_ops``; this package, the op
library, on top; the training application (``fused_remat.training``, run as
``python -m fused_remat.train``) and the integrations (``fused_remat.integrations``) above it,
never imported from here.
"""

from . import memory, reference
from .activations import gelu, swiglu
from .attention import attention, attention_varlen
from .block import TransformerBlock
from .loss import linear_cross_entropy
from .model import LanguageModel, ModelConfig
from .norms import layer_norm, rms_norm
from .remat import Remat

__all__ = ["LanguageModel", "ModelConfig", "Remat", "TransformerBlock", "attention", "attention_varlen", "gelu", "layer_norm", "linear_cross_entropy", "memory", "reference", "rms_norm", "swiglu"]
