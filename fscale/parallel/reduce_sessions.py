"""Gradient-reduction sessions: how one backward's gradients are bucketed, reduced and returned.

A `fscale.parallel.reduce.GradReducer` opens one session per backward that completes a step's
gradient: `AllReduceSession` for full gradients, `ScatterSession` for ZeRO's sharded buckets.

Autograd path. Leaves are packed into buckets (`fscale.parallel.buckets`: reverse order of use,
a small first bucket as torch DDP); each leaf's gradient is copied into its bucket by a hook the
moment it is final (the last bucket's, when no larger than the first, in one go after backward:
`GradBuckets.flush`; every bucket's, without a small first one, when the reducer does not
overlap: `GradReducer.overlap`), and a bucket's collective starts as soon as it is complete:

- all-reduce (mean) over the axes, in the bucket itself (`fscale.parallel.bucket_collectives`),
  or the user's reduction hook on the bucket's flat gradient;
- with a scatter axis (ZeRO), the aligned bucket layout of `fscale.parallel.bucket_layout`: a
  reduce-scatter (mean) during backward (``shard_grads=True``, at most two in flight, full
  buckets freed once their reduction starts) or after it (ZeRO-1), then an all-reduce of the
  shard over the remaining axes. Gradients come back as each bucket's shard.

torch.func path (no hooks run): a differentiable `replicate_many` over the leaves places the
all-reduce in the graph (so outer torch.func transforms see it), one per dtype; with a scatter
axis or gradients carried from earlier micro-batches, the reduction runs after backward instead.

Folding. After the forward pass `fscale.grad.value_and_grad` offers the session the loss and
the loss function's scalar metrics, then the float32 buffers the loss updated (one 1-D tensor,
see `fscale.step_means`), to be averaged over the step's metric axes (``session.fold(values,
axes)``); a session that can appends them to its last bucket (`GradBuckets.fold`), its
collective averages them, and `Step.apply_gradients` uses those means for the metrics and
buffers that still hold the values folded: no collective of their own. It can on the autograd
path without a reduction hook (under accumulation only the last micro-batch's buffers are
offered: the loss is known at the end), over one axis that is all the step's metric axes: the
all-reduce's, or the scatter axis where the reduce-scatter can send them to every rank beside
the bucket's parts (gloo, `bucket_collectives.folds_trailing`), when the last bucket has the
values' dtype and device. Over two ranks the bits are those of separate collectives; over more,
the longer bucket may add some of its gradients in another order (`fscale.step_means` says why
and what it buys). The folded bytes are part of the last bucket (``grad_bytes`` counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.memory import LiveBytes
from fscale.outside_graph import outside_graph
from fscale.parallel.bucket_assign import Bucket, assign_buckets, forward_order
from fscale.parallel.bucket_collectives import (
    BucketPending,
    all_reduce_bucket_start,
    folds_trailing,
    reduce_scatter_bucket_start,
)
from fscale.parallel.bucket_layout import layout_of
from fscale.parallel.buckets import GradBuckets

if TYPE_CHECKING:
    from fscale.parallel.reduce import GradReducer

__all__ = [
    "FIRST_BUCKET_BYTES",
    "MAX_IN_FLIGHT",
    "AllReduceSession",
    "BucketInfo",
    "ScatterSession",
    "bucket_info",
    "reducer_buckets",
]

PyTree = Any

# As torch DDP: the first bucket (the last layers' gradients) is small, so the first all-reduce
# starts early in backward; later buckets use the reducer's bucket size.
FIRST_BUCKET_BYTES = 1 << 20

# Reductions allowed in flight before the oldest is waited for (ZeRO-2's memory bound).
MAX_IN_FLIGHT = 2


class BucketInfo(NamedTuple):
    """What a reduction hook is told about the bucket it reduces."""

    index: int
    numel: int
    dtype: torch.dtype
    device: torch.device
    mesh: Mesh
    axes: tuple[str, ...]


def _axis(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def _all_reduce_start(
    flat: torch.Tensor, axes: tuple[str, ...], mesh: Mesh, trailing: int = 0, divided: bool = False
) -> BucketPending:
    """The mean over `axes`: the first axis asynchronously, then each further one in turn."""
    pending = all_reduce_bucket_start(flat, axes[0], mesh, trailing=trailing, divided=divided)
    for axis in axes[1:]:
        pending = pending.then(lambda t, a=axis: collectives.all_reduce(t, a, "mean", mesh=mesh))
    return pending


def reducer_buckets(
    leaves: list[torch.Tensor],
    params: PyTree,
    bucket_bytes: int,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[Bucket]:
    """The buckets of `leaves` (the leaves of `params`): reverse order of use, a small first
    (its reduction starts early in backward)."""
    order = forward_order(params)
    return assign_buckets(leaves, bucket_bytes, order=order, first_bucket_bytes=first_bucket_bytes)


def bucket_info(bucket: Bucket, mesh: Mesh, axes: tuple[str, ...]) -> BucketInfo:
    """What a reduction hook is told about `bucket`, reduced over `axes` of `mesh`."""
    layout = bucket.layout
    return BucketInfo(bucket.index, layout.numel, layout.dtype, layout.device, mesh, axes)


class _Session:
    """What both sessions share: micro-batches' carried gradients (`seed`) and the values that
    ride in the last bucket (`fold`, `folded`)."""

    def __init__(self, reducer: GradReducer, params: PyTree, grad_mode: str) -> None:
        self.reducer = reducer
        self.params = params
        self.func = grad_mode == "func"
        self.initial: list[torch.Tensor] | None = None
        self.collector: GradBuckets | None = None
        self.folded: torch.Tensor | None = None  # the riding values' means, once reduced
        self.num_folded = 0

    def seed(self, initial: Sequence[torch.Tensor] | None) -> None:
        self.initial = None if initial is None else list(initial)

    def _fold_into(self, values: torch.Tensor, last: Bucket) -> bool:
        """Append `values` to the `last` bucket where they can ride in its collective (its
        dtype and device; the caller checked the axes), before backward fills it."""
        layout = last.layout
        if self.collector is None or values.dtype != layout.dtype or values.device != layout.device:
            return False
        self.collector.fold(values)
        self.num_folded = values.numel()
        return True


class AllReduceSession(_Session):
    """Buckets of full gradients, each all-reduced (mean) or hooked as soon as it is complete."""

    def __init__(self, reducer: GradReducer, params: PyTree, grad_mode: str) -> None:
        super().__init__(reducer, params, grad_mode)
        self.axes = reducer.all_reduce_axes
        self.leaves, self.treedef = tree.flatten(params)
        self.in_flight: dict[int, collectives.Pending | BucketPending] = {}
        self.new_states: dict[int, Any] = {}

    def fold(self, values: torch.Tensor, axes: tuple[str, ...]) -> bool:
        """Average `values` over `axes` with the last bucket, where this session can (see the
        module docstring); whether it will."""
        if self.reducer.hook is not None or len(self.axes) != 1 or tuple(axes) != self.axes:
            return False
        return self.collector is not None and self._fold_into(values, self.buckets[-1])

    def prepare(self, live: PyTree) -> PyTree:
        if not self.func or self.initial is not None:
            return live
        # torch.func runs no hooks: place the dual pair in the graph, one node for all leaves
        # (one all-reduce per dtype once backward has produced every gradient, not one per
        # leaf waiting for the other ranks at each).
        axis, mesh = _axis(self.axes), self.reducer.mesh
        leaves, treedef = tree.flatten(live)
        return tree.unflatten(treedef, collectives.replicate_many(leaves, axis, "mean", mesh=mesh))

    # Outside the graph: Dynamo cannot rebuild the hooks' bound methods at a later break.
    @outside_graph
    def hooks(self, *, compiling: bool = False) -> list[Any]:
        if self.func:
            return [None] * len(self.leaves)
        overlap = self.reducer.overlaps(leaf.device for leaf in self.leaves)
        # Reduced after backward, the buckets need no small first one to start early: fewer
        # collectives (the first's own latency, on a small model the whole model in one). A
        # hook's buckets stay those its `init` was told of.
        keep_first = overlap or self.reducer.hook is not None
        bucket_bytes = self.reducer.bucket_bytes
        first = FIRST_BUCKET_BYTES if keep_first else bucket_bytes
        self.buckets = reducer_buckets(self.leaves, self.params, bucket_bytes, first)
        # Each hook holds its gradient until the bucket is complete and hands autograd a
        # stride-0 zero, so once a bucket's reduction has started the only copy is the one
        # being reduced.
        plain = self.reducer.hook is None and self.initial is None
        self.collector = GradBuckets(
            self.buckets,
            len(self.leaves),
            self._start,
            keep_grads=False,
            initial=self.initial,
            late_bytes=FIRST_BUCKET_BYTES,
            # The mean's first division in the copy into the bucket: not for a hook (it takes
            # the sum) nor under accumulation (the sum with the earlier micro-batches first).
            divide_by=self.reducer.mesh.size(self.axes[0]) if plain else 1,
            overlap=overlap,
        )
        return self.collector.hooks(compiling=compiling)

    def _start(self, bucket: Bucket, flat_grad: torch.Tensor) -> None:
        reducer, divided = self.reducer, self.collector.divide_by != 1  # type: ignore[union-attr]
        if reducer.hook is None:
            self.in_flight[bucket.index] = _all_reduce_start(
                flat_grad, self.axes, reducer.mesh, flat_grad.numel() - bucket.numel, divided
            )
        else:
            state = None if reducer.hook_states is None else reducer.hook_states[bucket.index]
            pending, self.new_states[bucket.index] = reducer.hook(
                flat_grad, bucket_info(bucket, reducer.mesh, self.axes), state
            )
            if not isinstance(pending, collectives.Pending):
                raise TypeError(
                    "data_parallel: the reduction hook must return (fscale.distributed.Pending, "
                    f"new_state), got a {type(pending).__name__} first"
                )
            self.in_flight[bucket.index] = pending
        self.collector.release(bucket.index)  # type: ignore[union-attr]

    def finish(self, grads: PyTree) -> PyTree:
        if self.func:
            if self.initial is None:
                return grads
            axis, mesh = _axis(self.axes), self.reducer.mesh
            summed = [g + a for g, a in zip(tree.leaves(grads), self.initial)]
            return tree.unflatten(
                self.treedef, [collectives.all_reduce(g, axis, "mean", mesh=mesh) for g in summed]
            )
        assert self.collector is not None
        self.collector.flush(tree.leaves(grads))
        reduced: list[Any] = [None] * len(self.leaves)
        for bucket in self.buckets:
            pending = self.in_flight.pop(bucket.index)
            flat = pending.wait()
            if self.num_folded and bucket.index == len(self.buckets) - 1:
                assert isinstance(pending, BucketPending)  # folding has no reduction hook
                self.folded = pending.trailing
            for leaf_index, view in zip(bucket.leaf_indices, bucket.layout.views(flat)):
                reduced[leaf_index] = view
        if self.reducer.hook_out is not None:
            self.reducer.hook_out["states"] = tuple(
                self.new_states.get(b.index) for b in self.buckets
            )
        return tree.unflatten(self.treedef, reduced)

    def metrics(self) -> dict[str, Any]:
        return {}


class ScatterSession(_Session):
    """ZeRO's buckets: reduce-scattered (mean) over the scatter axis, then all-reduced."""

    def __init__(self, reducer: GradReducer, params: PyTree, grad_mode: str) -> None:
        assert reducer.scatter_axis is not None  # `GradReducer.session` chose this session
        super().__init__(reducer, params, grad_mode)
        self.axis: str = reducer.scatter_axis
        shards = reducer.mesh.size(self.axis)
        self.layout, self.treedef = layout_of(params, reducer.bucket_bytes, shards)
        self.live = LiveBytes()
        self.shards: list[torch.Tensor | None] = [None] * len(self.layout.buckets)
        self.in_flight: list[tuple[int, Any]] = []  # Dynamo < 2.13 cannot trace deque.append

    def fold(self, values: torch.Tensor, axes: tuple[str, ...]) -> bool:
        """As `AllReduceSession.fold`, over the scatter axis alone."""
        if tuple(axes) != (self.axis,) or not folds_trailing(self.axis, self.reducer.mesh):
            return False
        return self._fold_into(values, self.layout.buckets[-1])

    def prepare(self, live: PyTree) -> PyTree:
        return live

    @outside_graph  # as `AllReduceSession.hooks`
    def hooks(self, *, compiling: bool = False) -> list[Any]:
        if self.func:
            return [None] * self.layout.num_leaves
        shard_grads = self.reducer.shard_grads
        on_ready = self._start_and_release if shard_grads else _keep
        # ZeRO-1 reduces after backward anyway: its hooks only keep each gradient in one copy,
        # worth their Python calls where the reducer would overlap (an accelerator), not on
        # CPU ranks of one host, whose buckets are then built after backward.
        devices = (b.layout.device for b in self.layout.buckets)
        overlap = shard_grads or self.reducer.overlaps(devices)
        # Zeroed whole: the aligned layout leaves gaps between leaves.
        self.collector = GradBuckets(
            self.layout.buckets,
            self.layout.num_leaves,
            on_ready,
            keep_grads=False,
            initial=self.initial,
            zero_whole=True,
            on_allocate=self.live.track,
            late_bytes=FIRST_BUCKET_BYTES,
            overlap=overlap,
        )
        return self.collector.hooks(compiling=compiling)

    def _reduce_start(
        self, bucket: Bucket, flat_grad: torch.Tensor
    ) -> collectives.Pending | BucketPending:
        trailing = flat_grad.numel() - bucket.numel
        mesh = self.reducer.mesh
        pending = reduce_scatter_bucket_start(flat_grad, self.axis, mesh, trailing=trailing)
        for received in getattr(pending, "held", ()):  # an exchange's receive buffers count
            self.live.track(received)
        return pending

    def _start_and_release(self, bucket: Bucket, flat_grad: torch.Tensor) -> None:
        # Started first: Dynamo before 2.13 cannot call a builtin method bound across a break.
        pending = self._reduce_start(bucket, flat_grad)
        self.in_flight.append((bucket.index, pending))
        self.collector.release(bucket.index)  # type: ignore[union-attr]
        del flat_grad
        self.live.sample()
        self._settle(MAX_IN_FLIGHT)

    def _settle(self, keep: int) -> None:
        while len(self.in_flight) > keep:
            index, pending = self.in_flight.pop(0)
            shard = pending.wait()
            if self.num_folded and index == len(self.shards) - 1:
                assert isinstance(pending, BucketPending)  # `folds_trailing` held
                self.folded = pending.trailing
            self.shards[index] = shard
            self.live.track(shard)

    def finish(self, grads: PyTree) -> list[torch.Tensor]:
        if self.func:
            self._after_backward(grads)
        else:
            assert self.collector is not None
            self.collector.flush(tree.leaves(grads))
            if not self.reducer.shard_grads:
                for bucket in self.layout.buckets:
                    full = self.collector.bucket_data(bucket.index)
                    assert full is not None  # flushed: every bucket has its buffer
                    pending = self._reduce_start(bucket, full)  # as in `_start_and_release`
                    self.in_flight.append((bucket.index, pending))
                    # Only the collective may hold the full bucket now, so it is freed as
                    # soon as the reduce-scatter is done with it.
                    del full
                    self.collector.release(bucket.index)
        self._settle(0)
        shards = [shard for shard in self.shards if shard is not None]
        assert len(shards) == len(self.shards)  # settled: every bucket is reduced
        axes = self.reducer.all_reduce_axes
        if axes:  # the shard's mean over the other data axes (ZeRO inside data parallelism)
            mesh = self.reducer.mesh
            shards = [collectives.all_reduce(s, _axis(axes), "mean", mesh=mesh) for s in shards]
        return shards

    def _after_backward(self, grads: PyTree) -> None:
        """torch.func gradients run no hooks: the full gradients, then a reduce-scatter each."""
        grad_leaves = tree.leaves(grads)
        if self.initial is not None:
            grad_leaves = [g + a for g, a in zip(grad_leaves, self.initial)]
        for leaf in grad_leaves:
            self.live.track(leaf)
        flat_grads = self.layout.pack(grad_leaves)
        for flat in flat_grads:
            self.live.track(flat)
        del grads, grad_leaves
        mesh = self.reducer.mesh
        for index, flat in enumerate(flat_grads):
            # torch.func's gradients: the differentiable collective (an outer transform may
            # track these buffers).
            pending = collectives.reduce_scatter_start(flat, self.axis, 0, "mean", mesh=mesh)
            self.in_flight.append((index, pending))
        del flat_grads

    def metrics(self) -> dict[str, Any]:
        return {"grad_peak_bytes": self.live.peak}


def _keep(bucket: Bucket, flat_grad: torch.Tensor) -> None:
    """ZeRO-1: full gradient buckets stay until backward ends."""
