"""The plan of `shard_optimizer` (ZeRO-1/2): one training step with sharded optimizer state.

Per step on each rank: backward with the full, replicated parameters; gradients reduce-scattered
bucket by bucket (during backward for ZeRO-2, after it for ZeRO-1); the optimizer updating only
this rank's fragments; the new shards all-gathered into fresh full parameter buckets. The
algorithm, traffic, memory and numerics are described in `fscale.parallel.zero`; the buckets'
layout in `fscale.parallel.zero.layout`; how the optimizer state is converted to and from its
full form in `fscale.parallel.opt_state`.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.memory import tree_bytes
from fscale.optim.base import Layout
from fscale.parallel import common
from fscale.parallel.buckets import Bucket, GradBuckets
from fscale.parallel.opt_state import StateMap, StateSpec, check_state, state_spec
from fscale.parallel.zero.layout import BucketLayout, layout_of
from fscale.train import Step, TrainState, value_and_grad

__all__ = ["ShardedOptState", "ShardedOptimizerPlan"]

PyTree = Any

# Reductions (and all-gathers) allowed in flight before the oldest is waited for.
_MAX_IN_FLIGHT = 2

# Optimizer state specs a plan keeps (one per model and optimizer it has run).
_MAX_CACHED_SPECS = 8


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
    # The optimizer state's expected spec on this rank, kept so that checking a state every step
    # does not run the optimizer's init each time: ``{(layout, treedef): (optimizer, spec)}``.
    # The layout and optimizer are held, not their ids, so a cached entry cannot be mistaken
    # for a new object at a reused address.
    _rank_specs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    # ---- helpers ------------------------------------------------------------------------

    @property
    def _size(self) -> int:
        return self.mesh.size(self.axis)

    @property
    def _rank(self) -> int:
        return self.mesh.rank(self.axis)

    def _layout(self, params: PyTree) -> tuple[BucketLayout, Any]:
        return layout_of(params, self.bucket_bytes, self._size)

    def _sum_over_axis(self, t: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(t, self.axis, "sum", mesh=self.mesh)

    def _opt_layout(self, layout: BucketLayout, treedef: Any, rank: int) -> Layout:
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
        layout: BucketLayout,
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
        layout: BucketLayout,
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
        layout: BucketLayout,
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
        self, step: Step, opt_state: Any, layout: BucketLayout, treedef: Any
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
        expected = self._rank_spec(step, layout, treedef)
        check_state("shard_optimizer", "state.opt_state.shard", opt_state.shard, expected,
                    "it does not come from this step's init on these params")
        return opt_state

    def _rank_spec(self, step: Step, layout: BucketLayout, treedef: Any) -> StateSpec:
        """`_state_spec` for this rank, computed once per optimizer, layout and tree."""
        cached = self._rank_specs.get((layout, treedef))
        if cached is not None and cached[0] is step.optimizer:
            return cached[1]
        spec = self._state_spec(step, layout, treedef, self._rank)
        if len(self._rank_specs) >= _MAX_CACHED_SPECS:
            self._rank_specs.clear()
        self._rank_specs[(layout, treedef)] = (step.optimizer, spec)
        return spec

    # ---- state in and out ---------------------------------------------------------------

    def consolidate(self, step: Step, state: TrainState) -> TrainState:
        """The full state: see `consolidate`."""
        layout, treedef = self._layout(state.params)
        opt_state = self._local_opt_state(step, state.opt_state, layout, treedef)
        full = self._state_map(step, layout, treedef).consolidate(
            opt_state.shard,
            self._rank,
            lambda t: collectives.all_gather(t, self.axis, mesh=self.mesh),
        )
        return state._replace(opt_state=full)

    def shard_state(self, step: Step, full_state: TrainState) -> TrainState:
        """This rank's sharded state: see `shard_state`."""
        if isinstance(full_state.opt_state, ShardedOptState):
            raise ValueError(
                "shard_state: `full_state.opt_state` is already sharded; consolidate it first "
                "with fscale.consolidate(old_step, state), using the step that made it"
            )
        self._check_same_trees(full_state.params, full_state.buffers, "the state's trees")
        layout, treedef = self._layout(full_state.params)
        state_map = self._state_map(step, layout, treedef)
        check_state("shard_state", "full_state.opt_state", full_state.opt_state, state_map.full,
                    "it is not the full state of this step's optimizer on these params")
        flats = layout.pack(tree.leaves(full_state.params))
        return full_state._replace(
            params=tree.unflatten(treedef, layout.leaf_views(flats)),
            opt_state=ShardedOptState(
                state_map.shard(full_state.opt_state, self._rank),
                torch.tensor(self._size, dtype=torch.int64),
            ),
        )

    def _state_spec(
        self, step: Step, layout: BucketLayout, treedef: Any, rank: int | None
    ) -> StateSpec:
        """What the optimizer's init returns on `rank`'s fragments, or on the full leaves (None)."""
        params = tree.unflatten(treedef, layout.stand_ins(rank))
        fragments = None if rank is None else tree.unflatten(treedef, layout.fragments(rank))
        return state_spec(step.optimizer, params, fragments, devices=layout.devices())

    def _state_map(self, step: Step, layout: BucketLayout, treedef: Any) -> StateMap:
        """The full state's spec and every rank's sharded spec (computed locally, no traffic)."""
        full = self._state_spec(step, layout, treedef, None)
        ranks = [self._state_spec(step, layout, treedef, r) for r in range(self._size)]
        return StateMap(full, ranks)

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

