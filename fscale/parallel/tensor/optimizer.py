"""`tensor_parallel_optimizer`: statistics over whole tensors for an optimizer of a tensor-parallel
model.

A pointwise optimizer (SGD, Adam, AdamW ...) needs nothing: each element's update depends on
that element alone, and a `tensor_parallel` model's gradients are complete (the collectives run
inside its forward and backward). A non-pointwise one computes statistics over whole tensors:
`clip_by_global_norm` the global norm, `lamb` each tensor's norms, `adafactor` its row and column
means and RMS values. On a tensor-parallel rank, which holds a shard of each split tensor and a
replica of the others, those statistics taken over the rank's own leaves differ from rank to
rank: the shards are scaled by other factors than the dense model's, and the replicas (the
norms' weights) drift apart.

The wrapper gives the optimizer a `fscale.optim.Sharding` in which each split leaf is its shard
of the full tensor (`fscale.flat.Fragment.block`) and each replica counts on the axis's first
rank only (`Fragment.counted`), and whose sum runs over the tensor-parallel axis, after the sum
of the plan that shards the optimizer over another axis (ZeRO, FSDP), if any. The result is the
dense optimizer's, within float round-off (the sums are taken in another order), on every
layout: tp alone, tp × dp with `data_parallel`, `shard_optimizer` or `fully_shard` over dp.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.flat import Fragment, TensorSlice
from fscale.optim.base import Optimizer, Sharding, resolve_sharding
from fscale.parallel.tensor.apply import splits_of
from fscale.parallel.tensor.layers import TensorAxis

__all__ = ["tensor_parallel_optimizer"]

PyTree = Any
_NAME = "tensor_parallel_optimizer"


def tensor_parallel_optimizer(optimizer: Optimizer, model: Any) -> Optimizer:
    """`optimizer` with its statistics taken over the whole tensors of a tensor-parallel model.

    Args:
        optimizer: any `fscale.optim.Optimizer` over the model's parameters, e.g.
            ``chain(clip_by_global_norm(1.0), adamw(3e-4))``: the whole optimizer, so that it
            sees the parameters under their names (inside `partition`, the leaves are a label's
            list and have none). A pointwise optimizer is returned as it is.
        model: the `tensor_parallel` module, or the `FunctionalModule` that
            `fscale.functionalize` made of it: its splits say which parameters are shards.

    Returns:
        An `Optimizer` whose `init`, `update` and `apply` hand `optimizer` a `Sharding` over
        the full tensors (see the module docstring).

    Raises:
        TypeError: `optimizer` is not an Optimizer, or `model` is not a `tensor_parallel` module.
        ValueError: `optimizer` is wrapped already; at init or update, a parameter the model
            does not have.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"{_NAME}: `optimizer` must be an fscale.optim.Optimizer, got {optimizer!r}"
        )
    if optimizer.description.startswith(f"{_NAME}("):
        raise ValueError(f"{_NAME}: {optimizer!r} is wrapped already; wrap the optimizer once")
    splits, axis = splits_of(model, _NAME)
    if optimizer.pointwise:
        return optimizer

    def full(params: PyTree, outer: Sharding | None) -> Sharding:
        raw_paths, leaves, treedef = optree.tree_flatten_with_path(params, none_is_leaf=False)
        fragments, outer_sum = resolve_sharding(_NAME, outer, leaves, treedef)
        placed = [_place(path, frag, splits, axis) for path, frag in zip(raw_paths, fragments)]

        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            return collectives.all_reduce(outer_sum(t), axis.axis, "sum", mesh=axis.mesh)

        return Sharding(tree.unflatten(treedef, placed), all_reduce)

    def init(params: PyTree, *, sharding: Sharding | None = None) -> Any:
        return optimizer.init(params, sharding=full(params, sharding))

    def update(
        grads: PyTree, state: Any, params: PyTree = None, *, sharding: Sharding | None = None
    ) -> tuple[PyTree, Any]:
        return optimizer.update(grads, state, params, sharding=full(grads, sharding))

    def apply(
        grads: PyTree,
        state: Any,
        params: PyTree,
        *,
        sharding: Sharding | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, Any]:
        assert optimizer.apply is not None  # offered only when the optimizer has one
        sharding = full(grads, sharding)
        return optimizer.apply(grads, state, params, sharding=sharding, donate=donate)

    return Optimizer(
        init=init,
        update=update,
        apply=apply if optimizer.apply is not None else None,
        pointwise=False,
        description=f"{_NAME}({optimizer!r}, axis={axis.axis!r})",
    )


def _place(
    raw_path: tuple[Any, ...], frag: Fragment, splits: dict[str, Any], axis: TensorAxis
) -> Fragment:
    """`frag`, a piece of this rank's leaf at `raw_path`, as a piece of the full tensor.

    The leaf is named by its dotted path (the params `fscale.functionalize` returns), or by its
    key in the dict that holds it (a pipeline rank's params: one dict per stage it holds, each
    under the Sequential's names)."""
    path = tree.path_str(raw_path)
    if path not in splits and raw_path and str(raw_path[-1]) in splits:
        path = str(raw_path[-1])
    if path not in splits:
        known = ", ".join(list(splits)[:4]) + (", ..." if len(splits) > 4 else "")
        raise ValueError(
            f"{_NAME}: the optimizer got a parameter {path!r} that the tensor-parallel model "
            f"does not have (its parameters: {known}); wrap the optimizer that updates the "
            "model's parameters under their names (the whole optimizer, not a part of a "
            "partition)"
        )
    if frag.block is not None or not frag.counted:
        raise ValueError(
            f"{_NAME}: parameter {path!r} is already placed in a tensor-parallel layout; wrap "
            "the optimizer once"
        )
    split = splits[path]
    if split is None or axis.size == 1:
        return Fragment(frag.shape, frag.start, frag.stop, None, counted=axis.index == 0)
    shape = list(frag.shape)
    shape[split.dim] *= axis.size
    block = TensorSlice(split.dim, split.parts, axis.size, axis.index)
    return Fragment(torch.Size(shape), frag.start, frag.stop, block)
