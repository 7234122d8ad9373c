"""Adagrad on torch's fused kernel, bit-exact with ``torch.optim.Adagrad(fused=True)``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fscale import tree
from fscale.optim import _core
from fscale.optim.base import Layout, Optimizer

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


def adagrad(
    lr: _core.LearningRate = 1e-2,
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
    lr_at = _core.learning_rate(name, lr)
    lr_decay = _core.check_non_negative(name, "lr_decay", lr_decay)
    weight_decay = _core.check_non_negative(name, "weight_decay", weight_decay)
    initial = _core.check_non_negative(
        name, "initial_accumulator_value", initial_accumulator_value
    )
    eps = _core.check_non_negative(name, "eps", eps)
    maximize = bool(maximize)

    def init(params: PyTree, *, layout: Layout | None = None) -> AdagradState:
        leaves, treedef = _core.float_leaves(name, params)
        return AdagradState(
            count=_core.new_count(),
            sum=tree.unflatten(treedef, _core.packed_full(leaves, initial)),
        )

    def apply(
        grads: PyTree,
        state: AdagradState,
        params: PyTree,
        *,
        layout: Layout | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, AdagradState]:
        _core.check_state(name, state, AdagradState)
        count = _core.read_count(name, state.count)
        inputs = _core.step_inputs(name, grads, params, {"sum": state.sum}, donate=donate)
        lr_now = lr_at(count)
        sums = inputs.states["sum"]
        with torch.no_grad():
            for idx in _core.device_groups(inputs.params):
                pick = _core.picker(idx, len(inputs.params))
                params_group = pick(inputs.params)
                step_t = torch.full(
                    (), count + 1, dtype=torch.float32, device=params_group[0].device
                )
                torch._fused_adagrad_(
                    params_group,
                    pick(inputs.grads),
                    pick(sums),
                    [step_t] * len(params_group),
                    lr=lr_now,
                    lr_decay=lr_decay,
                    weight_decay=weight_decay,
                    eps=eps,
                    maximize=maximize,
                )
        unflatten = _core.unflattener(inputs.treedef)
        return unflatten(inputs.params), AdagradState(
            count=_core.next_count(count), sum=unflatten(sums)
        )

    return Optimizer(init=init, update=_core.derive_update(apply), apply=apply, pointwise=True)
