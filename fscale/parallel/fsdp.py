"""`fully_shard(step, mesh)`: ZeRO-3 / FSDP as a transformation of a Step.

FSDP here is not a module wrapper with a state machine; it is three ideas placed around the
user's loss:

1. **At rest, every rank holds 1/N of everything.** Parameters are grouped into *units*
   (`fscale.parallel.units`: by default one per block of the first module list, plus a root
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
this step at any world size; both dispatch to this plan (`fscale.parallel.fsdp_state`).

Mixed precision is not implemented yet. The intended rule: gather in the compute dtype (the
unit's shard cast before the all-gather), reduce gradients in fp32.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale import remat
from fscale.dist import collectives
from fscale.dist.collectives import Pending
from fscale.dist.mesh import Mesh
from fscale.memory import tree_bytes
from fscale.model import UnitCall, UnitParams
from fscale.parallel import common
from fscale.parallel import fsdp_state
from fscale.parallel.units import ROOT, ShardLayout, UnitLayout, UnitSpec, assign_units
from fscale.train import LocalPlan, Step, TrainState, value_and_grad

__all__ = ["FullyShardPlan", "GatherStats", "fully_shard", "track_gathers"]


# ---------------------------------------------------------------------------------------------
# Accounting of gathered parameters


@dataclasses.dataclass
class GatherStats:
    """What unit all-gathers did while a `track_gathers()` block was open (root unit aside).

    Attributes:
        gathers: all-gathers of non-root units (forward, prefetch and backward re-gathers).
        live_units: non-root units gathered (or in flight) and not yet released, now.
        peak_units: the most non-root units gathered or in flight at once.
        peak_bytes: the most bytes of gathered non-root parameters held at once.
    """

    gathers: int = 0
    live_units: int = 0
    live_bytes: int = 0
    peak_units: int = 0
    peak_bytes: int = 0

    def _add(self, units: int, nbytes: int) -> None:
        self.live_units += units
        self.live_bytes += nbytes
        self.peak_units = max(self.peak_units, self.live_units)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


_TRACKERS: list[GatherStats] = []


class track_gathers:  # noqa: N801 - a context manager used like a function
    """Count unit all-gathers and the peak of gathered parameters inside the block.

    Yields a `GatherStats`. A gathered unit counts from the moment its all-gather is issued
    until the last tensor viewing it is freed (tracked by reference, so it measures what the
    program really keeps alive: autograd's saved tensors included). The communication library
    may hold a finished buffer a moment after the wait returned (gloo releases it from its
    worker thread), so an instant's peak can exceed the policy's by one unit.
    """

    def __enter__(self) -> GatherStats:
        self.stats = GatherStats()
        _TRACKERS.append(self.stats)
        return self.stats

    def __exit__(self, *exc_info: object) -> None:
        _TRACKERS.remove(self.stats)


def _track(unit: UnitLayout) -> Callable[[torch.Tensor], None]:
    """Count one gather of `unit` as live now; the returned callback ties it to a tensor."""
    if unit.name == ROOT or not _TRACKERS:
        return lambda tensor: None
    nbytes = unit.numel * unit.dtype.itemsize
    trackers = list(_TRACKERS)
    for stats in trackers:
        stats.gathers += 1
        stats._add(1, nbytes)

    def release() -> None:
        for stats in trackers:
            stats._add(-1, -nbytes)

    def tie(tensor: torch.Tensor) -> None:
        # Views keep their base alive, so the base's lifetime is the gathered buffer's.
        base = tensor._base if tensor._base is not None else tensor
        weakref.finalize(base, release)

    return tie


# ---------------------------------------------------------------------------------------------
# Gathering units in one forward pass


class _Gatherer:
    """Issues one step's unit all-gathers: in order of use, `prefetch` units ahead.

    In forward, units are gathered in the order they are called; in backward, the units whose
    gathered parameters were released after their forward are gathered again in the reverse
    of that order (`_Regather`).
    """

    def __init__(self, plan: FullyShardPlan, units: list[_ShardedUnit]) -> None:
        self.plan = plan
        self.order = [u for u in units if u.layout.name != ROOT]
        self.position = {u.layout.name: i for i, u in enumerate(self.order)}
        # unit name -> its prefetched gather (values only) and the gather's tracking tie
        self.pending: dict[str, tuple[Pending, Callable[[torch.Tensor], None]]] = {}
        self.started: set[str] = set()
        # The resharded forward calls, in call order: backward re-gathers walk it backwards.
        self.regathers: list[_Regather] = []

    def now(self, unit: _ShardedUnit, shard: torch.Tensor) -> torch.Tensor:
        """Gather `shard` (differentiable: its gradient is reduce-scattered) and wait for it."""
        plan = self.plan
        tie = _track(unit.layout)
        gathered = collectives.all_gather(
            self._replicated(shard), plan.axis, 0, "mean", mesh=plan.mesh
        )
        tie(gathered)
        return gathered

    def start(self, unit: _ShardedUnit) -> tuple[Pending, Callable[[torch.Tensor], None]]:
        """Start gathering `unit`'s shard: values only, no graph (see `_differentiable`)."""
        plan = self.plan
        tie = _track(unit.layout)
        with torch.no_grad():
            pending = collectives.all_gather_start(
                unit.shard.detach(), plan.axis, 0, "mean", mesh=plan.mesh
            )
        return pending, tie

    def _replicated(self, shard: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if plan.replicate_axis is None:
            return shard
        # HSDP: the dual of `replicate` all-reduces the gradient shard over the replicas.
        return collectives.replicate(shard, plan.replicate_axis, "mean", mesh=plan.mesh)

    def _differentiable(self, unit: _ShardedUnit, gathered: torch.Tensor) -> torch.Tensor:
        """`gathered` as the all-gather of `unit.shard`, for autograd, from the point of use.

        Prefetched gathers are issued without a graph and joined to it here, when the unit is
        used: autograd runs a node's backward in reverse order of creation, so a gradient
        node created at the prefetch (one unit early) would hold this unit's reduce-scatter
        back until the previous unit's backward had run too.
        """
        plan = self.plan
        return _GatheredFrom.apply(self._replicated(unit.shard), gathered, plan.axis, plan.mesh)

    def prefetch(self, after: int) -> None:
        """Start the gathers of the `prefetch` units after position `after` not started yet."""
        for unit in self.order[after + 1 : after + 1 + self.plan.prefetch]:
            name = unit.layout.name
            if name not in self.started:
                self.started.add(name)
                self.pending[name] = self.start(unit)

    def in_forward(self, unit: _ShardedUnit, grad: bool) -> torch.Tensor:
        """`unit`'s gathered buffer for its forward use, issuing the next units' gathers first.

        `grad`: whether the use needs the gather's graph (its gradient is the reduce-scatter);
        a use inside a remat forward records no graph and does not.
        """
        name = unit.layout.name
        self.started.add(name)
        pending, tie = self.pending.pop(name, None) or self.start(unit)
        # Issued before this unit's gather is waited on, so they overlap its compute.
        self.prefetch(self.position[name])
        gathered = pending.wait()
        tie(gathered)
        return self._differentiable(unit, gathered) if grad else gathered

    def resharded_call(self, unit: _ShardedUnit, gathered: torch.Tensor) -> _Regather:
        """Record a forward call of `unit` whose `gathered` buffer is released after it."""
        regather = _Regather(self, unit, len(self.regathers), gathered)
        self.regathers.append(regather)
        return regather

    def prefetch_backward(self, before: int) -> None:
        """Start the re-gathers of the `prefetch` resharded calls before position `before`."""
        started = 0
        for regather in reversed(self.regathers[:before]):
            if started == self.plan.prefetch:
                break
            if regather.needed:
                regather.start()
                started += 1

    def drain(self) -> None:
        """Wait for (and drop) gathers prefetched for units the forward did not call."""
        for pending, tie in self.pending.values():
            tie(pending.wait())
        self.pending.clear()

    def drain_backward(self) -> None:
        """Wait for (and drop) re-gathers a backward prefetched but did not use."""
        for regather in self.regathers:
            regather.release()


class _GatheredFrom(torch.autograd.Function):
    """Identity on an already gathered buffer, differentiated as the all-gather of `shard`.

    The backward is the all-gather's dual, a reduce-scatter (mean) of the buffer's gradient.
    """

    @staticmethod
    def forward(shard: torch.Tensor, gathered: torch.Tensor, axis: str, mesh: Mesh) -> torch.Tensor:
        return gathered.view_as(gathered)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, _, ctx.axis, ctx.mesh = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        shard_grad = collectives.reduce_scatter(grad, ctx.axis, 0, "mean", mesh=ctx.mesh)
        return shard_grad, None, None, None


class _Place(NamedTuple):
    """Where a tensor autograd saved lies in its unit's gathered buffer."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements from the start of the gathered buffer


class _Regather:
    """One forward call of a unit whose gathered parameters are freed after it.

    During the call, saved-tensor hooks turn every tensor autograd saves that views the
    gathered buffer into a `_Place`; the call's other saved tensors (activations) are kept as
    they are. In backward, the first unpacked place gathers the shard again (`fetch`) and
    starts the re-gathers of the calls before it; the new buffer is dropped once the gradient
    of the forward's buffer is complete, just before the forward gather's dual reduce-scatters
    it.
    """

    def __init__(
        self, gatherer: _Gatherer, unit: _ShardedUnit, index: int, gathered: torch.Tensor
    ) -> None:
        self.gatherer = gatherer
        self.unit = unit
        self.index = index
        # The forward buffer is identified by address only while it is certainly alive (the
        # call): holding the tensor would keep it alive, which is what this class avoids.
        self._address: int | None = gathered.untyped_storage().data_ptr()
        self._start_offset = gathered.storage_offset()
        self.needed = False  # whether autograd saved a view of the buffer
        self._pending: tuple[Pending, Callable[[torch.Tensor], None]] | None = None
        self._gathered: torch.Tensor | None = None
        self._done = False
        gathered.register_hook(self._gradient_complete)

    def run(self, call: UnitCall, params: Mapping[str, torch.Tensor]) -> Any:
        """Run the unit's call with its saved parameter views turned into places."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return call.run(params, call.state, call.args, call.kwargs)
        finally:
            self._address = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Place:
        if (
            self._address is None
            or type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or tensor.dtype != self.unit.layout.dtype
            or tensor.untyped_storage().data_ptr() != self._address
        ):
            return tensor
        self.needed = True
        offset = tensor.storage_offset() - self._start_offset
        return _Place(tensor.size(), tensor.stride(), offset)

    def _unpack(self, packed: torch.Tensor | _Place) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        gathered = self.fetch()
        return gathered.as_strided(
            packed.size, packed.stride, gathered.storage_offset() + packed.offset
        )

    def start(self) -> None:
        """Issue the re-gather (once; not after the unit's backward is done)."""
        if self._pending is None and self._gathered is None and not self._done:
            self._pending = self.gatherer.start(self.unit)

    def fetch(self) -> torch.Tensor:
        """The gathered buffer for backward: waits for the re-gather, issuing it if needed."""
        if self._gathered is None:
            self._done = False  # read after its gradient: a (rare) second re-gather
            self.start()
            assert self._pending is not None
            pending, tie = self._pending
            # The calls before this one are gathered while this unit's backward computes.
            self.gatherer.prefetch_backward(self.index)
            self._gathered = pending.wait()
            self._pending = None
            tie(self._gathered)
        return self._gathered

    def _gradient_complete(self, grad: torch.Tensor) -> None:
        self.release()
        self._done = True

    def release(self) -> None:
        """Drop the re-gathered buffer (waiting for a re-gather still in flight)."""
        if self._pending is not None:
            pending, tie = self._pending
            tie(pending.wait())
            self._pending = None
        self._gathered = None


class _ShardedUnit:
    """A `fscale.model.ParamUnit` over this rank's shard of one unit.

    `reshard`: "regather" (free after forward, gather again in backward), "remat" (recompute
    the unit in backward) or "keep" (gathered until backward).
    """

    def __init__(self, layout: UnitLayout, shard: torch.Tensor, reshard: str) -> None:
        self.layout = layout
        self.name = layout.name
        self.names = layout.names
        self.shard = shard
        self.reshard = reshard
        self.gatherer: _Gatherer  # set once the step's gatherer exists

    def _views(self, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.layout.flat.views(gathered)))

    def materialize(self) -> Mapping[str, torch.Tensor]:
        # The fallback: differentiable, kept until backward; prefetches the next units.
        return self._views(self.gatherer.in_forward(self, grad=torch.is_grad_enabled()))

    def call(self, call: UnitCall) -> Any:
        if self.reshard == "remat":
            return self._remat_call(call)
        grad = torch.is_grad_enabled()
        gathered = self.gatherer.in_forward(self, grad=grad)
        if self.reshard == "keep" or not gathered.requires_grad:
            return call.run(self._views(gathered), call.state, call.args, call.kwargs)
        regather = self.gatherer.resharded_call(self, gathered)
        return regather.run(call, self._views(gathered))

    def _remat_call(self, call: UnitCall) -> Any:
        runs = 0

        def gathered_call(inputs: Any) -> Any:
            nonlocal runs
            shard, state, args, kwargs = inputs
            runs += 1
            if runs == 1:
                # The forward: no graph is recorded here, so the prefetched buffer serves.
                gathered = self.gatherer.in_forward(self, grad=False)
            else:
                # The recompute in backward: a differentiable gather of the saved shard, whose
                # gradient is the reduce-scatter of this unit's gradient.
                gathered = self.gatherer.now(self, shard)
            return call.run(self._views(gathered), state, args, kwargs)

        # The shard and the submodule's other state are the remat's "module state" inputs, so
        # buffers updated in place (BatchNorm) are snapshotted and updated once.
        state = list(call.state)
        return remat._checkpointed_call(
            gathered_call,
            (self.shard, state, call.args, call.kwargs),
            _NO_OFFLOAD,
            module_state=1 + len(state),
            buffer_indexes=frozenset(1 + i for i in call.mutable),
        )

    def __repr__(self) -> str:
        return f"_ShardedUnit({self.name!r}, {len(self.names)} params)"


_NO_OFFLOAD = remat._Options(offload=False, policy=None)

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
        gatherers: list[_Gatherer] = []

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
        """How units are resharded after forward on this gradient path (see `_ShardedUnit`)."""
        if self.reshard_after_forward is False:
            return "keep"
        if self.reshard_after_forward == "remat" or grad_mode != "autograd":
            # torch.func transforms refuse saved-tensor hooks: recompute instead.
            return "remat"
        return "regather"

    def _unit_params(self, live: Shards, gatherers: list[_Gatherer], reshard: str) -> UnitParams:
        units = [_ShardedUnit(layout, live[layout.name], reshard) for layout in self.layout.units]
        gatherer = _Gatherer(self, units)
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
            `fscale.parallel.units`. A unit is padded to a multiple of N; a unit smaller than
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
