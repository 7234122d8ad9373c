"""Fully sharded state in and out: consolidate shards into full tensors, reshard full ones.

The public entry points are `fscale.consolidate` and `shard_state`, which call
the plan's ``consolidate`` / ``shard_state`` methods; for a `fully_shard` step those are the two
functions here.

Parameters are easy: a unit's shards over ranks 0..N-1 are its flat buffer in rank order.
Optimizer state follows the generic rule of `fscale.parallel.opt_state` (shared with
`shard_optimizer`): replicated leaves are kept whole on every rank, per-parameter leaves are
sharded exactly as their parameters are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.parallel.fsdp.units import ShardLayout
from fscale.parallel.opt_state import StateMap, check_state, plan_state_init, state_spec
from fscale.plan import TrainState

if TYPE_CHECKING:
    from fscale.parallel.fsdp.plan import FullyShardPlan

__all__ = ["consolidate_fully_sharded", "shard_fully_sharded"]


def consolidate_fully_sharded(plan: FullyShardPlan, step: Any, state: TrainState) -> TrainState:
    """The full, unsharded TrainState of a `fully_shard` step, on every rank.

    A collective over the step's shard axis: every rank must call it. Parameters come back as
    the ``{name: tensor}`` dict `step.init` was given (same order); the optimizer state has
    the structure ``step.optimizer.init(full_params)`` has. Buffers, step and key are passed
    through (they are replicated). Everything else is a copy: the result shares no memory
    with `state`.

    Args:
        plan: the step's `fully_shard` layer.
        step: the step the state belongs to.
        state: this rank's sharded state.

    Returns:
        A TrainState a single-process step (or `shard_state` at any world size) can continue from.

    Raises:
        TypeError: `step` is not a fully_shard step or `state` is not its state.
        ValueError: the state was sharded for another number of ranks, or its optimizer state
            does not have the structure and shapes the step's optimizer gives (the message
            names the first difference).
    """
    shards = plan.checked_shards(state.params)
    layout = plan.layout
    mesh, axis = plan.mesh, plan.axis
    rank = mesh.rank(axis)
    devices = {name: shards[unit.name].device for unit in layout.units for name in unit.names}
    state_map = _state_map(plan, step, layout, devices)
    check_state(
        "consolidate",
        "state.opt_state",
        state.opt_state,
        state_map.ranks[rank],
        f"it is not rank {rank}'s optimizer state of this step",
    )
    with torch.no_grad():
        gathered = {
            name: collectives.all_gather(shard.detach(), axis, mesh=mesh)
            for name, shard in shards.items()
        }
        params = layout.unshard(gathered)
        opt_state = state_map.consolidate(
            state.opt_state,
            rank,
            lambda t: collectives.all_gather(t, axis, mesh=mesh),
            copy_replicated=True,  # like the parameters, the full state owns its memory
        )
    return TrainState(params, state.buffers, opt_state, state.step, state.key)


def shard_fully_sharded(plan: FullyShardPlan, step: Any, full_state: TrainState) -> TrainState:
    """This rank's sharded state for `step` from a full state (from `consolidate` or a run).

    Works at any world size: the full state does not remember how it was sharded. Every rank
    must pass the same full state. Nothing is communicated.

    Args:
        plan: the step's `fully_shard` layer.
        step: the step.
        full_state: a TrainState with full ``{name: tensor}`` params and the optimizer state of
            ``step.optimizer.init(full params)``'s structure.

    Returns:
        The state `step` continues from.

    Raises:
        TypeError / ValueError: `step` is not a fully_shard step, or the state's optimizer
            state has another structure or shapes than the step's optimizer makes.
    """
    layout = plan.layout_for(full_state.params)
    rank = plan.mesh.rank(plan.axis)
    devices = {name: tensor.device for name, tensor in full_state.params.items()}
    state_map = _state_map(plan, step, layout, devices)
    check_state(
        "shard_state",
        "full_state.opt_state",
        full_state.opt_state,
        state_map.full,
        "pass the full state of this step's optimizer on these params",
    )
    opt_state = state_map.shard(full_state.opt_state, rank)
    shards = layout.shard(full_state.params, rank)
    # Only a state that passed every check replaces the model the step knows.
    plan.record_layout(layout)
    return TrainState(shards, full_state.buffers, opt_state, full_state.step, full_state.key)


def _state_map(
    plan: FullyShardPlan, step: Any, layout: ShardLayout, devices: dict[str, torch.device]
) -> StateMap:
    """The optimizer's state on the full parameters and on every rank's fragments.

    `devices` (``{name: device of the real tensor}``) lets an optimizer whose init needs real
    values (`fscale.offload_optimizer` copies them to the host) be initialised there instead.
    """
    # In the leaf order of the params dict (optree sorts its keys), as state_spec flattens it.
    leaf_devices = tree.leaves({name: devices[name] for name in layout.param_order})
    full = state_spec(plan_state_init(plan.inner, step), layout.meta_params(), devices=leaf_devices)
    ranks = [
        state_spec(
            plan_state_init(plan.inner, step, _meta_shards(layout)),
            layout.meta_fragments(rank),
            layout.fragments(rank),
            devices=leaf_devices,
        )
        for rank in range(layout.num_shards)
    ]
    return StateMap(full, ranks)


def _meta_shards(layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Stand-ins for a rank's ``{unit name: 1-D shard}`` (every rank's have the same shapes)."""
    return {
        unit.name: torch.empty(unit.shard_size, dtype=unit.dtype, device="meta")
        for unit in layout.units
    }
