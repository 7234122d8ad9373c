"""Fully sharded state in and out: consolidate shards into full tensors, reshard full ones.

The public entry points are `fscale.consolidate` and `shard_state`, which call
the plan's ``consolidate`` / ``shard_state`` methods; for a `fully_shard` step those are the two
functions here.

Parameters are easy: a unit's shards over ranks 0..N-1 are its flat buffer in rank order.
Optimizer state is handled by one generic rule, so every optimizer (and chain) works without
knowing its state type. Initialise the optimizer on full-shape meta tensors (structure and
full shapes, no memory) and, for every rank r, on meta tensors shaped like rank r's fragments
(what the sharded step initialises it on). A state leaf whose shape is the same on every rank
as in the full initialisation is *replicated* (a step count, Adafactor's row and column
factors, which sharded Adafactor keeps whole on every rank); any other leaf is a *fragment*: its
pieces over ranks 0..N-1, concatenated in rank order, are the row-major flattening of the full
leaf (a per-parameter moment is sharded exactly as its parameter is).
"""

from __future__ import annotations

from typing import Any

import torch

from fscale import optim as optim_lib
from fscale import tree
from fscale.dist import collectives
from fscale.parallel.units import ShardLayout
from fscale.train import Step, TrainState

__all__ = ["consolidate_fully_sharded", "shard_fully_sharded"]


def consolidate_fully_sharded(step: Step, state: TrainState) -> TrainState:
    """The full, unsharded TrainState of a `fully_shard` step, on every rank.

    A collective over the step's shard axis: every rank must call it. Parameters come back as
    the ``{name: tensor}`` dict `step.init` was given (same order); the optimizer state has
    the structure ``step.optimizer.init(full_params)`` has. Buffers, step and key are passed
    through (they are replicated).

    Args:
        step: the `fully_shard` step the state belongs to.
        state: this rank's sharded state.

    Returns:
        A TrainState a single-process step (or `shard_state` at any world size) can continue from.

    Raises:
        TypeError: `step` is not a fully_shard step or `state` is not its state.
        ValueError: the state was sharded for another number of ranks, or its optimizer state
            does not have the structure the step's optimizer gives (the message names it).
    """
    plan = _plan(step, "consolidate")
    shards = plan._checked_shards(state.params)
    layout = plan.layout
    mesh, axis = plan.mesh, plan.axis
    with torch.no_grad():
        gathered = {
            name: collectives.all_gather(shard.detach(), axis, mesh=mesh)
            for name, shard in shards.items()
        }
        params = layout.unshard(gathered)
        opt_state = _consolidate_opt_state(step.optimizer, layout, state.opt_state, plan)
    return TrainState(params, state.buffers, opt_state, state.step, state.key)


def shard_fully_sharded(step: Step, full_state: TrainState) -> TrainState:
    """This rank's sharded state for `step` from a full state (from `consolidate` or a run).

    Works at any world size: the full state does not remember how it was sharded. Every rank
    must pass the same full state. Nothing is communicated.

    Args:
        step: a `fully_shard` step.
        full_state: a TrainState with full ``{name: tensor}`` params and the optimizer state of
            ``step.optimizer.init(full params)``'s structure.

    Returns:
        The state `step` continues from.

    Raises:
        TypeError / ValueError: `step` is not a fully_shard step, or the state's optimizer
            state has another structure than the step's optimizer makes.
    """
    plan = _plan(step, "shard_state")
    if not isinstance(full_state, TrainState):
        raise TypeError(f"shard_state: `full_state` must be a TrainState, got {type(full_state).__name__}")
    layout = plan.layout_for(full_state.params)
    plan.record_layout(layout)
    rank = plan.mesh.rank(plan.axis)
    shards = layout.shard(full_state.params, rank)
    roles = _state_roles(step.optimizer, layout)
    full_leaves, treedef = tree.flatten(full_state.opt_state)
    _check_structure(treedef, roles.treedef, "shard_state", "full_state.opt_state")
    leaves = []
    for i, leaf in enumerate(full_leaves):
        if i in roles.fragment_leaves:
            start = sum(roles.shapes[q][i].numel() for q in range(rank))
            stop = start + roles.shapes[rank][i].numel()
            leaves.append(leaf.reshape(-1)[start:stop].clone())
        else:
            leaves.append(leaf.clone())
    opt_state = tree.unflatten(treedef, leaves)
    return TrainState(shards, full_state.buffers, opt_state, full_state.step, full_state.key)


# ---------------------------------------------------------------------------------------------


class _Roles:
    """Which optimizer state leaves are fragments, and every rank's shape of each leaf."""

    def __init__(self, treedef: Any, full_shapes: list[torch.Size], shapes: list[list[torch.Size]]):
        self.treedef = treedef
        self.full_shapes = full_shapes
        self.shapes = shapes  # shapes[rank][leaf]
        self.fragment_leaves = {
            i
            for i, full in enumerate(full_shapes)
            if any(rank_shapes[i] != full for rank_shapes in shapes)
        }


def _state_roles(optimizer: optim_lib.Optimizer, layout: ShardLayout) -> _Roles:
    full_leaves, full_def = tree.flatten(optimizer.init(layout.meta_params()))
    shapes = []
    for rank in range(layout.num_shards):
        sharded_layout = optim_lib.Layout(layout.fragments(rank), _no_collective)
        leaves, treedef = tree.flatten(optimizer.init(layout.meta_fragments(rank), layout=sharded_layout))
        if treedef != full_def:
            raise ValueError(
                "the optimizer's state has another structure on shards than on full tensors "
                f"({treedef} vs {full_def}), so it cannot be consolidated by the generic rule"
            )
        shapes.append([_shape(leaf) for leaf in leaves])
    return _Roles(full_def, [_shape(leaf) for leaf in full_leaves], shapes)


def _no_collective(t: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("optimizer init must not communicate")


def _shape(leaf: Any) -> torch.Size:
    return leaf.shape if isinstance(leaf, torch.Tensor) else torch.Size()


def _check_structure(actual: Any, expected: Any, caller: str, what: str) -> None:
    if actual != expected:
        raise ValueError(
            f"{caller}: `{what}` has structure {actual}, but the step's optimizer makes "
            f"{expected}; pass the state of this step's optimizer"
        )


def _consolidate_opt_state(optimizer, layout: ShardLayout, opt_state: Any, plan: Any) -> Any:  # type: ignore[no-untyped-def]
    roles = _state_roles(optimizer, layout)
    leaves, treedef = tree.flatten(opt_state)
    _check_structure(treedef, roles.treedef, "consolidate", "state.opt_state")
    rank = plan.mesh.rank(plan.axis)
    for i, leaf in enumerate(leaves):
        if _shape(leaf) != roles.shapes[rank][i]:
            raise ValueError(
                f"consolidate: optimizer state leaf {tree.paths(opt_state)[i]!r} has shape "
                f"{tuple(_shape(leaf))} but a shard of rank {rank} should have "
                f"{tuple(roles.shapes[rank][i])}"
            )
    full = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    fragment_leaves = sorted(roles.fragment_leaves)
    # One all-gather per dtype: this rank's fragments packed, padded to the longest rank's.
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in fragment_leaves:
        by_dtype.setdefault(leaves[i].dtype, []).append(i)
    num_ranks = layout.num_shards
    for indices in by_dtype.values():
        sizes = [[roles.shapes[r][i].numel() for i in indices] for r in range(num_ranks)]
        longest = max(max(sum(s) for s in sizes), 1)
        packed = leaves[indices[0]].new_zeros(longest)
        offset = 0
        for i in indices:
            n = leaves[i].numel()
            packed[offset : offset + n] = leaves[i].reshape(-1)
            offset += n
        gathered = collectives.all_gather(packed, plan.axis, mesh=plan.mesh).view(num_ranks, -1)
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in indices}
        for r in range(num_ranks):
            offset = 0
            for i, n in zip(indices, sizes[r]):
                pieces[i].append(gathered[r, offset : offset + n])
                offset += n
        for i in indices:
            full[i] = torch.cat(pieces[i]).view(roles.full_shapes[i])
    return tree.unflatten(treedef, full)


def _plan(step: Any, caller: str) -> Any:
    from fscale.parallel.fsdp import FullyShardPlan

    if not isinstance(step, Step) or not isinstance(step.plan, FullyShardPlan):
        raise TypeError(
            f"{caller}: `step` must be a step made by fscale.parallel.fully_shard, got "
            f"{step!r}"
        )
    return step.plan

