"""The Plan protocol: how a Step holds its state and runs its phases, and how plans nest.

A plan is a chain of layers, outermost first: ``data_parallel(fully_shard(train_step(...)))``
has the plan ``data_parallel ∘ fully_shard ∘ local``. Every layer provides the same five
methods, and a layer that has nothing to say about one of them passes it to the layer inside:

- ``init(step, params, buffers, key, ctx) -> TrainState``
- ``gradients(step, state, batch, ctx) -> (grads, GradAux)``: gradients in the plan's own layout
  (full, reduced, or sharded) and what the update needs besides them;
- ``apply_gradients(step, state, grads, aux, ctx) -> (TrainState, metrics)``;
- ``consolidate(step, state) -> TrainState`` and ``shard_state(step, full_state) -> TrainState``:
  the state to and from its full (unsharded) form. A layer whose state is full writes neither.

A layer never needs to know which layers surround it. It changes what the layers *inside* it do
through the `Context` it passes inward (`Plan.context`): maps from the state's parameters to what
the loss sees (a fully sharded layer gathers its shards), the reducer of the state's gradients
(data parallel layers add their axes to it; ZeRO scatters it), the `OptimizerRole` that
initialises and applies the optimizer on the state's layout (ZeRO and FSDP run it on their
shards), and accumulation (micro-batch weights and gradients carried between micro-batches).
The innermost layer, `LocalPlan`, is the only one that computes: it takes the gradients with
`fscale.grad.value_and_grad` under the context and applies the optimizer through the role.

What every multi-rank plan needs at the edges — ranks agreeing on the model and starting from
rank 0's values, the per-rank key, buffers averaged and metrics reduced over the data axes — is
done once, by the `Step`, over the union of the layers' `data_axes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from fscale import optim as optim_lib
from fscale import unused
from fscale.grad import value_and_grad
from fscale.memory import tree_bytes
from fscale.nonfinite import skipped_state

if TYPE_CHECKING:
    from fscale.distributed.mesh import Mesh
    from fscale.train import Step

__all__ = [
    "Context",
    "GradAux",
    "LocalPlan",
    "OptimizerRole",
    "PlainOptimizer",
    "Plan",
    "Precision",
    "Reducer",
    "TrainState",
]

PyTree = Any
Metrics = dict[str, Any]


class TrainState(NamedTuple):
    """Everything a run needs to continue: a pytree, so it saves, shards and compares as one."""

    params: PyTree
    buffers: PyTree
    opt_state: PyTree
    step: torch.Tensor
    key: torch.Tensor


class GradAux(NamedTuple):
    """What the update phase needs besides the gradients.

    Attributes:
        loss: this rank's mean loss over its batch (detached; reduced over the data axes only
            in the update's metrics).
        buffers: the buffers the loss function returned.
        metrics: the loss function's extra metrics and the plan's (``grad_bytes`` ...).
        carry: per-layer values a layer's update needs from its gradient phase, keyed by the
            layer's name (e.g. a stateful reduction hook's new state).
        used: per leaf of ``state.params``, whether the loss used it (a leaf it did not use is
            left as it was by the update, see `fscale.unused`); None: every leaf counts as
            used. `Step.apply_gradients` replaces this rank's mask by the one the ranks agree on.
        means: the means over the data axes begun in the gradient phase, of the loss, the
            scalar metrics and the updated buffers (`fscale.step_means.StepMeans`), which
            `Step.apply_gradients` uses for the values still holding those very tensors;
            None: none.
    """

    loss: torch.Tensor
    buffers: PyTree
    metrics: Metrics
    carry: dict[str, Any] = {}  # noqa: RUF012 - NamedTuple defaults are shared, never mutated
    used: tuple[bool, ...] | None = None
    means: Any = None


class OptimizerRole(Protocol):
    """How the optimizer is initialised on, and applied to, the state's parameter layout."""

    def init(self, optimizer: optim_lib.Optimizer, params: PyTree) -> PyTree: ...

    def apply(
        self,
        optimizer: optim_lib.Optimizer,
        grads: PyTree,
        opt_state: PyTree,
        params: PyTree,
        *,
        donate: bool,
    ) -> tuple[PyTree, PyTree]: ...


@dataclasses.dataclass(frozen=True)
class PlainOptimizer:
    """The optimizer on the parameters as they are (an `fscale.optim.Sharding` names fragments)."""

    sharding: optim_lib.Sharding | None = None

    def init(self, optimizer: optim_lib.Optimizer, params: PyTree) -> PyTree:
        return optimizer.init(params, sharding=self.sharding)

    def apply(self, optimizer, grads, opt_state, params, *, donate):
        return optim_lib.step(
            optimizer, grads, opt_state, params, sharding=self.sharding, donate=donate
        )


class Precision(Protocol):
    """A mixed-precision policy as the plan's layers read it (see `fscale.precision`)."""

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def reduce_dtype(self) -> torch.dtype: ...

    def describe_collectives(self, plan: Plan) -> str: ...


class Reducer(Protocol):
    """How the gradients of the state's parameter leaves are reduced across ranks.

    ``session(params, grad_mode)`` is opened for the backward pass that completes a step's
    gradient; it gives per-leaf hooks (autograd path), a differentiable map of the live leaves
    (torch.func path), takes the gradients of earlier micro-batches to add in (`seed`), and
    returns the reduced gradients from `finish`.
    """

    def session(self, params: PyTree, grad_mode: str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Context:
    """What the layers around a plan ask of it; passed inward, never mutated.

    Attributes:
        key: this rank's key for this step (and micro-batch); None outside the gradient phase.
        param_maps: differentiable maps from the state's live parameter leaves to what the
            loss function receives, applied in order. A map may have ``after_forward()`` and
            ``after_backward()`` methods, called when the loss returns and after backward.
        reducer: how the state's gradients are reduced (None: they are not).
        optimizer: the `OptimizerRole` that initialises and applies the optimizer.
        accumulated: gradients of earlier micro-batches of this step, in the state's layout,
            to add to this backward's (None: none).
        loss_weight: the factor the loss is multiplied by before differentiation.
        final: whether this backward completes the step's gradient: reductions run only then.
        skip_update: the ranks agreed to skip this step's update (its gradients are not
            finite, see `fscale.nonfinite`): the innermost layer returns the state unchanged
            but for its step counter and buffers.
        metric_axes: the axes the step averages its metrics over (the plan's data axes); a
            reducer over exactly these may average the loss with the gradients.
        metric_mesh: the mesh of `metric_axes`: the innermost plan begins the means over them
            after the forward pass (`fscale.step_means`); None: they are not begun early.
    """

    key: torch.Tensor | None = None
    param_maps: tuple[Callable[[PyTree], PyTree], ...] = ()
    reducer: Reducer | None = None
    # A factory, not a shared instance: Dynamo 2.11 cannot build a frozen dataclass whose
    # default is an object of a user class (a graph break at every Context made in a step).
    optimizer: OptimizerRole = dataclasses.field(default_factory=PlainOptimizer)
    accumulated: PyTree | None = None
    loss_weight: float = 1.0
    final: bool = True
    skip_update: bool = False
    metric_axes: tuple[str, ...] = ()
    metric_mesh: Any = None

    def replace(self, **changes: Any) -> Context:
        # Each layer replaces a field or two on every call of a step; `dataclasses.replace`
        # re-runs __init__ over every field, which costs more than the rest of the layer.
        # A comprehension, not `changes.keys() - _CONTEXT_FIELDS`: Dynamo in torch 2.11 traces
        # a dict view minus a frozenset to NotImplemented and fails the compiled step.
        unknown = [name for name in changes if name not in _CONTEXT_FIELDS]
        if unknown:
            raise TypeError(f"Context.replace: no field(s) {sorted(unknown)}")
        if torch.compiler.is_compiling():
            # Dynamo before torch 2.13 cannot trace `__dict__.update` (a graph break at every
            # Context made in a step), and 2.6 fails guarding `object.__setattr__` on a new
            # instance; all trace the dataclass's own replace.
            return dataclasses.replace(self, **changes)
        new = object.__new__(Context)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_CONTEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(Context))


class Plan:
    """A layer of a plan; subclass it to write a strategy (see the README's guide).

    Subclasses hold the layer inside them in `inner` (None only for the innermost layer) and
    override what they change; every method's default passes the call inward, under
    `context`. A layer that adds to the optimizer state (wraps ``state.opt_state``) overrides
    `consolidate` and `shard_state` to unwrap and rewrap it.
    """

    # Subclasses hold the layer inside them in an attribute `inner` (a dataclass field,
    # typically; None for the innermost layer). The base class reads it with getattr and does
    # not declare it, so a dataclass subclass's `inner` field has no inherited default.

    # ---- composition ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """This layer's name in a plan's description (the transformation that made it)."""
        return type(self).__name__

    def describe(self) -> str:
        """This layer alone, e.g. ``data_parallel(axis='dp' of size 2)``."""
        return self.name

    def layers(self) -> Iterator[Plan]:
        """This layer and the ones inside it, outermost first."""
        layer: Plan | None = self
        while layer is not None:
            yield layer
            layer = getattr(layer, "inner", None)

    def find(self, name: str) -> Plan | None:
        """The outermost layer called `name` (e.g. ``"fully_shard"``), or None."""
        return next((layer for layer in self.layers() if layer.name == name), None)

    def own_data_axes(self) -> tuple[str, ...]:
        """The mesh axes this layer splits the batch over (each rank reads its own slice)."""
        return ()

    def own_mesh(self) -> Mesh | None:
        """The mesh this layer's axes are on (None for a layer with no axes)."""
        return None

    def data_axes(self) -> tuple[str, ...]:
        """The axes the whole plan splits the batch over, outermost layer first, each once."""
        axes: list[str] = []
        for layer in self.layers():
            axes.extend(a for a in layer.own_data_axes() if a not in axes)
        return tuple(axes)

    def data_mesh(self) -> Mesh | None:
        """The mesh of the plan's axes (every layer's mesh is the same)."""
        for layer in self.layers():
            mesh = layer.own_mesh()
            if mesh is not None:
                return mesh
        return None

    def own_precision(self) -> Precision | None:
        """The mixed-precision policy this layer sets for the whole plan (None: none)."""
        return None

    def precision(self) -> Precision | None:
        """The plan's mixed-precision policy, whichever layer sets it (None: none)."""
        for layer in self.layers():
            policy = layer.own_precision()
            if policy is not None:
                return policy
        return None

    def context(self, ctx: Context) -> Context:
        """The context the layers inside this one run under (default: unchanged)."""
        return ctx

    def _inner(self) -> Plan:
        inner = getattr(self, "inner", None)
        if inner is None:
            raise NotImplementedError(
                f"{self.name}: the innermost layer of a plan must implement init, gradients and "
                "apply_gradients itself (or wrap another plan in `inner`)"
            )
        return inner

    # ---- phases --------------------------------------------------------------------------

    def init(
        self, step: Step, params: PyTree, buffers: PyTree, key: torch.Tensor, ctx: Context
    ) -> TrainState:
        return self._inner().init(step, params, buffers, key, self.context(ctx))

    def gradients(
        self, step: Step, state: TrainState, batch: Any, ctx: Context
    ) -> tuple[PyTree, GradAux]:
        return self._inner().gradients(step, state, batch, self.context(ctx))

    def apply_gradients(
        self, step: Step, state: TrainState, grads: PyTree, aux: GradAux, ctx: Context
    ) -> tuple[TrainState, Metrics]:
        return self._inner().apply_gradients(step, state, grads, aux, self.context(ctx))

    def consolidate(self, step: Step, state: TrainState) -> TrainState:
        return self._inner().consolidate(step, state)

    def shard_state(self, step: Step, full_state: TrainState) -> TrainState:
        return self._inner().shard_state(step, full_state)

    def __repr__(self) -> str:
        text = " ∘ ".join(layer.describe() for layer in self.layers())
        policy = self.precision()
        return text if policy is None else f"{text} [{policy.describe_collectives(self)}]"


class LocalPlan(Plan):
    """The innermost layer: gradients by `value_and_grad`, the update by the context's role."""

    inner = None

    @property
    def name(self) -> str:
        return "local"

    def init(self, step, params, buffers, key, ctx):
        opt_state = ctx.optimizer.init(step.optimizer, params)
        return TrainState(params, buffers, opt_state, torch.zeros((), dtype=torch.int64), key)

    def gradients(self, step, state, batch, ctx):
        if ctx.key is None:
            raise ValueError("LocalPlan.gradients: `ctx.key` is None; call step.gradients(...)")
        out, grads = value_and_grad(
            step.loss_fn,
            state.params,
            state.buffers,
            batch,
            ctx.key,
            grad_mode=step.grad_mode,
            ctx=ctx,
        )
        metrics = {**out.metrics, "grad_bytes": tree_bytes(grads)}
        # Every field given, defaults too: see `fscale.grad.normalize_loss_output`.
        return grads, GradAux(out.loss, out.buffers, metrics, {}, out.used, out.means)

    def apply_gradients(self, step, state, grads, aux, ctx):
        if ctx.skip_update:
            return skipped_state(state, aux.buffers), {"loss": aux.loss, **aux.metrics}
        held = unused.hold(aux.used, state.params, state.opt_state)
        params, opt_state = ctx.optimizer.apply(
            step.optimizer, grads, state.opt_state, state.params, donate=step.donate
        )
        unused.restore(held, params, opt_state)
        new_state = TrainState(params, aux.buffers, opt_state, state.step + 1, state.key)
        return new_state, {"loss": aux.loss, **aux.metrics}

    def consolidate(self, step, state):
        return state

    def shard_state(self, step, full_state):
        return full_state
