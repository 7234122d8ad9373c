"""The optimizer type, the `Sharding` of sharded callers, and the combinators `step` and `chain`.

An `Optimizer` is a NamedTuple of pure functions over explicit pytree state, in the manner of
optax's ``GradientTransformation``:

- ``init(params, *, sharding=None) -> state``
- ``update(grads, state, params=None, *, sharding=None) -> (updates, new_state)``: additive
  updates, ``new_params = apply_updates(params, updates)``.
- ``apply(grads, state, params, *, sharding=None, donate=False) -> (new_params, new_state)`` or
  None: the bit-exact path. torch.optim updates parameters with fused multiply-adds
  (``param.add_(update, alpha=-lr)``), so ``params + updates`` rounded separately differs from
  it in the last bit; every real optimizer therefore computes new params directly and derives
  `update` from that. Gradient transforms (clipping, scaling) have ``apply=None``.
- ``pointwise``: True when every output element depends only on the same element of the grads,
  params and state, so a sharded wrapper may run the optimizer on any slice unchanged.

`Sharding` is how sharded wrappers run non-pointwise optimizers on pieces of tensors: it says
which piece of which full tensor each leaf is, and how to sum a statistic across the ranks that
share the pieces.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import optree
import torch

from fscale import tree
from fscale.flat import Fragment

__all__ = [
    "EmptyState",
    "Optimizer",
    "Sharding",
    "apply_updates",
    "chain",
    "counted_only",
    "step",
]

PyTree = Any


class Optimizer(NamedTuple):
    """A pair of pure functions (`init`, `update`), an optional exact `apply`, and `pointwise`.

    See the module docstring for the contract of each field. Inputs are never mutated unless
    ``donate=True`` is passed to `apply` (the caller then gives up `params` and `state`, whose
    buffers may be updated in place, as torch.optim does).
    """

    init: Callable[..., Any]
    update: Callable[..., tuple[PyTree, Any]]
    apply: Callable[..., tuple[PyTree, Any]] | None
    pointwise: bool
    description: str = ""

    def __repr__(self) -> str:
        # The call that made it (``adamw(0.0003, weight_decay=0.1)``), so `print(step)` says
        # which optimizer a step runs.
        return self.description or f"Optimizer(pointwise={self.pointwise})"


F = TypeVar("F", bound=Callable[..., Optimizer])


def described(factory: F) -> F:
    """Record on each Optimizer `factory` returns the call that made it, as its repr."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Optimizer:
        optimizer = factory(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return optimizer
        parts = []
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                parts.extend(_describe(v) for v in value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                parts.extend(f"{k}={_describe(v)}" for k, v in value.items())
            else:
                parts.append(f"{name}={_describe(value)}")
        return tree.with_fields(optimizer, description=f"{factory.__name__}({', '.join(parts)})")

    return make  # type: ignore[return-value]


def _describe(value: Any) -> str:
    if isinstance(value, Optimizer):
        return repr(value)
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__name__", type(value).__name__)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class Sharding(NamedTuple):
    """Where each leaf sits in a full tensor, and how to complete a sum across ranks.

    Args:
        fragments: a pytree with the params' structure whose leaves are `fscale.flat.Fragment`:
            the leaf given to the optimizer is elements ``[start, stop)`` (possibly none) of the
            row-major flattening of a full tensor of ``shape``, as a 1-D tensor.
        all_reduce: ``t -> t`` summing a tensor across the ranks that share the pieces; a
            sharded wrapper passes ``lambda t: fscale.distributed.all_reduce(t, axis)``.

    Non-pointwise optimizers compute partial statistics over their fragments and complete them
    with one batched `all_reduce` per reduction round, leaving out the fragments that are not
    `Fragment.counted` (`counted_only`); pointwise ones ignore the sharding. A fragment may be a
    range of a tensor-parallel shard (`Fragment.block`; `Fragment.element_indices` places its
    elements in the full tensor). ``sharding=None`` means every leaf is a whole, local tensor.
    """

    fragments: PyTree
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


def is_fragment(x: Any) -> bool:
    return isinstance(x, Fragment)


def resolve_sharding(
    name: str, sharding: Sharding | None, leaves: list[torch.Tensor], treedef: optree.PyTreeSpec
) -> tuple[list[Fragment], Callable[[torch.Tensor], torch.Tensor]]:
    """Per-leaf fragments and the all-reduce of `sharding` (whole local tensors when None)."""
    if sharding is None:
        return [Fragment(t.shape, 0, t.numel()) for t in leaves], _identity
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"{name}: `sharding` must be an fscale.optim.Sharding, got {type(sharding)}"
        )
    fragments, fragments_def = optree.tree_flatten(
        sharding.fragments, is_leaf=is_fragment, none_is_leaf=False
    )
    if fragments_def != treedef or not all(map(is_fragment, fragments)):
        raise ValueError(
            f"{name}: `sharding.fragments` has structure {fragments_def} but the params have "
            f"structure {treedef}; give one fscale.flat.Fragment per parameter leaf"
        )
    # A shape given as a tuple is accepted: everything downstream calls `shape.numel()`.
    fragments = [
        f if isinstance(f.shape, torch.Size) else tree.with_fields(f, shape=torch.Size(f.shape))
        for f in fragments
    ]
    for i, (frag, leaf) in enumerate(zip(fragments, leaves)):
        block = frag.block
        if block is not None and not (
            0 <= block.dim < len(frag.shape)
            and 0 <= block.index < block.size
            and frag.shape[block.dim] % (block.size * block.parts) == 0
        ):
            raise ValueError(
                f"{name}: leaf {i}'s fragment {frag} names a shard that a tensor of its shape "
                "does not have; `block.dim` must be one of its dims, cut evenly into "
                "`block.parts` blocks of `block.size` chunks, `block.index` < `block.size`"
            )
        held = frag.shape if block is None else block.shape_of(frag.shape)
        if leaf.numel() != frag.numel or not 0 <= frag.start <= frag.stop <= held.numel():
            raise ValueError(
                f"{name}: leaf {i} has {leaf.numel()} elements but its fragment is {frag}; "
                "a leaf must hold exactly elements [start, stop) of a tensor of `shape` (of its "
                "shard `block`, if given)"
            )
    return fragments, sharding.all_reduce


def counted_only(values: torch.Tensor, fragments: Sequence[Fragment]) -> torch.Tensor:
    """`values`, one per fragment (or several rounds of one per fragment, concatenated), with
    the entries of fragments that are not `counted` set to zero: a replica's statistic, which
    another rank's copy already adds to the sum across ranks."""
    if all(f.counted for f in fragments):
        return values
    mask = torch.tensor([f.counted for f in fragments], device=values.device)
    return torch.where(mask.repeat(values.numel() // len(fragments)), values, 0)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf by leaf, in the params' dtypes (new tensors).

    Raises:
        ValueError: if the two trees have different structures.
    """
    with torch.no_grad():
        return tree.map(lambda p, u: p + u.to(p.dtype), params, updates)


def step(
    optimizer: Optimizer,
    grads: PyTree,
    state: Any,
    params: PyTree,
    *,
    sharding: Sharding | None = None,
    donate: bool = False,
) -> tuple[PyTree, Any]:
    """One optimizer step: ``(new_params, new_state)``.

    Uses ``optimizer.apply`` (bit-exact, in place on donated buffers) when present, else
    ``update`` followed by `apply_updates`.

    Args:
        optimizer: the optimizer.
        grads, state, params: the gradients, the optimizer state and the current params.
        sharding: where each leaf sits in a full tensor, for sharded callers (see `Sharding`).
        donate: give `params` and `state` up so their buffers may be updated in place.

    Returns:
        The new params and the new state.
    """
    if optimizer.apply is not None:
        return optimizer.apply(grads, state, params, sharding=sharding, donate=donate)
    updates, new_state = optimizer.update(grads, state, params, sharding=sharding)
    return apply_updates(params, updates), new_state


@described
def chain(*optimizers: Optimizer) -> Optimizer:
    """Run gradients through `optimizers` in order; the last one produces the new params.

    ``chain(clip_by_global_norm(1.0), adamw(3e-4))`` clips then applies AdamW exactly. The state
    is a tuple of the states in argument order. ``chain.apply`` is the last optimizer's `apply`
    after the others' `update` (None if the last has no `apply`).

    Raises:
        ValueError: if no optimizer is given.
        TypeError: if an argument is not an `Optimizer`.
    """
    if not optimizers:
        raise ValueError("chain: give at least one optimizer")
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, Optimizer):
            raise TypeError(f"chain: argument {i} is a {type(opt).__name__}, not an Optimizer")

    def init(params: PyTree, *, sharding: Sharding | None = None) -> tuple[Any, ...]:
        return tuple(opt.init(params, sharding=sharding) for opt in optimizers)

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(optimizers):
            raise ValueError(
                f"chain: `state` must be the tuple of {len(optimizers)} states that init "
                f"returned, got {type(state).__name__}"
            )

    def update(
        grads: PyTree,
        state: tuple[Any, ...],
        params: PyTree = None,
        *,
        sharding: Sharding | None = None,
    ) -> tuple[PyTree, tuple[Any, ...]]:
        check(state)
        new_states = []
        for opt, opt_state in zip(optimizers, state):
            grads, opt_state = opt.update(grads, opt_state, params, sharding=sharding)
            new_states.append(opt_state)
        return grads, tuple(new_states)

    last = optimizers[-1]
    head = optimizers[:-1]

    def head_update(
        grads: PyTree, state: tuple[Any, ...], params: PyTree, *, sharding: Sharding | None
    ) -> tuple[PyTree, tuple[Any, ...]]:
        new_states = []
        for opt, opt_state in zip(head, state):
            grads, opt_state = opt.update(grads, opt_state, params, sharding=sharding)
            new_states.append(opt_state)
        return grads, tuple(new_states)

    def chained_apply(
        grads: PyTree,
        state: tuple[Any, ...],
        params: PyTree,
        *,
        sharding: Sharding | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, tuple[Any, ...]]:
        check(state)
        grads, head_states = head_update(grads, state[:-1], params, sharding=sharding)
        new_params, last_state = last.apply(  # type: ignore[misc]
            grads, state[-1], params, sharding=sharding, donate=donate
        )
        return new_params, (*head_states, last_state)

    return Optimizer(
        init=init,
        update=update,
        apply=chained_apply if last.apply is not None else None,
        pointwise=all(opt.pointwise for opt in optimizers),
    )
