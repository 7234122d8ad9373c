"""Gathering `fully_shard` units: all-gathers at the point of use, prefetch, and their accounting.

Each step builds one `Gatherer` over its `ShardedUnit`s (this rank's shard of every unit). A
unit's forward call asks the gatherer for its gathered buffer: the all-gather is differentiable,
its gradient the reduce-scatter of the unit's gradient, and the next `prefetch` units' gathers
are issued before this one is waited on. After the forward a unit is kept gathered until
backward, recomputed under `fscale.remat`, or released and gathered again in backward
(`fscale.parallel.fsdp.regather`), as the plan's ``reshard_after_forward`` says.
`track_gathers` measures what the gathers keep alive. The policy is described in
`fscale.parallel.fsdp`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fscale import remat, tracking, tree
from fscale.distributed import collectives
from fscale.distributed.collectives import Pending
from fscale.distributed.mesh import Mesh
from fscale.functional import UnitCall
from fscale.offload.schedule import PrefetchSchedule
from fscale.parallel.fsdp.regather import Regather
from fscale.parallel.fsdp.units import ROOT, UnitLayout

if TYPE_CHECKING:
    from fscale.parallel.fsdp.plan import FullyShardPlan

__all__ = ["GatherStats", "Gatherer", "ShardedUnit", "track_gathers"]


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

    def add(self, units: int, nbytes: int) -> None:
        """Count `units` more gathered units of `nbytes` (negative: released)."""
        self.live_units += units
        self.live_bytes += nbytes
        self.peak_units = max(self.peak_units, self.live_units)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


_TRACKERS: tracking.Stack[GatherStats] = tracking.stack(__name__)


class track_gathers:  # noqa: N801 - a context manager used like a function
    """Count unit all-gathers and the peak of gathered parameters inside the block.

    Yields a `GatherStats`. A gathered unit counts from the moment its all-gather is issued
    until the last tensor viewing it is freed (tracked by reference, so it measures what the
    program really keeps alive: autograd's saved tensors included). The communication library
    may hold a finished buffer a moment after the wait returned (gloo releases it from its
    worker thread), so an instant's peak can exceed the policy's by one unit.
    """

    def __enter__(self) -> GatherStats:
        self.stats = _TRACKERS.push(GatherStats())
        return self.stats

    def __exit__(self, *exc_info: object) -> None:
        _TRACKERS.pop(self.stats)


def _track(unit: UnitLayout, dtype: torch.dtype | None = None) -> Callable[[torch.Tensor], None]:
    """Count one gather of `unit` (in `dtype`, default the unit's) as live now; the returned
    callback ties it to a tensor."""
    if unit.name == ROOT or not _TRACKERS:
        return lambda tensor: None
    nbytes = unit.numel * (unit.dtype if dtype is None else dtype).itemsize
    trackers = _TRACKERS.active()
    for stats in trackers:
        stats.gathers += 1
        stats.add(1, nbytes)

    def release() -> None:
        for stats in trackers:
            stats.add(-1, -nbytes)

    def tie(tensor: torch.Tensor) -> None:
        # Views keep their base alive, so the base's lifetime is the gathered buffer's.
        base = tensor._base if tensor._base is not None else tensor
        weakref.finalize(base, release)

    return tie


# ---------------------------------------------------------------------------------------------
# Gathering units in one forward pass


class Gatherer:
    """Issues one step's unit all-gathers: in order of use, `prefetch` units ahead.

    In forward, units are gathered in the order they are called; in backward, the units whose
    gathered parameters were released after their forward are gathered again in the reverse
    of that order (`Regather`).

    `gather_dtype` / `reduce_dtype` (a mixed-precision policy's ``param_dtype`` and
    ``reduce_dtype``; None: the shards' own dtype): each shard is cast to `gather_dtype` before
    its all-gather, so the wire carries it, and each gathered gradient to `reduce_dtype` before
    its reduce-scatter; the shard's gradient comes back in the shard's dtype.
    """

    def __init__(
        self,
        plan: FullyShardPlan,
        units: list[ShardedUnit],
        gather_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.plan = plan
        self.gather_dtype = gather_dtype
        self.reduce_dtype = reduce_dtype
        self.order = [u for u in units if u.layout.name != ROOT]
        self.position = {u.layout.name: i for i, u in enumerate(self.order)}
        # The forward's gathers, `prefetch` units ahead: a handle is the gather in flight
        # (values only) and its tracking tie; a unit is prefetched at most once per forward.
        self.forward = PrefetchSchedule(
            len(self.order),
            plan.prefetch,
            start=lambda position: self.start(self.order[position]),
            finish=lambda handle: handle,
        )
        # The resharded forward calls, in call order: backward re-gathers walk it backwards.
        self.regathers: list[Regather] = []
        self._backward: PrefetchSchedule | None = None
        self._backward_opened = False

    def now(self, unit: ShardedUnit, shard: torch.Tensor) -> torch.Tensor:
        """Gather `shard` (differentiable: its gradient is reduce-scattered) and wait for it."""
        plan = self.plan
        tie = _track(unit.layout, self.gather_dtype)
        if self.gather_dtype is None and self.reduce_dtype is None:
            gathered = collectives.all_gather(shard, plan.axis, 0, "mean", mesh=plan.mesh)
        else:
            gathered = _CastGathered.apply(
                shard, plan.axis, plan.mesh, self.gather_dtype, self.reduce_dtype
            )
        tie(gathered)
        return gathered

    def start(self, unit: ShardedUnit) -> tuple[Pending, Callable[[torch.Tensor], None]]:
        """Start gathering `unit`'s shard: values only, no graph (see `_differentiable`)."""
        plan = self.plan
        tie = _track(unit.layout, self.gather_dtype)
        with torch.no_grad():
            shard = unit.shard.detach()
            if self.gather_dtype is not None:
                shard = shard.to(self.gather_dtype)
            pending = collectives.all_gather_start(shard, plan.axis, 0, "mean", mesh=plan.mesh)
        return pending, tie

    def _differentiable(self, unit: ShardedUnit, gathered: torch.Tensor) -> torch.Tensor:
        """`gathered` as the all-gather of `unit.shard`, for autograd, from the point of use.

        Prefetched gathers are issued without a graph and joined to it here, when the unit is
        used: autograd runs a node's backward in reverse order of creation, so a gradient
        node created at the prefetch (one unit early) would hold this unit's reduce-scatter
        back until the previous unit's backward had run too.
        """
        plan = self.plan
        return _GatheredFrom.apply(unit.shard, gathered, plan.axis, plan.mesh, self.reduce_dtype)

    def in_forward(self, unit: ShardedUnit, grad: bool) -> torch.Tensor:
        """`unit`'s gathered buffer for its forward use, issuing the next units' gathers first.

        `grad`: whether the use needs the gather's graph (its gradient is the reduce-scatter);
        a use inside a remat forward records no graph and does not.
        """
        position = self.position[unit.layout.name]
        self.forward.fetch(position, "forward")
        # Issued before this unit's gather is waited on, so they overlap its compute.
        self.forward.prefetch_after(position)
        pending, tie = self.forward.acquire(position, "forward")
        gathered = pending.wait()
        tie(gathered)
        return self._differentiable(unit, gathered) if grad else gathered

    def resharded_call(self, unit: ShardedUnit, gathered: torch.Tensor) -> Regather:
        """Record a forward call of `unit` whose `gathered` buffer is released after it."""
        regather = Regather(self, unit, len(self.regathers), gathered)
        self.regathers.append(regather)
        return regather

    def backward_schedule(self) -> PrefetchSchedule:
        """The backward's re-gathers: the resharded calls in reverse, `prefetch` ahead.

        Made when backward first needs a unit again, once the forward's calls are all known.
        """
        if self._backward is None:
            regathers = self.regathers
            self._backward = PrefetchSchedule(
                len(regathers),
                self.plan.prefetch,
                start=lambda index: self.start(regathers[index].unit),
                finish=lambda handle: handle,
            )
        return self._backward

    def open_backward(self) -> None:
        """Start the re-gathers of the last `prefetch` resharded calls, once per backward: the
        backward has reached a unit kept from its forward, whose own gather nothing waits for."""
        if not self._backward_opened:
            self._backward_opened = True
            self.prefetch_backward(len(self.regathers))

    def prefetch_backward(self, before: int) -> None:
        """Start the re-gathers of the `prefetch` resharded calls before position `before`
        whose backward still reads their parameters."""
        among = {r.index for r in self.regathers if r.needed and not r.done}
        self.backward_schedule().prefetch_before(before, "backward", among=among)

    def drain(self) -> None:
        """Wait for (and drop) gathers prefetched for units the forward did not call."""
        for pending, tie in self.forward.drain("forward"):
            tie(pending.wait())

    def drain_backward(self) -> None:
        """Wait for (and drop) re-gathers a backward prefetched but did not use."""
        for regather in self.regathers:
            regather.release()


def _reduce_scattered(
    grad: torch.Tensor, axis: str, mesh: Mesh, reduce_dtype: torch.dtype | None, like: torch.dtype
) -> torch.Tensor:
    """The reduce-scatter (mean) of `grad`, in `reduce_dtype` when given, as dtype `like`."""
    if reduce_dtype is None:
        return collectives.reduce_scatter(grad, axis, 0, "mean", mesh=mesh)
    shard_grad = collectives.reduce_scatter(grad.to(reduce_dtype), axis, 0, "mean", mesh=mesh)
    return shard_grad.to(like)


class _GatheredFrom(torch.autograd.Function):
    """Identity on an already gathered buffer, differentiated as the all-gather of `shard`.

    The backward is the all-gather's dual, a reduce-scatter (mean) of the buffer's gradient
    (in `reduce_dtype` when given, then cast to the shard's dtype).
    """

    @staticmethod
    def forward(
        shard: torch.Tensor,
        gathered: torch.Tensor,
        axis: str,
        mesh: Mesh,
        reduce_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return gathered.view_as(gathered)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        shard, _, ctx.axis, ctx.mesh, ctx.reduce_dtype = inputs
        ctx.shard_dtype = shard.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        shard_grad = _reduce_scattered(grad, ctx.axis, ctx.mesh, ctx.reduce_dtype, ctx.shard_dtype)
        return shard_grad, None, None, None, None


class _CastGathered(torch.autograd.Function):
    """The all-gather of `shard` cast to `gather_dtype`; backward: the reduce-scatter (mean) of
    the gradient in `reduce_dtype`, as the shard's dtype (None: no cast)."""

    @staticmethod
    def forward(
        shard: torch.Tensor,
        axis: str,
        mesh: Mesh,
        gather_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        wire = shard if gather_dtype is None else shard.to(gather_dtype)
        return collectives.all_gather(wire, axis, 0, "mean", mesh=mesh)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        shard, ctx.axis, ctx.mesh, _, ctx.reduce_dtype = inputs
        ctx.shard_dtype = shard.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        shard_grad = _reduce_scattered(grad, ctx.axis, ctx.mesh, ctx.reduce_dtype, ctx.shard_dtype)
        return shard_grad, None, None, None, None


class ShardedUnit:
    """A `fscale.functional.ParamUnit` over this rank's shard of one unit.

    `reshard`: "regather" (free after forward, gather again in backward), "remat" (recompute
    the unit in backward) or "keep" (gathered until backward).
    """

    def __init__(self, layout: UnitLayout, shard: torch.Tensor, reshard: str) -> None:
        self.layout = layout
        self.name = layout.name
        self.names = layout.names
        self.shard = shard
        self.reshard = reshard
        # The last unit of a resharding forward: kept gathered, and the gradient reaching its
        # output starts the re-gathers of the units before it (nothing else would, so early).
        self.opens_backward = False
        self.gatherer: Gatherer  # set once the step's gatherer exists

    def views(self, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.layout.flat.views(gathered)))

    def materialize(self) -> Mapping[str, torch.Tensor]:
        # The fallback: differentiable, kept until backward; prefetches the next units.
        return self.views(self.gatherer.in_forward(self, grad=torch.is_grad_enabled()))

    def call(self, call: UnitCall) -> Any:
        if self.reshard == "remat":
            return self._remat_call(call)
        grad = torch.is_grad_enabled()
        gathered = self.gatherer.in_forward(self, grad=grad)
        if self.reshard == "keep" or not gathered.requires_grad:
            out = call.run(self.views(gathered), call.state, call.args, call.kwargs)
            if self.opens_backward and gathered.requires_grad:
                self._open_backward_at(out)
            return out
        regather = self.gatherer.resharded_call(self, gathered)
        return regather.run(call, self.views(gathered))

    def _open_backward_at(self, out: Any) -> None:
        """Start the backward's first re-gathers when a gradient reaches a tensor of `out`."""
        gatherer = self.gatherer

        def start(grad: torch.Tensor) -> None:
            gatherer.open_backward()

        for leaf in tree.leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(start)

    def _remat_call(self, call: UnitCall) -> Any:
        runs = 0

        def gathered_call(inputs: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            nonlocal runs
            shard, *state = inputs
            runs += 1
            if runs == 1:
                # The forward: no graph is recorded here, so the prefetched buffer serves.
                gathered = self.gatherer.in_forward(self, grad=False)
            else:
                # The recompute in backward: a differentiable gather of the saved shard, whose
                # gradient is the reduce-scatter of this unit's gradient.
                gathered = self.gatherer.now(self, shard)
            return call.run(self.views(gathered), state, args, kwargs)

        # The shard and the submodule's other state are the checkpoint's `state` inputs, so
        # buffers updated in place (BatchNorm) are snapshotted and updated once.
        return remat.checkpoint_call(
            gathered_call,
            call.args,
            call.kwargs,
            state=[self.shard, *call.state],
            mutable=[1 + i for i in call.mutable],
            # The recompute gathers differently from the forward (above), so what it saves for
            # backward is not the forward's tensor for tensor: it runs to the end.
            early_stop=False,
        )

    def __repr__(self) -> str:
        return f"ShardedUnit({self.name!r}, {len(self.names)} params)"
