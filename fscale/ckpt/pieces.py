"""Which boxes of each leaf of the full TrainState this rank holds, for any plan.

A checkpoint stores the *full* state, the one a single-process `train_step` takes: leaves
``params/<path>``, ``buffers/<path>``, ``opt_state/<path>``, ``step`` and ``key``, each a tensor
of its full shape. Under the built-in plans no rank builds that state: each describes what it
holds as `Piece`s, boxes of full leaves (`fscale.ckpt.boxes`) viewing its own tensors. The plan
is read from the inside out. The innermost sharding layer gives the pieces of the full state of
the model this rank trains; three layouts cover the built-in plans:

- **full** (``train_step``, ``data_parallel``, ``accumulate``): every leaf whole on every rank;
  identical pieces of replicated leaves are written once (DCP deduplicates them).
- **shard_optimizer** (ZeRO-1/2): parameters, buffers, step and key whole; every per-element
  optimizer state leaf is this rank's fragment, at the offset the ranks before it hold
  (`fscale.parallel.opt_state.StateMap`, the rule `consolidate` follows).
- **fully_shard** (ZeRO-3, and HSDP inside ``data_parallel``): each parameter is the fragment
  of it in this rank's unit shards (`fscale.flat.Fragment`: a range of its flattening),
  and the optimizer state is cut by the same `StateMap` rule.

Then every ``pipeline`` and ``expert_parallel`` layer around it, innermost first, and a
`tensor_parallel` model, place those pieces in the bigger model (`fscale.ckpt.placement`).

Any other plan (a user layer that wraps the optimizer state, a stateful reduction hook) is
**consolidated**: ``fscale.consolidate`` builds the step's full state on every rank, whose
leaves are then whole pieces (placed by a `tensor_parallel` model still); loading cuts it with
``fscale.shard_state``. Every layout reshards into every other, since all of them describe
boxes of the same full leaves.

`pieces_of` describes a state for saving (views of its tensors); `pieces_into` makes fresh
tensors laid out like a state, whose pieces a load fills, and the function that assembles the
state from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fscale import tree
from fscale.ckpt.boxes import Piece, range_pieces, whole_piece
from fscale.ckpt.placement import (
    PLACING_LAYERS,
    describe,
    place_layer,
    place_tensor_parallel,
    tensor_parallel_of,
)
from fscale.parallel import HookState, ShardedOptState, consolidate, shard_state
from fscale.parallel.bucket_layout import layout_of
from fscale.parallel.opt_state import StateMap, mirrored_leaves, plan_state_init, state_spec
from fscale.plan import Plan, TrainState
from fscale.train import Step

__all__ = [
    "CONSOLIDATED",
    "FULL",
    "Layout",
    "fsdp_state_map",
    "layout_kind",
    "layout_of_step",
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


class Layout(NamedTuple):
    """How a step holds its state, for a checkpoint.

    Attributes:
        kind: ``"full"``, ``"shard_optimizer"``, ``"fully_shard"`` or ``"consolidated"``.
        placing: the ``pipeline`` / ``expert_parallel`` layers around the sharding layer that
            place its pieces, innermost first (none for a consolidated layout).
        placements: one line per placement (those layers', then a tensor-parallel model's).
    """

    kind: str
    placing: tuple[Plan, ...]
    placements: tuple[str, ...]


def layout_kind(step: Step, state: TrainState) -> str:
    """How `step` holds `state`: ``"full"``, ``"shard_optimizer"``, ``"fully_shard"`` or
    ``"consolidated"`` (see the module docstring)."""
    return layout_of_step(step, state).kind


def layout_of_step(step: Step, state: TrainState, model: Any = None) -> Layout:
    """The `Layout` of `state` under `step`, its parameters split as `model` splits them
    (a `tensor_parallel` module, or None)."""
    tp = tensor_parallel_of(model)
    model_lines = (describe(tp[1]),) if tp is not None and tp[1].size > 1 else ()
    consolidated = Layout(CONSOLIDATED, (), model_lines)
    if isinstance(state.opt_state, HookState):
        return consolidated
    layers = list(step.plan.layers())
    sharding = [i for i, layer in enumerate(layers) if layer.name in _SHARDING_LAYERS]
    placing = [i for i, layer in enumerate(layers) if layer.name in PLACING_LAYERS]
    others = [
        layer
        for layer in layers
        if layer.name not in _SHARDING_LAYERS + PLACING_LAYERS and not _passes_state_through(layer)
    ]
    if others or len(sharding) > 1 or (sharding and any(i > sharding[0] for i in placing)):
        return consolidated
    kind = layers[sharding[0]].name if sharding else FULL
    outside_in = tuple(layers[i] for i in placing)
    lines = tuple(describe(layer) for layer in reversed(outside_in)) + model_lines
    return Layout(kind, tuple(reversed(outside_in)), lines)


def _passes_state_through(layer: Plan) -> bool:
    if layer.name == "data_parallel":
        # A stateful reduction hook wraps the optimizer state in a HookState.
        return not callable(getattr(getattr(layer, "hook", None), "init", None))
    if layer.name in _PASS_THROUGH:
        return True
    # A layer that adds to the state overrides both (the rule of `fscale.Plan`).
    kind = type(layer)
    return kind.consolidate is Plan.consolidate and kind.shard_state is Plan.shard_state


def pieces_of(step: Step, state: TrainState, model: Any = None) -> tuple[Layout, list[Piece]]:
    """``(layout, this rank's pieces of the full state)``; the values are views of `state`.

    `model` is the module the state's parameters belong to, when it is a `tensor_parallel`
    one. For a consolidated layout every rank must call this (``fscale.consolidate``
    communicates).
    """
    layout = layout_of_step(step, state, model)
    if layout.kind == CONSOLIDATED:
        return layout, _placed(layout, model, _whole(consolidate(step, state)))
    return layout, _placed(layout, model, _held(layout.kind, step, state))


def pieces_into(
    step: Step, like: TrainState, model: Any = None
) -> tuple[Layout, list[Piece], Callable[[], TrainState]]:
    """Fresh tensors laid out as `like`, their pieces, and the state assembled from them.

    Fill the pieces' values (a load does), then call the third item: it returns the state
    `step` continues from on this rank. `like` itself is not modified.
    """
    layout = layout_of_step(step, like, model)
    if layout.kind == CONSOLIDATED:
        full = _fresh(consolidate(step, like))
        pieces = _placed(layout, model, _whole(full))
        return layout, pieces, lambda: shard_state(step, full)
    fresh = _fresh(like)
    pieces = _placed(layout, model, _held(layout.kind, step, fresh))
    if layout.kind == "shard_optimizer":
        plan: Any = step.plan.find("shard_optimizer")

        # The parameters of a ZeRO state view full bucket buffers (the all-gather writes there).
        def assemble() -> TrainState:
            buckets, treedef = layout_of(fresh.params, plan.bucket_bytes, plan.mesh.size(plan.axis))
            flats = buckets.pack(tree.leaves(fresh.params))
            return fresh._replace(params=tree.unflatten(treedef, buckets.leaf_views(flats)))

        return layout, pieces, assemble
    return layout, pieces, lambda: fresh


def _placed(layout: Layout, model: Any, pieces: list[Piece]) -> list[Piece]:
    for layer in layout.placing:
        pieces = place_layer(layer, pieces)
    tp = tensor_parallel_of(model)
    if tp is not None:
        pieces = place_tensor_parallel(*tp, pieces)
    return pieces


# ---- the layouts --------------------------------------------------------------------------


def _held(kind: str, step: Step, state: TrainState) -> list[Piece]:
    if kind == FULL:
        return _whole(state)
    plan: Any = step.plan.find(kind)
    assert plan is not None
    rank = plan.mesh.rank(plan.axis)
    if kind == "shard_optimizer":
        params = _whole_group("params", state.params, mirrored=True)
        opt_state = state.opt_state
        assert isinstance(opt_state, ShardedOptState)
        state_map = zero_state_map(plan, step, state.params)
        buckets, treedef = layout_of(state.params, plan.bucket_bytes, plan.mesh.size(plan.axis))
        full_params = tree.unflatten(treedef, buckets.stand_ins(None))
        opt = _fragment_pieces(opt_state.shard, state_map, rank, full_params)
    else:
        layout = plan.layout
        fragments = layout.fragments(rank)
        views = layout.fragment_views(state.params, rank)
        params = []
        for name in sorted(layout.param_order):
            key = f"params/{name}"
            shape = tuple(fragments[name].shape)
            params += range_pieces(key, shape, fragments[name].start, views[name], key)
        state_map = fsdp_state_map(plan, step, state.params)
        opt = _fragment_pieces(state.opt_state, state_map, rank, layout.meta_params())
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


def _fragment_pieces(
    local: PyTree, state_map: StateMap, rank: int, full_params: PyTree
) -> list[Piece]:
    paths, leaves, _ = tree.flatten_with_paths(local)
    full_opt = tree.unflatten(
        state_map.full.treedef,
        [torch.empty(shape, device="meta") for shape in state_map.full.shapes],
    )
    mirrors = mirrored_leaves(full_params, full_opt)
    fragment_leaves = set(state_map.fragment_leaves)
    pieces = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        key = f"opt_state/{path}"
        if i not in fragment_leaves:
            pieces.append(_whole_piece(key, leaf, mirrors.get(path)))
            continue
        start = sum(spec.shapes[i].numel() for spec in state_map.ranks[:rank])
        full_shape = tuple(state_map.full.shapes[i])
        pieces += range_pieces(key, full_shape, start, leaf.reshape(-1), mirrors.get(path))
    return pieces


def _whole(state: TrainState) -> list[Piece]:
    mirrors = mirrored_leaves(state.params, state.opt_state)
    paths, leaves, _ = tree.flatten_with_paths(state.opt_state)
    return [
        *_whole_group("params", state.params, mirrored=True),
        *_whole_group("buffers", state.buffers),
        *[
            _whole_piece(f"opt_state/{path}", leaf, mirrors.get(path))
            for path, leaf in zip(paths, leaves)
        ],
        _whole_piece("step", state.step),
        _whole_piece("key", state.key),
    ]


def _whole_group(group: str, values: PyTree, *, mirrored: bool = False) -> list[Piece]:
    paths, leaves, _ = tree.flatten_with_paths(values)
    return [
        _whole_piece(f"{group}/{path}", leaf, f"{group}/{path}" if mirrored else None)
        for path, leaf in zip(paths, leaves)
    ]


def _whole_piece(key: str, leaf: Any, mirrors: str | None = None) -> Piece:
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"checkpoint files hold tensors, but the state's leaf {key!r} is a "
            f"{type(leaf).__name__}; keep it as a tensor in the state"
        )
    return whole_piece(key, leaf, mirrors)


def _fresh(state: TrainState) -> TrainState:
    """A copy of `state` that shares no memory with it (contiguous, so flat views write through)."""

    def copy(leaf: Any) -> Any:
        return (
            leaf.detach().clone(memory_format=torch.contiguous_format)
            if isinstance(leaf, torch.Tensor)
            else leaf
        )

    return tree.map(copy, state)
