"""Catch a checkpointed call that changes a non-tensor argument, which its recompute would redo.

A checkpoint runs its function twice: in forward and again in backward. Tensor inputs are
snapshotted or replayed for the second run, but an argument that is a plain Python object is
passed as it is, so a forward that changes it (a Hugging Face ``DynamicCache`` that each
attention layer appends its keys and values to) changes it again in the recompute: the
recompute then reads the doubled cache and computes another function, which gives wrong
gradients with no error (or a shape error deep inside the model).

`Watch` takes a fingerprint of every non-tensor argument before the forward and compares it
after: the fingerprint of an object is its type and the fingerprints of its attributes (its
``__dict__`` and ``__slots__``), of a list, tuple or dict its items, and of a tensor inside it
the tensor's identity, shape and version counter (so a tensor rebound to another or updated in
place both count as a change). Values of immutable types (numbers, strings, dtypes, devices,
enums, types, functions) are compared by value or identity. The walk is bounded (depth
`MAX_DEPTH`, `MAX_NODES` objects per argument), so an argument that holds a large object graph
costs little; what lies beyond the bounds is not compared.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "MAX_NODES", "MutatedArgumentError", "Watch", "describe_argument"]

MAX_DEPTH = 6
MAX_NODES = 2000

_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    slice,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    enum.Enum,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
)


class MutatedArgumentError(ValueError):
    """A checkpointed call changed a non-tensor argument; its recompute would change it again."""


class _Fingerprint:
    """The comparable state of one object graph, with references that keep its tensors alive.

    The tensors are held so that their ids stay theirs until the comparison (a freed tensor's
    id may be reused by a new one).
    """

    def __init__(self, value: Any) -> None:
        self.tensors: list[torch.Tensor] = []
        self._nodes = 0
        self._visiting: set[int] = set()
        self.state = self._of(value, 0)

    def _of(self, value: Any, depth: int) -> Any:
        if isinstance(value, torch.Tensor):
            self.tensors.append(value)
            return ("tensor", id(value), tuple(value.shape), value._version)
        if isinstance(value, _IMMUTABLE):
            return value
        self._nodes += 1
        if depth >= MAX_DEPTH or self._nodes > MAX_NODES:
            return ("unvisited", id(value))
        if id(value) in self._visiting:
            return ("cycle", id(value))
        self._visiting.add(id(value))
        try:
            return (type(value), self._children(value, depth + 1))
        finally:
            self._visiting.discard(id(value))

    def _children(self, value: Any, depth: int) -> Any:
        if isinstance(value, (list, tuple)):
            return tuple(self._of(item, depth) for item in value)
        if isinstance(value, dict):
            return tuple((self._of(k, depth), self._of(v, depth)) for k, v in value.items())
        if isinstance(value, (set, frozenset)):
            return (len(value), frozenset(id(item) for item in value))
        attributes = dict(getattr(value, "__dict__", {}))
        for cls in type(value).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                    attributes[slot] = getattr(value, slot)
        return tuple((name, self._of(item, depth)) for name, item in attributes.items())


def describe_argument(path: Sequence[Any]) -> str:
    """Name the argument at `path` in a checkpointed call's ``(state, args, kwargs)`` inputs."""
    where, *rest = path
    if where == 2 and rest:
        name, rest = f"`{rest[0]}`", rest[1:]
    elif where == 1 and rest:
        name, rest = f"at position {rest[0]}", rest[1:]
    else:
        name = "of the call"
    return name + (f" (inside it: {'.'.join(map(str, rest))})" if rest else "")


def _watched(value: Any) -> bool:
    return not isinstance(value, (torch.Tensor, *_IMMUTABLE))


class Watch:
    """Fingerprints of a call's non-tensor arguments, taken before the call.

    Args:
        leaves: the call's argument leaves; tensors and immutable values are skipped.
        describe: ``index -> str`` naming the argument of leaf `index` in an error.
    """

    def __init__(self, leaves: Sequence[Any], describe: Callable[[int], str]) -> None:
        self._describe = describe
        self._before = {
            i: (leaf, _Fingerprint(leaf)) for i, leaf in enumerate(leaves) if _watched(leaf)
        }

    def check(self, caller: str) -> None:
        """Raise `MutatedArgumentError` if the call changed a watched argument."""
        for i, (leaf, before) in self._before.items():
            after = _Fingerprint(leaf)
            if after.state != before.state:
                raise MutatedArgumentError(_message(caller, self._describe(i), leaf))


def _message(caller: str, argument: str, value: Any) -> str:
    kind = type(value).__name__
    lines = [
        (
            f"{caller}: the checkpointed forward changed its non-tensor argument {argument} "
            f"(a {kind}). The recompute in backward runs the forward again and would change it "
            "a second time, and then compute another function (wrong gradients, or a shape "
            "error)."
        )
    ]
    if "cache" in kind.lower() or "cache" in argument.lower():
        lines.append(
            "  This looks like a key/value cache: for a Hugging Face transformers model, call "
            "it with `use_cache=False` (or set `model.config.use_cache = False`) when training "
            "with checkpointed blocks or fully_shard(reshard_after_forward='remat')."
        )
    lines.append(
        "  Pass the state the call updates as tensors and return its new value, or turn the "
        "side effect off for training."
    )
    return "\n".join(lines)
