"""Adamax, bit-exact with torch.optim.Adamax's single-tensor implementation.

As for `rmsprop`: torch has no fused kernel, so each operation of
``torch.optim.Adamax(foreach=False)`` runs as one ``torch._foreach_*`` call over the per-leaf
views of the flat state buffers (torch's per-tensor kernels, applied tensor by tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fscale.optim import core, hyper
from fscale.optim.base import Optimizer, described

__all__ = ["AdamaxState", "adamax"]

PyTree = Any


class AdamaxState(NamedTuple):
    """State of `adamax`; field names follow torch.optim's state keys.

    Attributes:
        count: number of updates applied so far (a host int64 scalar; torch's ``step``).
        exp_avg: first moment, one tensor per param.
        exp_inf: exponentially weighted infinity norm, one tensor per param.
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_inf: PyTree


@described
def adamax(
    lr: hyper.LearningRate = 2e-3,
    *,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> Optimizer:
    """Adamax (Kingma & Ba, 2015, sec. 7), equal bit for bit to ``torch.optim.Adamax``.

    Matches torch's single-tensor implementation (``foreach=False``; there is no fused kernel).

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        betas: decay rates of the first moment and of the infinity norm, each in [0, 1).
        eps: added to the infinity norm, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        maximize: ascend the objective instead of descending.

    Returns:
        An `Optimizer` whose state is an `AdamaxState`.

    Raises:
        ValueError: for negative hyper-parameters or betas outside [0, 1).
    """
    name = "adamax"
    lr_at = hyper.learning_rate(name, lr)
    beta1, beta2 = hyper.check_betas(name, betas)
    eps = hyper.check_non_negative(name, "eps", eps)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)
    maximize = hyper.check_bool(name, "maximize", maximize)

    def update_group(group: core.Group) -> None:
        exp_avg, exp_inf = group.buffers["exp_avg"], group.buffers["exp_inf"]
        grads = core.regularized_grads(
            group.grads, group.params, maximize=maximize, weight_decay=weight_decay
        )
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_inf, beta2)
        bounded = torch._foreach_abs(grads)
        torch._foreach_add_(bounded, eps)
        torch._foreach_maximum_(exp_inf, bounded)
        step_size = group.lr / core.bias_correction(beta1, group.step)
        torch._foreach_addcdiv_(group.params, exp_avg, exp_inf, value=-step_size)

    return core.pointwise_optimizer(
        name, AdamaxState, ("exp_avg", "exp_inf"), update_group, lr=lr_at
    )
