"""A GPT whose every other block has a mixture-of-experts MLP (Switch / GShard layout).

Blocks 1, 3, 5 ... replace `fscale.models.gpt.FeedForward` with `fscale.parallel.moe.MoE`; the
embeddings, attention, norms and tied output layer are `fscale.models.gpt`'s. ``forward``
returns ``(logits, aux_loss)``: the sum of the MoE layers' weighted router losses, to add to the
language-model loss. Each MoE layer routes the ``B * T`` tokens of one call as one group, so a
rank's micro-batch is its routing group: training over N data-parallel ranks equals one process
that runs the same N groups (not one group of the concatenated batch, whose capacities and
balance statistics would differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fscale.distributed.mesh import Mesh
from fscale.models import building
from fscale.models.gpt import GPT, Block, GPTConfig
from fscale.parallel.moe.layer import MoE

__all__ = ["MoEBlock", "MoEGPT", "MoEGPTConfig"]


@dataclass(frozen=True)
class MoEGPTConfig:
    """Shape of a `MoEGPT`.

    Attributes:
        gpt: the dense model's shape (its ``d_ff`` is each expert's hidden width).
        num_experts: experts per MoE layer.
        moe: `fscale.moe_dispatch` options of every MoE layer (``k``, ``capacity``,
            ``capacity_factor`` ...).
    """

    gpt: GPTConfig = field(default_factory=GPTConfig)
    num_experts: int = 4
    moe: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        building.check_positive_ints("MoEGPTConfig", num_experts=self.num_experts)
        if not isinstance(self.gpt, GPTConfig):
            raise TypeError(f"MoEGPTConfig: `gpt` must be a GPTConfig, got {self.gpt!r}")


class MoEBlock(nn.Module):
    """`fscale.models.gpt.Block` with `MoE` as its MLP: ``forward(x) -> (x, aux_loss)``."""

    def __init__(self, cfg: MoEGPTConfig, mesh: Mesh | None, axis: str) -> None:
        super().__init__()
        dense = Block(cfg.gpt)
        self.attn_norm, self.attn, self.mlp_norm = dense.attn_norm, dense.attn, dense.mlp_norm
        hidden = cfg.gpt.d_ff if cfg.gpt.d_ff is not None else 4 * cfg.gpt.d_model
        self.mlp = MoE(
            cfg.gpt.d_model,
            hidden,
            cfg.num_experts,
            mesh=mesh,
            axis=axis,
            residual_std=0.02 / math.sqrt(2 * cfg.gpt.n_layers),
            **cfg.moe,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        y, aux_loss = self.mlp(self.mlp_norm(x))
        return x + y, aux_loss


class MoEGPT(nn.Module):
    """Token ids ``[B, T]`` to ``(logits [B, T, vocab], aux_loss)``; every other block MoE.

    Args:
        cfg: the shape.
        mesh, axis: where the experts live (None: every expert in this process). The module is
            always built with all experts; `fscale.expert_parallel` gives each rank its slice.
        seed: the initialisation seed (the dense parts are initialised as `fscale.models.GPT`
            with the same seed and shape).
    """

    def __init__(
        self,
        cfg: MoEGPTConfig | None = None,
        *,
        mesh: Mesh | None = None,
        axis: str = "ep",
        seed: int = 0,
    ) -> None:
        super().__init__()
        cfg = MoEGPTConfig() if cfg is None else cfg
        if not isinstance(cfg, MoEGPTConfig):
            raise TypeError(f"MoEGPT: `cfg` must be a MoEGPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dense = GPT(cfg.gpt, seed=seed)
        self.embed, self.final_norm, self.lm_head = dense.embed, dense.final_norm, dense.lm_head
        with building.seeded_float32_init(seed + 1):
            blocks: list[nn.Module] = [
                MoEBlock(cfg, mesh, axis) if i % 2 else dense.blocks[i]
                for i in range(cfg.gpt.n_layers)
            ]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, aux_loss)`` for token ids ``[B, T]``."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(
                "MoEGPT: `tokens` must be an int64 tensor of shape [batch, time], got "
                + (
                    f"shape {tuple(tokens.shape)}"
                    if isinstance(tokens, torch.Tensor)
                    else type(tokens).__name__
                )
            )
        x = self.embed(tokens)
        aux_loss = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                x, block_aux = block(x)
                aux_loss = aux_loss + block_aux
            else:
                x = block(x)
        return self.lm_head(self.final_norm(x)), aux_loss
