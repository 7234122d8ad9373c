"""`dense_state`: a tensor-parallel model's TrainState gathered into the dense model's, and
`tensor_parallel_state`, its inverse.

Each split parameter is all-gathered over the tensor-parallel axis and its chunks put back in the
dense order (for a fused weight split within `parts` blocks, rank r's shard holds chunk r of
every block: the blocks are rebuilt one after the other). An optimizer-state leaf that mirrors a
parameter (inside a subtree with the params' structure, of that parameter's shape: Adam's
moments, momentum) is gathered the same way. Every other leaf is the same on every rank of the
axis and is kept: a replicated parameter and its moments, the step count, and the row and
column factors that `tensor_parallel_optimizer` keeps for the full tensors. The result is the
state a single process training the dense model holds, on every rank; the data-parallel layers
are consolidated first (`fscale.consolidate`).
"""

from __future__ import annotations

from typing import Any

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.parallel.opt_state import mirrored_leaves
from fscale.parallel.tensor.apply import shard_tensor, splits_of
from fscale.parallel.tensor.layers import TensorAxis
from fscale.parallel.tensor.styles import Split
from fscale.plan import TrainState

__all__ = ["dense_state", "tensor_parallel_state"]


def dense_state(state: TrainState, model: Any) -> TrainState:
    """The dense model's TrainState from this rank's full (data-parallel consolidated) state of
    the tensor-parallel `model`; every rank of its axis must call it (one all-gather per split
    tensor)."""
    splits, axis = splits_of(model, "consolidate")
    if axis.size == 1:
        return state
    missing = [name for name in tree.paths(state.params) if name not in splits]
    if missing:
        raise ValueError(
            f"consolidate: the state's parameters {missing[:3]} are not parameters of the "
            "tensor-parallel `model`; pass the model whose parameters the step trains"
        )
    mirrors = mirrored_leaves(state.params, state.opt_state)

    def param(name: str, leaf: torch.Tensor) -> torch.Tensor:
        return _dense(leaf, splits[name], axis)

    def opt_leaf(path: str, leaf: Any) -> Any:
        mirrored = mirrors.get(path)
        if mirrored is None:
            return leaf
        return _dense(leaf, splits[mirrored.removeprefix("params/")], axis)

    return tree.with_fields(
        state,
        params=tree.map_with_path(param, state.params),
        opt_state=tree.map_with_path(opt_leaf, state.opt_state),
    )


def tensor_parallel_state(dense: TrainState, model: Any) -> TrainState:
    """This rank's full state of the tensor-parallel `model`, cut from the dense model's state
    (`dense_state`'s inverse, no communication): each split parameter and each optimizer-state
    leaf that mirrors one becomes this rank's shard (`shard_tensor`), every other leaf is
    kept."""
    splits, axis = splits_of(model, "shard_state")
    if axis.size == 1:
        return dense
    names = tree.paths(dense.params)
    missing = [name for name in names if name not in splits]
    if missing:
        raise ValueError(
            f"shard_state: the state's parameters {missing[:3]} are not parameters of the "
            "tensor-parallel `model`; pass the dense state of the model the step trains"
        )
    mirrors = mirrored_leaves(dense.params, dense.opt_state)

    def cut(leaf: torch.Tensor, split: Split | None) -> torch.Tensor:
        return leaf if split is None else shard_tensor(leaf, split, axis.size, axis.index)

    def opt_leaf(path: str, leaf: Any) -> Any:
        mirrored = mirrors.get(path)
        return leaf if mirrored is None else cut(leaf, splits[mirrored.removeprefix("params/")])

    return tree.with_fields(
        dense,
        params=tree.map_with_path(lambda name, leaf: cut(leaf, splits[name]), dense.params),
        opt_state=tree.map_with_path(opt_leaf, dense.opt_state),
    )


def _dense(shard: torch.Tensor, split: Split | None, axis: TensorAxis) -> torch.Tensor:
    if split is None:
        return shard
    with torch.no_grad():
        gathered = collectives.all_gather(shard.contiguous(), axis.axis, split.dim, mesh=axis.mesh)
    if split.parts == 1:
        return gathered
    # [rank 0: block 0 .. block k-1][rank 1: ...] -> [block 0: rank 0 .. rank N-1][block 1: ...]
    dim = split.dim
    chunks = gathered.unflatten(dim, (axis.size, split.parts, -1))
    return chunks.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()
