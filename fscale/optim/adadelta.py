"""Adadelta, bit-exact with torch.optim.Adadelta's single-tensor implementation.

As for `rmsprop`: torch has no fused kernel, so each operation of
``torch.optim.Adadelta(foreach=False)`` runs as one ``torch._foreach_*`` call over the per-leaf
views of the flat state buffers (torch's per-tensor kernels, applied tensor by tensor).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fscale.optim import core, hyper
from fscale.optim.base import Optimizer, described

__all__ = ["AdadeltaState", "adadelta"]

PyTree = Any


class AdadeltaState(NamedTuple):
    """State of `adadelta`; field names follow torch.optim's state keys.

    Attributes:
        count: number of updates applied so far (a host int64 scalar; torch's ``step``).
        square_avg: running average of squared gradients, one tensor per param.
        acc_delta: running average of squared updates, one tensor per param.
    """

    count: torch.Tensor
    square_avg: PyTree
    acc_delta: PyTree


@described
def adadelta(
    lr: hyper.LearningRate = 1.0,
    *,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> Optimizer:
    """Adadelta (Zeiler, 2012), equal bit for bit to ``torch.optim.Adadelta(foreach=False)``.

    Matches torch's single-tensor implementation (there is no fused Adadelta kernel).

    Args:
        lr: coefficient of the update, or a schedule ``count -> lr``.
        rho: decay rate of the running averages, in [0, 1).
        eps: added inside the square roots, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        maximize: ascend the objective instead of descending.

    Returns:
        An `Optimizer` whose state is an `AdadeltaState`.

    Raises:
        ValueError: for negative hyper-parameters or `rho` outside [0, 1).
    """
    name = "adadelta"
    lr_at = hyper.learning_rate(name, lr)
    rho = hyper.check_unit_interval(name, "rho", rho)
    eps = hyper.check_non_negative(name, "eps", eps)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)
    maximize = hyper.check_bool(name, "maximize", maximize)

    def update_group(group: core.Group) -> None:
        square_avg, acc_delta = group.buffers["square_avg"], group.buffers["acc_delta"]
        grads = core.regularized_grads(
            group.grads, group.params, maximize=maximize, weight_decay=weight_decay
        )
        torch._foreach_mul_(square_avg, rho)
        torch._foreach_addcmul_(square_avg, grads, grads, value=1 - rho)
        std = torch._foreach_add(square_avg, eps)
        torch._foreach_sqrt_(std)
        delta = torch._foreach_add(acc_delta, eps)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, grads)
        torch._foreach_mul_(acc_delta, rho)
        torch._foreach_addcmul_(acc_delta, delta, delta, value=1 - rho)
        torch._foreach_add_(group.params, delta, alpha=-group.lr)

    return core.pointwise_optimizer(
        name, AdadeltaState, ("square_avg", "acc_delta"), update_group, lr=lr_at
    )
