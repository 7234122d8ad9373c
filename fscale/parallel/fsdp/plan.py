"""The layer of `fully_shard` (ZeRO-3) and its optimizer role: shards at rest, gathered at use.

The algorithm, traffic and memory are described in `fscale.parallel.fsdp.transform`. As a layer,
`FullyShardPlan` changes three things for the layers inside it: the state's parameters are
``{unit name: 1-D shard}`` (`init`, `shard_state`); the loss receives a
`fscale.functional.UnitParams` that gathers each unit at its point of use (a parameter map in the
context, drained after the forward and after backward); and the optimizer runs on this rank's
fragments of the shards (`FsdpOptimizer`). Gradients arrive reduced and sharded through the
all-gather's dual, so the layer adds no reduction; a data-parallel layer around it averages
the shards over its own axis (HSDP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fscale import optim as optim_lib
from fscale import spmd
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.distributed.shared_memory import release_windows
from fscale.functional import UnitParams
from fscale.outside_graph import outside_graph
from fscale.parallel.fsdp.gather import Gatherer, ShardedUnit
from fscale.parallel.fsdp.materialize import has_meta, sharded_init
from fscale.parallel.fsdp.units import ROOT, ShardLayout, UnitSpec, assign_units
from fscale.plan import Plan, Precision
from fscale.state_agreement import check_same_values

__all__ = ["FsdpOptimizer", "FullyShardPlan"]

Shards = dict[str, torch.Tensor]  # {unit name: this rank's 1-D shard}


@dataclasses.dataclass(frozen=True)
class FsdpOptimizer:
    """The `fscale.plan.OptimizerRole` of ZeRO-3: the optimizer on this rank's fragments.

    Each parameter's fragment in this rank's shard is one leaf (``{name: 1-D fragment}``), and a
    `fscale.optim.Sharding` lets non-pointwise optimizers complete their statistics over the
    shard axis.
    """

    mesh: Mesh
    axis: str
    layout: ShardLayout

    @property
    def rank(self) -> int:
        return self.mesh.rank(self.axis)

    def sharding(self) -> optim_lib.Sharding:
        mesh, axis = self.mesh, self.axis
        return optim_lib.Sharding(
            fragments=self.layout.fragments(self.rank),
            all_reduce=lambda t: collectives.all_reduce(t, axis, "sum", mesh=mesh),
        )

    def init(self, optimizer: optim_lib.Optimizer, params: Shards) -> Any:
        fragments = self.layout.fragment_views(params, self.rank)
        return optimizer.init(fragments, sharding=self.sharding())

    def apply(self, optimizer, grads, opt_state, params, *, donate):
        new_fragments, new_opt_state = optim_lib.step(
            optimizer,
            self.layout.fragment_views(grads, self.rank),
            opt_state,
            self.layout.fragment_views(params, self.rank),
            sharding=self.sharding(),
            donate=donate,
        )
        return self.layout.pack(new_fragments, params, self.rank), new_opt_state


class GatherAtUse:
    """The parameter map of a fully sharded step: shards in, `UnitParams` out (one per call)."""

    def __init__(
        self, plan: FullyShardPlan, reshard: str, precision: Precision | None = None
    ) -> None:
        self.plan = plan
        self.reshard = reshard
        self.precision = precision
        self.gatherers: list[Gatherer] = []

    def __call__(self, live: Shards) -> UnitParams:
        units, gatherer = self._units(live)
        self.gatherers.append(gatherer)
        eager: dict[str, torch.Tensor] = {}
        root = next((u for u in units if u.name == ROOT), None)
        if root is not None:
            eager = root.views(gatherer.now(root, root.shard))
        return UnitParams(eager, [u for u in units if u.name != ROOT])

    # Outside the graph, as one call: Dynamo cannot rebuild the methods of objects made in the
    # graph across the gathers' breaks, and would run this map's call eagerly.
    @outside_graph
    def _units(self, live: Shards) -> tuple[list[ShardedUnit], Gatherer]:
        layouts = self.plan.layout.units
        units = [ShardedUnit(layout, live[layout.name], self.reshard) for layout in layouts]
        if self.plan.reshard_after_forward == "except_last":
            # The last unit in order of use is kept: backward would gather it again at once.
            last = next((u for u in reversed(units) if u.name != ROOT), None)
            if last is not None:
                last.reshard, last.opens_backward = "keep", True
        policy = self.precision
        if policy is None:
            gatherer = Gatherer(self.plan, units)
        else:
            gatherer = Gatherer(self.plan, units, policy.param_dtype, policy.reduce_dtype)
        for unit in units:
            unit.gatherer = gatherer
        return units, gatherer

    def after_forward(self) -> None:
        for gatherer in self.gatherers:
            gatherer.drain()
        # The gathers pause until backward reaches the last unit: the loss and its gradient,
        # where the activations peak, run without the shared-memory windows resident (the
        # strategy whose point is memory pays the next gather's page faults for it, about
        # 0.4 ms at 2 ranks). Not in a compiled step, where the call (host code) would break
        # the graph: there the windows stay resident.
        if not torch.compiler.is_compiling():
            release_windows()

    def after_backward(self) -> None:
        for gatherer in self.gatherers:
            gatherer.drain_backward()


@dataclasses.dataclass(frozen=True, repr=False)
class FullyShardPlan(Plan):
    """Parameters, gradients and optimizer state sharded over `axis`; see the module docstring."""

    inner: Plan
    mesh: Mesh
    axis: str
    units: UnitSpec
    reshard_after_forward: bool | str
    prefetch: int
    # The model's units, recorded by `init` (or `shard_state`): what turns a state's shards back
    # into named parameters. One entry; a new init replaces it.
    _layout: list[ShardLayout] = dataclasses.field(default_factory=list, compare=False, repr=False)
    # `Step.init` lets meta tensors through to this layer: init makes this rank's shards of a
    # model on the meta device (`fscale.parallel.fsdp.materialize`).
    materializes_meta = True

    @property
    def name(self) -> str:
        return "fully_shard"

    def describe(self) -> str:
        return (
            f"fully_shard(axis={self.axis!r} of size {self.num_shards}, units={self.units!r}, "
            f"reshard_after_forward={self.reshard_after_forward!r}, prefetch={self.prefetch})"
        )

    def own_data_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def own_mesh(self) -> Mesh:
        return self.mesh

    @property
    def layout(self) -> ShardLayout:
        """The unit layout of the model this step was initialised with."""
        if not self._layout:
            raise ValueError(
                "fully_shard: the step has no model yet; build its state with step.init(params, "
                "buffers) or fscale.shard_state(step, full_state) first"
            )
        return self._layout[0]

    def record_layout(self, layout: ShardLayout) -> None:
        self._layout[:] = [layout]

    @property
    def num_shards(self) -> int:
        return self.mesh.size(self.axis)

    def layout_for(self, params: Any) -> ShardLayout:
        """The units of the full `params` dict under this plan."""
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise TypeError(
                "fully_shard: `params` must be a flat dict name -> tensor (the params returned "
                f"by fscale.functionalize), got {type(params).__name__}"
            )
        for name, value in params.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"fully_shard: `params[{name!r}]` must be a tensor, got {type(value).__name__}"
                )
        units = assign_units(list(params), self.units, "fully_shard")
        return ShardLayout.build(params, units, self.num_shards, "fully_shard")

    def role(self) -> FsdpOptimizer:
        return FsdpOptimizer(self.mesh, self.axis, self.layout)

    def reshard(self, grad_mode: str) -> str:
        """How units are resharded after forward on this gradient path (see `ShardedUnit`);
        under "except_last", `GatherAtUse` then keeps the last unit."""
        if self.reshard_after_forward is False:
            return "keep"
        if self.reshard_after_forward == "remat" or grad_mode != "autograd":
            # torch.func transforms refuse saved-tensor hooks: recompute instead.
            return "remat"
        return "regather"

    # ---- phases --------------------------------------------------------------------------

    def init(self, step, params, buffers, key, ctx):
        layout = self.layout_for(params)
        spmd.check_same_on_all_ranks(
            self.mesh, self.axis, layout.describe(), "the units", "fully_shard"
        )
        rank = self.mesh.rank(self.axis)
        if has_meta(params, buffers):
            shards, buffers = sharded_init(layout, rank, params, buffers, key)
        else:
            shards = layout.shard(params, rank)
        self.record_layout(layout)
        return self.inner.init(step, shards, buffers, key, ctx.replace(optimizer=self.role()))

    def gradients(self, step, state, batch, ctx):
        self.checked_shards(state.params)
        gather = GatherAtUse(self, self.reshard(step.grad_mode), step.plan.precision())
        return self.inner.gradients(
            step, state, batch, ctx.replace(param_maps=(*ctx.param_maps, gather))
        )

    def apply_gradients(self, step, state, grads, aux, ctx):
        self.checked_shards(state.params)
        return self.inner.apply_gradients(
            step, state, grads, aux, ctx.replace(optimizer=self.role())
        )

    def consolidate(self, step, state):
        from fscale.parallel.fsdp.state import consolidate_fully_sharded

        return self.inner.consolidate(step, consolidate_fully_sharded(self, step, state))

    def shard_state(self, step, full_state):
        from fscale.parallel.fsdp.state import shard_fully_sharded

        check_same_values(full_state, self.mesh, self.axis, "full states", "shard_state")
        return shard_fully_sharded(self, step, self.inner.shard_state(step, full_state))

    def checked_shards(self, params: Any) -> Shards:
        layout = self.layout
        expected = {unit.name: unit.shard_size for unit in layout.units}
        found = (
            {name: tuple(shard.shape) for name, shard in params.items()}
            if isinstance(params, dict)
            else type(params).__name__
        )
        if found != {name: (size,) for name, size in expected.items()}:
            raise ValueError(
                f"fully_shard: `state.params` is not a sharded state of this step: expected "
                f"{{unit: 1-D shard}} with shard sizes {expected} ({layout.num_shards} ranks), "
                f"got {found}. Build the state with this step's init, or consolidate a state "
                "from another step or world size and reshard it "
                "(fscale.consolidate / shard_state)."
            )
        return params
