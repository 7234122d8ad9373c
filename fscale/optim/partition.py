"""Different optimizers for different groups of parameters (optax's ``multi_transform``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import optree
import torch

from fscale import tree
from fscale.optim.base import Optimizer, Sharding, described, is_fragment, resolve_sharding
from fscale.optim.base import step as optimizer_step

__all__ = ["PartitionState", "partition"]

PyTree = Any
Labels = PyTree | Callable[[str, torch.Tensor], str]


class PartitionState(NamedTuple):
    """State of `partition`: each group's optimizer state, keyed by label.

    Each inner state covers the list of that group's leaves, in the params' leaf order.
    """

    inner: dict[str, Any]


@described
def partition(labels: Labels, optimizers: Mapping[str, Optimizer]) -> Optimizer:
    """Route each parameter to the optimizer of its label.

    Every group's optimizer sees a flat list of its leaves (in the params' leaf order) and the
    matching fragments of the `Sharding`, so non-pointwise optimizers stay exact under sharding.

    Args:
        labels: a pytree of strings with the params' structure, or a function
            ``(path, leaf) -> label`` where `path` is the leaf's dotted path (``"blocks.0.w"``);
            under a `Sharding`, `leaf` is a meta tensor with the full tensor's shape and dtype.
        optimizers: the optimizer of each label.

    Returns:
        An `Optimizer` whose state is a `PartitionState`, pointwise when every group's
        optimizer is. Its `apply` exists when some group's optimizer has one: it runs each group
        through `fscale.optim.step`, so a group with an exact `apply` stays bit-exact next to a
        group of gradient transforms (``scale(0.0)`` to freeze parameters).

    Raises:
        ValueError: if a leaf's label has no optimizer, or `labels` has another structure than
            the params.

    Example:
        >>> import fscale.optim as optim
        >>> no_decay = lambda path, leaf: "plain" if leaf.dim() < 2 else "decay"
        >>> opt = optim.partition(no_decay, {"decay": optim.adamw(1e-3), "plain": optim.adam(1e-3)})
    """
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise ValueError("partition: `optimizers` must be a non-empty mapping label -> Optimizer")
    for label, opt in optimizers.items():
        if not isinstance(opt, Optimizer):
            raise TypeError(f"partition: optimizers[{label!r}] is a {type(opt).__name__}")
    names = sorted(optimizers)

    def groups(
        params: PyTree, sharding: Sharding | None
    ) -> tuple[list[torch.Tensor], optree.PyTreeSpec, dict[str, list[int]]]:
        paths, leaves, treedef = tree.flatten_with_paths(params)
        if callable(labels):
            # Under a sharding a leaf is a 1-D fragment; the label function sees a stand-in with
            # the full tensor's shape, so `leaf.dim()` rules label every rank's pieces alike.
            fragments, _ = resolve_sharding("partition", sharding, leaves, treedef)
            shaped = [
                leaf
                if sharding is None
                else torch.empty(frag.shape, dtype=leaf.dtype, device="meta")
                for leaf, frag in zip(leaves, fragments)
            ]
            leaf_labels = [labels(path, leaf) for path, leaf in zip(paths, shaped)]
        else:
            leaf_labels, labels_def = tree.flatten(labels)
            if labels_def != treedef:
                raise ValueError(
                    f"partition: `labels` has structure {labels_def} but the params have "
                    f"structure {treedef}; give one label per parameter leaf"
                )
        indices: dict[str, list[int]] = {label: [] for label in names}
        for i, (path, label) in enumerate(zip(paths, leaf_labels)):
            if label not in indices:
                raise ValueError(
                    f"partition: leaf {path!r} has label {label!r}, which has no optimizer; "
                    f"known labels: {names}"
                )
            # checked just above: `label` is one of the keys of `indices`, the string labels
            indices[cast(str, label)].append(i)
        return leaves, treedef, indices

    def sub_sharding(sharding: Sharding | None, idx: list[int]) -> Sharding | None:
        if sharding is None:
            return None
        fragments = optree.tree_leaves(sharding.fragments, is_leaf=is_fragment, none_is_leaf=False)
        return Sharding([fragments[i] for i in idx], sharding.all_reduce)

    def pick(leaves: list[Any], idx: list[int]) -> list[Any]:
        return [leaves[i] for i in idx]

    def check(state: Any) -> None:
        if not isinstance(state, PartitionState) or sorted(state.inner) != names:
            raise ValueError(
                f"partition: `state` must be the PartitionState that init returned, with groups "
                f"{names}"
            )

    def init(params: PyTree, *, sharding: Sharding | None = None) -> PartitionState:
        leaves, _, indices = groups(params, sharding)
        return PartitionState(
            {
                label: optimizers[label].init(
                    pick(leaves, indices[label]), sharding=sub_sharding(sharding, indices[label])
                )
                for label in names
            }
        )

    def run(
        group_fn: Callable[..., tuple[list[Any], Any]],
        grads: PyTree,
        state: PartitionState,
        params: PyTree,
        **kwargs: Any,
    ) -> tuple[PyTree, PartitionState]:
        """`group_fn(optimizer, grads, state, params, sharding=..., **kwargs)` on every group."""
        check(state)
        if params is None:
            raise ValueError("partition: `params` is required (labels are assigned from them)")
        sharding = kwargs.pop("sharding", None)
        leaves, treedef, indices = groups(params, sharding)
        grad_leaves, grads_def = tree.flatten(grads)
        if grads_def != treedef:
            raise ValueError(
                f"partition: `grads` has structure {grads_def} but `params` has structure "
                f"{treedef}; pass trees of the same structure"
            )
        out: list[Any] = [None] * len(leaves)
        new_inner = {}
        for label in names:
            idx = indices[label]
            result, new_inner[label] = group_fn(
                optimizers[label],
                pick(grad_leaves, idx),
                state.inner[label],
                pick(leaves, idx),
                sharding=sub_sharding(sharding, idx),
                **kwargs,
            )
            for i, value in zip(idx, result):
                out[i] = value
        return tree.unflatten(treedef, out), PartitionState(new_inner)

    def update(
        grads: PyTree,
        state: PartitionState,
        params: PyTree = None,
        *,
        sharding: Sharding | None = None,
    ) -> tuple[PyTree, PartitionState]:
        return run(_group_update, grads, state, params, sharding=sharding)

    def apply(
        grads: PyTree,
        state: PartitionState,
        params: PyTree,
        *,
        sharding: Sharding | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, PartitionState]:
        return run(optimizer_step, grads, state, params, sharding=sharding, donate=donate)

    # With no group producing params, the partition is a gradient transform (apply=None), so
    # chain() and step() treat it as one.
    produces_params = any(opt.apply is not None for opt in optimizers.values())
    return Optimizer(
        init=init,
        update=update,
        apply=apply if produces_params else None,
        pointwise=all(opt.pointwise for opt in optimizers.values()),
    )


def _group_update(
    optimizer: Optimizer, grads: Any, state: Any, params: Any, **kwargs: Any
) -> tuple[Any, Any]:
    return optimizer.update(grads, state, params, **kwargs)
