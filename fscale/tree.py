"""Pytree helpers over optree: thin, named wrappers so the library reads the same everywhere.

Every pytree in fscale (params, buffers, optimizer state, grads) is an optree tree whose
leaves are tensors; `None` is an empty subtree. Flat buffers of many tensors are in
`fscale.flat`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree

__all__ = [
    "flatten",
    "flatten_with_paths",
    "leaves",
    "map",
    "map_with_path",
    "path_str",
    "paths",
    "same_structure",
    "structure",
    "unflatten",
    "with_fields",
]

PyTree = Any
Record = TypeVar("Record", bound=tuple)

# `None` is an empty subtree (as in JAX and optax), so a missing state or a frozen group can be
# written as `None` without special cases.
_NONE_IS_LEAF = False


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of `tree` in optree's canonical order."""
    return optree.tree_leaves(tree, none_is_leaf=_NONE_IS_LEAF)


def structure(tree: PyTree) -> optree.PyTreeSpec:
    """The structure (treedef) of `tree`."""
    return optree.tree_structure(tree, none_is_leaf=_NONE_IS_LEAF)


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """`(leaves, treedef)` of `tree`."""
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF)


def unflatten(treedef: optree.PyTreeSpec, leaf_values: Sequence[Any]) -> PyTree:
    """Rebuild a tree of shape `treedef` from `leaf_values` (inverse of `flatten`)."""
    leaf_values = list(leaf_values)
    if len(leaf_values) != treedef.num_leaves:
        raise ValueError(
            f"unflatten: the tree structure has {treedef.num_leaves} leaves but "
            f"{len(leaf_values)} values were given"
        )
    return optree.tree_unflatten(treedef, leaf_values)


def same_structure(a: Any, b: Any) -> bool:
    """Whether treedefs `a` and `b` describe the same structure.

    Inside a ``torch.compile`` trace, optree's treedefs are stood in for by Dynamo's Python
    ones, and a frame Dynamo runs eagerly between graphs hands the traced code optree's own:
    the two kinds never compare equal with ``==``, and Dynamo's also tells dicts apart by
    insertion order, which optree ignores. Two optree treedefs compare with ``==``; otherwise
    node types and entries (dict keys, sorted; field names) are compared level by level.
    """
    if isinstance(a, optree.PyTreeSpec) and isinstance(b, optree.PyTreeSpec):
        return a == b
    return _node_shape(a) == _node_shape(b)


def _node_shape(spec: Any) -> tuple[Any, ...]:
    return (spec.type, tuple(spec.entries()), tuple(_node_shape(c) for c in spec.children()))


def path_str(path: Sequence[Any]) -> str:
    """Readable form of an optree path, e.g. ``('blocks', 0, 'w')`` -> ``"blocks.0.w"``."""
    return ".".join(str(p) for p in path) if path else "<root>"


def flatten_with_paths(tree: PyTree) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """`(paths, leaves, treedef)`; each path is a dotted string naming the leaf."""
    raw_paths, leaf_values, treedef = optree.tree_flatten_with_path(
        tree, none_is_leaf=_NONE_IS_LEAF
    )
    return [path_str(p) for p in raw_paths], leaf_values, treedef


def paths(tree: PyTree) -> list[str]:
    """Dotted paths of the leaves of `tree`, in leaf order."""
    return flatten_with_paths(tree)[0]


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply `fn` leaf-wise over `tree` and trees of the same structure in `rest`.

    A structure mismatch raises a ValueError naming both structures.
    """
    try:
        return optree.tree_map(fn, tree, *rest, none_is_leaf=_NONE_IS_LEAF)
    except ValueError as error:
        shapes = ", ".join(str(structure(t)) for t in (tree, *rest))
        raise ValueError(f"tree map over trees of different structure: {shapes}") from error


def map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Like `map`, with the leaf's dotted path as the first argument of `fn`."""
    return optree.tree_map_with_path(
        lambda p, *xs: fn(path_str(p), *xs), tree, *rest, none_is_leaf=_NONE_IS_LEAF
    )


def with_fields(record: Record, **changes: Any) -> Record:
    """A copy of the named tuple `record` with some fields changed: ``record._replace(...)``.

    Built by calling the class with every field, because Dynamo before torch 2.13 rebuilds the
    result of `_replace` wrongly where a compiled step resumes after a graph break (2.11 passed
    on an empty tuple, 2.9 failed an internal assertion). fscale's step code uses this instead.

    Raises:
        TypeError: a name in `changes` is not a field of `record`.
    """
    cls = type(record)
    fields = cls._fields  # type: ignore[attr-defined]
    unknown = [name for name in changes if name not in fields]
    if unknown:
        raise TypeError(f"with_fields: {cls.__name__} has no field(s) {sorted(unknown)}")
    # By name, not by zipping: Dynamo cannot step a zip in a frame it resumes.
    return cls(*[changes[name] if name in changes else getattr(record, name) for name in fields])
