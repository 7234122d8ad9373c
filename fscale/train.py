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
higher-order gradients of the step (it builds a second-order graph: about 2x the peak memory of
the default path).

Metrics: ``loss`` (the mean loss), the loss_fn's extra metrics, and ``grad_bytes``: the bytes of
gradient storage this rank held for the update (exact, see `fscale.memory.tree_bytes`); with
``on_nonfinite="skip"``, ``skipped`` (1.0 when the ranks agreed to skip this step's update).

Checks at the boundary: ranks that build different models or optimizers (kind and
hyper-parameters) fail at `Step.init`; a state given to a donated step, or whose donated update
failed part way, and a loss function that writes into its params or buffers, fail with the fix
(`fscale.purity`); non-finite gradients are handled as ``on_nonfinite`` says
(`fscale.nonfinite`); parameters the loss did not use are left as they were (`fscale.unused`).

Randomness comes from the state's key folded with the step count (and, under data
parallelism, the rank's mesh coordinate), so a run is reproducible from its state alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fscale import nonfinite, purity, spmd, step_means, tree
from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale.functional import ownership
from fscale.grad import GRAD_MODES, value_and_grad
from fscale.optim.hyper import check_bool
from fscale.outside_graph import outside_graph
from fscale.plan import Context, GradAux, LocalPlan, PlainOptimizer, Plan, TrainState
from fscale.split_params import check_statistics_span_the_model
from fscale.step_means import StepMeans

__all__ = ["LossFn", "Plan", "Step", "TrainState", "train_step", "value_and_grad"]

PyTree = Any
Batch = Any
LossFn = Callable[[PyTree, PyTree, Batch, torch.Tensor], Any]
Metrics = dict[str, Any]
UNUSED_PARAMS = ("auto", "skip", "zero")
# Context's default optimizer role, given explicitly: Dynamo cannot trace a default argument
# that is an object without a source (a graph break at every Context the step builds).
_PLAIN = PlainOptimizer()


@dataclasses.dataclass(frozen=True)
class Step:
    """A training step ``(TrainState, batch) -> (TrainState, metrics)``; build with `train_step`.

    ``step(state, batch)`` is ``step.apply_gradients(state, *step.gradients(state, batch))``, bit
    for bit: the two phases are public so that a strategy can act between them (compress,
    accumulate, inspect) without rebuilding the step.

    Attributes:
        loss_fn: ``loss_fn(params, buffers, batch, key)``.
        optimizer: an `fscale.optim.Optimizer`.
        plan: the strategy (a `fscale.Plan` chain: local, data parallel, sharded ...), set by
            transformations.
        grad_mode: ``"autograd"`` or ``"func"`` (see `fscale.grad.value_and_grad`).
        donate: when True the step may update the incoming state's parameter and optimizer
            buffers in place (as JAX's buffer donation): faster, but the caller must not use the
            old state again. That includes the params given to `init` on one process, which
            the first step updates in place (the state holds those very tensors).
            Default False: the input state is never mutated. A state given to a donated step
            is refused afterwards, and one whose donated update raised part way is marked
            invalid (see `fscale.purity`).
        on_nonfinite: ``"propagate"``, ``"skip"`` or ``"raise"``: what the step does when its
            reduced gradients hold NaN or infinity on any rank (see `fscale.nonfinite`).
        unused_params: ``"auto"``, ``"skip"`` or ``"zero"``: whether a parameter the loss did
            not use is left as it was (``"skip"``, as torch.optim skips a param whose grad is
            None) or updated with a zero gradient (``"zero"``: weight decay and momentum still
            move it). ``"auto"`` skips on one process and gives zeros under plans with data
            axes of size > 1, where skipping needs one small all-reduce per step (torch DDP's
            ``find_unused_parameters=True``); see `fscale.unused`.
    """

    loss_fn: LossFn
    optimizer: optim_lib.Optimizer
    plan: Plan = dataclasses.field(default_factory=LocalPlan)
    grad_mode: str = "autograd"
    donate: bool = False
    on_nonfinite: str = "propagate"
    unused_params: str = "auto"

    def init(
        self,
        params: PyTree,
        buffers: PyTree = None,
        key: torch.Tensor | int | None = None,
    ) -> TrainState:
        """The initial TrainState for `params` (and `buffers`), with step 0.

        `key` is a `fscale.random` key or an int seed (default seed 0). Under a plan with data
        axes, the ranks first check that they build the same model (an error names the first
        difference) and then all start from index 0's params, buffers and key.

        The state takes the tensors: on one process it holds the given tensors themselves (no
        copy; a donating step updates them in place), under data axes copies of index 0's,
        under `fscale.fully_shard` this rank's shards only. The module `fscale.functionalize`
        handed them out from is then released (its slots hold meta tensors, see
        `fscale.FunctionalModule.release`), so once the caller drops its own `params` and
        `buffers` no full copy outside the state remains. Meta tensors (a module built on the
        meta device) are accepted by plans that create them: `fully_shard` makes only this
        rank's shards, with the module's ``init`` seeded by `key`.
        """
        if buffers is None:
            buffers = {}
        _check_params(params, buffers, _materializes(self.plan))
        check_statistics_span_the_model(
            params, self.optimizer, adascale=self.plan.find("adascale") is not None
        )
        start_key = _key(key)
        given = (params, buffers)
        mesh, axes = self.plan.data_mesh(), self.plan.data_axes()
        if mesh is not None and axes:
            lines = [*spmd.describe_tree(params), "buffers:", *spmd.describe_tree(buffers)]
            for axis in axes:
                spmd.check_same_on_all_ranks(
                    mesh, axis, lines, "the parameter and buffer trees", self.plan.name
                )
                self._check_configuration_agrees(mesh, axis)
            for axis in axes:
                params, buffers, start_key = _broadcast(params, buffers, start_key, mesh, axis)
        state = self.plan.init(self, params, buffers, start_key, Context())
        ownership.release_taken(given)
        return state

    def gradients(self, state: TrainState, batch: Batch) -> tuple[PyTree, GradAux]:
        """The gradient phase: ``(grads, aux)``, grads in the plan's layout (full, reduced or
        sharded) and what `apply_gradients` needs besides them."""
        _check_state(state)
        purity.check_usable(state, "Step.gradients")
        mesh, axes = self.plan.data_mesh(), self.plan.data_axes()
        key = _step_key(state, mesh, axes)
        ctx = Context(key=key, optimizer=_PLAIN, metric_axes=axes, metric_mesh=mesh)
        return self.plan.gradients(self, state, batch, ctx)

    def apply_gradients(
        self, state: TrainState, grads: PyTree, aux: GradAux
    ) -> tuple[TrainState, Metrics]:
        """The update phase: the new state, and metrics (``loss`` and the loss function's scalar
        extras are means over the data axes, equal on every rank)."""
        _check_state(state)
        purity.check_usable(state, "Step.apply_gradients")
        if not isinstance(aux, GradAux):
            raise TypeError(
                "Step.apply_gradients: `aux` must be the GradAux that step.gradients returned, "
                f"got {type(aux).__name__}"
            )
        mesh, axes = self.plan.data_mesh(), self.plan.data_axes()
        aux, skip = self._agree(state, grads, aux, mesh, axes)
        ctx = Context(skip_update=skip, optimizer=_PLAIN)
        if self.donate:
            try:
                new_state, metrics = self.plan.apply_gradients(self, state, grads, aux, ctx)
            except BaseException as error:
                purity.mark_invalid(state, error)
                raise
            if new_state.step is not state.step:
                purity.mark_consumed(state)
        else:
            new_state, metrics = self.plan.apply_gradients(self, state, grads, aux, ctx)
        if mesh is not None and axes:
            new_state, metrics = _reduce_over_data_axes(
                state, new_state, metrics, aux.means, mesh, axes
            )
        if self.on_nonfinite == "skip":  # equal on every rank: added after the reduction
            metrics = {**metrics, "skipped": torch.tensor(float(skip))}
        return new_state, metrics

    def _agree(
        self, state: TrainState, grads: PyTree, aux: GradAux, mesh: Any, axes: tuple[str, ...]
    ) -> tuple[GradAux, bool]:
        """The usage mask the ranks of the data axes agree on, and the non-finite verdict every
        rank of the mesh agrees on (one all-reduce, two when the mesh has more axes than the
        data axes and both are asked for; none on one process or when neither is)."""
        single = mesh is None or not axes or mesh.size(spmd.axis_arg(axes)) == 1
        mode = self.unused_params
        skip_unused = mode == "skip" or (mode == "auto" and single)
        used = aux.used if skip_unused else None
        checking = self.on_nonfinite != "propagate"
        if not checking and (used is None or single):
            return (aux if used is aux.used else tree.with_fields(aux, used=used)), False
        found = nonfinite.has_nonfinite(grads) if checking else False
        # The verdict holds for every rank of the mesh (pipeline stages, tensor shards too): a
        # rank that updated while another skipped would leave the model inconsistent.
        everywhere = tuple(mesh.axis_names) if checking and mesh is not None else axes
        agreement = nonfinite.agree(found, used, mesh, axes, verdict_axes=everywhere)
        if agreement.nonfinite and self.on_nonfinite == "raise":
            nonfinite.raise_nonfinite(agreement, int(state.step))
        return tree.with_fields(aux, used=agreement.used), agreement.nonfinite

    def _check_configuration_agrees(self, mesh: Any, axis: str) -> None:
        """Every rank of `axis` runs the same optimizer (kind and hyper-parameters, as its
        description records them) and step options; else an error on every rank naming them."""
        mine = {
            "optimizer": repr(self.optimizer),
            "step options": f"grad_mode={self.grad_mode!r}, donate={self.donate}, "
            f"on_nonfinite={self.on_nonfinite!r}, unused_params={self.unused_params!r}",
        }
        everyone = spmd.all_gather_objects(mine, mesh, axis)
        for what in mine:
            values = [config[what] for config in everyone]
            if len(set(values)) > 1:
                ranks = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise ValueError(
                    f"Step.init: the ranks along axis {axis!r} disagree on the {what} ({ranks}); "
                    "a rank-dependent value would silently train different replicas. Build the "
                    "step from the same values on every rank."
                )

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        grads, aux = self.gradients(state, batch)
        return self.apply_gradients(state, grads, aux)

    def replace(self, **changes: Any) -> Step:
        """A copy with some fields changed (transformations use this)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        return (
            f"Step(loss_fn={name}, optimizer={self.optimizer!r}, plan={self.plan!r}, "
            f"grad_mode={self.grad_mode!r}, donate={self.donate}, "
            f"on_nonfinite={self.on_nonfinite!r}, unused_params={self.unused_params!r})"
        )


@outside_graph
def _step_key(state: TrainState, mesh: Any, axes: tuple[str, ...]) -> torch.Tensor:
    # The key is mixed in 64-bit host integers from the step counter's value: under
    # torch.compile this runs outside the graph (a read of a tensor's value ends a graph).
    return spmd.rank_key(state.key, int(state.step), mesh, axes)


@outside_graph
def _reduce_over_data_axes(
    state: TrainState,
    new_state: TrainState,
    metrics: Metrics,
    means: StepMeans | None,
    mesh: Any,
    axes: tuple[str, ...],
) -> tuple[TrainState, Metrics]:
    """`new_state` with the buffers the loss updated averaged over `axes`, and the metrics'
    means over them: from the means the gradient phase began (`fscale.step_means`) where they
    hold the values the step returns, else by collectives issued here.

    Under torch.compile this runs outside the graph: its collectives end a graph anyway (c10d
    with the ledger's and watchdog's host bookkeeping), and Dynamo rebuilds the pytree specs
    held across such a break wrongly (torch 2.13: "length mismatch" when unflattening).
    """
    if means is None or means.axes != tuple(axes):
        axis = spmd.axis_arg(axes)
        buffers = spmd.average_updated_buffers(state.buffers, new_state.buffers, mesh, axis)
        return tree.with_fields(new_state, buffers=buffers), spmd.reduce_metrics(
            metrics, mesh, axis
        )
    buffers = step_means.mean_buffers(state.buffers, new_state.buffers, means)
    metrics = step_means.mean_metrics(metrics, means)
    means.finish()
    return tree.with_fields(new_state, buffers=buffers), metrics


def _key(key: Any) -> torch.Tensor:
    """`key` (a key, an int seed, or None for seed 0) as a key."""
    if key is None:
        return fsrandom.key(0)
    if isinstance(key, int) and not isinstance(key, bool):
        return fsrandom.key(key)
    if not isinstance(key, torch.Tensor) or not fsrandom.is_key(key):
        raise TypeError(
            "Step.init: `key` must be an int seed or a key from fscale.random.key(seed), "
            f"got {type(key).__name__}"
        )
    return key


def _check_state(state: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"a Step takes a TrainState (from step.init(params, buffers)), got "
            f"{type(state).__name__}"
        )


def _materializes(plan: Plan) -> bool:
    """Whether a layer of `plan` creates the values of meta tensors at init."""
    return any(getattr(layer, "materializes_meta", False) for layer in plan.layers())


def _broadcast(params: PyTree, buffers: PyTree, key: torch.Tensor, mesh: Any, axis: str) -> Any:
    """Index 0's values along `axis`; meta tensors (no values yet) are passed through."""
    leaves, treedef = tree.flatten((params, buffers, key))
    real = [i for i, leaf in enumerate(leaves) if not _is_meta(leaf)]
    if len(real) == len(leaves):
        return spmd.broadcast_tree((params, buffers, key), mesh, axis)
    copies = spmd.broadcast_tree([leaves[i] for i in real], mesh, axis)
    for i, copy in zip(real, copies):
        leaves[i] = copy
    return tree.unflatten(treedef, leaves)


def _is_meta(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.device.type == "meta"


def _check_params(params: PyTree, buffers: PyTree, materializes: bool) -> None:
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
            raise TypeError(
                f"Step.init: params leaf `{path}` is a {type(leaf).__name__}, not a tensor"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"Step.init: params leaf `{path}` has dtype {leaf.dtype}; trained parameters must "
                "be floating point (keep integer state in `buffers`)"
            )
    if materializes:
        return
    for what, values in (("params", params), ("buffers", buffers)):
        paths, leaves, _ = tree.flatten_with_paths(values)
        for path, leaf in zip(paths, leaves):
            if _is_meta(leaf):
                raise ValueError(_meta_message(what, path, leaf))


def _meta_message(what: str, path: str, leaf: torch.Tensor) -> str:
    if ownership.is_released(leaf):
        return (
            f"Step.init: {what} leaf `{path}` is a placeholder: its values were taken by the "
            "state of an earlier step.init, which released the module. Continue from that "
            "state, or functionalize the module once and keep its params"
        )
    return (
        f"Step.init: {what} leaf `{path}` is on the meta device (it has a shape but no values) "
        "and this plan cannot create values; shard it with fscale.fully_shard, which creates "
        "only this rank's shards (fscale.functionalize(module, init=...)), or materialise the "
        "whole model first: `apply.materialize(key)`, or module.to_empty(device='cpu') and "
        "initialise or load its weights, then functionalize it"
    )


def train_step(
    loss_fn: LossFn,
    optimizer: optim_lib.Optimizer,
    *,
    grad_mode: str = "autograd",
    donate: bool = False,
    on_nonfinite: str = "propagate",
    unused_params: str = "auto",
) -> Step:
    """The single-process training step for `loss_fn` and `optimizer`.

    Args:
        loss_fn: ``loss_fn(params, buffers, batch, key)`` returning the mean loss over the batch,
            ``(loss, new_buffers)`` or ``(loss, new_buffers, metrics)``.
        optimizer: an `fscale.optim.Optimizer`.
        grad_mode: ``"autograd"`` (default) or ``"func"`` for a torch.func-transformable step.
        donate: let the step update the incoming state's buffers in place (see `Step`).
        on_nonfinite: ``"propagate"`` (default: no check, as a torch.optim loop), ``"skip"``
            (every rank skips a step whose gradients hold NaN or infinity; metric ``skipped``)
            or ``"raise"`` (a `fscale.nonfinite.NonFiniteGradientError` on every rank).
        unused_params: ``"auto"`` (default), ``"skip"`` or ``"zero"`` (see `Step`).

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
            "train_step: `optimizer` must be an fscale.optim.Optimizer (e.g. "
            "fscale.optim.adamw(3e-4)), "
            f"got {type(optimizer).__name__}"
        )
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"train_step: `grad_mode` must be one of {GRAD_MODES}, got {grad_mode!r}")
    donate = check_bool("train_step", "donate", donate)
    on_nonfinite = nonfinite.check_on_nonfinite("train_step", on_nonfinite)
    if not isinstance(unused_params, str) or unused_params not in UNUSED_PARAMS:
        raise ValueError(
            f"train_step: `unused_params` must be one of {UNUSED_PARAMS}, got {unused_params!r}"
        )
    return Step(
        loss_fn=loss_fn,
        optimizer=optimizer,
        grad_mode=grad_mode,
        donate=donate,
        on_nonfinite=on_nonfinite,
        unused_params=unused_params,
    )
