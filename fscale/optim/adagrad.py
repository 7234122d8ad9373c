"""Adagrad on torch's fused kernel, bit-exact with ``torch.optim.Adagrad(fused=True)``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fscale.optim import core, hyper
from fscale.optim.base import Optimizer, described

__all__ = ["AdagradState", "adagrad"]

PyTree = Any


class AdagradState(NamedTuple):
    """State of `adagrad`; field names follow torch.optim's state keys.

    Attributes:
        count: number of updates applied so far (a host int64 scalar; torch's ``step``).
        sum: running sum of squared gradients, one tensor per param (views of one buffer per
            dtype), starting at ``initial_accumulator_value``.
    """

    count: torch.Tensor
    sum: PyTree


@described
def adagrad(
    lr: hyper.LearningRate = 1e-2,
    *,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
) -> Optimizer:
    """Adagrad (Duchi et al., 2011), equal bit for bit to ``torch.optim.Adagrad(fused=True)``.

    Matches torch's fused implementation (``torch._fused_adagrad_``), called once per device and
    dtype on the per-parameter views of the flat state buffer. The step size at update ``t`` is
    ``lr / (1 + (t - 1) * lr_decay)``.

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        lr_decay: learning-rate decay, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        initial_accumulator_value: starting value of the squared-gradient sum, >= 0.
        eps: added to the denominator, >= 0.
        maximize: ascend the objective instead of descending.

    Returns:
        An `Optimizer` whose state is an `AdagradState`.

    Raises:
        ValueError: for negative hyper-parameters.
    """
    name = "adagrad"
    lr_at = hyper.learning_rate(name, lr)
    lr_decay = hyper.check_non_negative(name, "lr_decay", lr_decay)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)
    initial = hyper.check_non_negative(name, "initial_accumulator_value", initial_accumulator_value)
    eps = hyper.check_non_negative(name, "eps", eps)
    maximize = hyper.check_bool(name, "maximize", maximize)

    def update_group(group: core.Group) -> None:
        torch._fused_adagrad_(
            group.params,
            group.grads,
            group.buffers["sum"],
            core.fused_steps(group),
            lr=group.lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
        )

    return core.pointwise_optimizer(
        name, AdagradState, ("sum",), update_group, lr=lr_at, fill=initial
    )
