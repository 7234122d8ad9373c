"""Optimizer state between sharded and full form: the one rule every sharded strategy follows.

A sharded step (`shard_optimizer`, `fully_shard`) initialises its optimizer on the 1-D fragments
of the parameters this rank owns; a single-process step initialises it on the full parameters.
`fscale.consolidate` and `fscale.shard_state` convert between the two without knowing the
optimizer's state type, so every optimizer (and chain) works unchanged:

1. Initialise the optimizer on full-shape meta tensors: the full state's structure and leaf
   shapes, no memory (`state_spec` without fragments).
2. Initialise it, for every rank r of N, on meta tensors shaped like rank r's fragments, with a
   `fscale.optim.Sharding` naming their places: rank r's structure and shapes. It must have the
   full state's structure (treedef).
3. A leaf whose shape is the same on every rank as in the full state is *replicated* (a step
   count; Adafactor's row and column factors, which sharded Adafactor keeps whole). Any other
   leaf is a *fragment* leaf: its pieces on ranks 0..N-1, concatenated in rank order, are the
   row-major flattening of the full leaf (a per-parameter moment is sharded exactly as its
   parameter is). A leaf that is neither is refused.

`StateMap` holds the result of 1-3 and moves a state both ways: `StateMap.shard` cuts a full
state into a rank's state (no communication), `StateMap.consolidate` joins the ranks' states
into the full one (one all-gather per dtype and device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale import tree
from fscale.plan import Context

__all__ = [
    "StateMap",
    "StateSpec",
    "check_state",
    "mirrored_leaves",
    "plan_state_init",
    "state_spec",
]

PyTree = Any


class StateSpec(NamedTuple):
    """The structure and leaf shapes of an optimizer state (non-tensor leaves have shape ())."""

    treedef: Any
    shapes: tuple[torch.Size, ...]


InitFn = Callable[..., PyTree]
"""``init(params, sharding=...) -> state``: an optimizer's init, or a plan's opt_state init."""


def plan_state_init(plan: Any, step: Any, plan_params: PyTree | None = None) -> InitFn:
    """``init(params, sharding=...)``: the optimizer state `plan`'s init makes (with the layers
    inside it) when its optimizer is initialised on `params` with `sharding`.

    Sharded layers build their state specs from it, so a user plan between them and the
    innermost layer that adds state (e.g. a copy of the params) is sharded and consolidated by
    the same rule as the optimizer's own state. `plan_params` are the parameters the plan
    itself is given, when they differ from what its optimizer sees (ZeRO gives the plan full
    parameters and the optimizer this rank's fragments); None: the same.
    """
    key = fsrandom.key(0)

    def init(params: PyTree, *, sharding: optim_lib.Sharding | None = None) -> PyTree:
        ctx = Context(optimizer=_OnGiven(params, sharding))
        given = params if plan_params is None else plan_params
        return plan.init(step, given, {}, key, ctx).opt_state

    return init


class _OnGiven:
    """An optimizer role that initialises on fixed params, whatever the plan passes it."""

    def __init__(self, params: PyTree, sharding: optim_lib.Sharding | None) -> None:
        self.params, self.sharding = params, sharding

    def init(self, optimizer: optim_lib.Optimizer, params: PyTree) -> PyTree:
        return optimizer.init(self.params, sharding=self.sharding)

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a state spec is only initialised, never stepped")


def state_spec(
    optimizer: optim_lib.Optimizer | InitFn,
    params: PyTree,
    fragments: PyTree | None = None,
    devices: Sequence[torch.device] | None = None,
) -> StateSpec:
    """What ``optimizer.init`` returns on `params`, computed on meta tensors (no memory).

    Args:
        optimizer: the optimizer, or an init function (`plan_state_init`).
        params: meta tensors: the full parameters, or (with `fragments`) a rank's 1-D fragments.
        fragments: for a rank's fragments, the tree of `fscale.flat.Fragment` naming each one's
            place in its full tensor (given to the init as its sharding); None for full tensors.
        devices: per leaf of `params`, the device of the real tensor. An optimizer whose init
            needs real values (`offload_optimizer` copies them to the host) is then initialised
            on zeros there instead; without `devices` its error propagates.

    Returns:
        The state's structure and leaf shapes.
    """
    init = optimizer.init if isinstance(optimizer, optim_lib.Optimizer) else optimizer
    sharding = None
    if fragments is not None:
        # Only shapes are read, so the init's reductions need not reach the other ranks.
        sharding = optim_lib.Sharding(fragments, _local_sum)
    try:
        state = init(params, sharding=sharding)
    except (NotImplementedError, RuntimeError):
        if devices is None:
            raise
        leaves, treedef = tree.flatten(params)
        real = [
            torch.zeros(t.shape, dtype=t.dtype, device=device) for t, device in zip(leaves, devices)
        ]
        state = init(tree.unflatten(treedef, real), sharding=sharding)
    leaves, treedef = tree.flatten(state)
    return StateSpec(treedef, tuple(_shape(leaf) for leaf in leaves))


def check_state(caller: str, what: str, value: PyTree, spec: StateSpec, why: str) -> None:
    """Raise a ValueError naming the first difference between `value` and `spec`.

    Args:
        caller: the public function, for the message.
        what: how the caller's user names `value` (e.g. ``"state.opt_state"``).
        value: an optimizer state.
        spec: the structure and shapes it must have.
        why: the likely cause and the fix, appended to the message.
    """
    leaves, value_def = tree.flatten(value)
    if value_def != spec.treedef:
        raise ValueError(
            f"{caller}: `{what}` has structure {value_def} but {spec.treedef} was expected; {why}"
        )
    if all(_shape(leaf) == shape for leaf, shape in zip(leaves, spec.shapes)):
        return  # every step: the leaves' paths are only spelled out for the message
    paths, leaves, _ = tree.flatten_with_paths(value)
    for path, leaf, shape in zip(paths, leaves, spec.shapes):
        if _shape(leaf) != shape:
            raise ValueError(
                f"{caller}: `{what}` leaf {path!r} has shape {tuple(_shape(leaf))} but "
                f"{tuple(shape)} was expected; {why}"
            )


class StateMap:
    """How an optimizer's state is split over N ranks (see the module docstring).

    Attributes:
        full: the full state's spec.
        ranks: every rank's spec, ``ranks[r]`` for rank r.
        fragment_leaves: the indices of the leaves held in per-rank pieces, ascending.

    Raises:
        ValueError: a rank's state has another structure than the full one, or a leaf's pieces
            do not add up to the full leaf (the state is neither replicated nor per-element).
    """

    def __init__(self, full: StateSpec, ranks: Sequence[StateSpec]) -> None:
        self.full = full
        self.ranks = list(ranks)
        for spec in self.ranks:
            if spec.treedef != full.treedef:
                raise ValueError(
                    "the optimizer's state has another structure on shards than on full tensors "
                    f"({spec.treedef} vs {full.treedef}), so it cannot be consolidated by the "
                    "generic rule"
                )
        fragment_leaves = []
        for i, shape in enumerate(full.shapes):
            if all(spec.shapes[i] == shape for spec in self.ranks):
                continue
            pieces = sum(spec.shapes[i].numel() for spec in self.ranks)
            if pieces != shape.numel():
                raise ValueError(
                    f"cannot map optimizer state leaf {i}: the ranks hold {pieces} elements of a "
                    f"tensor of shape {tuple(shape)}; state leaves must be either replicated or "
                    "per-element pieces of the parameter fragments"
                )
            fragment_leaves.append(i)
        self.fragment_leaves = tuple(fragment_leaves)

    @property
    def num_shards(self) -> int:
        return len(self.ranks)

    def _start(self, leaf: int, rank: int) -> int:
        """Where `rank`'s piece of fragment leaf `leaf` starts in the full leaf's flattening."""
        return sum(spec.shapes[leaf].numel() for spec in self.ranks[:rank])

    def shard(self, full_state: PyTree, rank: int) -> PyTree:
        """`rank`'s state cut from `full_state` (every leaf a copy; nothing communicated)."""
        leaves, treedef = tree.flatten(full_state)
        mine = self.ranks[rank].shapes
        fragment_leaves = set(self.fragment_leaves)
        out = []
        for i, leaf in enumerate(leaves):
            if i in fragment_leaves:
                start = self._start(i, rank)
                piece = leaf.reshape(-1)[start : start + mine[i].numel()]
                out.append(piece.reshape(mine[i]).clone())
            else:
                out.append(_copy(leaf))
        return tree.unflatten(treedef, out)

    def consolidate(
        self,
        state: PyTree,
        rank: int,
        all_gather: Callable[[torch.Tensor], torch.Tensor],
        *,
        copy_replicated: bool = False,
    ) -> PyTree:
        """The full state joined from every rank's `state` (a collective: all ranks call it).

        Args:
            state: this rank's state (checked against ``ranks[rank]`` by the caller).
            rank: this rank.
            all_gather: gathers a 1-D tensor of equal length from every rank into one 1-D tensor,
                in rank order; it is called once per dtype and device of the fragment leaves.
            copy_replicated: copy the replicated leaves instead of sharing them with `state`.

        Returns:
            The state with the full structure and shapes.
        """
        leaves, treedef = tree.flatten(state)
        out = [_copy(leaf) if copy_replicated else leaf for leaf in leaves]
        for indices in _by_dtype_and_device(leaves, self.fragment_leaves):
            joined = self._gather_pieces(leaves, indices, rank, all_gather)
            for i, value in zip(indices, joined):
                out[i] = value
        return tree.unflatten(treedef, out)

    def _gather_pieces(
        self,
        leaves: Sequence[torch.Tensor],
        indices: Sequence[int],
        rank: int,
        all_gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """All ranks' pieces of the leaves `indices` (one dtype), joined into full tensors."""
        # This rank's pieces packed back to back, zero-padded to the longest rank's total so
        # that one all-gather of equal lengths carries them all.
        sizes = [[spec.shapes[i].numel() for i in indices] for spec in self.ranks]
        width = max(max(sum(row) for row in sizes), 1)
        first = leaves[indices[0]]
        mine = torch.zeros(width, dtype=first.dtype, device=first.device)
        torch.cat([leaves[i].reshape(-1) for i in indices], out=mine[: sum(sizes[rank])])
        gathered = all_gather(mine).view(self.num_shards, width)
        offsets = [0] * self.num_shards
        joined = []
        for k, i in enumerate(indices):
            pieces = []
            for r in range(self.num_shards):
                pieces.append(gathered[r, offsets[r] : offsets[r] + sizes[r][k]])
                offsets[r] += sizes[r][k]
            joined.append(torch.cat(pieces).view(self.full.shapes[i]))
        return joined


def mirrored_leaves(params: PyTree, opt_state: PyTree) -> dict[str, str]:
    """``{optimizer state path: params/ key}`` of the optimizer state leaves that mirror a
    parameter: inside a subtree with the params' structure, of that parameter's shape."""
    params_def = tree.structure(params)
    param_paths, param_leaves, _ = tree.flatten_with_paths(params)

    def is_params(node: Any) -> bool:
        return tree.structure(node) == params_def

    raw_paths, items, _ = optree.tree_flatten_with_path(
        opt_state, is_leaf=is_params, none_is_leaf=False
    )
    found = {}
    for outer, item in zip(raw_paths, items):
        if not is_params(item):
            continue
        inner_paths, leaves, _ = optree.tree_flatten_with_path(item, none_is_leaf=False)
        for inner, leaf, name, param in zip(inner_paths, leaves, param_paths, param_leaves):
            if isinstance(leaf, torch.Tensor) and tuple(leaf.shape) == tuple(param.shape):
                found[tree.path_str((*outer, *inner))] = f"params/{name}"
    return found


def _local_sum(t: torch.Tensor) -> torch.Tensor:
    return t


def _shape(leaf: Any) -> torch.Size:
    return leaf.shape if isinstance(leaf, torch.Tensor) else torch.Size()


def _copy(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _by_dtype_and_device(leaves: Sequence[torch.Tensor], indices: Sequence[int]) -> list[list[int]]:
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i in indices:
        groups.setdefault((leaves[i].dtype, leaves[i].device), []).append(i)
    return list(groups.values())
