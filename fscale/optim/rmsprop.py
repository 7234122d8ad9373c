"""RMSprop, bit-exact with torch.optim.RMSprop's single-tensor implementation.

torch has no fused RMSprop kernel, so this follows ``torch.optim.RMSprop(foreach=False)``
operation by operation. Each operation runs as one ``torch._foreach_*`` call over the per-leaf
views of the flat state buffers: on CPU those apply torch's per-tensor kernel to each tensor, so
the arithmetic (including where each tensor's vectorised body ends) is torch's, with one Python
call per operation instead of one per operation and parameter.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fscale.optim import core, hyper
from fscale.optim.base import Optimizer, described

__all__ = ["RMSpropState", "rmsprop"]

PyTree = Any


class RMSpropState(NamedTuple):
    """State of `rmsprop`; field names follow torch.optim's state keys.

    Attributes:
        count: number of updates applied so far (a host int64 scalar; torch's ``step``).
        square_avg: running average of squared gradients, one tensor per param.
        momentum_buffer: the velocity when ``momentum > 0``, else None.
        grad_avg: running average of gradients when ``centered``, else None.
    """

    count: torch.Tensor
    square_avg: PyTree
    momentum_buffer: PyTree
    grad_avg: PyTree


@described
def rmsprop(
    lr: hyper.LearningRate = 1e-2,
    *,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    maximize: bool = False,
) -> Optimizer:
    """RMSprop (Hinton, 2012), equal bit for bit to ``torch.optim.RMSprop(foreach=False)``.

    Matches torch's single-tensor implementation (there is no fused RMSprop kernel).

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        alpha: smoothing constant of the squared-gradient average, in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        momentum: momentum factor, >= 0.
        centered: normalise by an estimate of the gradient's variance instead of its second
            moment.
        maximize: ascend the objective instead of descending.

    Returns:
        An `Optimizer` whose state is an `RMSpropState`.

    Raises:
        ValueError: for negative hyper-parameters or `alpha` outside [0, 1).
    """
    name = "rmsprop"
    lr_at = hyper.learning_rate(name, lr)
    alpha = hyper.check_unit_interval(name, "alpha", alpha)
    eps = hyper.check_non_negative(name, "eps", eps)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)
    momentum = hyper.check_non_negative(name, "momentum", momentum)
    centered = hyper.check_bool(name, "centered", centered)
    maximize = hyper.check_bool(name, "maximize", maximize)

    def update_group(group: core.Group) -> None:
        square_avg = group.buffers["square_avg"]
        grads = core.regularized_grads(
            group.grads, group.params, maximize=maximize, weight_decay=weight_decay
        )
        torch._foreach_mul_(square_avg, alpha)
        torch._foreach_addcmul_(square_avg, grads, grads, value=1 - alpha)
        if centered:
            grad_avg = group.buffers["grad_avg"]
            torch._foreach_lerp_(grad_avg, grads, 1 - alpha)
            avg = torch._foreach_addcmul(square_avg, grad_avg, grad_avg, value=-1)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, eps)
        if momentum > 0:
            velocity = group.buffers["momentum_buffer"]
            torch._foreach_mul_(velocity, momentum)
            torch._foreach_addcdiv_(velocity, grads, avg)
            torch._foreach_add_(group.params, velocity, alpha=-group.lr)
        else:
            torch._foreach_addcdiv_(group.params, grads, avg, value=-group.lr)

    buffers = ["square_avg"]
    if momentum > 0:
        buffers.append("momentum_buffer")
    if centered:
        buffers.append("grad_avg")
    return core.pointwise_optimizer(name, RMSpropState, buffers, update_group, lr=lr_at)
