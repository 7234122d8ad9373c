"""`shard_optimizer(step, mesh)`: ZeRO-1/2 (FairScale's OSS and ShardedDDP) as a transformation.

Algorithm (Rajbhandari et al., 2020, stages 1 and 2), per step on each of the N ranks of `axis`:

1. Forward and backward on the local batch with the full, replicated parameters.
2. Gradients are reduce-scattered (mean over the axis) bucket by bucket, so rank r receives only
   slice r of every bucket: the gradient of the global mean loss for the elements it owns.
3. The optimizer updates only those slices, with optimizer state for those slices only.
4. The new slices are all-gathered into fresh full parameter buckets, replicated again.

Layout. Trainable leaves are grouped into buckets of about `bucket_mb` (`assign_buckets`, in
reverse order of use so buckets complete early in backward). Each bucket is one flat buffer in
which every leaf starts on a 64-byte boundary and whose length is N equal shards of a multiple
of 64 bytes; rank r owns shard r. The alignment is what makes sharding exact: torch's fused CPU
optimizer kernels (SGD, Adam, Adagrad) run a vectorised body and a scalar tail over each tensor
and the two round differently, so a slice cut at an arbitrary element would be updated
differently from the same elements of the whole tensor. Cut on vector boundaries, every element
takes the same path as in the unsharded update. At rest, ``state.params`` is the usual pytree,
whose leaves are views into the full bucket buffers (the all-gather writes straight into them).

The optimizer sees a pytree with the params' structure whose leaves are the 1-D fragments this
rank owns (empty for leaves it owns none of), plus a `fscale.optim.Layout` naming each
fragment's place in its full tensor and an all-reduce over the axis. Pointwise optimizers ignore
the layout; LAMB, Adafactor and `clip_by_global_norm` complete their per-tensor and global
statistics with it, so they stay exact under sharding (FairScale's OSS cannot do this: its
per-rank optimizers see only their own parameters). The optimizer state is a `ShardedOptState`:
the wrapped optimizer's state for the owned fragments and the number of shards, so a state
made for another world size is refused on every rank at once.

Communication per rank per step, with Ψ the padded size of all buckets (the sum of
``bucket.numel``: parameters plus alignment and shard padding, at most 64 bytes per leaf and per
shard): a reduce-scatter and an all-gather of Ψ elements, 2·Ψ·(N−1)/N elements under the ring
model, the same as data parallelism's one all-reduce; plus one all-reduce of the scalar metrics
and, if the loss returns floating-point buffers (BatchNorm statistics), one of those, which are
averaged as under `data_parallel`. Never an all-reduce followed by a broadcast.

Gradients:

- ``shard_grads=True`` (ZeRO-2, ShardedDDP): each gradient is copied into its bucket as autograd
  produces it; the moment a bucket is complete its reduce-scatter starts and the bucket is
  released, so the reduction of bucket k runs while backward computes bucket k+1. At most two
  reductions are in flight; the step waits for the older one before starting a third, which
  frees its full bucket. The peak of gradient memory is about Ψ/N (the reduced shards) plus
  three buckets, instead of Ψ.
- ``shard_grads=False`` (ZeRO-1, OSS on top of DDP): the full gradient buckets are kept until
  backward ends, then reduce-scattered. Gradient memory peaks at Ψ + Ψ/N.
- ``grad_mode="func"`` (`torch.func` gradients, no autograd hooks): backward returns the full
  gradients; they are packed into the buckets and reduce-scattered afterwards, as in ZeRO-1.

The metrics report ``grad_bytes`` (the reduced shards the update used) and ``grad_peak_bytes``
(the most gradient storage alive at once during the step, measured through weak references to
the buffers' storage, so a buffer counts until the last tensor viewing it, collectives in flight
included, is gone).

Numerics. The reduce-scatter sums the ranks' gradients and divides by N afterwards; data
parallelism divides first and all-reduces. Division by a power of two is exact, and at N = 2
both add the same two numbers, so `shard_optimizer` equals `data_parallel` bit for bit. At N = 4
gloo's reduce-scatter and all-reduce associate the four terms differently for some elements, so
results agree to rounding. Non-pointwise statistics are sums over fragments completed by an
all-reduce, which also differ from the unsharded sums by rounding.

Composition. `shard_optimizer` takes a Step from `train_step` or from `data_parallel` over the
same axis; in the latter case it *replaces* the data-parallel all-reduce (the reduce-scatter
already averages the gradients). Combining it with data parallelism over another axis (HSDP) or
sharding twice is refused. `fscale.checkpoint` inside the loss and `fscale.offload_optimizer`
around the optimizer compose unchanged (each rank offloads its own shard).

State in and out: `consolidate(step, state)` returns the full, unsharded TrainState on every
rank (what a single-process step takes); `shard_state(step, full_state)` builds the sharded
state for this step from a full one, at any world size. The mapping is generic over optimizers:
the optimizer is initialised on full-shape stand-ins to learn the full state's structure, and on
each rank's fragments to learn each rank's; a state leaf whose shape differs from the full one on
some rank is a per-element leaf whose ranks' pieces tile its flattening in rank order, any other
leaf is replicated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale import tree
from fscale.dist import collectives
from fscale.dist.mesh import Mesh
from fscale.memory import tree_bytes
from fscale.optim.base import Layout
from fscale.parallel import common
from fscale.parallel.buckets import Bucket, GradBuckets, assign_buckets, forward_order
from fscale.parallel.data import DataParallelPlan
from fscale.train import LocalPlan, Step, TrainState, value_and_grad
from fscale.tree import FlatBuffer, Fragment, aligned_elements

__all__ = [
    "ShardedOptState",
    "ShardedOptimizerPlan",
    "consolidate",
    "shard_optimizer",
    "shard_state",
]

PyTree = Any

# Reductions (and all-gathers) allowed in flight before the oldest is waited for.
_MAX_IN_FLIGHT = 2


class ShardedOptState(NamedTuple):
    """The optimizer state of a `shard_optimizer` step on one rank.

    Attributes:
        shard: the wrapped optimizer's state for the fragments this rank owns (the structure
            of the optimizer's full state; per-element leaves hold this rank's pieces).
        num_shards: the number of ranks the state is sharded over (an int64 scalar), so a state
            from another world size is detected on every rank.
    """

    shard: PyTree
    num_shards: torch.Tensor


# ----------------------------------------------------------------------------- layout


def _aligned_layout(
    shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, num_shards: int
) -> FlatBuffer:
    """A bucket layout whose leaves and shard boundaries are aligned (see the module docstring).

    Only shapes, offsets and sizes are held (``data`` is on the meta device); the real buffers
    are allocated by the caller on ``layout.device``. The gaps between leaves are zero in every
    buffer this module allocates and are never read by the optimizer.
    """
    tensors = [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes]
    layout = FlatBuffer(tensors, num_shards, align=aligned_elements(dtype))
    layout.device = device
    return layout


class _ShardLayout:
    """Where every trainable leaf lives: its bucket, its slot there, and who owns which part."""

    def __init__(
        self,
        signature: tuple[tuple[torch.Size, torch.dtype, torch.device], ...],
        groups: Sequence[Sequence[int]],
        num_shards: int,
    ) -> None:
        self.num_leaves = len(signature)
        self.num_shards = num_shards
        self.buckets: list[Bucket] = []
        self.where: list[tuple[int, int]] = [(0, 0)] * self.num_leaves
        for index, leaf_indices in enumerate(groups):
            _, dtype, device = signature[leaf_indices[0]]
            shapes = [signature[i][0] for i in leaf_indices]
            layout = _aligned_layout(shapes, dtype, device, num_shards)
            self.buckets.append(Bucket(index, list(leaf_indices), layout))
            for slot, leaf in enumerate(leaf_indices):
                self.where[leaf] = (index, slot)

    @property
    def numel(self) -> int:
        """Ψ: elements of all buckets, padding included (what each collective moves)."""
        return sum(bucket.numel for bucket in self.buckets)

    def _per_leaf(self, per_bucket: Callable[[Bucket], list[Any]]) -> list[Any]:
        out: list[Any] = [None] * self.num_leaves
        for bucket in self.buckets:
            for leaf, value in zip(bucket.leaf_indices, per_bucket(bucket)):
                out[leaf] = value
        return out

    def fragments(self, rank: int) -> list[Fragment]:
        """Per leaf: the element range of it that `rank` owns."""
        return self._per_leaf(lambda b: b.layout.fragments(rank))

    def leaf_views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf: a full-shape view into its bucket's flat buffer."""
        return self._per_leaf(lambda b: b.layout.views(flats[b.index]))

    def fragment_views(self, rank: int, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf: a 1-D view of `rank`'s fragment inside its bucket's shard-sized tensor."""
        return self._per_leaf(lambda b: b.layout.fragment_views(rank, shards[b.index]))

    def owned(self, rank: int, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket: the view of `rank`'s shard inside the full flat buffer."""
        return [b.layout.shard(rank, flats[b.index]) for b in self.buckets]

    def pack(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New zero-padded flat buffers holding `leaves`, one per bucket."""
        return [_pack(bucket, leaves) for bucket in self.buckets]

    def flats_of(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The flat buffers `leaves` are views of (as `leaf_views` returns), else packed copies."""
        flats = []
        for bucket in self.buckets:
            flat = _enclosing_flat(bucket.layout, [leaves[i] for i in bucket.leaf_indices])
            flats.append(flat if flat is not None else _pack(bucket, leaves))
        return flats

    def stand_ins(self, rank: int | None = None) -> list[torch.Tensor]:
        """Per leaf, a meta tensor: the full leaf, or `rank`'s 1-D fragment of it."""
        fragments = self.fragments(0 if rank is None else rank)
        out = []
        for frag, (b, _) in zip(fragments, self.where):
            shape = frag.shape if rank is None else (frag.numel,)
            out.append(torch.empty(shape, dtype=self.buckets[b].layout.dtype, device="meta"))
        return out

    def devices(self) -> list[torch.device]:
        """Per leaf, the device its bucket lives on."""
        return [self.buckets[b].layout.device for b, _ in self.where]


def _pack(bucket: Bucket, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    layout = bucket.layout
    flat = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
    with torch.no_grad():
        for leaf, view in zip(bucket.leaf_indices, layout.views(flat)):
            view.copy_(leaves[leaf])
    return flat


def _enclosing_flat(layout: FlatBuffer, leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer whose `layout.views` are exactly `leaves`, or None if there is none."""
    first = leaves[0]
    base = first.storage_offset() - layout.offsets[0]
    storage = first.untyped_storage()
    if base < 0 or (base + layout.numel) * first.element_size() > storage.nbytes():
        return None
    for leaf, offset, shape in zip(leaves, layout.offsets, layout.shapes):
        if (
            leaf.untyped_storage().data_ptr() != storage.data_ptr()
            or leaf.storage_offset() != base + offset
            or leaf.shape != shape
            or leaf.dtype != layout.dtype
            or not leaf.is_contiguous()
        ):
            return None
    return first.as_strided((layout.numel,), (1,), base)


@functools.lru_cache(maxsize=32)
def _cached_layout(
    signature: tuple[tuple[torch.Size, torch.dtype, torch.device], ...],
    order: tuple[int, ...],
    bucket_bytes: int,
    num_shards: int,
) -> _ShardLayout:
    # Leaves on different devices never share a bucket: bucket each device's leaves on their
    # own (assign_buckets sees meta stand-ins, so it only separates dtypes).
    groups: list[list[int]] = []
    for device in dict.fromkeys(device for _, _, device in signature):
        indices = [i for i in order if signature[i][2] == device]
        stand_ins = [
            torch.empty(signature[i][0], dtype=signature[i][1], device="meta") for i in indices
        ]
        buckets = assign_buckets(stand_ins, bucket_bytes, num_shards, order=range(len(indices)))
        groups.extend([indices[j] for j in bucket.leaf_indices] for bucket in buckets)
    return _ShardLayout(signature, groups, num_shards)


def _layout_of(params: PyTree, bucket_bytes: int, num_shards: int) -> tuple[_ShardLayout, Any]:
    leaves, treedef = tree.flatten(params)
    signature = tuple((leaf.shape, leaf.dtype, leaf.device) for leaf in leaves)
    order = tuple(forward_order(params))
    return _cached_layout(signature, order, bucket_bytes, num_shards), treedef


# ----------------------------------------------------------------------------- gradients


class _ShardedGradBuckets(GradBuckets):
    """`GradBuckets` whose buffers start zeroed (gaps included) and are dropped once reduced.

    The aligned layouts have gaps between leaves that no gradient writes, so a bucket buffer is
    zeroed whole when its first gradient arrives; `release` forgets a bucket whose reduction
    has started, so its memory goes as soon as the collective is done with it.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        num_leaves: int,
        on_ready: Callable[[Bucket, torch.Tensor], None],
        on_allocate: Callable[[torch.Tensor], None],
    ) -> None:
        super().__init__(buckets, num_leaves, on_ready, keep_grads=False)
        self._on_allocate = on_allocate

    def _deliver(self, bucket_index: int, slot: int, grad: torch.Tensor) -> torch.Tensor:
        if self._data[bucket_index] is None:
            layout = self.buckets[bucket_index].layout
            data = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
            self._data[bucket_index] = data
            self._on_allocate(data)
        return super()._deliver(bucket_index, slot, grad)

    def release(self, bucket_index: int) -> None:
        self._data[bucket_index] = None


class _LiveBytes:
    """The peak of storage bytes alive among the tensors registered with `track`.

    Weak references to the storages tell exactly when the last tensor using one is gone
    (including views held by a collective in flight), so the figure is measured, not assumed.
    """

    def __init__(self) -> None:
        self._storages: list[tuple[weakref.ref, int]] = []
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self._storages.append((weakref.ref(storage), storage.nbytes()))
        self.sample()

    def sample(self) -> None:
        self._storages = [(ref, n) for ref, n in self._storages if ref() is not None]
        self.peak = max(self.peak, sum(n for _, n in self._storages))


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class ShardedOptimizerPlan:
    """Replicated parameters; gradients reduce-scattered and optimizer state sharded over `axis`."""

    mesh: Mesh
    axis: str
    bucket_bytes: int
    shard_grads: bool

    # ---- helpers ------------------------------------------------------------------------

    @property
    def _size(self) -> int:
        return self.mesh.size(self.axis)

    @property
    def _rank(self) -> int:
        return self.mesh.rank(self.axis)

    def _layout(self, params: PyTree) -> tuple[_ShardLayout, Any]:
        return _layout_of(params, self.bucket_bytes, self._size)

    def _sum_over_axis(self, t: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(t, self.axis, "sum", mesh=self.mesh)

    def _opt_layout(self, layout: _ShardLayout, treedef: Any, rank: int) -> Layout:
        return Layout(tree.unflatten(treedef, layout.fragments(rank)), self._sum_over_axis)

    # ---- Plan protocol ------------------------------------------------------------------

    def init(self, step: Step, params: PyTree, buffers: PyTree, key: torch.Tensor) -> TrainState:
        self._check_same_trees(params, buffers, "the parameter and buffer trees")
        layout, treedef = self._layout(params)
        flats = common.broadcast_tree(layout.pack(tree.leaves(params)), self.mesh, self.axis)
        buffers = common.broadcast_tree(buffers, self.mesh, self.axis)
        key = common.broadcast_tree(key, self.mesh, self.axis)
        owned = layout.fragment_views(self._rank, layout.owned(self._rank, flats))
        opt_state = step.optimizer.init(
            tree.unflatten(treedef, owned), layout=self._opt_layout(layout, treedef, self._rank)
        )
        return TrainState(
            tree.unflatten(treedef, layout.leaf_views(flats)),
            buffers,
            ShardedOptState(opt_state, torch.tensor(self._size, dtype=torch.int64)),
            torch.zeros((), dtype=torch.int64),
            key,
        )

    def run(self, step: Step, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        layout, treedef = self._layout(state.params)
        opt_state = self._local_opt_state(step, state.opt_state, layout, treedef)
        rank = self._rank
        flats = layout.flats_of(tree.leaves(state.params))
        key = fsrandom.fold_in(fsrandom.fold_in(state.key, int(state.step)), rank)
        live = _LiveBytes()
        if step.grad_mode == "func":
            out, grad_shards = self._grads_after_backward(step, state, batch, key, layout, live)
        else:
            out, grad_shards = self._grads_by_buckets(step, state, batch, key, layout, live)

        owned = layout.owned(rank, flats)
        new_fragments, new_opt_state = optim_lib.step(
            step.optimizer,
            tree.unflatten(treedef, layout.fragment_views(rank, grad_shards)),
            opt_state.shard,
            tree.unflatten(treedef, layout.fragment_views(rank, owned)),
            layout=self._opt_layout(layout, treedef, rank),
            donate=step.donate,
        )
        new_flats = self._gather_params(layout, tree.leaves(new_fragments), flats, step.donate)
        params = tree.unflatten(treedef, layout.leaf_views(new_flats))

        buffers = common.average_updated_buffers(state.buffers, out.buffers, self.mesh, self.axis)
        metrics = common.reduce_metrics({"loss": out.loss, **out.metrics}, self.mesh, self.axis)
        metrics["grad_bytes"] = tree_bytes(grad_shards)
        metrics["grad_peak_bytes"] = live.peak
        new_state = TrainState(
            params,
            buffers,
            ShardedOptState(new_opt_state, opt_state.num_shards),
            state.step + 1,
            state.key,
        )
        return new_state, metrics

    # ---- gradients ----------------------------------------------------------------------

    def _grads_by_buckets(
        self,
        step: Step,
        state: TrainState,
        batch: Any,
        key: torch.Tensor,
        layout: _ShardLayout,
        live: _LiveBytes,
    ) -> tuple[Any, list[torch.Tensor]]:
        """Backward with bucket hooks; this rank's reduced shard of every bucket."""
        shards: list[torch.Tensor | None] = [None] * len(layout.buckets)
        in_flight: collections.deque = collections.deque()

        def settle(keep: int) -> None:
            while len(in_flight) > keep:
                index, pending = in_flight.popleft()
                shards[index] = pending.wait()
                live.track(shards[index])

        def start(bucket: Bucket, flat_grad: torch.Tensor) -> None:
            in_flight.append((bucket.index, self._reduce_scatter_start(flat_grad)))

        def start_and_release(bucket: Bucket, flat_grad: torch.Tensor) -> None:
            start(bucket, flat_grad)
            collector.release(bucket.index)
            del flat_grad
            live.sample()
            settle(_MAX_IN_FLIGHT)

        collector = _ShardedGradBuckets(
            layout.buckets,
            layout.num_leaves,
            start_and_release if self.shard_grads else (lambda bucket, flat_grad: None),
            live.track,
        )
        out, _ = value_and_grad(
            step.loss_fn, state.params, state.buffers, batch, key, grad_hooks=collector.hooks()
        )
        collector.flush()
        if not self.shard_grads:
            for bucket in layout.buckets:
                start(bucket, collector.bucket_data(bucket.index))
                collector.release(bucket.index)
        settle(0)
        return out, shards

    def _grads_after_backward(
        self,
        step: Step,
        state: TrainState,
        batch: Any,
        key: torch.Tensor,
        layout: _ShardLayout,
        live: _LiveBytes,
    ) -> tuple[Any, list[torch.Tensor]]:
        """torch.func gradients run no hooks: the full gradients, then a reduce-scatter each."""
        out, grads = value_and_grad(
            step.loss_fn, state.params, state.buffers, batch, key, grad_mode="func"
        )
        grad_leaves = tree.leaves(grads)
        for leaf in grad_leaves:
            live.track(leaf)
        flat_grads = layout.pack(grad_leaves)
        for flat in flat_grads:
            live.track(flat)
        del grads, grad_leaves
        pendings = [self._reduce_scatter_start(flat) for flat in flat_grads]
        del flat_grads
        shards = []
        for pending in pendings:
            shards.append(pending.wait())
            live.track(shards[-1])
        return out, shards

    def _reduce_scatter_start(self, flat_grad: torch.Tensor) -> collectives.Pending:
        return collectives.reduce_scatter_start(flat_grad, self.axis, 0, "mean", mesh=self.mesh)

    # ---- parameters ---------------------------------------------------------------------

    def _gather_params(
        self,
        layout: _ShardLayout,
        new_fragments: list[torch.Tensor],
        flats: list[torch.Tensor],
        donate: bool,
    ) -> list[torch.Tensor]:
        """All-gather every bucket's updated shard into a full buffer (in place when donating)."""
        rank = self._rank
        new_flats: list[torch.Tensor | None] = [None] * len(layout.buckets)
        in_flight: collections.deque = collections.deque()

        def finish(index: int, pending: collectives.Pending) -> None:
            gathered = pending.wait()
            if donate:
                flats[index].copy_(gathered)
                new_flats[index] = flats[index]
            else:
                new_flats[index] = gathered

        with torch.no_grad():
            for bucket in layout.buckets:
                bucket_layout = bucket.layout
                if donate:  # the optimizer updated the owned part of the donated buffer
                    shard = bucket_layout.shard(rank, flats[bucket.index])
                else:
                    shard = torch.zeros(
                        bucket_layout.shard_size, dtype=bucket_layout.dtype,
                        device=bucket_layout.device,
                    )
                targets = bucket_layout.fragment_views(rank, shard)
                for leaf, target in zip(bucket.leaf_indices, targets):
                    if not _same_memory(new_fragments[leaf], target):
                        target.copy_(new_fragments[leaf])
                in_flight.append(
                    (bucket.index, collectives.all_gather_start(shard, self.axis, mesh=self.mesh))
                )
                if len(in_flight) > _MAX_IN_FLIGHT:
                    finish(*in_flight.popleft())
            while in_flight:
                finish(*in_flight.popleft())
        return new_flats  # type: ignore[return-value]

    # ---- checks -------------------------------------------------------------------------

    def _check_same_trees(self, params: PyTree, buffers: PyTree, what: str) -> None:
        lines = common.describe_tree(params) + ["buffers:"] + common.describe_tree(buffers)
        common.check_same_on_all_ranks(self.mesh, self.axis, lines, what, "shard_optimizer")

    def _local_opt_state(
        self, step: Step, opt_state: Any, layout: _ShardLayout, treedef: Any
    ) -> ShardedOptState:
        if not isinstance(opt_state, ShardedOptState):
            raise ValueError(
                "shard_optimizer: `state.opt_state` is a full (unsharded) optimizer state, "
                f"a {type(opt_state).__name__}; convert the state with "
                "fscale.shard_state(step, state) before passing it to a sharded step"
            )
        num_shards = int(opt_state.num_shards)
        if num_shards != self._size:
            raise ValueError(
                f"shard_optimizer: the optimizer state is sharded over {num_shards} ranks but "
                f"this step shards axis {self.axis!r} over {self._size}; rebuild it with "
                "fscale.shard_state(step, fscale.consolidate(old_step, state)), where old_step "
                "is the step that made it"
            )
        expected = _state_spec(step.optimizer, layout, treedef, self._rank)
        _check_spec("shard_optimizer", "state.opt_state.shard", opt_state.shard, expected,
                    "it does not come from this step's init on these params")
        return opt_state

    # ---- state in and out ---------------------------------------------------------------

    def consolidate(self, step: Step, state: TrainState) -> TrainState:
        """The full state: see `consolidate`."""
        layout, treedef = self._layout(state.params)
        opt_state = self._local_opt_state(step, state.opt_state, layout, treedef)
        full, specs = self._state_specs(step, layout, treedef)
        leaves, state_def = tree.flatten(opt_state.shard)
        fragmented = _fragmented_leaves(full, specs)
        out = list(leaves)
        for indices in _by_dtype(leaves, fragmented):
            for i, value in zip(indices, self._gather_pieces(leaves, indices, full, specs)):
                out[i] = value
        return state._replace(opt_state=tree.unflatten(state_def, out))

    def _gather_pieces(
        self,
        leaves: list[torch.Tensor],
        indices: list[int],
        full: _StateSpec,
        specs: list[_StateSpec],
    ) -> list[torch.Tensor]:
        """All ranks' pieces of the leaves `indices` (one dtype), joined into full tensors."""
        device = leaves[indices[0]].device
        sizes = [[spec.shapes[i].numel() for i in indices] for spec in specs]
        width = max(max(sum(row) for row in sizes), 1)
        mine = torch.zeros(width, dtype=leaves[indices[0]].dtype, device=device)
        torch.cat([leaves[i].reshape(-1) for i in indices], out=mine[: sum(sizes[self._rank])])
        gathered = collectives.all_gather(mine, self.axis, mesh=self.mesh).view(self._size, width)
        offsets = [0] * self._size
        joined = []
        for k, i in enumerate(indices):
            pieces = []
            for r in range(self._size):
                pieces.append(gathered[r, offsets[r] : offsets[r] + sizes[r][k]])
                offsets[r] += sizes[r][k]
            joined.append(torch.cat(pieces).view(full.shapes[i]))
        return joined

    def shard_state(self, step: Step, full_state: TrainState) -> TrainState:
        """This rank's sharded state: see `shard_state`."""
        if isinstance(full_state.opt_state, ShardedOptState):
            raise ValueError(
                "shard_state: `full_state.opt_state` is already sharded; consolidate it first "
                "with fscale.consolidate(old_step, state), using the step that made it"
            )
        self._check_same_trees(full_state.params, full_state.buffers, "the state's trees")
        layout, treedef = self._layout(full_state.params)
        full, specs = self._state_specs(step, layout, treedef)
        _check_spec("shard_state", "full_state.opt_state", full_state.opt_state, full,
                    "it is not the full state of this step's optimizer on these params")
        leaves, state_def = tree.flatten(full_state.opt_state)
        fragmented = set(_fragmented_leaves(full, specs))
        mine = specs[self._rank]
        out = []
        for i, leaf in enumerate(leaves):
            if i in fragmented:
                start = sum(spec.shapes[i].numel() for spec in specs[: self._rank])
                piece = leaf.reshape(-1)[start : start + mine.shapes[i].numel()]
                out.append(piece.reshape(mine.shapes[i]).clone())
            else:
                out.append(leaf.clone())
        flats = layout.pack(tree.leaves(full_state.params))
        return full_state._replace(
            params=tree.unflatten(treedef, layout.leaf_views(flats)),
            opt_state=ShardedOptState(
                tree.unflatten(state_def, out), torch.tensor(self._size, dtype=torch.int64)
            ),
        )

    def _state_specs(
        self, step: Step, layout: _ShardLayout, treedef: Any
    ) -> tuple[_StateSpec, list[_StateSpec]]:
        """The full state's spec and every rank's sharded spec (computed locally, no traffic)."""
        full = _state_spec(step.optimizer, layout, treedef, None)
        return full, [_state_spec(step.optimizer, layout, treedef, r) for r in range(self._size)]

    def __repr__(self) -> str:
        stage = (
            "ZeRO-2: gradients reduce-scattered during backward"
            if self.shard_grads
            else "ZeRO-1: gradients reduce-scattered after backward"
        )
        return (
            f"shard_optimizer(axis={self.axis!r} of size {self._size}, {stage}, "
            f"bucket={self.bucket_bytes / 2**20:g} MiB)"
        )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.shape == b.shape)


# ----------------------------------------------------------------------------- state specs


class _StateSpec(NamedTuple):
    """The structure and leaf shapes of an optimizer state."""

    treedef: Any
    shapes: tuple[torch.Size, ...]


def _state_spec(
    optimizer: optim_lib.Optimizer, layout: _ShardLayout, treedef: Any, rank: int | None
) -> _StateSpec:
    """What ``optimizer.init`` returns on `rank`'s fragments, or on the full leaves (None).

    Shapes come from an init on meta tensors (no memory); an optimizer whose init needs real
    values (e.g. `offload_optimizer` copies them to the host) is initialised on zeros instead.
    """
    stand_ins = layout.stand_ins(rank)
    opt_layout = None
    if rank is not None:
        opt_layout = Layout(tree.unflatten(treedef, layout.fragments(rank)), _no_reduction)
    try:
        state = optimizer.init(tree.unflatten(treedef, stand_ins), layout=opt_layout)
    except (NotImplementedError, RuntimeError):
        real = [
            torch.zeros(t.shape, dtype=t.dtype, device=device)
            for t, device in zip(stand_ins, layout.devices())
        ]
        state = optimizer.init(tree.unflatten(treedef, real), layout=opt_layout)
    leaves, state_def = tree.flatten(state)
    return _StateSpec(state_def, tuple(leaf.shape for leaf in leaves))


def _no_reduction(t: torch.Tensor) -> torch.Tensor:
    return t


def _check_spec(caller: str, what: str, value: PyTree, spec: _StateSpec, why: str) -> None:
    paths, leaves, value_def = tree.flatten_with_paths(value)
    if value_def != spec.treedef:
        raise ValueError(
            f"{caller}: `{what}` has structure {value_def} but {spec.treedef} was expected; "
            f"{why}"
        )
    for path, leaf, shape in zip(paths, leaves, spec.shapes):
        if leaf.shape != shape:
            raise ValueError(
                f"{caller}: `{what}` leaf {path!r} has shape {tuple(leaf.shape)} but "
                f"{tuple(shape)} was expected; {why}"
            )


def _fragmented_leaves(full: _StateSpec, specs: Sequence[_StateSpec]) -> list[int]:
    """Leaves held in per-rank pieces: their shape differs from the full one on some rank."""
    fragmented = []
    for i, shape in enumerate(full.shapes):
        if all(spec.shapes[i] == shape for spec in specs):
            continue
        pieces = sum(spec.shapes[i].numel() for spec in specs)
        if pieces != shape.numel():
            raise ValueError(
                f"cannot map optimizer state leaf {i}: the ranks hold {pieces} elements of a "
                f"tensor of shape {tuple(shape)}; state leaves must be either replicated or "
                "per-element pieces of the parameter fragments"
            )
        fragmented.append(i)
    return fragmented


def _by_dtype(leaves: Sequence[torch.Tensor], indices: Sequence[int]) -> list[list[int]]:
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i in indices:
        groups.setdefault((leaves[i].dtype, leaves[i].device), []).append(i)
    return list(groups.values())


# ----------------------------------------------------------------------------- public API


def shard_optimizer(
    step: Step,
    mesh: Mesh,
    axis: str = "dp",
    *,
    shard_grads: bool = True,
    bucket_mb: float = 25.0,
) -> Step:
    """ZeRO: shard the optimizer state (and, by default, the gradients) over `axis`.

    ``shard_grads=True`` is ZeRO-2 (FairScale's ShardedDDP with OSS): each bucket of gradients
    is reduce-scattered as soon as backward completes it and then freed. ``shard_grads=False``
    is ZeRO-1 (OSS with DDP): full gradients until backward ends, then a reduce-scatter. Either
    way each rank updates only its slice of every bucket and the new slices are all-gathered.
    See the module docstring for layout, traffic, memory and numerics.

    Args:
        step: a Step from `fscale.train_step`, or from `data_parallel` over the same `axis`
            (whose all-reduce this replaces: the reduce-scatter already averages gradients).
        mesh: the mesh; `axis` must be one of its axes.
        axis: the data-parallel axis the state is sharded over; each rank reads its own slice
            of the global batch.
        shard_grads: reduce-scatter and free gradient buckets during backward (ZeRO-2).
        bucket_mb: bucket size in MiB.

    Returns:
        A Step whose state holds replicated parameters and a `ShardedOptState`; its metrics
        (the loss and scalar extras) are means over the axis, plus ``grad_bytes`` and
        ``grad_peak_bytes``. Use `consolidate` / `shard_state` to convert states.

    Raises:
        TypeError: `step` is not a Step, `mesh` is not a Mesh, or `shard_grads` is not a bool.
        ValueError: `mesh` lacks `axis`; `step` is already sharded, data parallel over another
            axis, or transformed otherwise; `bucket_mb` is not positive. At init, ranks that
            disagree on the parameter tree get an error naming the first difference.

    Example::

        step = fs.shard_optimizer(fs.train_step(loss_fn, fs.optim.adamw(3e-4)), fs.Mesh(dp=4))
        state = step.init(params, buffers)
        state, metrics = step(state, local_batch)
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"shard_optimizer: `step` must be a Step from fscale.train_step, got "
            f"{type(step).__name__}"
        )
    common.check_axis(mesh, axis, "shard_optimizer")
    if not isinstance(shard_grads, bool):
        raise TypeError(
            f"shard_optimizer: `shard_grads` must be True or False, got {shard_grads!r}"
        )
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(
            f"shard_optimizer: `bucket_mb` must be a positive number, got {bucket_mb!r}"
        )
    plan = step.plan
    if isinstance(plan, ShardedOptimizerPlan):
        raise ValueError(
            f"shard_optimizer: the step already shards its optimizer ({plan!r}); shard it once, "
            "from a step of fscale.train_step or fscale.data_parallel"
        )
    if isinstance(plan, DataParallelPlan) and plan.axis != axis:
        raise ValueError(
            f"shard_optimizer: the step is data parallel over axis {plan.axis!r} but the "
            f"optimizer would be sharded over {axis!r}; replicating over one axis while sharding "
            "over another (HSDP) is not supported: shard over the data-parallel axis, "
            f"shard_optimizer(step, mesh, axis={plan.axis!r})"
        )
    if not isinstance(plan, (LocalPlan, DataParallelPlan)):
        raise ValueError(
            f"shard_optimizer: cannot shard the optimizer of a step with plan {plan!r}; apply it "
            "to a step from fscale.train_step or fscale.data_parallel"
        )
    return step.replace(
        plan=ShardedOptimizerPlan(mesh, axis, int(bucket_mb * 2**20), shard_grads)
    )
