"""The layer of `shard_optimizer` (ZeRO-1/2) and its optimizer role: the update on 1/N.

Per step on each rank: backward with the full, replicated parameters; gradients reduce-scattered
bucket by bucket (during backward for ZeRO-2, after it for ZeRO-1); the optimizer updating only
this rank's fragments; the new shards all-gathered into fresh full parameter buckets. The
algorithm, traffic, memory and numerics are described in `fscale.parallel.zero`; the buckets'
layout in `fscale.parallel.bucket_layout`; how the optimizer state is converted to and from its
full form in `fscale.parallel.opt_state`.

Under torch.compile the forward is compiled; the state check and the update (optimizer and
all-gathers) each run outside the graph as one call, and the reduce-scatters start from the
gradient hooks, eagerly, as backward runs.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import torch

from fscale import optim as optim_lib
from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.optim.base import Sharding
from fscale.outside_graph import outside_graph
from fscale.parallel.bucket_collectives import all_gather_bucket_start
from fscale.parallel.bucket_layout import BucketLayout, layout_of
from fscale.parallel.opt_state import StateMap, StateSpec, check_state, plan_state_init, state_spec
from fscale.parallel.reduce import MAX_IN_FLIGHT, add_scatter_axis
from fscale.plan import Context, Plan
from fscale.state_agreement import check_same_values

__all__ = ["ShardedOptState", "ShardedOptimizerPlan", "ZeroOptimizer"]

PyTree = Any

# Optimizer state specs a plan keeps (one per model and optimizer it has run).
_MAX_CACHED_SPECS = 8


class _SpecCache:
    """This rank's expected optimizer-state spec per (layout, treedef, optimizer), so that
    checking a state every step does not run the init each time.

    The keys are held, not their ids, so an entry cannot be mistaken for a new object at a
    reused address; they are compared one by one (at most `_MAX_CACHED_SPECS`) rather than
    hashed: Dynamo before torch 2.13 cannot hash a treedef, and a dict keyed by one, reachable
    from a step, broke the graph wherever the step was passed to a call.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[BucketLayout, Any, Any, StateSpec]] = []

    def get(self, layout: BucketLayout, treedef: Any, optimizer: Any) -> StateSpec | None:
        for held_layout, held_treedef, held_optimizer, spec in self._entries:
            if held_layout is layout and held_optimizer is optimizer and held_treedef == treedef:
                return spec
        return None

    def put(self, layout: BucketLayout, treedef: Any, optimizer: Any, spec: StateSpec) -> None:
        if len(self._entries) >= _MAX_CACHED_SPECS:
            self._entries.pop(0)
        self._entries.append((layout, treedef, optimizer, spec))


class ShardedOptState(NamedTuple):
    """The optimizer state of a `shard_optimizer` step on one rank.

    Attributes:
        shard: the wrapped plan's optimizer state for the fragments this rank owns (the
            structure of the full state; per-element leaves hold this rank's pieces).
        num_shards: the number of ranks the state is sharded over (an int64 scalar), so a state
            from another world size is detected on every rank.
    """

    shard: PyTree
    num_shards: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ZeroOptimizer:
    """The `fscale.plan.OptimizerRole` of ZeRO: the optimizer on this rank's fragments.

    `init` initialises the optimizer on the fragments of the bucket buffers this rank owns;
    `apply` takes the reduced gradient shards, updates the owned fragments, and all-gathers
    every bucket's new shard into full buffers that the new parameters view.
    """

    mesh: Mesh
    axis: str
    layout: BucketLayout

    @property
    def rank(self) -> int:
        return self.mesh.rank(self.axis)

    def sharding(self, treedef: Any) -> Sharding:
        """The fragments' places in a params tree of structure `treedef`, and the all-reduce."""
        mesh, axis = self.mesh, self.axis
        return Sharding(
            tree.unflatten(treedef, self.layout.fragments(self.rank)),
            lambda t: collectives.all_reduce(t, axis, "sum", mesh=mesh),
        )

    def _owned(self, params: PyTree) -> tuple[list[torch.Tensor], PyTree, Any]:
        leaves, treedef = tree.flatten(params)
        flats = self.layout.flats_of(leaves)
        owned = self.layout.fragment_views(self.rank, self.layout.owned(self.rank, flats))
        return flats, tree.unflatten(treedef, owned), treedef

    def init(self, optimizer: optim_lib.Optimizer, params: PyTree) -> PyTree:
        _, owned, treedef = self._owned(params)
        return optimizer.init(owned, sharding=self.sharding(treedef))

    # Under torch.compile the whole update runs outside the graph, as one call: its all-gathers
    # on gloo end a graph anyway and the optimizer's apply runs eagerly already. The trees it
    # rebuilds take their treedef from the params here: a treedef made in the graph is
    # Dynamo's stand-in, which fails outside it (torch 2.13: "length mismatch" unflattening).
    @outside_graph
    def apply(self, optimizer, grads, opt_state, params, *, donate):
        flats, owned, treedef = self._owned(params)
        grad_fragments = tree.unflatten(treedef, self.layout.fragment_views(self.rank, grads))
        new_fragments, new_opt_state = optim_lib.step(
            optimizer,
            grad_fragments,
            opt_state,
            owned,
            sharding=self.sharding(treedef),
            donate=donate,
        )
        new_flats = self._gather_params(tree.leaves(new_fragments), flats, donate)
        return tree.unflatten(treedef, self.layout.leaf_views(new_flats)), new_opt_state

    def _gather_params(
        self, new_fragments: list[torch.Tensor], flats: list[torch.Tensor], donate: bool
    ) -> list[torch.Tensor]:
        """All-gather every bucket's updated shard into a full buffer (in place when donating)."""
        rank, layout = self.rank, self.layout
        new_flats: list[torch.Tensor | None] = [None] * len(layout.buckets)
        in_flight: collections.deque = collections.deque()

        def finish(index: int, pending: collectives.Pending) -> None:
            new_flats[index] = pending.wait()

        with torch.no_grad():
            for bucket in layout.buckets:
                bucket_layout = bucket.layout
                # Donated: the optimizer updated the owned part of the bucket in place, and the
                # other ranks' parts are gathered around it. Else a new bucket is filled.
                flat = flats[bucket.index] if donate else _new_bucket(bucket_layout)
                shard = bucket_layout.shard(rank, flat)
                targets = bucket_layout.fragment_views(rank, shard)
                for leaf, target in zip(bucket.leaf_indices, targets):
                    if not _same_memory(new_fragments[leaf], target):
                        target.copy_(new_fragments[leaf])
                in_flight.append(
                    (bucket.index, all_gather_bucket_start(flat, self.axis, self.mesh))
                )
                if len(in_flight) > MAX_IN_FLIGHT:
                    finish(*in_flight.popleft())
            while in_flight:
                finish(*in_flight.popleft())
        return new_flats  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, repr=False)
class ShardedOptimizerPlan(Plan):
    """Replicated parameters; gradients reduce-scattered and optimizer state sharded over `axis`."""

    inner: Plan
    mesh: Mesh
    axis: str
    bucket_bytes: int
    shard_grads: bool
    _rank_specs: _SpecCache = dataclasses.field(
        default_factory=_SpecCache, compare=False, repr=False
    )

    @property
    def name(self) -> str:
        return "shard_optimizer"

    def describe(self) -> str:
        stage = (
            "ZeRO-2: gradients reduce-scattered during backward"
            if self.shard_grads
            else "ZeRO-1: gradients reduce-scattered after backward"
        )
        return (
            f"shard_optimizer(axis={self.axis!r} of size {self._size}, {stage}, "
            f"bucket={self.bucket_bytes / 2**20:g} MiB)"
        )

    def own_data_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def own_mesh(self) -> Mesh:
        return self.mesh

    @property
    def _size(self) -> int:
        return self.mesh.size(self.axis)

    @property
    def _rank(self) -> int:
        return self.mesh.rank(self.axis)

    def _layout(self, params: PyTree) -> tuple[BucketLayout, Any]:
        return layout_of(params, self.bucket_bytes, self._size)

    def context(self, ctx: Context) -> Context:
        reducer = add_scatter_axis(
            ctx.reducer, self.mesh, self.axis, self.bucket_bytes, self.shard_grads
        )
        return ctx.replace(reducer=reducer)

    # ---- phases --------------------------------------------------------------------------

    def init(self, step, params, buffers, key, ctx):
        layout, treedef = self._layout(params)
        # At rest the parameters view full bucket buffers, which the all-gather writes into.
        flats = layout.pack(tree.leaves(params))
        params = tree.unflatten(treedef, layout.leaf_views(flats))
        role = ZeroOptimizer(self.mesh, self.axis, layout)
        state = self.inner.init(
            step, params, buffers, key, self.context(ctx).replace(optimizer=role)
        )
        return tree.with_fields(
            state,
            opt_state=ShardedOptState(state.opt_state, torch.tensor(self._size, dtype=torch.int64)),
        )

    def gradients(self, step, state, batch, ctx):
        self._check_opt_state(step, state.params, state.opt_state)
        return self.inner.gradients(
            step, tree.with_fields(state, opt_state=state.opt_state.shard), batch, self.context(ctx)
        )

    def apply_gradients(self, step, state, grads, aux, ctx):
        layout = self._check_opt_state(step, state.params, state.opt_state)
        opt_state = state.opt_state
        role = ZeroOptimizer(self.mesh, self.axis, layout)
        new_state, metrics = self.inner.apply_gradients(
            step,
            tree.with_fields(state, opt_state=opt_state.shard),
            grads,
            aux,
            self.context(ctx).replace(optimizer=role),
        )
        return tree.with_fields(
            new_state, opt_state=ShardedOptState(new_state.opt_state, opt_state.num_shards)
        ), metrics

    # ---- checks --------------------------------------------------------------------------

    # Under torch.compile the check runs outside the graph, as one call: it reads the shard
    # count's value (a host read ends a graph anyway) and keys its spec cache by the params'
    # treedef, which must be optree's own, not Dynamo's stand-in for it.
    @outside_graph
    def _check_opt_state(self, step: Any, params: PyTree, opt_state: Any) -> BucketLayout:
        """Check that `opt_state` is this step's sharded state for `params`; their layout."""
        layout, treedef = self._layout(params)
        self._check_opt_state_on(step, opt_state, layout, treedef)
        return layout

    def _check_opt_state_on(
        self, step: Any, opt_state: Any, layout: BucketLayout, treedef: Any
    ) -> None:
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
        check_state(
            "shard_optimizer",
            "state.opt_state.shard",
            opt_state.shard,
            expected,
            "it does not come from this step's init on these params",
        )

    def _rank_spec(self, step: Any, layout: BucketLayout, treedef: Any) -> StateSpec:
        """`_state_spec` for this rank, computed once per optimizer, layout and tree."""
        spec = self._rank_specs.get(layout, treedef, step.optimizer)
        if spec is None:
            spec = self._state_spec(step, layout, treedef, self._rank)
            self._rank_specs.put(layout, treedef, step.optimizer, spec)
        return spec

    # ---- state in and out ----------------------------------------------------------------

    def consolidate(self, step, state):
        layout, treedef = self._layout(state.params)
        opt_state = state.opt_state
        self._check_opt_state_on(step, opt_state, layout, treedef)
        full = self._state_map(step, layout, treedef).consolidate(
            opt_state.shard,
            self._rank,
            lambda t: collectives.all_gather(t, self.axis, mesh=self.mesh),
        )
        return self.inner.consolidate(step, tree.with_fields(state, opt_state=full))

    def shard_state(self, step, full_state):
        if isinstance(full_state.opt_state, ShardedOptState):
            raise ValueError(
                "shard_state: `full_state.opt_state` is already sharded; consolidate it first "
                "with fscale.consolidate(old_step, state), using the step that made it"
            )
        check_same_values(full_state, self.mesh, self.axis, "full states", "shard_state")
        full_state = self.inner.shard_state(step, full_state)
        layout, treedef = self._layout(full_state.params)
        state_map = self._state_map(step, layout, treedef)
        check_state(
            "shard_state",
            "full_state.opt_state",
            full_state.opt_state,
            state_map.full,
            "it is not the full state of this step's optimizer on these params",
        )
        flats = layout.pack(tree.leaves(full_state.params))
        return tree.with_fields(
            full_state,
            params=tree.unflatten(treedef, layout.leaf_views(flats)),
            opt_state=ShardedOptState(
                state_map.shard(full_state.opt_state, self._rank),
                torch.tensor(self._size, dtype=torch.int64),
            ),
        )

    def _state_spec(
        self, step: Any, layout: BucketLayout, treedef: Any, rank: int | None
    ) -> StateSpec:
        """What the inner plan's init makes on `rank`'s fragments, or on the full leaves (None)."""
        full = tree.unflatten(treedef, layout.stand_ins(None))
        if rank is None:
            return state_spec(plan_state_init(self.inner, step), full, devices=layout.devices())
        params = tree.unflatten(treedef, layout.stand_ins(rank))
        fragments = tree.unflatten(treedef, layout.fragments(rank))
        return state_spec(
            plan_state_init(self.inner, step, full), params, fragments, devices=layout.devices()
        )

    def _state_map(self, step: Any, layout: BucketLayout, treedef: Any) -> StateMap:
        """The full state's spec and every rank's sharded spec (computed locally, no traffic)."""
        full = self._state_spec(step, layout, treedef, None)
        ranks = [self._state_spec(step, layout, treedef, r) for r in range(self._size)]
        return StateMap(full, ranks)


def _new_bucket(bucket_layout: Any) -> torch.Tensor:
    """A zeroed parameter bucket (the gaps between leaves stay zero, as the layout requires)."""
    return torch.zeros(bucket_layout.numel, dtype=bucket_layout.dtype, device=bucket_layout.device)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.shape == b.shape)
