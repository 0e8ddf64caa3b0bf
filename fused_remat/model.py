"""A decoder-only language model built from ``TransformerBlock``, configured by a dataclass.

    x = embed(tokens)
    x = block_i(x)                  for each layer, each with its own remat policy
    loss = cross_entropy(head(norm(x)), targets)   in chunks of tokens, never all logits at once

``block_impl="fused"`` runs our block (a remat point per layer, or a ``memory_budget`` fraction);
``block_impl="reference"`` runs the plain-PyTorch twin, eagerly (``none``) or under
``torch.utils.checkpoint`` (``full``): the baselines the benchmarks and ``--find-max-seq-len``
compare against. Both share parameter names, so one state dict loads into either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import reference, value_checks
from . import context_parallel as cp
from .block import TransformerBlock
from .kernels.limits import check_documents, check_eps, check_softcap, check_window
from .loss import linear_cross_entropy
from .norms import layer_norm, rms_norm
from .remat import Remat, check_memory_budget, parse_per_layer

BLOCK_CLASSES = {"fused": TransformerBlock, "reference": reference.TransformerBlock}
BLOCK_IMPLS = tuple(BLOCK_CLASSES)
IGNORE_INDEX = -100  # targets that do not count (padding), as in F.cross_entropy


def _out_of_vocabulary(tokens: torch.Tensor, vocab: int, later: bool) -> ValueError:
    """The error for token ids outside 0..vocab-1 (``later``: found after the forward returned)."""
    low, high = torch.stack(torch.aminmax(tokens)).tolist()
    when = value_checks.found_later("forward") if later else ""
    return ValueError(f"tokens must hold ids in 0..{vocab - 1}, got {low if low < 0 else high}{when}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the model. ``n_kv_heads=None`` means as many as ``n_heads``; ``ffn_dim=None``
    is 4 x dim for GELU and LLaMA's rounded 8/3 x dim for SwiGLU; ``rope_theta=None`` gives no
    position embedding at all (causal attention still tells positions apart)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    norm: str = "layernorm"
    activation: str = "gelu"
    bias: bool = True
    rope_theta: float | None = 10000.0
    eps: float = 1e-5
    tie_embeddings: bool = True
    window: tuple[int, int] = (-1, -1)  # every layer's sliding window (left, right); -1 unbounded
    softcap: float = 0.0  # every layer's attention softcap; 0 off

    def __post_init__(self):
        for name in ("vocab_size", "n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig: {name} must be a positive int, got {value!r}")
        check_eps("ModelConfig", self.eps)
        # a window read back from JSON is a list: kept as the tuple the blocks compare against
        object.__setattr__(self, "window", check_window("ModelConfig", self.window))
        object.__setattr__(self, "softcap", check_softcap("ModelConfig", self.softcap))

    def block_kwargs(self) -> dict:
        """Keyword arguments of ``TransformerBlock`` (either twin) for one layer."""
        return dict(n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim, norm=self.norm, activation=self.activation,
                    bias=self.bias, causal=True, eps=self.eps, rope_theta=self.rope_theta, window=self.window,
                    softcap=self.softcap)

    def describe(self) -> str:
        kv = "" if self.n_kv_heads in (None, self.n_heads) else f"/{self.n_kv_heads} kv"
        return (f"{self.n_layers} layers x dim {self.dim}, {self.n_heads}{kv} heads, {self.norm}/{self.activation}, "
                f"vocab {self.vocab_size}{', tied head' if self.tie_embeddings else ''}")


# Byte-level by default (vocab 256): ``--vocab-size`` replaces it for tokenized data.
PRESETS = {
    # Small enough for a CPU running the Triton interpreter.
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=192),
    "gpt2-small": ModelConfig(dim=768, n_layers=12, n_heads=12, activation="gelu_tanh"),
    "gpt2-medium": ModelConfig(dim=1024, n_layers=24, n_heads=16, activation="gelu_tanh"),
    # LLaMA-3.2-1B's shape: RMSNorm, SwiGLU (ffn 8192), RoPE, GQA 32:8, no biases.
    "llama-1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, norm="rmsnorm",
                            activation="swiglu", bias=False, rope_theta=500000.0, eps=1e-5),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def resolve_policies(remat: str | Sequence[str], n_layers: int, block_impl: str = "fused", *,
                     owner: str = "remat") -> list[Remat]:
    """One policy for every layer, or one per layer (a sequence or a comma list), parsed and checked
    against what the block kind supports; errors name ``owner``."""
    if block_impl not in BLOCK_CLASSES:
        raise ValueError(f"block_impl must be one of {BLOCK_IMPLS}, got {block_impl!r}")
    return parse_per_layer(remat, n_layers, BLOCK_CLASSES[block_impl].SUPPORTED_REMAT, owner=owner)


class LanguageModel(nn.Module):
    """Token ids (B, N) -> mean next-token loss (with targets) or logits (B, N, vocab) (without).

    ``remat``: one policy for all layers or a list, one per layer (``fused_remat.planner`` makes
    such a list for a memory budget in bytes; default: ``cheap``, ``none`` for the reference block);
    ``memory_budget``: a fraction f in [0, 1] instead, every layer keeping at most f of what
    ``none`` keeps and choosing its point per call (``TransformerBlock.memory_budget``). Weights
    start as GPT-2's: normal(0, 0.02), with the two projections that write into the residual stream
    scaled by 1/sqrt(2 x layers).

    ``context_parallel``: a process group over which every sequence is split (fused blocks only).
    tokens and targets are then this rank's zigzag part of the full sequences
    (``fused_remat.context_parallel.zigzag_shard``); the loss returned is the mean over all tokens
    of the full sequences (the same on every rank), and each rank's parameter gradients are its
    share: their sum over the group is the gradient of that mean.
    """

    def __init__(self, config: ModelConfig, remat: Remat | str | Sequence[Remat | str] | None = None, *,
                 block_impl: str = "fused", memory_budget: float | None = None, context_parallel=None, device=None,
                 dtype=None):
        super().__init__()
        if context_parallel is not None and block_impl != "fused":
            raise ValueError(f"context_parallel needs block_impl='fused' (ring attention), got {block_impl!r}")
        if memory_budget is not None and block_impl != "fused":
            raise ValueError(f"memory_budget needs block_impl='fused' (the reference block keeps all or x), got {block_impl!r}")
        if memory_budget is not None and remat is not None:
            raise ValueError(f"remat={remat!r} and memory_budget={memory_budget!r} are two ways to say what each layer "
                             "keeps; give one (memory_budget lets each layer choose its point per call)")
        if remat is None:  # each block kind's default: cheap for ours, none (eager) for the reference
            remat = Remat.CHEAP if block_impl == "fused" else Remat.NONE
        policies = resolve_policies(remat, config.n_layers, block_impl)
        self.config, self.block_impl = config, block_impl
        factory = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(config.vocab_size, config.dim, **factory)
        self.blocks = nn.ModuleList(
            BLOCK_CLASSES[block_impl](config.dim, config.n_heads, **config.block_kwargs(), remat=policy, **factory)
            for policy in policies
        )
        if config.norm == "rmsnorm":
            self.norm = nn.RMSNorm(config.dim, eps=config.eps, **factory)
        else:
            self.norm = nn.LayerNorm(config.dim, eps=config.eps, bias=config.bias, **factory)
        self.head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False, **factory)
        self.context_parallel = context_parallel
        for block in self.blocks if context_parallel is not None else ():
            block.context_parallel = context_parallel
        if memory_budget is not None:
            self.memory_budget = memory_budget
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    @property
    def remat(self) -> list[Remat]:
        return [block.remat for block in self.blocks]

    def set_remat(self, remat: Remat | str | Sequence[Remat | str]) -> None:
        """Change the policies between steps (validated before any block changes; refused under a
        ``memory_budget``, which chooses them)."""
        budgets = [block.memory_budget for block in self.blocks if getattr(block, "memory_budget", None) is not None]
        if budgets:
            raise ValueError(f"set_remat({remat!r}) would not be used: memory_budget {budgets[0]:g} chooses each "
                             "layer's point per call; set memory_budget = None first")
        for block, policy in zip(self.blocks, resolve_policies(remat, self.config.n_layers, self.block_impl)):
            block.remat = policy

    @property
    def memory_budget(self) -> float | None:
        """The fraction of ``none``'s bytes every layer keeps at most, each choosing its point per call
        (``TransformerBlock.memory_budget``); None where the layers run their ``remat``."""
        budgets = {getattr(block, "memory_budget", None) for block in self.blocks}
        return budgets.pop() if len(budgets) == 1 else None

    @memory_budget.setter
    def memory_budget(self, fraction: float | None) -> None:
        if self.block_impl != "fused":
            raise ValueError(f"memory_budget needs block_impl='fused', got {self.block_impl!r}")
        check_memory_budget(fraction, owner="memory_budget")
        for block in self.blocks:
            block.memory_budget = fraction

    @torch.no_grad()
    def reset_parameters(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "fc2.weight")):
                nn.init.normal_(param, std=residual_std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 1:  # norm weights
                nn.init.ones_(param)
            else:
                nn.init.normal_(param, std=0.02)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                position_ids: torch.Tensor | None = None, documents=None) -> torch.Tensor:
        """Logits (B, N, vocab), or with ``targets`` the mean loss. ``cu_seqlens``: documents packed
        in the B N tokens (int32 offsets; each attends only within itself, and RoPE restarts at each),
        ``max_seqlen`` the longest (read once from the offsets when None), ``position_ids`` (B, N)
        RoPE positions instead; every layer gets them. Under context parallelism, packed documents
        come as ``documents`` (``fused_remat.context_parallel_documents.shard_documents`` of the whole
        batch's offsets), and tokens and targets are this rank's share (``documents.shard``)."""
        self._check_tokens("tokens", tokens)
        if targets is not None:
            # Their type and shape; their range is the loss's to check (linear_cross_entropy).
            if isinstance(targets, torch.Tensor) and targets.shape != tokens.shape:
                raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, got {tuple(targets.shape)}")
            self._check_tokens("targets", targets)
        sequences = {}
        if cu_seqlens is not None:
            max_seqlen = check_documents("LanguageModel", cu_seqlens, tokens.numel(), tokens.device, max_seqlen)
            sequences.update(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        elif max_seqlen is not None:
            raise ValueError("LanguageModel: max_seqlen is given without cu_seqlens")
        if position_ids is not None:
            sequences["position_ids"] = position_ids
        if documents is not None:
            if self.context_parallel is None:
                raise ValueError("LanguageModel: documents (a DocumentShards) split documents over context-parallel "
                                 "ranks; build the model with context_parallel=group, or pass cu_seqlens")
            sequences["documents"] = documents
        tokens, poison = self._in_vocabulary(tokens)
        x = self.embed(tokens)
        if poison is not None:
            x.add_(poison)  # in place: no second activation (the embedding's backward keeps only the ids)
        for block in self.blocks:
            x = block(x, **sequences)
        x = self._final_norm(x)
        if targets is None:
            return F.linear(x, self.head_weight)
        loss = linear_cross_entropy(x, self.head_weight, targets, ignore_index=IGNORE_INDEX)
        if self.context_parallel is None:
            return loss
        return cp.mean_over_group(loss, (targets != IGNORE_INDEX).sum(), self.context_parallel)

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_impl == "reference":
            return self.norm(x)
        if self.config.norm == "rmsnorm":
            return rms_norm(x, self.norm.weight, self.config.eps)
        return layer_norm(x, self.norm.weight, self.norm.bias, self.config.eps)

    @staticmethod
    def _check_tokens(name: str, tokens) -> None:
        """Type and shape of token ids."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int64 or int32 tensor of token ids")
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(f"{name} must have shape (batch, seq_len) with both > 0, got {tuple(tokens.shape)}")

    def _in_vocabulary(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens clamped to the vocabulary, a 0-dim poison: NaN where some id lay outside it, else 0),
        and the check that raises for such an id without waiting for the GPU
        (``fused_remat.value_checks``: on a CPU tensor at once, on CUDA once the flag is on the host).
        Unchecked, the embedding would fail with a bare IndexError on CPU or a device-side assert on
        CUDA that leaves the CUDA context unusable; the NaN keeps the step loud until the error comes
        (a trainer that skips non-finite steps drops it). A captured graph gets the clamp and
        the NaN only (a replay cannot raise). Under torch.compile and on the meta device (no values)
        the tokens go to the embedding as they are, and its own check remains."""
        if torch.compiler.is_compiling() or tokens.device.type == "meta":
            return tokens, None
        vocab = self.config.vocab_size
        outside = ((tokens < 0) | (tokens >= vocab)).any()
        value_checks.check_later(outside, lambda later: _out_of_vocabulary(tokens, vocab, later))
        return tokens.clamp(0, vocab - 1), torch.where(outside, torch.nan, 0.0)
