"""Moving a TrainState between strategies and world sizes: `consolidate` and `shard_state`.

Every layer of a plan maps its part of the state (`fscale.Plan.consolidate` / `shard_state`):
a sharded layer (ZeRO, fully sharded) joins its shards into the full state a single-process
step takes and cuts a full state into this rank's shard, a layer that adds to the state
unwraps and rewraps it, and a layer whose state is full passes it through. These two functions
check their arguments and call the plan. Going ``consolidate`` on N ranks then
``shard_state`` on M ranks reshards a run exactly.
"""

from __future__ import annotations

from typing import Any

from fscale.distributed.watchdog import CollectiveTimeoutError
from fscale.parallel.tensor.dense import dense_state, tensor_parallel_state
from fscale.parallel.zero.plan import ShardedOptState
from fscale.plan import TrainState
from fscale.train import Step

__all__ = ["consolidate", "shard_state"]


def consolidate(step: Step, state: TrainState, *, model: Any = None) -> TrainState:
    """The full (unsharded) TrainState of `state`, on every rank.

    For a `shard_optimizer` step, each per-element optimizer state leaf is gathered from its
    ranks' pieces (one all-gather per dtype; every rank of the axis must call this) and the
    result is exactly the state a single-process `train_step` with the same optimizer takes.
    The parameters, buffers and replicated state leaves are shared with `state`, not copied.
    For a step whose state is already full (`train_step`, `data_parallel`), returns `state`.
    With `model` a `tensor_parallel` module, its shards are then gathered over the
    tensor-parallel axis into the dense model's state (`fscale.parallel.tensor.dense`; every
    rank of that axis must call this too).

    Args:
        step: the step that made `state`.
        state: its state.
        model: the `tensor_parallel` module (or its FunctionalModule) whose parameters the step
            trains, to gather its shards; None (the default) keeps them as they are.

    Returns:
        A TrainState whose ``opt_state`` is the wrapped optimizer's full state.

    Raises:
        TypeError: `step` is not a Step or `state` is not a TrainState, or the step's plan has
            no notion of a full state.
        ValueError: `state` does not belong to `step` (another world size, another optimizer).
        CollectiveTimeoutError: a peer did not join the gather within twice the collective
            timeout (called on some ranks only, as under ``if rank == 0:``).
    """
    _check_step_and_state("consolidate", step, state, "state")
    _check_not_zero_state(
        "consolidate",
        step,
        state,
        "`state` is sharded but `step` is not; pass the sharded step that made the state",
    )
    try:
        full = step.plan.consolidate(step, state)
        return full if model is None else dense_state(full, model)
    except CollectiveTimeoutError as error:
        raise CollectiveTimeoutError(
            "consolidate: a peer did not join this rank's gather of the state. consolidate is a "
            "collective over the step's sharded axes: every rank calls it, then the rank that "
            "saves keeps the result (`if rank == 0:` around the save, not around consolidate)."
            f"\n{error}"
        ) from error


def shard_state(step: Step, full_state: TrainState, *, model: Any = None) -> TrainState:
    """The state `step` takes on this rank, built from a full (unsharded) TrainState.

    Works at any world size: the full state may come from `consolidate` over any number of
    ranks, or from a single-process `train_step`. Every rank passes the same full state and
    keeps its own slices (no communication). For a step whose state is full (`train_step`,
    `data_parallel` without a stateful reduction hook), returns `full_state`. With `model` a
    `tensor_parallel` module, `full_state` is the dense model's, first cut into this rank's
    tensor-parallel shards (`fscale.parallel.tensor.dense.tensor_parallel_state`).

    Args:
        step: the step that will run on the state.
        full_state: a TrainState with the full parameters and the optimizer's full state.
        model: the `tensor_parallel` module (or its FunctionalModule) whose parameters the step
            trains, when `full_state` is the dense model's; None (the default): `full_state`
            holds the parameters as the step's model has them.

    Returns:
        The sharded TrainState for this rank.

    Raises:
        TypeError: `step` is not a Step or `full_state` is not a TrainState.
        ValueError: `full_state` is already sharded, or its optimizer state does not have the
            structure and shapes of `step`'s optimizer on these parameters.
    """
    _check_step_and_state("shard_state", step, full_state, "full_state")
    _check_not_zero_state(
        "shard_state",
        step,
        full_state,
        "`full_state.opt_state` is sharded; consolidate it first with "
        "fscale.consolidate(old_step, state)",
    )
    if model is not None:
        full_state = tensor_parallel_state(full_state, model)
    return step.plan.shard_state(step, full_state)


def _check_not_zero_state(caller: str, step: Step, state: TrainState, if_sharded: str) -> None:
    """A ZeRO state given to a step without a ZeRO layer: say what to do instead."""
    if step.plan.find("shard_optimizer") is None and isinstance(state.opt_state, ShardedOptState):
        raise ValueError(f"{caller}: {if_sharded}")


def _check_step_and_state(caller: str, step: Any, state: Any, name: str) -> None:
    if not isinstance(step, Step):
        raise TypeError(f"{caller}: `step` must be a Step, got {type(step).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"{caller}: `{name}` must be a TrainState, got {type(state).__name__}")
