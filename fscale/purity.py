"""Purity and donation enforced: states given up or half-updated, loss functions that write.

A Step is pure from the caller's view, and donation (``donate=True``) is the one exception the
caller opts into. Three ways to break that silently are detected here, each at O(1) or one
version-counter read per leaf:

- **Reuse after donation.** A donated step updates the incoming state's buffers in place for the
  state it returns, so the two alias: stepping the old state again would corrupt both. The step
  marks the old state *consumed* (an attribute on its step-counter tensor, which the new state
  does not share: it gets ``step + 1``), and every phase refuses a consumed state.
- **A failed donated update.** An error in the middle of an in-place update may leave one dtype
  group updated and another not. The step marks the state *invalid* before re-raising, so the
  next call says what happened instead of training on a half-updated state.
- **A loss function that writes into its inputs.** ``loss_fn`` receives aliases of the state's
  params and buffers (no copies: they are what make the step as fast as eager). An in-place
  write under ``torch.no_grad`` would change the caller's state; the leaves' version counters,
  read before and after the loss, catch it and name the leaf.
"""

from __future__ import annotations

from typing import Any

import torch

from fscale import tree

__all__ = [
    "check_not_written",
    "check_usable",
    "mark_consumed",
    "mark_invalid",
    "versions",
]

PyTree = Any

# The marker's attribute on a state's step counter: absent on a usable state.
_MARK = "_fscale_given_up"


def mark_consumed(state: Any) -> None:
    """Record that a donated step took `state` (its buffers now belong to the returned state)."""
    _mark(state, "consumed")


def mark_invalid(state: Any, error: BaseException) -> None:
    """Record that a donated update of `state` raised `error` part way."""
    _mark(state, f"invalid: {type(error).__name__}: {error}")


def _mark(state: Any, mark: str) -> None:
    # The step counter is a tensor in every state a Step makes; one built by hand with a Python
    # number cannot carry the mark (and is not protected).
    if isinstance(state.step, torch.Tensor):
        setattr(state.step, _MARK, mark)


def check_usable(state: Any, caller: str) -> None:
    """Raise if `state` was consumed by a donated step or left invalid by a failed one."""
    mark = getattr(state.step, _MARK, None)
    if mark is None:
        return
    if mark == "consumed":
        raise ValueError(
            f"{caller}: this TrainState was given to a donated step (donate=True), which updated "
            "its buffers in place for the state it returned; the two share memory, so using the "
            "old one again would corrupt both. Continue from the returned state, or build the "
            "step with donate=False to keep old states usable."
        )
    raise ValueError(
        f"{caller}: this TrainState is invalid: a donated update of it failed part way "
        f"({mark.removeprefix('invalid: ')}), so some of its buffers may be updated and others "
        "not. Restore the state from a checkpoint (or rebuild it with step.init), or run with "
        "donate=False, which never writes into the incoming state."
    )


def versions(leaves: list[Any]) -> list[int]:
    """The version counter of each tensor leaf (in-place writes advance it; -1 for others)."""
    return [getattr(leaf, "_version", -1) for leaf in leaves]


def check_not_written(what: str, values: PyTree, leaves: list[Any], before: list[int]) -> None:
    """Raise naming the first leaf of `values` (a `what` tree) written since `before`.

    Not checked under ``torch.compile``: inside a graph the counters are symbolic, and the
    compiled step's own replay of writes into its inputs (AOTAutograd copies them back) advances
    counters the eager step leaves alone (measured under `fscale.fully_shard`: an assertion on
    them fails for a loss that writes nothing). The eager step checks every call, so a new loss
    function is checked by running its step eagerly once.
    """
    if torch.compiler.is_compiling() or versions(leaves) == before:
        return
    for path, version, previous in zip(tree.paths(values), versions(leaves), before):
        if version != previous:
            raise ValueError(_written(what, path))


def _written(what: str, path: str) -> str:
    return (
        f"loss_fn wrote into {what} leaf {path!r} in place (an in-place op, e.g. under "
        "torch.no_grad), which changes the caller's state: a step never mutates its "
        "input. Compute a new tensor instead (`w = w * 0.5`, not `w.mul_(0.5)`); state "
        "that changes during the forward belongs in the buffers the loss returns."
    )
