"""SGD with momentum on torch's fused kernel, bit-exact with ``torch.optim.SGD(fused=True)``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fscale.optim import core, hyper
from fscale.optim.base import Optimizer, described

__all__ = ["SGDState", "sgd"]

PyTree = Any


class SGDState(NamedTuple):
    """State of `sgd`; field names follow torch.optim's state keys.

    Attributes:
        count: number of updates applied so far (a host int64 scalar).
        momentum_buffer: the velocity, one tensor per param (views of one buffer per dtype),
            or None when ``momentum == 0`` (as torch.optim stores it).
    """

    count: torch.Tensor
    momentum_buffer: PyTree


@described
def sgd(
    lr: hyper.LearningRate,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, equal bit for bit to ``torch.optim.SGD(..., fused=True)``.

    Matches torch's fused implementation (``torch._fused_sgd_``) called once per device and
    dtype on the per-parameter views of the flat momentum buffer. As in torch, the first step
    sets the momentum buffer to the gradient (no dampening), later ones to
    ``momentum * buf + (1 - dampening) * grad``.

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        momentum: momentum factor, >= 0.
        dampening: dampening of the momentum, >= 0.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty added to the gradient, >= 0.
        maximize: ascend the objective instead of descending.

    Returns:
        An `Optimizer` whose state is an `SGDState`.

    Raises:
        ValueError: for negative hyper-parameters, or `nesterov` without momentum or with
            dampening.

    Example:
        >>> import torch, fscale.optim as optim
        >>> params = [torch.zeros(2)]
        >>> opt = optim.sgd(0.5, momentum=0.9)
        >>> params, state = optim.step(opt, [torch.ones(2)], opt.init(params), params)
        >>> params[0]
        tensor([-0.5000, -0.5000])
    """
    name = "sgd"
    lr_at = hyper.learning_rate(name, lr)
    momentum = hyper.check_non_negative(name, "momentum", momentum)
    dampening = hyper.check_non_negative(name, "dampening", dampening)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)
    nesterov = hyper.check_bool(name, "nesterov", nesterov)
    maximize = hyper.check_bool(name, "maximize", maximize)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"sgd: Nesterov momentum needs momentum > 0 and dampening == 0, got "
            f"momentum={momentum}, dampening={dampening}"
        )
    has_buffer = momentum != 0

    def update_group(group: core.Group) -> None:
        torch._fused_sgd_(
            group.params,
            group.grads,
            group.buffers["momentum_buffer"] if has_buffer else [],
            weight_decay=weight_decay,
            momentum=momentum,
            lr=group.lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=maximize,
            # torch starts the buffer as a copy of the first gradient
            is_first_step=has_buffer and group.step == 1,
        )

    buffers = ("momentum_buffer",) if has_buffer else ()
    return core.pointwise_optimizer(name, SGDState, buffers, update_group, lr=lr_at)
