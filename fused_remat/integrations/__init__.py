"""Adapters from other libraries' models to fused_remat's block.

- ``fused_remat.integrations.huggingface``: ``apply_fused_remat(model)`` swaps the decoder layers of a
  Hugging Face ``transformers`` causal LM for ``fused_remat.TransformerBlock``; ``revert_fused_remat``
  swaps them back. Importing it imports ``transformers``.

This package imports nothing on its own, and the library (``fused_remat``) never imports it.
"""
