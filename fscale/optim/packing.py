"""Leaves packed back to back in one buffer per (device, dtype), and writable copies of them.

The optimizers' state lives packed (one fresh 1-D buffer per device and dtype, the leaves views
of it, as `init` creates it), so that a step's copy of leaves that are consecutive views of one
storage is a single `clone` of their span rather than one copy per leaf, and fused kernels can
take whole buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from fscale.flat import FlatBuffer

__all__ = [
    "contiguous",
    "device_groups",
    "is_packed",
    "packed_copy",
    "packed_full",
    "span",
    "writable",
]


def packed_full(leaves: Sequence[torch.Tensor], fill: float = 0.0) -> list[torch.Tensor]:
    """Tensors shaped like `leaves`, filled with `fill`, packed in one buffer per device/dtype."""
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in device_groups(leaves):
        group = [leaves[i] for i in indices]
        total = sum(t.numel() for t in group)
        if not total:  # a FlatBuffer needs at least one element; empty leaves need no storage
            views = [torch.full_like(t, fill) for t in group]
        else:
            data = torch.full((total,), fill, dtype=group[0].dtype, device=group[0].device)
            views = FlatBuffer(group, data=data).views()
        for i, view in zip(indices, views):
            out[i] = view
    return out  # type: ignore[return-value]


def device_groups(leaves: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of `leaves` grouped by (device, dtype), in first-seen order.

    Fused kernels and packed buffers need one device and dtype per call; the common case of a
    single group is detected without building per-leaf keys.
    """
    if not leaves:
        return []
    first = leaves[0]
    dtype, device = first.dtype, first.device
    if all(t.dtype == dtype for t in leaves) and all(t.device == device for t in leaves):
        return [list(range(len(leaves)))]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(leaves):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def span(leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view over `leaves` if they are consecutive, contiguous pieces of one allocation.

    Consecutive addresses inside the first leaf's storage are what makes a single `clone` of the
    span equal to copying every leaf; leaves of separate allocations return None.
    """
    anchor = next((t for t in leaves if t.numel()), None)
    if anchor is None:
        return None
    itemsize = anchor.element_size()
    start = anchor.data_ptr()
    expected = start
    for t in leaves:
        if not t.numel():
            continue
        if t.data_ptr() != expected or not t.is_contiguous():
            return None
        expected += t.numel() * itemsize
    storage = anchor.untyped_storage()
    if start < storage.data_ptr() or expected > storage.data_ptr() + storage.nbytes():
        return None
    return anchor.as_strided(((expected - start) // itemsize,), (1,))


def packed_copy(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh copies of `leaves`, packed in one new buffer per (device, dtype)."""
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in device_groups(leaves):
        group = [leaves[i] for i in indices]
        whole = span(group)
        if whole is not None:
            flat = whole.clone()
        else:
            total = sum(t.numel() for t in group)
            flat = torch.empty(total, dtype=group[0].dtype, device=group[0].device)
            if total:
                torch.cat([t.reshape(-1) for t in group], out=flat)
        for i, view in zip(indices, _unflatten_dense_tensors(flat, group)):
            out[i] = view
    return out  # type: ignore[return-value]


@torch.no_grad()
def writable(
    leaves: list[torch.Tensor], donate: bool, *, packed: bool = False
) -> list[torch.Tensor]:
    """Tensors with the values of `leaves` that the step may update in place.

    With `donate`, the caller gave its tensors up, so they are used as they are (a non-contiguous
    leaf is replaced by a contiguous copy, which kernels need); otherwise they are copied.
    `packed` asks for one buffer per (device, dtype) also when donating: donated leaves that are
    not consecutive pieces of one are then copied once (the step returns them packed).
    Copies are made without autograd: an optimizer step is not differentiated, and leaves that
    require grad (``nn.Parameter``, ``dict(model.named_parameters())``) must give plain values.
    """
    if not donate or (packed and not is_packed(leaves)):
        return packed_copy(leaves)
    return contiguous(leaves)


def is_packed(leaves: list[torch.Tensor]) -> bool:
    return all(span([leaves[i] for i in group]) is not None for group in device_groups(leaves))


def contiguous(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    if all(map(torch.Tensor.is_contiguous, leaves)):  # the common case, without a Python loop
        return leaves
    return [t if t.is_contiguous() else t.contiguous() for t in leaves]
