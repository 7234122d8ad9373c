"""`fully_shard(step, mesh)`: ZeRO-3 / FSDP as a transformation of a Step.

FSDP here is not a module wrapper with a state machine; it is three ideas placed around the
user's loss:

1. **At rest, every rank holds 1/N of everything.** Parameters are grouped into *units*
   (`fscale.parallel.fsdp.units`: by default one per block of the first module list, plus a root
   unit); each unit is a flat buffer zero-padded to a multiple of N, and rank r keeps only
   slice r of it: ``state.params == {unit name: 1-D shard}``. Gradients and
   optimizer state are sharded the same way, so fp32 Adam holds
   (4 params + 4 grads + 8 moments)·Ψ/N bytes per rank (Ψ with each unit's padding).
2. **A unit's parameters are all-gathered at their point of use.** The step hands ``loss_fn`` a
   `fscale.model.UnitParams` instead of the params dict. A `FunctionalModule` given one runs
   each unit's submodule through the unit: ``all_gather(shard, axis, op="mean")``, the views of
   the gathered buffer swapped in, the submodule's forward, and the buffer released when the
   submodule returns. The gradient of ``all_gather`` is its dual, a reduce-scatter (mean), so
   each unit's gradient arrives already reduced and sharded the moment that unit's backward is
   done; nobody writes the gradient collective.
3. **Backward gathers a unit again instead of recomputing it.** With
   ``reshard_after_forward=True`` (on the default ``grad_mode="autograd"`` path) a unit's
   forward runs normally and autograd keeps its activations, but every tensor it saves that
   views the gathered buffer (a weight for a matmul's input gradient, a norm's scale) is saved
   as a *place* in the unit (offset, shape, strides) through saved-tensor hooks, so nothing
   holds the buffer and it is freed when the submodule returns. The first backward node of the
   unit that unpacks one of those places all-gathers the shard again (no graph: the all-gather
   of the forward already carries the gradient) and reads the view out of the new buffer; the
   buffer is dropped when the gradient of the forward's gathered buffer is complete, right
   before that gather's dual reduce-scatters it. This is torch FSDP2's resharding (free after
   forward, gather before backward, keep activations), with no recompute. A unit whose
   backward reads none of its parameters (the first layer when the model's input needs no
   gradient) is not gathered again.
   ``reshard_after_forward="remat"`` runs each unit under `fscale.remat` instead (the
   mechanism of `fscale.checkpoint`): the unit keeps only its shard and its inputs, and
   backward gathers it again and recomputes it, which also discards its activations; this is
   what ``True`` means under ``grad_mode="func"``, where torch.func transforms refuse
   saved-tensor hooks. To discard activations inside a unit only, wrap blocks (or parts of
   them) in `fscale.checkpoint`: it composes with either mode (its saved parameters are
   places too). Saved-tensor hooks opened by the caller around the step (e.g.
   ``torch.autograd.graph.save_on_cpu``) do not reach inside a resharded unit: the unit's own
   hooks are innermost there. ``reshard_after_forward=False`` keeps the gathered parameters
   until backward (one all-gather less per unit, every unit resident at the end of the
   forward). Peak
   gathered parameters when resharding: the unit being computed plus `prefetch` units in
   flight, in forward and in backward (the root unit aside: it is gathered before the forward
   and kept until its gradient, like torch FSDP's root).

Prefetch: when unit i is called, the all-gathers of the next `prefetch` units (in parameter
registration order, the order of use for sequential models) are issued with
``all_gather_start`` before unit i's own gather is waited on, so communication overlaps the
compute of unit i. In backward, when unit i is gathered again, the re-gathers of the
`prefetch` units called before it are issued too, before unit i's gradient is reduce-scattered,
so they overlap unit i's backward. A model that calls its units in another order stays correct;
a unit prefetched but never called is gathered for nothing and released at the end of the
forward (or of the backward).

Communication per rank per step, ring model, units' padded sizes Ψ_u, N ranks on `axis`:
3·Ψ_u·(N−1)/N per non-root unit with reshard_after_forward (forward gather, backward re-gather,
gradient reduce-scatter), 2·Ψ_u·(N−1)/N without it, for the root unit, and for a unit whose
backward reads none of its parameters; plus one all-reduce
of the scalar metrics (and of the floating-point buffers, if any). With `replicate_axis`
(HSDP) each unit's gradient shard is also all-reduced (mean) over that axis: 2·(Ψ_u/N)·(R−1)/R.

The optimizer runs on the shards: each parameter's fragment in this rank's shard is one leaf
(``{name: 1-D fragment}``), and a `fscale.optim.Layout` built from the units' fragments lets
non-pointwise optimizers (LAMB, Adafactor, clip_by_global_norm) complete their per-tensor
statistics with an all-reduce over `axis`, so they stay exact.

Fallback: a ``loss_fn`` that does not use `functionalize` (it indexes ``params[name]``) gets
each unit gathered lazily on the first access of one of its names, with no recompute (the
gathered unit lives until backward; its gradient is still reduce-scattered).

Buffers (BatchNorm statistics) are replicated, and averaged over the data axes after every step
as `data_parallel` does; frozen parameters are buffers, never sharded. Randomness: the key is
folded with the step and this rank's data-parallel index, as under `data_parallel`.

State in and out: `fscale.consolidate(step, state)` gathers the full TrainState
(params as the dict given to init, optimizer state as the optimizer makes it on full tensors)
on every rank, and `fscale.shard_state(step, full_state)` shards a full state for
this step at any world size; both dispatch to this plan (`fscale.parallel.fsdp.state`), which
converts the optimizer state by the rule `shard_optimizer` shares (`fscale.parallel.opt_state`).

Mixed precision is not implemented yet. The intended rule: gather in the compute dtype (the
unit's shard cast before the all-gather), reduce gradients in fp32.

Code: this module holds the transformation and its plan; the gathers, prefetch and their
accounting are in `fscale.parallel.fsdp.gather`, the backward re-gather in
`fscale.parallel.fsdp.regather`, the units in `fscale.parallel.fsdp.units`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.memory import tree_bytes
from fscale.model import UnitParams
from fscale.parallel import common
from fscale.parallel.fsdp import state as fsdp_state
from fscale.parallel.fsdp.gather import Gatherer, GatherStats, ShardedUnit, track_gathers
from fscale.parallel.fsdp.units import ROOT, ShardLayout, UnitSpec, assign_units
from fscale.train import LocalPlan, Step, TrainState, value_and_grad

__all__ = ["FullyShardPlan", "GatherStats", "fully_shard", "track_gathers"]

Shards = dict[str, torch.Tensor]  # {unit name: this rank's 1-D shard}


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class FullyShardPlan:
    """Parameters, gradients and optimizer state sharded over `axis`; see the module docstring."""

    mesh: Mesh
    axis: str
    units: UnitSpec
    reshard_after_forward: bool | str
    prefetch: int
    replicate_axis: str | None
    # The model's units, recorded by `init` (or `shard_state`): what turns a state's shards back
    # into named parameters. One entry; a new init replaces it.
    _layout: list[ShardLayout] = dataclasses.field(
        default_factory=list, compare=False, repr=False
    )

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
    def data_axes(self) -> str | tuple[str, ...]:
        """The axes the batch is split over (and metrics and buffers averaged over)."""
        return self.axis if self.replicate_axis is None else (self.replicate_axis, self.axis)

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

    def init(self, step: Step, params: Any, buffers: Any, key: torch.Tensor) -> TrainState:
        layout = self.layout_for(params)
        lines = (
            common.describe_tree(params) + ["buffers:"] + common.describe_tree(buffers)
            + ["units:"] + layout.describe()
        )
        for axis in self._axes():
            common.check_same_on_all_ranks(
                self.mesh, axis, lines, "the parameters, buffers and units", "fully_shard"
            )
            params = common.broadcast_tree(params, self.mesh, axis)
            buffers = common.broadcast_tree(buffers, self.mesh, axis)
            key = common.broadcast_tree(key, self.mesh, axis)
        shards = layout.shard(params, self.mesh.rank(self.axis))
        self.record_layout(layout)
        opt_state = step.optimizer.init(
            self._fragments(shards), layout=self.optimizer_layout(layout)
        )
        return TrainState(shards, buffers, opt_state, torch.zeros((), dtype=torch.int64), key)

    def _axes(self) -> tuple[str, ...]:
        return (self.axis,) if self.replicate_axis is None else (self.axis, self.replicate_axis)

    def optimizer_layout(self, layout: ShardLayout) -> optim_lib.Layout:
        """The `fscale.optim.Layout` of this rank's fragments: sums complete over `axis`."""
        mesh, axis = self.mesh, self.axis
        return optim_lib.Layout(
            fragments=layout.fragments(mesh.rank(axis)),
            all_reduce=lambda t: collectives.all_reduce(t, axis, "sum", mesh=mesh),
        )

    def _fragments(self, shards: Shards) -> dict[str, torch.Tensor]:
        return self.layout.fragment_views(shards, self.mesh.rank(self.axis))

    def run(self, step: Step, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        shards = self._checked_shards(state.params)
        out, grads = self.value_and_grad(step, state, batch)
        layout = self.layout
        rank = self.mesh.rank(self.axis)
        new_fragments, opt_state = optim_lib.step(
            step.optimizer,
            self._fragments(grads),
            state.opt_state,
            self._fragments(shards),
            layout=self.optimizer_layout(layout),
            donate=step.donate,
        )
        params = layout.pack(new_fragments, shards, rank)
        buffers = common.mean_floating_leaves(out.buffers, self.mesh, self.data_axes)
        metrics = common.reduce_metrics(
            {"loss": out.loss, **out.metrics}, self.mesh, self.data_axes
        )
        metrics["grad_bytes"] = tree_bytes(grads)
        return TrainState(params, buffers, opt_state, state.step + 1, state.key), metrics

    def value_and_grad(self, step: Step, state: TrainState, batch: Any) -> tuple[Any, Shards]:
        """The loss outputs and this rank's gradient shards (reduced over the data axes).

        The gradient of each unit's shard is the reduce-scatter (mean) of the unit's full
        gradient: ``{unit name: 1-D gradient shard}``, the only gradient memory the step holds.
        """
        shards = self._checked_shards(state.params)
        key = fsrandom.fold_in(
            fsrandom.fold_in(state.key, int(state.step)), self.mesh.rank(self.data_axes)
        )
        gatherers: list[Gatherer] = []

        def loss_fn(params: Any, buffers: Any, batch: Any, key: torch.Tensor) -> Any:
            out = step.loss_fn(params, buffers, batch, key)
            for gatherer in gatherers:
                gatherer.drain()
            return out

        def prepare(live: Shards) -> UnitParams:
            return self._unit_params(live, gatherers, reshard)

        reshard = self._reshard(step.grad_mode)
        result = value_and_grad(
            loss_fn, shards, state.buffers, batch, key, grad_mode=step.grad_mode, prepare=prepare
        )
        for gatherer in gatherers:
            gatherer.drain_backward()
        return result

    def _reshard(self, grad_mode: str) -> str:
        """How units are resharded after forward on this gradient path (see `ShardedUnit`)."""
        if self.reshard_after_forward is False:
            return "keep"
        if self.reshard_after_forward == "remat" or grad_mode != "autograd":
            # torch.func transforms refuse saved-tensor hooks: recompute instead.
            return "remat"
        return "regather"

    def _unit_params(self, live: Shards, gatherers: list[Gatherer], reshard: str) -> UnitParams:
        units = [ShardedUnit(layout, live[layout.name], reshard) for layout in self.layout.units]
        gatherer = Gatherer(self, units)
        for unit in units:
            unit.gatherer = gatherer
        gatherers.append(gatherer)
        eager: dict[str, torch.Tensor] = {}
        root = next((u for u in units if u.name == ROOT), None)
        if root is not None:
            eager = root._views(gatherer.now(root, root.shard))
        return UnitParams(eager, [u for u in units if u.name != ROOT])

    def consolidate(self, step: Step, state: TrainState) -> TrainState:
        """The full state (see `fscale.consolidate`, which calls this)."""
        return fsdp_state.consolidate_fully_sharded(step, state)

    def shard_state(self, step: Step, full_state: TrainState) -> TrainState:
        """This rank's state from a full one (see `fscale.shard_state`)."""
        return fsdp_state.shard_fully_sharded(step, full_state)

    def _checked_shards(self, params: Any) -> Shards:
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

    def __repr__(self) -> str:
        hsdp = f", replicate_axis={self.replicate_axis!r}" if self.replicate_axis else ""
        return (
            f"fully_shard(axis={self.axis!r} of size {self.num_shards}, units={self.units!r}, "
            f"reshard_after_forward={self.reshard_after_forward!r}, prefetch={self.prefetch}{hsdp})"
        )


def fully_shard(
    step: Step,
    mesh: Mesh,
    axis: str = "dp",
    *,
    units: UnitSpec = None,
    reshard_after_forward: bool | str = True,
    prefetch: int = 1,
    replicate_axis: str | None = None,
) -> Step:
    """ZeRO-3 / FSDP: shard parameters, gradients and optimizer state over `axis`.

    Forward collective: ``all_gather`` of each unit at its point of use. Backward collective:
    its dual, a ``reduce_scatter`` (mean) of the unit's gradient, plus (with
    `reshard_after_forward`) the re-gather of the unit before its backward. Resident per rank:
    1/N of parameters, gradients and optimizer state, plus the units in use. See the module
    docstring for the exact traffic and memory.

    Args:
        step: a single-process Step from `fscale.train_step`. Its ``loss_fn`` receives a
            `fscale.model.UnitParams`: pass it to a `FunctionalModule` (gather at the point of
            use) or index it by name (each unit gathered on first access).
        mesh: the mesh; `axis` (and `replicate_axis`) must be among its axes.
        axis: the axis to shard over. Each rank along it (and along `replicate_axis`) reads its
            own slice of the global batch.
        units: which parameters are gathered together: None (one unit per element of the
            first module list, e.g. per GPT block, the rest in the root unit), a list of path
            prefixes, or a function ``path -> unit name`` (None for the root unit). See
            `fscale.parallel.fsdp.units`. A unit is padded to a multiple of N; a unit smaller than
            N leaves some ranks holding only padding. All names of a tied weight must be in
            one unit (for a GPT's embedding and output layer: the root unit).
        reshard_after_forward: True: release each unit's gathered parameters after its
            forward and gather them again when its backward needs them, keeping its
            activations (3 transfers of the unit per step, at most ``prefetch + 1`` units
            resident; under ``grad_mode="func"`` this recomputes, as "remat"). "remat": keep
            only the unit's inputs and recompute the unit in backward after gathering it
            again (activation checkpointing per unit, same traffic). False: keep them until
            backward (2 transfers, every unit resident at the end of the forward).
        prefetch: how many units ahead to issue all-gathers, in the forward and for the
            re-gathers of the backward (0: none).
        replicate_axis: an outer axis to replicate over (HSDP): parameters are sharded over
            `axis` within each replica, and each gradient shard is also averaged over the
            replicas.

    Returns:
        A Step whose state holds ``{unit name: 1-D shard}`` as its params and whose metrics
        (the loss and scalar extras) are means over the data axes, equal on every rank.

    Raises:
        TypeError / ValueError: `step` is not an untransformed Step, `mesh` lacks an axis, bad
            `units`, `prefetch` or flags. At init: a unit spec matching nothing, a unit mixing
            dtypes, a tied weight split across units (at the first step), or ranks that
            disagree on the parameters or units.

    Example:
        >>> import fscale as fs
        >>> model = fs.models.mlp([4, 8, 2])
        >>> apply, params, buffers = fs.functionalize(model)
        >>> def loss_fn(p, b, batch, key):
        ...     out, b = apply(p, b, batch)
        ...     return out.square().mean(), b
        >>> step = fully_shard(fs.train_step(loss_fn, fs.optim.adam(1e-3)), fs.Mesh(dp=1))
        >>> state = step.init(params, buffers)
        >>> sorted(state.params)
        ['0', '2']
        >>> state, metrics = step(state, torch.ones(3, 4))
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"fully_shard: `step` must be a Step from fscale.train_step, got {type(step).__name__}"
        )
    common.check_axis(mesh, axis, "fully_shard")
    if replicate_axis is not None:
        common.check_axis(mesh, replicate_axis, "fully_shard")
        if replicate_axis == axis:
            raise ValueError(
                f"fully_shard: `replicate_axis` must differ from `axis`, both are {axis!r}"
            )
    if not isinstance(step.plan, LocalPlan):
        raise ValueError(
            f"fully_shard: the step is already transformed ({step.plan!r}); apply fully_shard "
            "to a single-process step from fscale.train_step (for HSDP pass replicate_axis=...)"
        )
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward != "remat":
        raise ValueError(
            "fully_shard: `reshard_after_forward` must be True, False or 'remat', got "
            f"{reshard_after_forward!r}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fully_shard: `prefetch` must be an int >= 0, got {prefetch!r}")
    if units is not None and not callable(units):
        if isinstance(units, str) or not isinstance(units, (list, tuple)) or not all(
            isinstance(p, str) for p in units
        ):
            raise TypeError(
                "fully_shard: `units` must be None, a list of path prefixes (e.g. ['blocks.0', "
                f"'blocks.1']) or a function path -> unit name, got {units!r}"
            )
        units = tuple(units)
    plan = FullyShardPlan(mesh, axis, units, reshard_after_forward, prefetch, replicate_axis)
    return step.replace(plan=plan)
