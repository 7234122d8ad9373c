"""Gradient transformations without an exact `apply`: global-norm clipping and scaling."""

from __future__ import annotations

from typing import Any

import torch

from fscale import tree
from fscale.optim import core, hyper
from fscale.optim.base import EmptyState, Optimizer, Sharding, described, resolve_sharding

__all__ = ["clip_by_global_norm", "scale"]

PyTree = Any


@described
def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Scale the gradients so that their global L2 norm is at most `max_norm`.

    The coefficient is ``min(1, max_norm / (norm + 1e-6))``, as in
    ``torch.nn.utils.clip_grad_norm_``. Under a `Sharding` the squared norm is summed over the
    rank's fragments and completed with one ``all_reduce`` of a one-element tensor.

    Args:
        max_norm: the largest allowed global norm, >= 0.

    Returns:
        An `Optimizer` with ``apply=None``; chain it before an optimizer:
        ``chain(clip_by_global_norm(1.0), adamw(3e-4))``.

    Raises:
        ValueError: for a negative `max_norm`.
    """
    name = "clip_by_global_norm"
    max_norm = hyper.check_non_negative(name, "max_norm", max_norm, finite=False)

    def init(params: PyTree, *, sharding: Sharding | None = None) -> EmptyState:
        return EmptyState()

    def update(
        grads: PyTree, state: EmptyState, params: PyTree = None, *, sharding: Sharding | None = None
    ) -> tuple[PyTree, EmptyState]:
        leaves, treedef = tree.flatten(grads)
        if not leaves:
            return grads, state
        _, all_reduce = resolve_sharding(name, sharding, leaves, treedef)
        with torch.no_grad():
            device = leaves[0].device
            squares = core.sum_of_squares(leaves[0], device)
            for g in leaves[1:]:
                squares = squares + core.sum_of_squares(g, device)
            norm = all_reduce(squares.reshape(1)).sqrt().reshape(())  # 0-d: keeps 0-d leaves 0-d
            coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            clipped = [g * coefficient.to(g) for g in leaves]
        return tree.unflatten(treedef, clipped), state

    return Optimizer(init=init, update=update, apply=None, pointwise=False)


@described
def scale(factor: float) -> Optimizer:
    """Multiply the gradients by `factor` (any float; e.g. -1 to turn them into a descent step).

    Returns:
        A pointwise `Optimizer` with ``apply=None``.

    Raises:
        TypeError: if `factor` is not a number.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"scale: `factor` must be a number, got {type(factor).__name__}")
    factor = float(factor)

    def init(params: PyTree, *, sharding: Sharding | None = None) -> EmptyState:
        return EmptyState()

    def update(
        grads: PyTree, state: EmptyState, params: PyTree = None, *, sharding: Sharding | None = None
    ) -> tuple[PyTree, EmptyState]:
        with torch.no_grad():
            return tree.map(lambda g: g * factor, grads), state

    return Optimizer(init=init, update=update, apply=None, pointwise=True)
