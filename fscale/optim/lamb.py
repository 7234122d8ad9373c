"""LAMB: Adam moments with a per-tensor trust ratio (You et al., 2019).

LAMB is not pointwise: each tensor's update is scaled by ``||p|| / ||r||``. Under a `Sharding`
each rank holds fragments of the tensors, so the squared norms are computed over the fragments
and completed with a single batched ``sharding.all_reduce`` per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fscale import tree
from fscale.optim import core, hyper, packing
from fscale.optim.base import Optimizer, Sharding, counted_only, described, resolve_sharding

__all__ = ["LambState", "lamb"]

PyTree = Any


class LambState(NamedTuple):
    """State of `lamb`.

    Attributes:
        count: number of updates applied so far (a host int64 scalar).
        exp_avg: first moment, one tensor per param (views of one buffer per dtype).
        exp_avg_sq: second moment, likewise.
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree


@described
def lamb(
    lr: hyper.LearningRate = 1e-3,
    *,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
) -> Optimizer:
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

    With ``t`` the 1-based step::

        m = beta1 m + (1 - beta1) g            v = beta2 v + (1 - beta2) g^2
        r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay p
        p = p - lr * trust * r,    trust = ||p|| / ||r||  (1 when either norm is 0)

    per tensor, with the identity as the paper's scaling function phi. torch.optim has no LAMB,
    so this is tested against the equations, not against torch.

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        betas: decay rates of the moments, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled weight decay added to the update direction, >= 0.

    Returns:
        An `Optimizer` (``pointwise=False``) whose state is a `LambState`. With a `Sharding`, it
        makes exactly one ``all_reduce`` call per step (the per-tensor squared norms of the
        params and of the update direction, stacked).

    Raises:
        ValueError: for negative hyper-parameters or betas outside [0, 1).
    """
    name = "lamb"
    lr_at = hyper.learning_rate(name, lr)
    beta1, beta2 = hyper.check_betas(name, betas)
    eps = hyper.check_non_negative(name, "eps", eps)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)

    def init(params: PyTree, *, sharding: Sharding | None = None) -> LambState:
        leaves, treedef = core.float_leaves(name, params)

        def zeros() -> PyTree:
            return tree.unflatten(treedef, packing.packed_full(leaves))

        return LambState(count=core.new_count(), exp_avg=zeros(), exp_avg_sq=zeros())

    def apply(
        grads: PyTree,
        state: LambState,
        params: PyTree,
        *,
        sharding: Sharding | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, LambState]:
        core.check_state_type(name, state, LambState)
        count = core.read_count(name, state.count)
        inputs = core.step_inputs(
            name,
            grads,
            params,
            {"exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq},
            donate=donate,
        )
        fragments, all_reduce = resolve_sharding(name, sharding, inputs.params, inputs.treedef)
        lr_now = lr_at(count)
        params_ = inputs.params
        if params_:
            with torch.no_grad():
                direction = _direction(
                    inputs.grads,
                    params_,
                    core.required_state(name, inputs, "exp_avg"),
                    core.required_state(name, inputs, "exp_avg_sq"),
                    count + 1,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                )
                # One collective for all tensors: [||p_i||^2 ..., ||r_i||^2 ...] over fragments.
                device = params_[0].device
                partial = torch.stack(
                    [core.sum_of_squares(t, device) for t in (*params_, *direction)]
                )
                totals = all_reduce(counted_only(partial, fragments))
                param_norm, direction_norm = totals.sqrt().split(len(params_))
                usable = (param_norm > 0) & (direction_norm > 0)
                trust = torch.where(usable, param_norm / direction_norm, 1.0)
                torch._foreach_mul_(direction, [lr_now * ratio for ratio in trust.tolist()])
                torch._foreach_sub_(params_, direction)
        unflatten = core.unflattener(inputs.treedef)
        return unflatten(params_), LambState(
            count=core.next_count(count),
            exp_avg=unflatten(inputs.states["exp_avg"]),
            exp_avg_sq=unflatten(inputs.states["exp_avg_sq"]),
        )

    return Optimizer(init=init, update=core.derive_update(apply), apply=apply, pointwise=False)


def _direction(
    grads: list[torch.Tensor],
    params: list[torch.Tensor],
    exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor],
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> core.TensorList:
    """Update the moments in place and return ``r``, the Adam direction plus weight decay."""
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
    denominator = torch._foreach_div(exp_avg_sq, core.bias_correction(beta2, step))
    torch._foreach_sqrt_(denominator)
    torch._foreach_add_(denominator, eps)
    direction = torch._foreach_div(exp_avg, core.bias_correction(beta1, step))
    torch._foreach_div_(direction, denominator)
    if weight_decay:
        torch._foreach_add_(direction, params, alpha=weight_decay)
    return direction
