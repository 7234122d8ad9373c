"""Save policies: which intermediates a checkpoint keeps instead of recomputing, and `name`.

A policy selects operations whose outputs the forward keeps: `save_matmuls()` every matrix
product, `save_names("attn_out")` the operations whose results fn marks with
`name(value, "attn_out")`. Both sides work below autograd, as `TorchDispatchMode`s keyed by
(operator, how many times it ran before in this call), which is the same in the forward and in
the recompute: `recording(policy)` keeps the selected outputs during the forward, `ReplayOps`
returns them in place of running their operations during the recompute, so the recomputed graph
is the forward's graph and gradients are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fscale import tree

__all__ = [
    "KeptOutputs",
    "RecordOps",
    "ReplayOps",
    "SavePolicy",
    "name",
    "recording",
    "save_matmuls",
    "save_names",
    "storage_key",
    "tensor_leaves",
]

# (operator, occurrence) -> (its kept outputs, the shapes of its tensor arguments)
KeptOutputs = dict[tuple[Any, int], tuple[Any, list[tuple[int, ...]]]]


@dataclasses.dataclass(frozen=True)
class SavePolicy:
    """Which intermediate values a checkpoint keeps from forward instead of recomputing.

    Build one with `save_names` or `save_matmuls`; combine with ``|``.

    Attributes:
        names: values marked inside fn with `name(value, n)` for `n` in `names`.
        ops: ATen operator names (``"mm"``, ``"addmm"``...) whose outputs are all kept.
    """

    names: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()

    def __or__(self, other: SavePolicy) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return SavePolicy(self.names | other.names, self.ops | other.ops)


def save_names(*names: str) -> SavePolicy:
    """A policy that keeps the values fn marks with `name(value, n)` for each `n` in `names`.

    The operation that produced a marked value is not run again in backward; its outputs are
    kept from forward (all of them: an attention kernel's log-sum-exp is kept with its output,
    because its backward needs both). Mark the direct result of the expensive operation, e.g.
    ``name(F.scaled_dot_product_attention(q, k, v), "attn")``: marking a reshape of it keeps the
    reshape's result and still recomputes the attention.

    Cost: while a checkpointed call with names runs forward, every intermediate of that call is
    held until it returns (one block's activations, as without checkpointing), because a value
    can be marked after the operation that made it and before its siblings are freed.

    Args:
        *names: the names to keep; at least one.

    Returns:
        A `SavePolicy`.

    Raises:
        ValueError: if no name is given.
        TypeError: if a name is not a string.
    """
    if not names:
        raise ValueError("save_names: give at least one name, e.g. save_names('attn_out')")
    for value in names:
        if not isinstance(value, str):
            raise TypeError(f"save_names: names must be strings, got {value!r}")
    return SavePolicy(names=frozenset(names))


_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def save_matmuls() -> SavePolicy:
    """A policy that keeps the output of every matrix product (``mm``, ``addmm``, ``bmm``...).

    The backward then recomputes only the cheap element-wise work between products (norms,
    activations, softmax), at the memory cost of one output per product.

    Returns:
        A `SavePolicy`.
    """
    return SavePolicy(ops=_MATMUL_OPS)


class _NameStack(threading.local):
    def __init__(self) -> None:
        self.recorders: list[RecordOps] = []


_ACTIVE = _NameStack()


def name(value: torch.Tensor, label: str) -> torch.Tensor:
    """Mark `value` as the intermediate called `label` for a checkpoint's `save_names` policy.

    An identity: it returns `value` itself. Outside a checkpoint whose policy lists `label`
    (or under `no_grad`, where checkpoints just run) it does nothing else.

    Args:
        value: a tensor computed inside the checkpointed function.
        label: the name a `save_names` policy refers to.

    Returns:
        `value`.

    Raises:
        TypeError: if `value` is not a tensor or `label` is not a string.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"name: `value` must be a tensor, got {type(value).__name__}")
    if not isinstance(label, str):
        raise TypeError(f"name: `label` must be a string, got {label!r}")
    if _ACTIVE.recorders:
        _ACTIVE.recorders[-1].mark(value, label)
    return value


def storage_key(t: torch.Tensor) -> int:
    """An id of `t`'s storage: views and in-place results share their base's."""
    return t.untyped_storage().data_ptr()


def tensor_leaves(x: Any) -> list[torch.Tensor]:
    """The tensor leaves of the pytree `x`, in order."""
    return [v for v in tree.leaves(x) if isinstance(v, torch.Tensor)]


class RecordOps(TorchDispatchMode):
    """Forward side of a policy: keep the outputs of the operations the policy selects.

    Operations are keyed by (operator, how many times it ran before in this call), the same in
    forward and in the recompute. To map a named value back to the operation that allocated its
    storage, every output is held until the call ends when the policy has names.
    """

    def __init__(self, policy: SavePolicy) -> None:
        super().__init__()
        self.policy = policy
        self.occurrences: dict[Any, int] = {}
        self.kept: dict[tuple[Any, int], Any] = {}
        self.held: dict[tuple[Any, int], Any] = {}
        self.versions: dict[tuple[Any, int], list[int]] = {}
        self.arg_shapes: dict[tuple[Any, int], list[tuple[int, ...]]] = {}
        self.producer: dict[int, tuple[Any, int]] = {}
        self.seen_names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op_key = (func, self.occurrences.get(func, 0))
        self.occurrences[func] = op_key[1] + 1
        outputs = tensor_leaves(out)
        if not outputs:
            return out
        if func.overloadpacket.__name__ in self.policy.ops:
            self._hold(op_key, func, args, kwargs, out, outputs)
            self.kept[op_key] = out
        elif self.policy.names:
            # Only fresh allocations name an operation: a view or in-place op shares its
            # input's storage, and the allocating op is the one worth not running again.
            input_storages = {storage_key(t) for t in tensor_leaves((args, kwargs))}
            fresh = [t for t in outputs if storage_key(t) not in input_storages]
            if fresh:
                self._hold(op_key, func, args, kwargs, out, outputs)
                for t in fresh:
                    if t.numel():
                        self.producer[storage_key(t)] = op_key
        return out

    def _hold(self, op_key, func, args, kwargs, out, outputs) -> None:  # type: ignore[no-untyped-def]
        self.held[op_key] = out
        self.versions[op_key] = [t._version for t in outputs]
        self.arg_shapes[op_key] = [tuple(t.shape) for t in tensor_leaves((args, kwargs))]

    def mark(self, value: torch.Tensor, label: str) -> None:
        self.seen_names.add(label)
        if label not in self.policy.names or not value.numel():
            return
        op_key = self.producer.get(storage_key(value))
        if op_key is not None:  # None: an input of fn, which is kept anyway
            self.kept[op_key] = self.held[op_key]

    def finish(self) -> KeptOutputs:
        """The kept outputs, without those fn modified in place after making them."""
        missing = self.policy.names - self.seen_names
        if missing:
            raise ValueError(
                f"checkpoint: policy names {sorted(missing)} were never marked with "
                f"fscale.remat.name(...) during the forward of the checkpointed function; names "
                f"marked were {sorted(self.seen_names)}. Fix the spelling in save_names(...) or "
                "mark the value inside the checkpointed function."
            )
        # A kept output modified in place after its op ran holds the modified value; replaying it
        # would apply the modification twice, so such ops are recomputed instead.
        return {
            op_key: (out, self.arg_shapes[op_key])
            for op_key, out in self.kept.items()
            if [t._version for t in tensor_leaves(out)] == self.versions[op_key]
        }


class ReplayOps(TorchDispatchMode):
    """Backward side of a policy: return the kept outputs instead of running their operations."""

    def __init__(self, kept: KeptOutputs) -> None:
        super().__init__()
        self.kept = kept
        self.occurrences: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        op_key = (func, self.occurrences.get(func, 0))
        self.occurrences[func] = op_key[1] + 1
        entry = self.kept.get(op_key)
        if entry is None:
            return func(*args, **kwargs)
        out, arg_shapes = entry
        if [tuple(t.shape) for t in tensor_leaves((args, kwargs))] != arg_shapes:
            raise RuntimeError(
                f"checkpoint: the recompute of the checkpointed function diverged from its "
                f"forward at {func} (call {op_key[1]}): different argument shapes. The function "
                "must run the same operations when called again with the same inputs."
            )
        return out


@contextlib.contextmanager
def recording(policy: SavePolicy) -> Iterator[RecordOps]:
    """Record the forward of a checkpointed call under `policy`; `name` marks values for it."""
    recorder = RecordOps(policy)
    _ACTIVE.recorders.append(recorder)
    try:
        with recorder:
            yield recorder
    finally:
        _ACTIVE.recorders.pop()
