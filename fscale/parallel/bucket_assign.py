"""Which parameter leaves go in which gradient bucket, in the order backward completes them.

Buckets are filled in reverse leaf order, because backward produces the gradients of the last
layers first. A bucket holds leaves of one dtype and device; a leaf larger than the cap gets a
bucket of its own. Each bucket is a `FlatBuffer` padded to a multiple of the number of shards,
so reduce-scatter gives every rank an equal slice. The assignment depends only on the leaves'
shapes, dtypes, devices and order of use, and is cached for them (`fscale.parallel.buckets`
collects the gradients into the buffers; `fscale.parallel.bucket_layout` aligns ZeRO's).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fscale.flat import FlatBuffer

__all__ = ["Bucket", "assign_buckets", "forward_order"]


class Bucket:
    """A group of leaves packed into one flat buffer layout.

    Attributes:
        index: position of the bucket in reduction order (0 = first to complete in backward).
        leaf_indices: indices into the flattened parameter list, in packing order.
        layout: `FlatBuffer` describing the packing (shapes and offsets only: its ``data``
            is on the meta device; ``layout.device`` is where the real buffers live).
    """

    def __init__(self, index: int, leaf_indices: list[int], layout: FlatBuffer) -> None:
        self.index = index
        self.leaf_indices = leaf_indices
        self.layout = layout

    @property
    def numel(self) -> int:
        return self.layout.numel

    def __repr__(self) -> str:
        return f"Bucket({self.index}, leaves={self.leaf_indices}, {self.layout.numel} elements)"


def assign_buckets(
    leaves: Sequence[torch.Tensor],
    bucket_bytes: int,
    num_shards: int = 1,
    order: Sequence[int] | None = None,
    first_bucket_bytes: int | None = None,
) -> list[Bucket]:
    """Group `leaves` into buckets of at most `bucket_bytes`, last-used leaves first.

    Only the leaves' shapes, dtypes and devices matter; the result is cached for a given
    signature, so calling this every step costs a dictionary look-up. The buckets' layouts
    hold no memory (their ``data`` lives on the meta device).

    Args:
        leaves: the parameter leaves.
        bucket_bytes: cap on a bucket's size in bytes; a larger leaf gets its own bucket.
        num_shards: each bucket is padded to a multiple of this.
        order: leaf indices in the order the forward pass uses them (default: leaf order);
            see `forward_order`.
        first_bucket_bytes: a smaller cap for the first bucket, so the first collective starts
            early in backward instead of after a whole `bucket_bytes` of gradients (torch DDP
            uses 1 MiB); default `bucket_bytes`.

    Returns:
        Buckets in the order backward completes them.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"`bucket_bytes` must be positive, got {bucket_bytes}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"`num_shards` must be a positive int, got {num_shards!r}")
    signature = tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)
    order = tuple(range(len(leaves))) if order is None else tuple(order)
    if sorted(order) != list(range(len(leaves))):
        raise ValueError("assign_buckets: `order` must be a permutation of the leaf indices")
    first = bucket_bytes if first_bucket_bytes is None else min(first_bucket_bytes, bucket_bytes)
    if first <= 0:
        raise ValueError(f"`first_bucket_bytes` must be positive, got {first_bucket_bytes}")
    return _assign_buckets(signature, bucket_bytes, num_shards, order, first)


def forward_order(params: Any) -> list[int]:
    """Leaf indices of `params` in the order a model most likely uses them.

    optree visits dict keys sorted, but `functionalize` returns the parameters in module
    registration order, which is (for sequential models) the order of use; buckets built in the
    reverse of that order complete earliest in backward. For a dict, this returns the leaf
    indices in key insertion order; for any other tree, leaf order.
    """
    if not isinstance(params, dict):
        return list(range(len(optree.tree_paths(params, none_is_leaf=False))))
    keys = tuple(params)
    structure = optree.tree_structure(params, none_is_leaf=False)  # pyright: ignore[reportArgumentType]
    if torch.compiler.is_compiling():
        # Dynamo traces an lru_cache'd function as if it had no cache, and warns that it may be
        # wrong to: the order depends on the structure alone, so the trace computes it itself.
        return list(_dict_forward_order(structure, keys))
    # Determined by the structure and the key order: computed once per model, not per step.
    return list(_cached_dict_forward_order(structure, keys))


def _dict_forward_order(structure: optree.PyTreeSpec, keys: tuple[Any, ...]) -> tuple[int, ...]:
    by_key: dict[Any, list[int]] = {}
    for index, path in enumerate(structure.paths()):
        by_key.setdefault(path[0], []).append(index)
    return tuple(index for key in keys for index in by_key.get(key, []))


_cached_dict_forward_order = functools.lru_cache(maxsize=64)(_dict_forward_order)


@functools.lru_cache(maxsize=64)
def _assign_buckets(
    signature: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...],
    bucket_bytes: int,
    num_shards: int,
    order: tuple[int, ...],
    first_bucket_bytes: int,
) -> list[Bucket]:
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_kind: tuple[torch.dtype, torch.device] | None = None
    for i in reversed(order):
        shape, dtype, device = signature[i]
        kind = (dtype, device)
        size = torch.Size(shape).numel() * dtype.itemsize
        cap = first_bucket_bytes if not groups else bucket_bytes
        if current and (kind != current_kind or current_bytes + size > cap):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
        current_kind = kind
    if current:
        groups.append(current)
    buckets = []
    for b, indices in enumerate(groups):
        shapes = [
            torch.empty(signature[i][0], dtype=signature[i][1], device="meta") for i in indices
        ]
        total = sum(t.numel() for t in shapes)
        padded = -(-max(total, 1) // num_shards) * num_shards
        layout = FlatBuffer(
            shapes, num_shards, data=torch.empty(padded, dtype=shapes[0].dtype, device="meta")
        )
        layout.device = signature[indices[0]][2]  # where the bucket's real buffers live
        buckets.append(Bucket(b, indices, layout))
    return buckets
