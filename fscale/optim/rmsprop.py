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

from fscale import tree
from fscale.optim import _core
from fscale.optim.base import Layout, Optimizer

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


def rmsprop(
    lr: _core.LearningRate = 1e-2,
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
    lr_at = _core.learning_rate(name, lr)
    alpha = _core.check_unit_interval(name, "alpha", alpha)
    eps = _core.check_non_negative(name, "eps", eps)
    weight_decay = _core.check_non_negative(name, "weight_decay", weight_decay)
    momentum = _core.check_non_negative(name, "momentum", momentum)
    centered, maximize = bool(centered), bool(maximize)

    def init(params: PyTree, *, layout: Layout | None = None) -> RMSpropState:
        leaves, treedef = _core.float_leaves(name, params)

        def zeros() -> PyTree:
            return tree.unflatten(treedef, _core.packed_full(leaves))

        return RMSpropState(
            count=_core.new_count(),
            square_avg=zeros(),
            momentum_buffer=zeros() if momentum > 0 else None,
            grad_avg=zeros() if centered else None,
        )

    def apply(
        grads: PyTree,
        state: RMSpropState,
        params: PyTree,
        *,
        layout: Layout | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, RMSpropState]:
        _core.check_state(name, state, RMSpropState)
        count = _core.read_count(name, state.count)
        inputs = _core.step_inputs(
            name,
            grads,
            params,
            {
                "square_avg": state.square_avg,
                "momentum_buffer": state.momentum_buffer if momentum > 0 else None,
                "grad_avg": state.grad_avg if centered else None,
            },
            donate=donate,
        )
        lr_now = lr_at(count)
        square_avg = inputs.states["square_avg"]
        buffers = inputs.states["momentum_buffer"]
        grad_avg = inputs.states["grad_avg"]
        params_ = inputs.params
        if params_:
            with torch.no_grad():
                grads_ = inputs.grads
                if maximize:
                    grads_ = torch._foreach_neg(grads_)
                if weight_decay != 0:
                    grads_ = torch._foreach_add(grads_, params_, alpha=weight_decay)
                torch._foreach_mul_(square_avg, alpha)
                torch._foreach_addcmul_(square_avg, grads_, grads_, value=1 - alpha)
                if centered:
                    torch._foreach_lerp_(grad_avg, grads_, 1 - alpha)
                    avg = torch._foreach_addcmul(square_avg, grad_avg, grad_avg, value=-1)
                    torch._foreach_sqrt_(avg)
                else:
                    avg = torch._foreach_sqrt(square_avg)
                torch._foreach_add_(avg, eps)
                if momentum > 0:
                    torch._foreach_mul_(buffers, momentum)
                    torch._foreach_addcdiv_(buffers, grads_, avg)
                    torch._foreach_add_(params_, buffers, alpha=-lr_now)
                else:
                    torch._foreach_addcdiv_(params_, grads_, avg, value=-lr_now)
        unflatten = _core.unflattener(inputs.treedef)
        return unflatten(params_), RMSpropState(
            count=_core.next_count(count),
            square_avg=unflatten(square_avg),
            momentum_buffer=unflatten(buffers),
            grad_avg=unflatten(grad_avg),
        )

    return Optimizer(init=init, update=_core.derive_update(apply), apply=apply, pointwise=True)
