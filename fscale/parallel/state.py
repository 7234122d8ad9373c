"""Moving a TrainState between strategies and world sizes: `consolidate` and `shard_state`.

A sharded plan (ZeRO, fully sharded) knows how to join its state into the full one a
single-process step takes, and how to cut a full state into this rank's shard; these two
functions dispatch to it, and pass full states of unsharded plans through unchanged. Going
``consolidate`` on N ranks then ``shard_state`` on M ranks reshards a run exactly.
"""

from __future__ import annotations

from typing import Any

from fscale.parallel.ddp import DataParallelPlan
from fscale.parallel.zero.plan import ShardedOptState
from fscale.train import LocalPlan, Step, TrainState

__all__ = ["consolidate", "shard_state"]


def consolidate(step: Step, state: TrainState) -> TrainState:
    """The full (unsharded) TrainState of `state`, on every rank.

    For a `shard_optimizer` step, each per-element optimizer state leaf is gathered from its
    ranks' pieces (one all-gather per dtype; every rank of the axis must call this) and the
    result is exactly the state a single-process `train_step` with the same optimizer takes.
    The parameters, buffers and replicated state leaves are shared with `state`, not copied.
    For a step whose state is already full (`train_step`, `data_parallel`), returns `state`.

    Args:
        step: the step that made `state`.
        state: its state.

    Returns:
        A TrainState whose ``opt_state`` is the wrapped optimizer's full state.

    Raises:
        TypeError: `step` is not a Step or `state` is not a TrainState, or the step's plan has
            no notion of a full state.
        ValueError: `state` does not belong to `step` (another world size, another optimizer).
    """
    _check_step_and_state("consolidate", step, state, "state")
    if hasattr(step.plan, "consolidate"):  # a plan that shards state knows how to join it
        return step.plan.consolidate(step, state)
    return _already_full(
        "consolidate", step, state,
        "`state` is sharded but `step` is not; pass the sharded step that made the state",
    )


def shard_state(step: Step, full_state: TrainState) -> TrainState:
    """The state `step` takes on this rank, built from a full (unsharded) TrainState.

    Works at any world size: the full state may come from `consolidate` over any number of
    ranks, or from a single-process `train_step`. Every rank passes the same full state and
    keeps its own slices (no communication, besides a check under `shard_optimizer` that the
    ranks' trees agree). For a
    step whose state is full (`train_step`, `data_parallel`), returns `full_state`.

    Args:
        step: the step that will run on the state.
        full_state: a TrainState with the full parameters and the optimizer's full state.

    Returns:
        The sharded TrainState for this rank.

    Raises:
        TypeError: `step` is not a Step or `full_state` is not a TrainState.
        ValueError: `full_state` is already sharded, or its optimizer state does not have the
            structure and shapes of `step`'s optimizer on these parameters.
    """
    _check_step_and_state("shard_state", step, full_state, "full_state")
    if hasattr(step.plan, "shard_state"):
        return step.plan.shard_state(step, full_state)
    return _already_full(
        "shard_state", step, full_state,
        "`full_state.opt_state` is sharded; consolidate it first with "
        "fscale.consolidate(old_step, state)",
    )


def _already_full(caller: str, step: Step, state: TrainState, if_sharded: str) -> TrainState:
    """`state` itself, for a step whose state is full (`train_step`, `data_parallel`).

    Raises:
        ValueError: `state` holds a sharded optimizer state (`if_sharded` says what to do).
        TypeError: the step's plan has no notion of a full state.
    """
    if not isinstance(step.plan, (LocalPlan, DataParallelPlan)):
        raise TypeError(f"{caller}: steps with plan {step.plan!r} are not supported")
    if isinstance(state.opt_state, ShardedOptState):
        raise ValueError(f"{caller}: {if_sharded}")
    return state


def _check_step_and_state(caller: str, step: Any, state: Any, name: str) -> None:
    if not isinstance(step, Step):
        raise TypeError(f"{caller}: `step` must be a Step, got {type(step).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"{caller}: `{name}` must be a TrainState, got {type(state).__name__}")

