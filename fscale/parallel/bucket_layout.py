"""The aligned bucket layout of `shard_optimizer`: where every trainable leaf lives, who owns it.

Trainable leaves are grouped into buckets of about ``bucket_bytes`` (`assign_buckets`, in
reverse order of use, each device's leaves apart). Each bucket is one flat buffer in which
every leaf starts on a 64-byte boundary and whose length is N equal shards of a multiple of
64 bytes; rank r owns shard r. The alignment makes sharding exact: torch's fused CPU optimizer
kernels run a vectorised body and a scalar tail over each tensor and the two round
differently, so a slice cut on vector boundaries is updated exactly as the same elements of
the whole tensor. `BucketLayout` maps between the parameters' leaves, the buckets' flat
buffers, and each rank's fragments of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fscale import tree
from fscale.flat import FlatBuffer, Fragment, aligned_elements
from fscale.outside_graph import outside_graph
from fscale.parallel.bucket_assign import Bucket, assign_buckets, forward_order

__all__ = ["BucketLayout", "layout_of"]

PyTree = Any


def _aligned_layout(
    shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, num_shards: int
) -> FlatBuffer:
    """One bucket's packing, its leaves and shard boundaries aligned (see the module docstring).

    Only shapes, offsets and sizes are held (``data`` is on the meta device); the real buffers
    are allocated by the caller on ``layout.device``. The gaps between leaves are zero in every
    buffer this module allocates and are never read by the optimizer.
    """
    tensors = [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes]
    layout = FlatBuffer(tensors, num_shards, align=aligned_elements(dtype))
    layout.device = device
    return layout


class BucketLayout:
    """Where every trainable leaf lives: its bucket, its slot there, and who owns which part."""

    def __init__(
        self,
        signature: tuple[tuple[torch.Size, torch.dtype, torch.device], ...],
        groups: Sequence[Sequence[int]],
        num_shards: int,
    ) -> None:
        self.num_leaves = len(signature)
        self.num_shards = num_shards
        self.buckets: list[Bucket] = []
        self.where: list[tuple[int, int]] = [(0, 0)] * self.num_leaves
        for index, leaf_indices in enumerate(groups):
            _, dtype, device = signature[leaf_indices[0]]
            shapes = [signature[i][0] for i in leaf_indices]
            layout = _aligned_layout(shapes, dtype, device, num_shards)
            self.buckets.append(Bucket(index, list(leaf_indices), layout))
            for slot, leaf in enumerate(leaf_indices):
                self.where[leaf] = (index, slot)

    @property
    def numel(self) -> int:
        """Ψ: elements of all buckets, padding included (what each collective moves)."""
        return sum(bucket.numel for bucket in self.buckets)

    def _per_leaf(self, per_bucket: Callable[[Bucket], list[Any]]) -> list[Any]:
        out: list[Any] = [None] * self.num_leaves
        for bucket in self.buckets:
            for leaf, value in zip(bucket.leaf_indices, per_bucket(bucket)):
                out[leaf] = value
        return out

    def fragments(self, rank: int) -> list[Fragment]:
        """Per leaf: the element range of it that `rank` owns."""
        return self._per_leaf(lambda b: b.layout.fragments(rank))

    def leaf_views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf: a full-shape view into its bucket's flat buffer."""
        return self._per_leaf(lambda b: b.layout.views(flats[b.index]))

    def fragment_views(self, rank: int, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf: a 1-D view of `rank`'s fragment inside its bucket's shard-sized tensor."""
        return self._per_leaf(lambda b: b.layout.fragment_views(rank, shards[b.index]))

    def owned(self, rank: int, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket: the view of `rank`'s shard inside the full flat buffer."""
        return [b.layout.shard(rank, flats[b.index]) for b in self.buckets]

    def pack(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New zero-padded flat buffers holding `leaves`, one per bucket."""
        return [_pack(bucket, leaves) for bucket in self.buckets]

    def flats_of(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The flat buffers `leaves` are views of (as `leaf_views` returns), else packed copies."""
        flats = []
        for bucket in self.buckets:
            flat = _enclosing_flat(bucket.layout, [leaves[i] for i in bucket.leaf_indices])
            flats.append(flat if flat is not None else _pack(bucket, leaves))
        return flats

    def stand_ins(self, rank: int | None = None) -> list[torch.Tensor]:
        """Per leaf, a meta tensor: the full leaf, or `rank`'s 1-D fragment of it."""
        fragments = self.fragments(0 if rank is None else rank)
        out = []
        for frag, (b, _) in zip(fragments, self.where):
            shape = frag.shape if rank is None else (frag.numel,)
            out.append(torch.empty(shape, dtype=self.buckets[b].layout.dtype, device="meta"))
        return out

    def devices(self) -> list[torch.device]:
        """Per leaf, the device its bucket lives on."""
        return [self.buckets[b].layout.device for b, _ in self.where]


def _pack(bucket: Bucket, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    layout = bucket.layout
    flat = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
    with torch.no_grad():
        for leaf, view in zip(bucket.leaf_indices, layout.views(flat)):
            view.copy_(leaves[leaf])
    return flat


def _enclosing_flat(layout: FlatBuffer, leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer whose `layout.views` are exactly `leaves`, or None if there is none."""
    first = leaves[0]
    base = first.storage_offset() - layout.offsets[0]
    storage = first.untyped_storage()
    if base < 0 or (base + layout.numel) * first.element_size() > storage.nbytes():
        return None
    for leaf, offset, shape in zip(leaves, layout.offsets, layout.shapes):
        if (
            leaf.untyped_storage().data_ptr() != storage.data_ptr()
            or leaf.storage_offset() != base + offset
            or leaf.shape != shape
            or leaf.dtype != layout.dtype
            or not leaf.is_contiguous()
        ):
            return None
    return first.as_strided((layout.numel,), (1,), base)


# Layouts by (signature, order of use, bucket bytes, shards), the oldest dropped beyond
# `_MAX_LAYOUTS`. A dict, not functools.lru_cache: under torch.compile Dynamo looks a key up in a
# dict (guarding on it) and takes the layout built eagerly, while it traces an lru_cache'd
# function as if it had no cache, building the layout's meta tensors in the graph (which
# inductor rejects).
_LAYOUTS: dict[tuple[Any, ...], BucketLayout] = {}
_MAX_LAYOUTS = 32


@outside_graph
def _new_layout(
    key: tuple[Any, ...],
    signature: tuple[tuple[torch.Size, torch.dtype, torch.device], ...],
    order: tuple[int, ...],
    bucket_bytes: int,
    num_shards: int,
) -> BucketLayout:
    # Leaves on different devices never share a bucket: bucket each device's leaves on their
    # own (assign_buckets sees meta stand-ins, so it only separates dtypes).
    groups: list[list[int]] = []
    for device in dict.fromkeys(device for _, _, device in signature):
        indices = [i for i in order if signature[i][2] == device]
        stand_ins = [
            torch.empty(signature[i][0], dtype=signature[i][1], device="meta") for i in indices
        ]
        buckets = assign_buckets(stand_ins, bucket_bytes, num_shards, order=range(len(indices)))
        groups.extend([indices[j] for j in bucket.leaf_indices] for bucket in buckets)
    layout = BucketLayout(signature, groups, num_shards)
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.pop(next(iter(_LAYOUTS)), None)
    _LAYOUTS[key] = layout
    return layout


def layout_of(params: PyTree, bucket_bytes: int, num_shards: int) -> tuple[BucketLayout, Any]:
    """The (cached) bucket layout of `params` and their treedef.

    Args:
        params: the trainable parameters, a pytree of tensors.
        bucket_bytes: the target size of a bucket.
        num_shards: the number of ranks every bucket is split over.

    Returns:
        ``(layout, treedef)``: the layout depends only on the leaves' shapes, dtypes, devices
        and order of use, so equal parameter trees share one.
    """
    leaves, treedef = tree.flatten(params)
    signature = tuple((leaf.shape, leaf.dtype, leaf.device) for leaf in leaves)
    order = tuple(forward_order(params))
    key = (signature, order, bucket_bytes, num_shards)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _new_layout(key, signature, order, bucket_bytes, num_shards)
    return layout, treedef
