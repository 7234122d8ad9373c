"""Leaves packed back to back in one buffer per (device, dtype), and writable copies of them.

The optimizers' state lives packed (one fresh 1-D buffer per device and dtype, the leaves views
of it, as `init` creates it), so that a step's copy of leaves that are consecutive views of one
storage is a single `clone` of their span rather than one copy per leaf, and fused kernels can
take whole buffers.

Layouts are decided once per list of tensor objects, not once per step. The buffers made here
(`packed_full`, `packed_copy`) are recorded as they are built, and a list that `span` finds to
be consecutive views of one storage is recorded when found; a record is keyed by the list's
first tensor and holds the others, so asking again about the same tensors, in the same order,
costs one identity comparison per leaf and reads no tensor's address, shape or dtype. A record
lives as long as its first tensor, and its values are the other tensors of the list (and spans
over their storage): for a span those are views of the storage the first keeps alive anyway,
for a list in several buffers (`gradient_runs`) the other buffers live as long as the first
leaf does, which a step's gradients do not outlive. Only lists whose first tensor is a view
are recorded (a record of a base tensor's views would keep the base alive forever). A
recorded tensor whose storage or shape is later changed in place (``Tensor.set_``, assigning
``.data``, ``resize_``) is not re-checked; fscale never does that to the buffers it packs, and
the caller gives donated buffers up.

Gradients that lie in a few buffers in another order than the leaves' (a reducer's buckets)
are described by `gradient_runs`; `writable` can pack params and state to follow them, and
`run_spans` cuts buffers packed so into one span per run (`fscale.optim.flat_group`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch._utils import _unflatten_dense_tensors
from torch.utils.weak import WeakIdKeyDictionary

from fscale.flat import FlatBuffer, flat_copy

__all__ = [
    "Runs",
    "Signature",
    "arranged",
    "contiguous",
    "device_groups",
    "gradient_runs",
    "is_packed",
    "packed_copy",
    "packed_full",
    "run_spans",
    "signatures",
    "span",
    "writable",
]

# What an optimizer checks every state and gradient leaf against: its parameter's
# (shape, dtype, device); None for a leaf that is not a tensor.
Signature = tuple[torch.Size, torch.dtype, torch.device] | None


class _Record:
    """What is known about one list of tensors (see the module docstring)."""

    __slots__ = ("rest", "runs", "signatures", "whole")

    def __init__(
        self,
        rest: tuple[torch.Tensor, ...],
        whole: torch.Tensor | None,
        signatures: list[Signature] | None,
        runs: Runs | None = None,
    ) -> None:
        self.rest = rest  # the leaves after the first (the key), in order
        self.whole = whole  # the 1-D span over all of them; None: they are `runs`
        self.signatures = signatures  # read on first use: spans of new gradients never need it
        self.runs = runs


_records: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _recorded(leaves: Sequence[torch.Tensor]) -> _Record | None:
    """The record of exactly these tensor objects in this order, or None."""
    if not leaves or not isinstance(leaves[0], torch.Tensor):
        return None
    for record in _records.get(leaves[0]) or ():
        if len(record.rest) == len(leaves) - 1 and all(
            map(operator.is_, itertools.islice(leaves, 1, None), record.rest)
        ):
            return record
    return None


# Records kept per first tensor: a buffer packed in the gradients' order is known both in that
# order and in leaf order, and the two lists may start with the same tensor.
_RECORDS_PER_TENSOR = 2


def _remember(
    leaves: Sequence[torch.Tensor],
    whole: torch.Tensor | None,
    signatures: list[Signature] | None = None,
    runs: Runs | None = None,
) -> None:
    first = leaves[0]
    if first._base is None:  # a base tensor: its views, held by the record, would keep it
        return
    record = _Record(tuple(leaves[1:]), whole, signatures, runs)
    _records[first] = (record, *(_records.get(first) or ()))[:_RECORDS_PER_TENSOR]


def signatures(leaves: Sequence[object]) -> list[Signature]:
    """``(shape, dtype, device)`` of each leaf (None for a non-tensor); recorded lists reuse
    one list, so that comparing two lists that share their tuples is a pointer comparison."""
    record = _recorded(leaves)  # type: ignore[arg-type]
    if record is None:
        return [
            (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in leaves
        ]
    if record.signatures is None:
        record.signatures = _tensor_signatures(leaves)  # type: ignore[arg-type]
    return record.signatures


def _tensor_signatures(leaves: Sequence[torch.Tensor]) -> list[Signature]:
    return [(t.shape, t.dtype, t.device) for t in leaves]


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
            _remember(views, data, signatures(group))
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
    if _recorded(leaves) is not None:
        return [list(range(len(leaves)))]
    first = leaves[0]
    dtype, device = first.dtype, first.device
    dtypes = map(operator.attrgetter("dtype"), leaves)
    devices = map(operator.attrgetter("device"), leaves)
    if all(map(operator.is_, dtypes, itertools.repeat(dtype))) and all(
        map(operator.eq, devices, itertools.repeat(device))
    ):
        return [list(range(len(leaves)))]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(leaves):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def span(leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view over `leaves` if they are consecutive, contiguous pieces of one allocation.

    Consecutive addresses inside the first leaf's storage (and one dtype) are what makes a
    single `clone` of the span equal to copying every leaf; leaves of separate allocations
    return None. The answer for the same tensors is recorded (see the module docstring).
    """
    record = _recorded(leaves)
    if record is not None and (record.whole is not None or record.runs is None):
        return record.whole
    if record is not None:
        return None  # recorded as several runs
    whole = _find_span(leaves)
    if whole is not None and len(leaves) > 1:
        _remember(leaves, whole)
    return whole


def _find_span(leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
    # The per-leaf reads run in C (map), not in a Python loop: gradients are new tensors every
    # step, so this runs every step for them.
    sizes = list(map(torch.Tensor.numel, leaves))
    if 0 in sizes:  # an empty leaf has no address of its own: leave it out
        leaves = [t for t, n in zip(leaves, sizes) if n]
        sizes = [n for n in sizes if n]
    if not leaves:
        return None
    anchor = leaves[0]
    itemsize, dtype = anchor.element_size(), anchor.dtype
    if len(leaves) > 1 and leaves[1].data_ptr() != anchor.data_ptr() + sizes[0] * itemsize:
        return None  # separate tensors (autograd's gradients) fail here, before the C loops
    starts = list(itertools.accumulate(map(operator.mul, sizes, itertools.repeat(itemsize))))
    start = anchor.data_ptr()
    expected = [start, *map(start.__add__, starts[:-1])]
    if list(map(torch.Tensor.data_ptr, leaves)) != expected:
        return None
    dtypes = map(operator.attrgetter("dtype"), leaves)
    if not all(map(operator.is_, dtypes, itertools.repeat(dtype))):
        return None
    if not all(map(torch.Tensor.is_contiguous, leaves)):
        return None
    storage = anchor.untyped_storage()
    end = start + starts[-1]
    if start < storage.data_ptr() or end > storage.data_ptr() + storage.nbytes():
        return None
    return anchor.as_strided((starts[-1] // itemsize,), (1,))


class Runs(NamedTuple):
    """Leaves that lie in few buffers, as `gradient_runs` finds them.

    Attributes:
        order: the leaf indices run after run, each run's in the order they lie in memory.
        spans: per run, a 1-D span over its leaves (consecutive in `order`).
        numels: the elements of each run.
        bounds: per run, its ``(start, stop)`` positions in `order`.
    """

    order: Sequence[int]
    spans: list[torch.Tensor]
    numels: list[int]
    bounds: list[tuple[int, int]]


def gradient_runs(leaves: Sequence[torch.Tensor]) -> Runs | None:
    """`leaves` as runs of consecutive views of one storage each, or None if that saves little.

    A reducer's gradient buckets hand over views of a few flat buffers, in the buckets' order
    (not the params' tree order); sorted by address, such leaves form one run per bucket. None
    when the leaves are of several dtypes or devices, or form more than half as many runs as
    there are leaves (separate tensors: one run each). Recorded like `span`.
    """
    record = _recorded(leaves)
    if record is not None:
        if record.runs is None and record.whole is not None:
            record.runs = _one_run(leaves, record.whole)
        return record.runs
    whole = span(leaves)
    if whole is not None:
        return _one_run(leaves, whole)
    runs = _find_runs(leaves)
    if runs is not None:
        _remember(leaves, None, runs=runs)
    return runs


def _one_run(leaves: Sequence[torch.Tensor], whole: torch.Tensor) -> Runs:
    return Runs(range(len(leaves)), [whole], [whole.numel()], [(0, len(leaves))])


def _find_runs(leaves: Sequence[torch.Tensor]) -> Runs | None:
    if len(leaves) < 2 or len(device_groups(leaves)) != 1:
        return None
    if not all(map(torch.Tensor.is_contiguous, leaves)):
        return None
    sizes = list(map(torch.Tensor.numel, leaves))
    itemsize = leaves[0].element_size()
    ptrs = list(map(torch.Tensor.data_ptr, leaves))
    # Empty leaves (a shard's fragment of a tensor that another rank holds) have no place in
    # memory: they join the last run, where they add nothing.
    empty = [i for i, n in enumerate(sizes) if not n] if 0 in sizes else []
    by_address = sorted(itertools.compress(range(len(sizes)), sizes), key=ptrs.__getitem__)
    if not by_address:
        return None
    starts = [ptrs[i] for i in by_address]
    ends = [ptrs[i] + sizes[i] * itemsize for i in by_address]
    breaks = [j for j in range(1, len(by_address)) if starts[j] != ends[j - 1]]
    if 2 * (len(breaks) + 1) > len(by_address):
        return None
    bounds = list(zip([0, *breaks], [*breaks, len(by_address)]))
    # Runs in a stable order (their lowest leaf index), not by address: buffers allocated anew
    # each step may lie in another order, and the state packed in the runs' order stays valid.
    bounds.sort(key=lambda b: min(by_address[b[0] : b[1]]))
    spans, numels, order, positions = [], [], [], [0]
    for first, stop in bounds:
        anchor = leaves[by_address[first]]
        storage = anchor.untyped_storage()
        begin, end = starts[first], ends[stop - 1]
        if begin < storage.data_ptr() or end > storage.data_ptr() + storage.nbytes():
            return None  # adjacent allocations, not one buffer
        numel = (end - begin) // itemsize
        spans.append(anchor.as_strided((numel,), (1,)))
        numels.append(numel)
        order += by_address[first:stop]
        positions.append(len(order))
    order += empty
    positions[-1] = len(order)
    return Runs(order, spans, numels, list(itertools.pairwise(positions)))


def run_spans(leaves: Sequence[torch.Tensor], runs: Runs) -> list[torch.Tensor] | None:
    """Per run of `runs`, a 1-D span over `leaves` in its order, or None where one is not.

    One span over all of `leaves` in the runs' order (what `writable` packs) is cut at the
    runs' bounds; else each run's leaves must be a span of their own (buffers that mirror the
    gradients' layout, as a sharded optimizer's parameter fragments do).
    """
    in_order = arranged(leaves, runs.order)
    whole = span(in_order)
    if whole is not None:
        if whole.numel() != sum(runs.numels):
            return None
        return [whole] if len(runs.numels) == 1 else list(whole.split(runs.numels))
    pieces = []
    for (start, stop), numel in zip(runs.bounds, runs.numels):
        piece = span(in_order[start:stop])
        if piece is None or piece.numel() != numel:
            return None
        pieces.append(piece)
    return pieces


def arranged(leaves: Sequence[torch.Tensor], order: Sequence[int]) -> Sequence[torch.Tensor]:
    """`leaves` in `order` (`leaves` itself for the identity order)."""
    if isinstance(order, range):
        return leaves
    return [leaves[i] for i in order]


def packed_copy(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh copies of `leaves`, packed in one new buffer per (device, dtype)."""
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in device_groups(leaves):
        group = [leaves[i] for i in indices]
        whole = span(group)
        flat = whole.clone() if whole is not None else flat_copy(group)
        views = _unflatten_dense_tensors(flat, group)
        if flat.numel():
            _remember(views, flat, signatures(group))
        for i, view in zip(indices, views):
            out[i] = view
    return out  # type: ignore[return-value]


@torch.no_grad()
def writable(
    leaves: list[torch.Tensor], donate: bool, *, runs: Runs | None = None
) -> list[torch.Tensor]:
    """Tensors with the values of `leaves` that the step may update in place.

    With `donate`, the caller gave its tensors up, so they are used as they are (a non-contiguous
    leaf is replaced by a contiguous copy, which kernels need); otherwise they are copied.
    `runs` (the gradients' `gradient_runs`) asks for leaves that are one span per run also when
    donating: donated leaves that are not (`run_spans`) are then copied once into one buffer,
    in the runs' order (the step returns them packed so). Without it copies are packed in leaf
    order, one buffer per (device, dtype).
    Copies are made without autograd: an optimizer step is not differentiated, and leaves that
    require grad (``nn.Parameter``, ``dict(model.named_parameters())``) must give plain values.
    """
    if runs is None:
        return contiguous(leaves) if donate else packed_copy(leaves)
    order = runs.order
    if donate and run_spans(leaves, runs) is not None:
        return leaves
    copies = packed_copy(arranged(leaves, runs.order))
    if isinstance(order, range):
        return copies
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for i, copy in zip(order, copies):
        out[i] = copy
    _remember(out, None, signatures(leaves))  # type: ignore[arg-type]  # known in leaf order too
    return out  # type: ignore[return-value]


def is_packed(leaves: list[torch.Tensor]) -> bool:
    """Whether each (device, dtype) group of `leaves` is one `span`."""
    record = _recorded(leaves)
    if record is not None and record.whole is not None:
        return True
    return all(span([leaves[i] for i in group]) is not None for group in device_groups(leaves))


def contiguous(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """`leaves`, with each non-contiguous one replaced by a contiguous copy."""
    if _recorded(leaves) is not None or all(map(torch.Tensor.is_contiguous, leaves)):
        return leaves
    return [t if t.is_contiguous() else t.contiguous() for t in leaves]
