"""Gradient transformations without an exact `apply`: global-norm clipping and scaling.

`clip_by_global_norm` offers two formulas for the global norm. ``"torch"`` (the default) is
``torch.nn.utils.clip_grad_norm_``'s: the 2-norm of the vector of per-tensor 2-norms, the
per-tensor norms taken by ``torch._foreach_norm`` over the tensors grouped by device and dtype
(in order of first appearance, as torch groups them), so a clipped run matches a torch loop bit
for bit. ``"sum_of_squares"`` is the square root of one running sum of every tensor's squared
elements. Both scale the gradients by ``min(1, max_norm / (norm + 1e-6))``.

Under a `Sharding` each leaf is a fragment of one tensor. With ``"torch"`` the per-tensor norms
are completed by one ``all_reduce`` of a float64 vector holding, per tensor, its norm where a
rank holds the whole tensor (zero on every other rank) and its squared sum over the fragments
where it is split: a tensor held whole by one rank gets exactly torch's norm (adding zeros and
widening to float64 round nothing), a split one the square root of the completed sum (within
fp32 round-off of torch). ``"sum_of_squares"`` all-reduces the one-element squared sum. A
tensor-parallel shard (`Fragment.block`) is a split tensor; a replica that is not `counted`
adds nothing, so a norm's weight held whole by every tensor-parallel rank counts once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from fscale import tree
from fscale.flat import Fragment
from fscale.optim import core, hyper
from fscale.optim.base import (
    EmptyState,
    Optimizer,
    Sharding,
    counted_only,
    described,
    resolve_sharding,
)

__all__ = ["clip_by_global_norm", "scale"]

PyTree = Any
NormFormula = Literal["torch", "sum_of_squares"]
_FORMULAS = ("torch", "sum_of_squares")


@described
def clip_by_global_norm(max_norm: float, *, formula: NormFormula = "torch") -> Optimizer:
    """Scale the gradients so that their global L2 norm is at most `max_norm`.

    The coefficient is ``min(1, max_norm / (norm + 1e-6))``, as in
    ``torch.nn.utils.clip_grad_norm_``; the module docstring says how each `formula` computes
    the norm, and how it is completed under a `Sharding`.

    Args:
        max_norm: the largest allowed global norm, >= 0.
        formula: ``"torch"`` (the norm of the per-tensor norms, bit for bit as
            ``clip_grad_norm_``) or ``"sum_of_squares"`` (one sum of all squared elements).

    Returns:
        An `Optimizer` with ``apply=None``; chain it before an optimizer:
        ``chain(clip_by_global_norm(1.0), adamw(3e-4))``.

    Raises:
        ValueError: for a negative `max_norm` or an unknown `formula`.
    """
    name = "clip_by_global_norm"
    max_norm = hyper.check_non_negative(name, "max_norm", max_norm, finite=False)
    if formula not in _FORMULAS:
        raise ValueError(
            f'{name}: `formula` must be one of {_FORMULAS} ("torch": the norm of the per-tensor'
            f" norms, as torch.nn.utils.clip_grad_norm_), got {formula!r}"
        )

    def init(params: PyTree, *, sharding: Sharding | None = None) -> EmptyState:
        return EmptyState()

    def update(
        grads: PyTree, state: EmptyState, params: PyTree = None, *, sharding: Sharding | None = None
    ) -> tuple[PyTree, EmptyState]:
        leaves, treedef = tree.flatten(grads)
        if not leaves:
            return grads, state
        fragments, all_reduce = resolve_sharding(name, sharding, leaves, treedef)
        with torch.no_grad():
            if formula == "sum_of_squares":
                clipped = _clip_by_sum_of_squares(leaves, fragments, all_reduce, max_norm)
            else:
                groups = _groups(leaves, _insertion_order(grads, leaves))
                norm = _norm_of_norms(
                    leaves, groups, fragments, all_reduce, sharded=sharding is not None
                )
                coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
                clipped = _scaled(leaves, groups, coefficient)
        return tree.unflatten(treedef, clipped), state

    return Optimizer(init=init, update=update, apply=None, pointwise=False)


def _clip_by_sum_of_squares(
    leaves: list[torch.Tensor],
    fragments: list[Fragment],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    max_norm: float,
) -> list[torch.Tensor]:
    device = leaves[0].device
    squares: torch.Tensor | None = None
    for g, frag in zip(leaves, fragments):
        term = core.sum_of_squares(g, device)
        # A replica adds zero, of its dtype: every rank sums in the same dtype.
        term = term if frag.counted else torch.zeros_like(term)
        squares = term if squares is None else squares + term
    assert squares is not None  # `update` returns early when there are no leaves
    norm = all_reduce(squares.reshape(1)).sqrt().reshape(())  # 0-d: keeps 0-d leaves 0-d
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return [g * coefficient.to(g) for g in leaves]


def _groups(leaves: list[torch.Tensor], order: list[int]) -> list[list[int]]:
    """Indexes of `leaves` grouped by (device, dtype), groups in order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in order:
        groups.setdefault((leaves[i].device, leaves[i].dtype), []).append(i)
    return list(groups.values())


def _insertion_order(grads: PyTree, leaves: list[torch.Tensor]) -> list[int]:
    """Indexes of `leaves` (optree's order) in the order torch iterates the parameters.

    optree flattens a dict in sorted key order, torch in insertion order (`named_parameters`,
    which is the order of functionalize's dicts); the norm of the stacked norms depends on the
    order of the summands, so torch's is followed. Lists and tuples keep their order; any
    other node keeps optree's order for its leaves.
    """
    positions: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        positions.setdefault(id(leaf), []).append(i)
    order: list[int] = []

    def walk(node: PyTree) -> None:
        if type(node) is dict:
            for value in node.values():
                walk(value)
        elif type(node) in (list, tuple):
            for value in node:
                walk(value)
        else:
            order.extend(positions[id(leaf)].pop(0) for leaf in tree.leaves(node))

    walk(grads)
    return order


def _tensor_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor 2-norms as clip_grad_norm_ takes them (one device and dtype)."""
    if tensors[0].device.type in ("cpu", "cuda"):
        return list(torch._foreach_norm(tensors, 2.0))
    return [torch.linalg.vector_norm(t, 2.0) for t in tensors]


def _norm_of_norms(
    leaves: list[torch.Tensor],
    groups: list[list[int]],
    fragments: list[Fragment],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    *,
    sharded: bool,
) -> torch.Tensor:
    local_norms: list[torch.Tensor | None] = [None] * len(leaves)
    for group in groups:
        whole = [i for i in group if not sharded or fragments[i].is_whole]
        if whole:
            for i, norm in zip(whole, _tensor_norms([leaves[i] for i in whole])):
                local_norms[i] = norm
    if sharded:
        norms = _completed_norms(leaves, local_norms, fragments, all_reduce)
    else:
        norms = [norm for norm in local_norms if norm is not None]
    first_device = leaves[0].device
    ordered = [norms[i].to(first_device) for group in groups for i in group]
    return torch.linalg.vector_norm(torch.stack(ordered), 2.0)


def _completed_norms(
    leaves: list[torch.Tensor],
    local_norms: list[torch.Tensor | None],
    fragments: list[Fragment],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """Every tensor's norm from this rank's fragments, with one all_reduce (module docstring)."""
    device = leaves[0].device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    whole = [zero if n is None else n.to(device, torch.float64) for n in local_norms]
    partial = [
        core.sum_of_squares(leaf, device).to(torch.float64) if n is None else zero
        for leaf, n in zip(leaves, local_norms)
    ]
    totals = all_reduce(counted_only(torch.stack(whole + partial), fragments))
    whole_total, partial_total = totals.split(len(leaves))
    completed = whole_total + partial_total.sqrt()
    return [
        value.to(leaf.device, _norm_dtype(leaf)) for value, leaf in zip(completed.unbind(), leaves)
    ]


def _norm_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of ``torch.linalg.vector_norm(t)``: the real dtype of a complex tensor."""
    return t.real.dtype if t.is_complex() else t.dtype


def _scaled(
    leaves: list[torch.Tensor], groups: list[list[int]], coefficient: torch.Tensor
) -> list[torch.Tensor]:
    """``leaves * coefficient`` as clip_grad_norm_'s `_foreach_mul_` does it, out of place."""
    scaled: list[torch.Tensor | None] = [None] * len(leaves)
    for group in groups:
        tensors = [leaves[i] for i in group]
        factor = coefficient.to(tensors[0].device)
        if tensors[0].device.type in ("cpu", "cuda"):
            products = torch._foreach_mul(tensors, factor)
        else:
            products = [t * factor for t in tensors]
        for i, product in zip(group, products):
            scaled[i] = product
    return scaled  # type: ignore[return-value]


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
