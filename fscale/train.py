"""`train_step(loss_fn, optimizer) -> Step`: one pure training step, the thing strategies transform.

A `Step` maps ``(TrainState, batch) -> (TrainState, metrics)``. It holds the user's loss
function, the optimizer and a *plan*: how parameters are held at rest and how gradients are
reduced (one process, data parallel, ZeRO-1/2, ZeRO-3). Parallel strategies are functions
``Step -> Step`` that return a new Step with a new plan, so composition is function composition
and ``print(step)`` shows the plan.

The loss convention: ``loss_fn(params, buffers, batch, key)`` returns the mean loss over the
local batch, or ``(loss, new_buffers)``, or ``(loss, new_buffers, extra_metrics)``. Gradients
are taken with ``torch.autograd.grad`` with respect to detached aliases (no copies) of the
parameter leaves (measured: as fast as eager ``loss.backward()`` and the least memory);
``grad_mode="func"`` takes them with ``torch.func.grad`` instead, for users who need
higher-order gradients of the step (it builds a second-order graph: about 2x the peak memory of the default path).

Metrics: ``loss`` (the mean loss), the loss_fn's extra metrics, and ``grad_bytes``: the bytes of
gradient storage this rank held for the update (exact, see `fscale.memory.tree_bytes`).

Randomness comes from the state's key folded with the step count (and, under data
parallelism, the rank's mesh coordinate), so a run is reproducible from its state alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale import tree
from fscale.memory import tree_bytes

__all__ = ["LossFn", "Plan", "Step", "TrainState", "train_step", "value_and_grad"]

PyTree = Any
Batch = Any
LossFn = Callable[[PyTree, PyTree, Batch, torch.Tensor], Any]
Metrics = dict[str, Any]

_GRAD_MODES = ("autograd", "func")


class TrainState(NamedTuple):
    """Everything a run needs to continue: a pytree, so it saves, shards and compares as one."""

    params: PyTree
    buffers: PyTree
    opt_state: PyTree
    step: torch.Tensor
    key: torch.Tensor


class LossOutput(NamedTuple):
    loss: torch.Tensor
    buffers: PyTree
    metrics: Metrics


def _normalize_loss_output(out: Any, buffers: PyTree) -> LossOutput:
    """Accept ``loss``, ``(loss, new_buffers)`` or ``(loss, new_buffers, metrics)``."""
    if isinstance(out, torch.Tensor):
        loss, new_buffers, metrics = out, buffers, {}
    elif isinstance(out, tuple) and len(out) in (2, 3):
        loss, new_buffers = out[0], out[1]
        metrics = dict(out[2]) if len(out) == 3 else {}
        if new_buffers is None:
            new_buffers = buffers
    else:
        raise TypeError(
            "loss_fn must return the loss, (loss, new_buffers) or (loss, new_buffers, metrics); "
            f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, tuple) else "")
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() > 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar loss (the mean over the local batch), got {shape}; "
            "reduce it with .mean() inside loss_fn"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn returned a loss of dtype {loss.dtype}; expected a float tensor")
    return LossOutput(loss.reshape(()), new_buffers, metrics)


def value_and_grad(
    loss_fn: LossFn,
    params: PyTree,
    buffers: PyTree,
    batch: Batch,
    key: torch.Tensor,
    *,
    grad_mode: str = "autograd",
    prepare: Callable[[PyTree], PyTree] | None = None,
    grad_hooks: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> tuple[LossOutput, PyTree]:
    """Loss outputs and the gradient of the loss w.r.t. every leaf of `params`.

    Args:
        loss_fn: ``loss_fn(params, buffers, batch, key)`` (see the module docstring).
        params: the pytree to differentiate w.r.t.; it is not modified.
        buffers, batch, key: passed through to `loss_fn`.
        grad_mode: ``"autograd"`` (default, first-order, least memory) or ``"func"``
            (``torch.func.grad``; composes with outer torch.func transforms).
        prepare: a differentiable map applied to the live parameters before `loss_fn` sees
            them (strategies insert collectives here, e.g. an all-gather of shards).
        grad_hooks: one hook per leaf of `params` (``None`` entries allowed), registered on the
            live leaves on the autograd path; each runs as soon as that leaf's gradient is
            complete and may return a replacement (strategies use this to start reducing a
            bucket of gradients while the rest of backward runs).

    Returns:
        ``(LossOutput(loss, new_buffers, metrics), grads)`` with `grads` shaped like `params`
        (zeros for leaves the loss does not use). The loss is detached.
    """
    if grad_mode not in _GRAD_MODES:
        raise ValueError(f"`grad_mode` must be one of {_GRAD_MODES}, got {grad_mode!r}")
    leaves, treedef = tree.flatten(params)
    if grad_mode == "func":
        return _value_and_grad_func(loss_fn, leaves, treedef, buffers, batch, key, prepare)

    with torch.enable_grad():
        live = [leaf.detach().requires_grad_(True) for leaf in leaves]
        if grad_hooks is not None:
            for leaf, hook in zip(live, grad_hooks):
                if hook is not None:
                    leaf.register_hook(hook)
        live_tree = tree.unflatten(treedef, live)
        used = prepare(live_tree) if prepare is not None else live_tree
        out = _normalize_loss_output(loss_fn(used, buffers, batch, key), buffers)
        if not out.loss.requires_grad:
            raise ValueError(
                "the loss does not depend on `params`: check that loss_fn uses the params it is "
                "given (not the module's own parameters)"
            )
        grads = torch.autograd.grad(out.loss, live, allow_unused=True, materialize_grads=True)
    return out._replace(loss=out.loss.detach()), tree.unflatten(treedef, list(grads))


def _value_and_grad_func(loss_fn, leaves, treedef, buffers, batch, key, prepare):
    def objective(*flat_params):
        live_tree = tree.unflatten(treedef, list(flat_params))
        used = prepare(live_tree) if prepare is not None else live_tree
        out = _normalize_loss_output(loss_fn(used, buffers, batch, key), buffers)
        return out.loss, out

    argnums = tuple(range(len(leaves)))
    grads, out = torch.func.grad(objective, argnums=argnums, has_aux=True)(*leaves)
    return out._replace(loss=out.loss.detach()), tree.unflatten(treedef, list(grads))


class Plan(Protocol):
    """How a Step holds its parameters and reduces its gradients (one per strategy)."""

    def init(self, step: Step, params: PyTree, buffers: PyTree, key: torch.Tensor) -> TrainState:
        ...

    def run(self, step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        ...


class LocalPlan:
    """One process: full parameters, full gradients, full optimizer state."""

    def init(self, step: Step, params: PyTree, buffers: PyTree, key: torch.Tensor) -> TrainState:
        opt_state = step.optimizer.init(params)
        return TrainState(params, buffers, opt_state, torch.zeros((), dtype=torch.int64), key)

    def run(self, step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        key = fsrandom.fold_in(state.key, int(state.step))
        out, grads = value_and_grad(
            step.loss_fn, state.params, state.buffers, batch, key, grad_mode=step.grad_mode
        )
        params, opt_state = optim_lib.step(
            step.optimizer, grads, state.opt_state, state.params, donate=step.donate
        )
        new_state = TrainState(params, out.buffers, opt_state, state.step + 1, state.key)
        return new_state, {"loss": out.loss, **out.metrics, "grad_bytes": tree_bytes(grads)}

    def __repr__(self) -> str:
        return "local"


@dataclasses.dataclass(frozen=True)
class Step:
    """A training step ``(TrainState, batch) -> (TrainState, metrics)``; build with `train_step`.

    Attributes:
        loss_fn: ``loss_fn(params, buffers, batch, key)``.
        optimizer: an `fscale.optim.Optimizer`.
        plan: the strategy (local, data parallel, sharded ...), set by transformations.
        grad_mode: ``"autograd"`` or ``"func"`` (see `value_and_grad`).
        donate: when True the step may update the incoming state's parameter and optimizer
            buffers in place (as JAX's buffer donation): faster, but the caller must not use the
            old state again. That includes the params given to `init`, which the first step
            updates in place (after `fscale.functionalize` they share memory with the module).
            Default False: the input state is never mutated.
    """

    loss_fn: LossFn
    optimizer: optim_lib.Optimizer
    plan: Any = dataclasses.field(default_factory=LocalPlan)
    grad_mode: str = "autograd"
    donate: bool = False

    def init(
        self,
        params: PyTree,
        buffers: PyTree = None,
        key: torch.Tensor | int | None = None,
    ) -> TrainState:
        """The initial TrainState for `params` (and `buffers`), with step 0.

        `key` is a `fscale.random` key or an int seed (default seed 0).
        """
        _check_params(params)
        if buffers is None:
            buffers = {}
        if key is None:
            key = fsrandom.key(0)
        elif isinstance(key, int) and not isinstance(key, bool):
            key = fsrandom.key(key)
        elif not fsrandom.is_key(key):
            raise TypeError(
                "Step.init: `key` must be an int seed or a key from fscale.random.key(seed), "
                f"got {type(key).__name__}"
            )
        return self.plan.init(self, params, buffers, key)

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"a Step takes a TrainState (from step.init(params, buffers)), got "
                f"{type(state).__name__}"
            )
        return self.plan.run(self, state, batch)

    def replace(self, **changes: Any) -> Step:
        """A copy with some fields changed (transformations use this)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        return (
            f"Step(loss_fn={name}, plan={self.plan!r}, grad_mode={self.grad_mode!r}, "
            f"donate={self.donate})"
        )


def _check_params(params: PyTree) -> None:
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            "Step.init: `params` is an nn.Module; pass its parameter pytree, e.g. "
            "`apply, params, buffers = fscale.functionalize(module)`"
        )
    paths, leaves, _ = tree.flatten_with_paths(params)
    if not leaves:
        raise ValueError("Step.init: `params` has no tensors to train")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"Step.init: params leaf `{path}` is a {type(leaf).__name__}, not a tensor")
        if not leaf.is_floating_point():
            raise TypeError(
                f"Step.init: params leaf `{path}` has dtype {leaf.dtype}; trained parameters must "
                "be floating point (keep integer state in `buffers`)"
            )


def train_step(
    loss_fn: LossFn,
    optimizer: optim_lib.Optimizer,
    *,
    grad_mode: str = "autograd",
    donate: bool = False,
) -> Step:
    """The single-process training step for `loss_fn` and `optimizer`.

    Args:
        loss_fn: ``loss_fn(params, buffers, batch, key)`` returning the mean loss over the batch,
            ``(loss, new_buffers)`` or ``(loss, new_buffers, metrics)``.
        optimizer: an `fscale.optim.Optimizer`.
        grad_mode: ``"autograd"`` (default) or ``"func"`` for a torch.func-transformable step.
        donate: let the step update the incoming state's buffers in place (see `Step`).

    Returns:
        A `Step`; ``state = step.init(params, buffers)`` then ``state, metrics = step(state, b)``.

    Example:
        >>> import torch, fscale as fs
        >>> params = {"w": torch.ones(3)}
        >>> def loss_fn(p, buffers, batch, key):
        ...     return ((p["w"] * batch).sum() - 1.0) ** 2
        >>> step = fs.train_step(loss_fn, fs.optim.sgd(0.1))
        >>> state = step.init(params)
        >>> state, metrics = step(state, torch.ones(3))
        >>> float(metrics["loss"])
        4.0
    """
    if not callable(loss_fn):
        raise TypeError(f"train_step: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optim_lib.Optimizer):
        raise TypeError(
            "train_step: `optimizer` must be an fscale.optim.Optimizer (e.g. fscale.optim.adamw(3e-4)), "
            f"got {type(optimizer).__name__}"
        )
    if grad_mode not in _GRAD_MODES:
        raise ValueError(f"train_step: `grad_mode` must be one of {_GRAD_MODES}, got {grad_mode!r}")
    return Step(loss_fn=loss_fn, optimizer=optimizer, grad_mode=grad_mode, donate=bool(donate))
