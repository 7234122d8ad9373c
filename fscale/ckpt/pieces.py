"""Which piece of each leaf of the full TrainState this rank holds, for any plan.

A checkpoint stores the *full* state, the one a single-process `train_step` takes: leaves
``params/<path>``, ``buffers/<path>``, ``opt_state/<path>``, ``step`` and ``key``, each as the
row-major flattening of the full tensor. Under the built-in plans no rank builds that state:
each describes what it holds as `Piece`s, elements ``[start, start + numel)`` of a full leaf's
flattening as a 1-D view into its own state. Three layouts cover the built-in plans:

- **full** (``train_step``, ``data_parallel``, ``accumulate``): every leaf whole on every rank;
  identical pieces of replicated leaves are written once (DCP deduplicates them).
- **shard_optimizer** (ZeRO-1/2): parameters, buffers, step and key whole; every per-element
  optimizer state leaf is this rank's fragment, at the offset the ranks before it hold
  (`fscale.parallel.opt_state.StateMap`, the rule `consolidate` follows).
- **fully_shard** (ZeRO-3, and HSDP inside ``data_parallel``): each parameter is the fragment
  of it in this rank's unit shards (`fscale.flat.Fragment`: a 1-D slice of its flattening),
  and the optimizer state is cut by the same `StateMap` rule.

Any other plan (a user layer that wraps the optimizer state, a stateful reduction hook) is
**consolidated**: ``fscale.consolidate`` builds the full state on every rank, whose leaves are
then whole pieces; loading cuts it with ``fscale.shard_state``. Every layout reshards into
every other, since all of them describe the same full leaves.

`pieces_of` describes a state for saving (views of its tensors); `pieces_into` makes fresh
tensors laid out like a state, whose pieces a load fills, and the function that assembles the
state from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fscale import tree
from fscale.parallel import HookState, ShardedOptState, consolidate, shard_state
from fscale.parallel.bucket_layout import layout_of
from fscale.parallel.opt_state import StateMap, plan_state_init, state_spec
from fscale.plan import Plan, TrainState
from fscale.train import Step

__all__ = [
    "CONSOLIDATED",
    "FULL",
    "Piece",
    "fsdp_state_map",
    "layout_kind",
    "pieces_into",
    "pieces_of",
    "zero_state_map",
]

PyTree = Any

FULL = "full"
CONSOLIDATED = "consolidated"
_SHARDING_LAYERS = ("shard_optimizer", "fully_shard")
# Layers that keep the state of the layers inside them as it is.
_PASS_THROUGH = ("accumulate", "local")


class Piece(NamedTuple):
    """Elements ``[start, start + values.numel())`` of the full leaf `key`, held by this rank.

    `shape` and `dtype` are the full leaf's; `values` is 1-D.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    values: torch.Tensor


def layout_kind(step: Step, state: TrainState) -> str:
    """How `step` holds `state`: ``"full"``, ``"shard_optimizer"``, ``"fully_shard"`` or
    ``"consolidated"`` (see the module docstring)."""
    if isinstance(state.opt_state, HookState):
        return CONSOLIDATED
    sharding = [layer for layer in step.plan.layers() if layer.name in _SHARDING_LAYERS]
    others = [
        layer
        for layer in step.plan.layers()
        if layer.name not in _SHARDING_LAYERS and not _passes_state_through(layer)
    ]
    if others or len(sharding) > 1:
        return CONSOLIDATED
    return sharding[0].name if sharding else FULL


def _passes_state_through(layer: Plan) -> bool:
    if layer.name == "data_parallel":
        # A stateful reduction hook wraps the optimizer state in a HookState.
        return not callable(getattr(getattr(layer, "hook", None), "init", None))
    if layer.name in _PASS_THROUGH:
        return True
    # A layer that adds to the state overrides both (the rule of `fscale.Plan`).
    kind = type(layer)
    return kind.consolidate is Plan.consolidate and kind.shard_state is Plan.shard_state


def pieces_of(step: Step, state: TrainState) -> tuple[str, list[Piece]]:
    """``(layout kind, this rank's pieces of the full state)``; the values are views of `state`.

    For a consolidated layout every rank must call this (``fscale.consolidate`` communicates).
    """
    kind = layout_kind(step, state)
    if kind == CONSOLIDATED:
        return kind, _whole(consolidate(step, state))
    if kind == FULL:
        return kind, _whole(state)
    plan = step.plan.find(kind)
    assert plan is not None
    return kind, _sharded_pieces(kind, plan, step, state)


def pieces_into(step: Step, like: TrainState) -> tuple[str, list[Piece], Callable[[], TrainState]]:
    """Fresh tensors laid out as `like`, their pieces, and the state assembled from them.

    Fill the pieces' values (a load does), then call the third item: it returns the state
    `step` continues from on this rank. `like` itself is not modified.
    """
    kind = layout_kind(step, like)
    if kind == CONSOLIDATED:
        full = _fresh(consolidate(step, like))
        return kind, _whole(full), lambda: shard_state(step, full)
    fresh = _fresh(like)
    if kind == FULL:
        return kind, _whole(fresh), lambda: fresh
    plan: Any = step.plan.find(kind)
    assert plan is not None
    pieces = _sharded_pieces(kind, plan, step, fresh)
    if kind == "shard_optimizer":
        # The parameters of a ZeRO state view full bucket buffers (the all-gather writes there).
        def assemble() -> TrainState:
            layout, treedef = layout_of(fresh.params, plan.bucket_bytes, plan.mesh.size(plan.axis))
            flats = layout.pack(tree.leaves(fresh.params))
            return fresh._replace(params=tree.unflatten(treedef, layout.leaf_views(flats)))

        return kind, pieces, assemble
    return kind, pieces, lambda: fresh


# ---- the layouts --------------------------------------------------------------------------


def _sharded_pieces(kind: str, plan: Any, step: Step, state: TrainState) -> list[Piece]:
    rank = plan.mesh.rank(plan.axis)
    if kind == "shard_optimizer":
        params = _whole_group("params", state.params)
        opt_state = state.opt_state
        assert isinstance(opt_state, ShardedOptState)
        state_map = zero_state_map(plan, step, state.params)
        opt = _fragment_pieces("opt_state", opt_state.shard, state_map, rank)
    else:
        layout = plan.layout
        fragments = layout.fragments(rank)
        views = layout.fragment_views(state.params, rank)
        params = [
            Piece(
                f"params/{name}",
                tuple(fragments[name].shape),
                views[name].dtype,
                fragments[name].start,
                views[name],
            )
            for name in sorted(layout.param_order)
        ]
        state_map = fsdp_state_map(plan, step, state.params)
        opt = _fragment_pieces("opt_state", state.opt_state, state_map, rank)
    rest = _whole(state._replace(params={}, opt_state={}))
    return params + opt + rest


def zero_state_map(plan: Any, step: Step, params: PyTree) -> StateMap:
    """The optimizer state's full spec and every rank's, under a `shard_optimizer` layer."""
    size = plan.mesh.size(plan.axis)
    layout, treedef = layout_of(params, plan.bucket_bytes, size)
    full_params = tree.unflatten(treedef, layout.stand_ins(None))
    devices = layout.devices()
    full = state_spec(plan_state_init(plan.inner, step), full_params, devices=devices)
    ranks = [
        state_spec(
            plan_state_init(plan.inner, step, full_params),
            tree.unflatten(treedef, layout.stand_ins(rank)),
            tree.unflatten(treedef, layout.fragments(rank)),
            devices=devices,
        )
        for rank in range(size)
    ]
    return StateMap(full, ranks)


def fsdp_state_map(plan: Any, step: Step, shards: dict[str, torch.Tensor]) -> StateMap:
    """The optimizer state's full spec and every rank's, under a `fully_shard` layer."""
    layout = plan.layout
    unit_devices = {unit.name: shards[unit.name].device for unit in layout.units}
    devices = {name: unit_devices[unit.name] for unit in layout.units for name in unit.names}
    leaf_devices = tree.leaves({name: devices[name] for name in layout.param_order})
    meta_shards = {
        unit.name: torch.empty(unit.shard_size, dtype=unit.dtype, device="meta")
        for unit in layout.units
    }
    full = state_spec(plan_state_init(plan.inner, step), layout.meta_params(), devices=leaf_devices)
    ranks = [
        state_spec(
            plan_state_init(plan.inner, step, meta_shards),
            layout.meta_fragments(rank),
            layout.fragments(rank),
            devices=leaf_devices,
        )
        for rank in range(layout.num_shards)
    ]
    return StateMap(full, ranks)


def _fragment_pieces(group: str, local: PyTree, state_map: StateMap, rank: int) -> list[Piece]:
    paths, leaves, _ = tree.flatten_with_paths(local)
    fragment_leaves = set(state_map.fragment_leaves)
    pieces = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        if i not in fragment_leaves:
            pieces.append(_whole_piece(f"{group}/{path}", leaf))
            continue
        start = sum(spec.shapes[i].numel() for spec in state_map.ranks[:rank])
        full_shape = tuple(state_map.full.shapes[i])
        pieces.append(Piece(f"{group}/{path}", full_shape, leaf.dtype, start, leaf.reshape(-1)))
    return pieces


def _whole(state: TrainState) -> list[Piece]:
    return [
        *_whole_group("params", state.params),
        *_whole_group("buffers", state.buffers),
        *_whole_group("opt_state", state.opt_state),
        _whole_piece("step", state.step),
        _whole_piece("key", state.key),
    ]


def _whole_group(group: str, values: PyTree) -> list[Piece]:
    paths, leaves, _ = tree.flatten_with_paths(values)
    return [_whole_piece(f"{group}/{path}", leaf) for path, leaf in zip(paths, leaves)]


def _whole_piece(key: str, leaf: Any) -> Piece:
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"checkpoint files hold tensors, but the state's leaf {key!r} is a "
            f"{type(leaf).__name__}; keep it as a tensor in the state"
        )
    return Piece(key, tuple(leaf.shape), leaf.dtype, 0, leaf.detach().reshape(-1))


def _fresh(state: TrainState) -> TrainState:
    """A copy of `state` that shares no memory with it (contiguous, so flat views write through)."""

    def copy(leaf: Any) -> Any:
        return (
            leaf.detach().clone(memory_format=torch.contiguous_format)
            if isinstance(leaf, torch.Tensor)
            else leaf
        )

    return tree.map(copy, state)
