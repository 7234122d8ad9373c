"""`MoE`: a mixture-of-experts MLP as an ``nn.Module``, the stacked experts of `moe_dispatch`.

The module holds ``gate.weight`` ``(d_model, E)`` and the stacked expert MLP leaves
``experts.w_in`` ``(E, d_model, hidden)``, ``experts.b_in`` ``(E, hidden)``, ``experts.w_out``
``(E, hidden, d_model)``, ``experts.b_out`` ``(E, d_model)``: the parameter convention of
`moe_dispatch`, so its parameter names are those `expert_parallel` recognises (a path with an
``experts`` component). It is built with all E experts; under expert parallelism
`expert_parallel` hands each rank's forward its slice of them (`fscale.functionalize` swaps
them in), and the layer's `moe_dispatch` over the same mesh axis expects exactly that slice.

``forward(x)`` takes ``(..., d_model)`` and returns ``(y, aux_loss)``: every leading dim is a
token, the routing group is all of them (one group per call, per rank). Evaluation is the
module's mode: ``.eval()`` (or `fscale.functionalize`'s ``train=False``) selects the evaluation
capacity factor and turns the noise off. With ``noisy=True`` the noise is drawn from the
ambient RNG, which `fscale.functionalize` seeds from the step's key.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fscale.distributed.mesh import Mesh
from fscale.functional.checks import APPLY_SHAPE_ATTR
from fscale.parallel.moe.dispatch import MoEDispatch, moe_dispatch

__all__ = ["MoE", "expert_mlp"]

Tensor = torch.Tensor


def expert_mlp(params: dict[str, Tensor], tokens: Tensor) -> Tensor:
    """One expert: ``gelu(tokens @ w_in + b_in) @ w_out + b_out``."""
    hidden = F.gelu(tokens @ params["w_in"] + params["b_in"])
    return hidden @ params["w_out"] + params["b_out"]


class MoE(nn.Module):
    """Top-k mixture of MLP experts.

    Args:
        d_model: token width.
        hidden: each expert's hidden width.
        num_experts: E.
        mesh, axis: where the experts live (None: all in this process); see `moe_dispatch`.
        residual_std: standard deviation of ``w_out`` (the projection into the residual stream).
        **options: `moe_dispatch`'s keyword options (``k``, ``capacity_factor``,
            ``eval_capacity_factor``, ``aux_loss_weight``, ``z_loss_weight``, ``capacity``,
            ``noisy``).
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        num_experts: int,
        *,
        mesh: Mesh | None = None,
        axis: str = "ep",
        residual_std: float = 0.02,
        **options: Any,
    ) -> None:
        super().__init__()
        self.dispatch: MoEDispatch = moe_dispatch(
            expert_mlp, mesh, axis, num_experts=num_experts, **options
        )
        self.gate = nn.ParameterDict({"weight": nn.Parameter(torch.empty(d_model, num_experts))})
        self.experts = nn.ParameterDict(
            {
                "w_in": nn.Parameter(torch.empty(num_experts, d_model, hidden)),
                "b_in": nn.Parameter(torch.zeros(num_experts, hidden)),
                "w_out": nn.Parameter(torch.empty(num_experts, hidden, d_model)),
                "b_out": nn.Parameter(torch.zeros(num_experts, d_model)),
            }
        )
        ranks = 1 if mesh is None else mesh.size(axis)
        if ranks > 1:  # the forward gets this rank's E/ep experts (see `expert_parallel`)
            for leaf in self.experts.values():
                setattr(leaf, APPLY_SHAPE_ATTR, (num_experts // ranks, *leaf.shape[1:]))
        nn.init.normal_(self.gate["weight"], 0.0, 0.02)
        nn.init.normal_(self.experts["w_in"], 0.0, 0.02)
        nn.init.normal_(self.experts["w_out"], 0.0, residual_std)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(y, aux_loss)`` for ``x`` of shape ``(..., d_model)``."""
        params = {
            "gate": {"weight": self.gate["weight"]},
            "experts": dict(self.experts.items()),
        }
        tokens = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        y, aux = self.dispatch(params, tokens, training=self.training)
        return y.view(x.shape), aux["aux_loss"]
