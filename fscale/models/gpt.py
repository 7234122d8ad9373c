"""A small GPT: token and position embeddings, pre-norm transformer blocks, a tied output layer.

The transformer blocks are an ``nn.ModuleList`` called ``blocks``, with the embeddings
(``embed``) and the final norm and output layer (``final_norm``, ``lm_head``) as separate
children, so "one sharding unit per block plus the root" and "remat each block"
(``model.blocks[i] = fscale.checkpoint(model.blocks[i])``) are one line each. The output layer
shares its weight with the token embedding (one parameter under two names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import torch
import torch.nn.functional as F
from torch import nn

from fscale.models import building

__all__ = ["GPT", "Block", "CausalSelfAttention", "Embeddings", "FeedForward", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`.

    Attributes:
        vocab_size: number of token ids.
        seq_len: longest sequence (number of learned positions).
        d_model: width of the residual stream.
        n_heads: attention heads; must divide `d_model`.
        n_layers: transformer blocks.
        d_ff: hidden width of the MLPs; None means ``4 * d_model``.
        dropout: probability of the dropouts on the embeddings and on each block's attention
            and MLP outputs.
        tie_embeddings: whether the output layer reuses the token embedding's weight.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        building.check_positive_ints(
            "GPTConfig",
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            d_ff=self.d_ff,
        )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: `n_heads`={self.n_heads} must divide `d_model`={self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: `dropout` must be in [0, 1), got {self.dropout!r}")


class Embeddings(nn.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.token(tokens) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # No bias: the key bias would have an exactly-zero gradient (softmax ignores a constant
        # shift per query), which adaptive optimizers turn from rounding noise into updates.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = einops.rearrange(
            self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads
        )
        # The fused kernel never materialises the [T, T] scores or a mask. On the CPU each
        # output row (and, in backward, each head's gradient) is computed by one thread in a
        # fixed order, so results are bit-identical across runs, thread counts and splits of
        # the batch; it also works under torch.func.grad and vjp.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.proj(einops.rearrange(attended, "b h t d -> b t (h d)")))


class FeedForward(nn.Module):
    """Position-wise MLP: Linear, GELU, Linear, dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.d_ff if cfg.d_ff is not None else 4 * cfg.d_model
        self.fc_in = nn.Linear(cfg.d_model, hidden)
        self.fc_out = nn.Linear(hidden, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2 layout, pre-LayerNorm).

    Maps token ids ``[B, T]`` (int64, batch-major, ``T <= cfg.seq_len``) to next-token logits
    ``[B, T, vocab_size]``. Weights are initialised as in GPT-2: normal(0, 0.02), with the
    projections that write into the residual stream scaled by ``1 / sqrt(2 * n_layers)`` so the
    stream's variance does not grow with depth; biases zero, LayerNorms the identity.

    Args:
        cfg: the shape.
        seed: the initialisation seed.
    """

    def __init__(self, cfg: GPTConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        cfg = GPTConfig() if cfg is None else cfg
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT: `cfg` must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        with building.seeded_float32_init(seed):
            self.embed = Embeddings(cfg)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.final_norm = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.token.weight

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_output = name.endswith(("attn.proj", "mlp.fc_out"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual_output else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``[B, T]``."""
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dtype not in (torch.int64, torch.int32)
            or tokens.dim() != 2
        ):
            raise ValueError(
                "GPT: `tokens` must be an int64 tensor of shape [batch, time], got "
                + (
                    f"dtype {tokens.dtype} and shape {tuple(tokens.shape)}"
                    if isinstance(tokens, torch.Tensor)
                    else type(tokens).__name__
                )
            )
        if not 1 <= tokens.shape[1] <= self.cfg.seq_len:
            raise ValueError(
                f"GPT: sequences of length {tokens.shape[1]} do not fit; the model has "
                f"seq_len={self.cfg.seq_len} positions"
            )
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))
