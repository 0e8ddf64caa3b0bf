"""Triton kernels and their plain launchers: torch tensors in, torch tensors out, no autograd.

Installed as ``fused_remat.kernels``. Nothing here imports from ``fused_remat`` above it.
"""
