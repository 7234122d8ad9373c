"""`expert_parallel(step, mesh, "ep")`: experts sharded over an axis, everything else replicated.

Mixture-of-experts training over a ``dp x ep`` mesh: the batch is split over both axes (every
rank reads its own slice), each rank of the "ep" axis holds a contiguous slice of every expert
leaf (leading dimension E/N), and the other parameters are replicated on every rank. The
layer is a `fscale.Plan` layer with "ep" as a data axis, so the `Step` makes all ranks start
from the same full model, folds the rank's "ep" index into the key, and averages the metrics
and buffers over "ep" as over "dp".

The reduction. The global loss is the mean over all ``dp * ep`` ranks' losses. Over "dp"
every parameter is replicated, so the data-parallel layer (``data_parallel``,
``shard_optimizer`` or ``fully_shard`` over "dp", inside or outside this one) averages every
gradient over "dp" as usual. Over "ep" the two kinds of leaves differ:

- a replicated leaf (attention, norms, embeddings, the router) is used by every ep rank's own
  loss: its gradient must be averaged over "ep" — this layer passes the replicated leaves
  through ``replicate_many(leaves, "ep", op="mean")``, whose backward is that all-reduce, one
  for all of them (per `fully_shard` unit, at its point of use);
- an expert leaf exists once, on its owner; the all-to-all's dual already brings the owner the
  gradient of every ep rank's loss, summed: it only needs the factor 1/ep — this layer passes
  it through an identity whose backward scales by 1/ep. Averaging it over "ep" would mix the
  gradients of different experts.

Both maps are applied to what the loss function receives (the layer wraps the step's
``loss_fn``), so they see named parameters whatever the layers inside hold: full
parameters, ZeRO's bucket views, or `fully_shard`'s units (wrapped so that each unit's
gathered parameters pass through the maps at their point of use). Which leaves are experts
is the `experts` predicate on the parameter names (default: a name with an ``experts``
component, the convention of `fscale.parallel.moe.MoE`).

State: `init` receives the full model (every expert, the same on every rank) and keeps this
rank's slice of each expert leaf before the layers inside see it; so this layer goes OUTSIDE
``shard_optimizer`` and ``fully_shard`` (``expert_parallel(fully_shard(step, mesh, "dp"),
mesh, "ep")``), which then shard the sliced model over "dp". `consolidate` all-gathers the
expert leaves of the parameters and of the optimizer state over "ep"; `shard_state` slices
them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.functional.units import ParamUnit, UnitCall, UnitParams
from fscale.parallel import layers
from fscale.plan import Plan
from fscale.train import Step

__all__ = ["ExpertParallelPlan", "expert_parallel", "is_expert_name", "is_expert_state"]

Tensor = torch.Tensor
NamedMap = Callable[[Mapping[str, Tensor]], dict[str, Tensor]]


def is_expert_name(name: str) -> bool:
    """The default `experts` predicate: ``name`` has a component ``experts``."""
    return "experts" in name.split(".")


def is_expert_state(
    path: str, shape: tuple[int, ...], names: list[str], shapes: list[tuple[int, ...]]
) -> bool:
    """Whether the leaf at `path` of `shape` (of the params or the optimizer state) is, or is
    the state of, one of the expert leaves `names` of `shapes`: its path ends with the expert
    leaf's name and it has that leaf's shape."""
    for name, expert_shape in zip(names, shapes):
        if (path == name or path.endswith("." + name)) and tuple(shape) == tuple(expert_shape):
            return True
    return False


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `factor` backward."""

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class _MappedUnit:
    """A `ParamUnit` whose parameters pass through `named_map` wherever they are used."""

    def __init__(self, unit: ParamUnit, named_map: NamedMap) -> None:
        self.unit = unit
        self.named_map = named_map
        self.name: str = unit.name
        self.names: tuple[str, ...] = unit.names

    def _mapped(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.named_map(params)

    def materialize(self) -> Mapping[str, Tensor]:
        return self._mapped(self.unit.materialize())

    def call(self, call: UnitCall) -> Any:
        def run(params, state, args, kwargs):
            return call.run(self._mapped(params), state, args, kwargs)

        return self.unit.call(tree.with_fields(call, run=run))


@dataclasses.dataclass(frozen=True, repr=False)
class ExpertParallelPlan(Plan):
    """Experts sharded over `axis`, other leaves replicated; see the module docstring."""

    inner: Plan
    mesh: Mesh
    axis: str
    experts: Callable[[str], bool]

    @property
    def name(self) -> str:
        return "expert_parallel"

    def describe(self) -> str:
        return f"expert_parallel(axis={self.axis!r} of size {self.mesh.size(self.axis)})"

    def own_data_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def own_mesh(self) -> Mesh:
        return self.mesh

    # ---- the gradient maps ---------------------------------------------------------------

    def _map_named(self, named: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The expert leaves through the 1/N scale, the others through one `replicate_many`:
        their gradients averaged over the axis in one all-reduce per dtype, once backward has
        produced all of them (one all-reduce per leaf waited for the other ranks at every
        leaf: an expert-parallel GPT's step took twice as long on 2 CPU ranks)."""
        ranks = self.mesh.size(self.axis)
        if ranks == 1:
            return dict(named)
        out = {
            name: _ScaleGrad.apply(leaf, 1.0 / ranks)
            for name, leaf in named.items()
            if self.experts(name)
        }
        shared = [name for name in named if name not in out]
        views = collectives.replicate_many(
            [named[name] for name in shared], self.axis, "mean", mesh=self.mesh
        )
        out.update(zip(shared, views))
        return {name: out[name] for name in named}

    def _map_params(self, params: Any) -> Any:
        if isinstance(params, UnitParams):
            eager = self._map_named(params.eager)
            units = [_MappedUnit(unit, self._map_named) for unit in params.units.values()]
            return UnitParams(eager, units)
        paths, leaves, treedef = tree.flatten_with_paths(params)
        mapped = self._map_named(dict(zip(paths, leaves)))
        return tree.unflatten(treedef, [mapped[path] for path in paths])

    def _step(self, step: Step) -> Step:
        loss_fn = step.loss_fn

        def expert_parallel_loss(params, buffers, batch, key):
            return loss_fn(self._map_params(params), buffers, batch, key)

        return step.replace(loss_fn=expert_parallel_loss)

    # ---- phases --------------------------------------------------------------------------

    def init(self, step, params, buffers, key, ctx):
        return self.inner.init(self._step(step), self._slice_params(params), buffers, key, ctx)

    def gradients(self, step, state, batch, ctx):
        return self.inner.gradients(self._step(step), state, batch, ctx)

    def apply_gradients(self, step, state, grads, aux, ctx):
        return self.inner.apply_gradients(self._step(step), state, grads, aux, ctx)

    def consolidate(self, step, state):
        state = self.inner.consolidate(self._step(step), state)
        names, locals_ = self.expert_shapes(state.params)
        return tree.with_fields(
            state,
            params=self._map_experts(state.params, names, locals_, self._gather),
            opt_state=self._map_experts(state.opt_state, names, locals_, self._gather),
        )

    def shard_state(self, step, full_state):
        names, fulls = self.expert_shapes(full_state.params)
        state = tree.with_fields(
            full_state,
            params=self._map_experts(full_state.params, names, fulls, self._slice),
            opt_state=self._map_experts(full_state.opt_state, names, fulls, self._slice),
        )
        return self.inner.shard_state(self._step(step), state)

    # ---- slicing and gathering expert leaves ---------------------------------------------

    def _slice(self, leaf: Tensor) -> Tensor:
        ranks, index = self.mesh.size(self.axis), self.mesh.rank(self.axis)
        local = leaf.shape[0] // ranks
        return leaf[index * local : (index + 1) * local].clone()

    def _gather(self, leaf: Tensor) -> Tensor:
        with torch.no_grad():
            return collectives.all_gather(leaf.contiguous(), self.axis, dim=0, mesh=self.mesh)

    def expert_shapes(self, params: Any) -> tuple[list[str], list[tuple[int, ...]]]:
        """The paths and shapes of the expert leaves of `params`."""
        paths, leaves, _ = tree.flatten_with_paths(params)
        pairs = [(p, tuple(leaf.shape)) for p, leaf in zip(paths, leaves) if self.experts(p)]
        return [p for p, _s in pairs], [s for _p, s in pairs]

    def _map_experts(
        self,
        values: Any,
        names: list[str],
        shapes: list[tuple[int, ...]],
        fn: Callable[[Tensor], Tensor],
    ) -> Any:
        """`fn` on every leaf of `values` that is, or is the optimizer state of, an expert leaf
        (its path ends with an expert leaf's name and it has that leaf's shape)."""

        def visit(path: str, leaf: Any) -> Any:
            if isinstance(leaf, Tensor) and is_expert_state(path, leaf.shape, names, shapes):
                return fn(leaf)
            return leaf

        return tree.map_with_path(visit, values)

    def _slice_params(self, params: Any) -> Any:
        names, shapes = self.expert_shapes(params)
        ranks = self.mesh.size(self.axis)
        if not names:
            raise ValueError(
                "expert_parallel: no parameter is an expert leaf by the `experts` predicate "
                f"(the parameters are {_preview(tree.paths(params))}). Name the expert leaves "
                "(e.g. fscale.parallel.moe.MoE's '...experts.w_in'), and apply expert_parallel "
                "outside shard_optimizer and fully_shard, which replace the named parameters by "
                "buckets or units"
            )
        for name, shape in zip(names, shapes):
            if not shape or shape[0] % ranks:
                raise ValueError(
                    f"expert_parallel: expert leaf `{name}` of shape {shape} has a leading "
                    f"(expert) dimension not divisible by the {ranks} ranks of axis "
                    f"{self.axis!r}; every rank must hold the same number of experts"
                )
        return self._map_experts(params, names, shapes, self._slice)


def _preview(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:6])
    return f"[{shown}{', ...' if len(names) > 6 else ''}]"


def expert_parallel(
    step: Step,
    mesh: Mesh,
    axis: str = "ep",
    *,
    experts: Callable[[str], bool] = is_expert_name,
) -> Step:
    """Shard the expert leaves over `axis`; split the batch over it; reduce as the module
    docstring says.

    Forward collectives: none of its own (the MoE layers' all-to-alls, built with
    `fscale.moe_dispatch` over the same mesh and axis, move the tokens). Backward: one
    all-reduce (mean) over `axis` of all the replicated leaves' gradients (per dtype; per
    `fully_shard` unit), and 1/N on the expert leaves.
    Resident per rank: the replicated parameters, 1/N of every expert leaf (and of its
    optimizer state).

    Args:
        step: any Step; the transformations that change what the parameters look like
            (``shard_optimizer``, ``fully_shard``) go inside this one.
        mesh: the mesh; `axis` must be one of its axes.
        axis: the expert-parallel axis.
        experts: ``name -> bool``, which parameter leaves are stacked experts (leading
            dimension E, divisible by the axis size).

    Returns:
        A Step whose state holds this rank's slice of the experts. Metrics are means over
        every data axis.

    Raises:
        TypeError / ValueError: `step` is not a Step, `mesh` lacks `axis` or already splits over
            it, `experts` is not callable, `step` is a pipeline (make its stages expert-parallel
            with ``per_stage=`` instead); at init, no leaf is an expert or an expert's leading
            dimension does not divide.
    """
    layers.check_step(step, "expert_parallel")
    layers.check_axis_free(step, mesh, axis, "expert_parallel")
    if not callable(experts):
        raise TypeError(
            f"expert_parallel: `experts` must be a predicate on parameter names, got {experts!r}"
        )
    if step.plan.find("pipeline") is not None:
        # The pipeline runs its stages itself, not the step's loss function, which is where
        # this layer puts its gradient maps: they would never run.
        raise ValueError(
            "expert_parallel: the step is a pipeline, whose stages this layer cannot reach; "
            "make each stage expert-parallel instead: fscale.pipeline(..., per_stage=lambda s: "
            f"fscale.expert_parallel(s, mesh, {axis!r}))"
        )
    return step.replace(plan=ExpertParallelPlan(step.plan, mesh, axis, experts))
