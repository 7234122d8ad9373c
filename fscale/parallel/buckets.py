"""Gradient buckets: group leaves into flat buffers and act on each as soon as it is complete.

Data parallelism and ZeRO reduce gradients bucket by bucket *during* backward, so the reduction
of one bucket overlaps the computation of the next, and one collective moves many tensors
(one collective per tensor costs 10-15% on this kind of machine; see DESIGN.md).

Which leaves go in which bucket is `fscale.parallel.bucket_assign`'s (re-exported here).

`GradBuckets.hooks()` returns one hook per leaf for `fscale.train.value_and_grad`: the hook takes
the leaf's gradient for its bucket and calls ``on_ready(bucket, flat_grad)`` once every leaf of
the bucket has arrived. Autograd runs a leaf's hook as soon as that leaf's gradient is final,
which is what makes the overlap possible. Where autograd need not get the bucket's contents back
(``keep_grads=False``), a hook only holds the gradient, and the bucket's flat buffer is built
when its last gradient arrives, in one concatenation (divided by ``divide_by`` when a mean asks
for it; the gradients then live only there): one kernel per bucket instead of a copy per leaf.

`GradBuckets.fold` appends a few scalars (the step's loss and metrics) after the last bucket's
elements in its buffer, so that the bucket's collective reduces them too and the step needs no
collective of its own for them.

Buckets are handed to ``on_ready`` strictly in index order, whatever order they complete in: a
bucket that completes early waits until every bucket before it has been handed out. `on_ready`
issues a collective, and collectives must be issued in the same order on every rank; the order
in which buckets complete is not the same on every rank when the graph differs between them
(a parameter unused on one rank completes its bucket only at `GradBuckets.flush`), and
collectives issued out of step would silently combine different buckets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from fscale.flat import FlatBuffer, Placement, flat_copy
from fscale.outside_graph import outside_graph
from fscale.parallel.bucket_assign import Bucket, assign_buckets, forward_order

__all__ = ["Bucket", "GradBuckets", "assign_buckets", "forward_order"]


# One stride-0 zero per (shape, dtype, device), handed to autograd in place of every gradient
# whose only copy is its bucket: made once, not once per leaf and step.
_ZEROS: dict[tuple[torch.Size, torch.dtype, torch.device], torch.Tensor] = {}
_MAX_ZEROS = 4096


def _zero_like(grad: torch.Tensor) -> torch.Tensor:
    key = (grad.shape, grad.dtype, grad.device)
    zero = _ZEROS.get(key)
    if zero is None:
        if len(_ZEROS) >= _MAX_ZEROS:
            _ZEROS.clear()
        zero = _ZEROS[key] = grad.new_zeros(()).expand(grad.shape)
    return zero


_ZERO_RUNS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _write_divided(target: torch.Tensor, source: torch.Tensor, divide_by: int) -> None:
    if divide_by == 1:
        target.copy_(source)
    else:
        torch.div(source, divide_by, out=target)


def _zero_run(numel: int, layout: FlatBuffer) -> torch.Tensor:
    """`numel` zeros for a bucket's gaps: eagerly, a slice of one zero tensor per dtype and
    device."""
    if torch.compiler.is_compiling():
        # In a graph the zeros are one more op for the compiler to fold into the copy; reading
        # the cache there would guard the graph on its contents, and the entry the first step
        # adds would compile the step again.
        return torch.zeros(numel, dtype=layout.dtype, device=layout.device)
    key = (layout.dtype, layout.device)
    zeros = _ZERO_RUNS.get(key)
    if zeros is None or zeros.numel() < numel:
        zeros = _ZERO_RUNS[key] = torch.zeros(max(numel, 64), dtype=key[0], device=key[1])
    return zeros[:numel]


# Under a compiled step every leaf's hook enters through this one function, kept eager: autograd
# calls the hooks, and Dynamo would compile a hook anew for every leaf shape, then check its
# guards on each call. Wrapped once here, not once per leaf and step (a wrapper of its own per
# hook cost about 4 us a leaf to make, 0.1 ms a step on a 26-leaf model).
@outside_graph
def _deliver_eagerly(
    collector: GradBuckets, bucket_index: int, slot: int, placement: Placement, grad: torch.Tensor
) -> torch.Tensor:
    return collector._deliver(bucket_index, slot, placement, grad)


class GradBuckets:
    """Per-step collector that writes leaf gradients into bucket buffers.

    Args:
        buckets: from `assign_buckets` (``buckets[i].index == i``).
        num_leaves: the number of parameter leaves.
        on_ready: called as ``on_ready(bucket, flat_grad)`` once per bucket, in bucket index
            order, when that bucket and every bucket before it have all their gradients;
            `flat_grad` is the bucket's padded flat gradient buffer.
        keep_grads: when True (the default) each hook writes its gradient into the bucket
            buffer and returns a view of it, so the gradients autograd hands back *are* the
            bucket contents (no second copy); when False it returns a stride-0 zero that holds
            no memory, for strategies that keep only a reduced copy or shard of each bucket,
            and holds the gradient until its bucket is complete, which is then built in one
            concatenation (for a moment the bucket's gradients are held twice).
        initial: per leaf, a gradient to add to the one autograd delivers (the sum over the
            earlier micro-batches of a step), or None.
        zero_whole: zero each new buffer whole (a layout with gaps between its leaves), not
            only its padding (every other element is overwritten by a gradient).
        on_allocate: called with each buffer this collector allocates (e.g. to track it).
        divide_by: every element of every buffer is written divided by this (a mean's division
            done in the copy into the bucket instead of a pass of its own over it; the same
            bits, `x / n` either way); not with `initial`, whose sum comes first.
        late_bytes: the last bucket, when it holds at most this many bytes of gradients, gets
            no per-leaf hooks: `flush` writes its gradients in one go after backward.
            Its leaves are the first the forward pass uses, so their gradients are the last
            backward completes and its collective could not start much earlier; a hook costs
            a Python call inside autograd per leaf (about 15 us on a CPU), which on a small
            model is a large part of the step. The price is the bucket's gradients held twice
            for a moment at the end of backward, when the activations are gone.
        overlap: when False no bucket gets hooks: `flush` writes them all after backward, and
            their collectives start then (in the same buckets, so with the same results).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        num_leaves: int,
        on_ready: Callable[[Bucket, torch.Tensor], None],
        *,
        keep_grads: bool = True,
        initial: Sequence[torch.Tensor] | None = None,
        zero_whole: bool = False,
        on_allocate: Callable[[torch.Tensor], None] | None = None,
        late_bytes: int = 0,
        divide_by: int = 1,
        overlap: bool = True,
    ) -> None:
        if isinstance(divide_by, bool) or not isinstance(divide_by, int) or divide_by < 1:
            raise ValueError(f"GradBuckets: `divide_by` must be a positive int, got {divide_by!r}")
        if divide_by != 1 and initial is not None:
            raise ValueError(
                "GradBuckets: `divide_by` divides each gradient before `initial` "
                "could be added; divide the sums afterwards instead"
            )
        self.divide_by = divide_by
        self.buckets = list(buckets)
        last = self.buckets[-1].layout if self.buckets else None
        late = last is not None and last.numel * last.dtype.itemsize <= late_bytes
        # Buckets from this index on get no hooks: `flush` writes them after backward.
        self.late_from = 0 if not overlap else len(self.buckets) - int(late)
        self.zero_whole = zero_whole
        self.on_allocate = on_allocate
        self.on_ready = on_ready
        self.keep_grads = keep_grads
        self.initial = None if initial is None else list(initial)
        self._where: list[tuple[int, int] | None] = [None] * num_leaves
        for position, bucket in enumerate(self.buckets):
            if bucket.index != position:
                raise ValueError(
                    f"GradBuckets: `buckets` must be in index order as `assign_buckets` returns "
                    f"them; bucket {bucket.index} is at position {position}"
                )
            for slot, leaf in enumerate(bucket.leaf_indices):
                self._where[leaf] = (bucket.index, slot)
        self._data: list[torch.Tensor | None] = [None] * len(self.buckets)
        # Per bucket, the gradients held until it is complete; None where they are written
        # into the buffer as they arrive (a hook that returns a view of it, or a sum to add)
        # and, once `_build` has made its buffer, for a bucket whose gradients were held.
        self._held: list[list[torch.Tensor | None] | None] = []
        for b in self.buckets:
            slots: list[torch.Tensor | None] = [None] * len(b.leaf_indices)
            holds = initial is None and (not keep_grads or b.index >= self.late_from)
            self._held.append(slots if holds else None)
        self._delivered = [[False] * len(b.leaf_indices) for b in self.buckets]
        self._pending = [len(b.leaf_indices) for b in self.buckets]
        self._next_ready = 0  # buckets before this one have been handed to `on_ready`
        self._trailing: torch.Tensor | None = None

    def fold(self, values: torch.Tensor) -> None:
        """Place the 1-D `values` after the last bucket's elements in its buffer.

        The flat buffer handed to ``on_ready`` for the last bucket is then
        ``layout.numel + values.numel()`` long: the bucket's elements, then `values`.

        Raises:
            ValueError: `values` is not a 1-D tensor of the last bucket's dtype and device, or
                the last bucket's buffer exists already (fold before backward).
        """
        last = self.buckets[-1].layout
        if (
            not isinstance(values, torch.Tensor)
            or values.dim() != 1
            or values.dtype != last.dtype
            or values.device != last.device
        ):
            raise ValueError(
                f"GradBuckets.fold: `values` must be a 1-D {last.dtype} tensor on {last.device}, "
                f"got {values!r:.80}"
            )
        if self._data[-1] is not None or self._next_ready == len(self.buckets):
            raise ValueError(
                "GradBuckets.fold: the last bucket's buffer exists already; fold before backward"
            )
        self._trailing = values

    def hooks(
        self, *, compiling: bool = False
    ) -> list[Callable[[torch.Tensor], torch.Tensor] | None]:
        """One hook per leaf (None for leaves in no bucket and for those of the late buckets,
        which `flush` writes).

        `compiling`: the step that registers them is being compiled (pass
        ``torch.compiler.is_compiling()`` from the traced code), so the hooks must keep Dynamo
        out; an eager step's hooks skip the guard's cost (a few microseconds a call).
        """
        return [
            None
            if where is None or where[0] >= self.late_from
            else self._make_hook(*where, compiling)
            for where in self._where
        ]

    def _make_hook(
        self, bucket_index: int, slot: int, compiling: bool
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        placement = self.buckets[bucket_index].layout.placements[slot]
        if compiling:
            return functools.partial(_deliver_eagerly, self, bucket_index, slot, placement)
        return functools.partial(self._deliver, bucket_index, slot, placement)

    def _deliver(
        self, bucket_index: int, slot: int, placement: Placement, grad: torch.Tensor
    ) -> torch.Tensor:
        if self._held[bucket_index] is None:
            target = self._write(bucket_index, slot, grad, placement)
            returned = target if self.keep_grads else _zero_like(grad)
        else:
            self._hold(bucket_index, slot, grad)
            returned = _zero_like(grad)  # held only where autograd keeps no copy
        if self._pending[bucket_index] == 0 and bucket_index == self._next_ready:
            self._hand_out_ready()
        return returned

    def _arrive(self, bucket_index: int, slot: int) -> None:
        """Count one leaf's gradient in (each leaf's exactly once)."""
        delivered = self._delivered[bucket_index]
        if delivered[slot]:
            # A second call would complete the bucket while another leaf is still unwritten.
            raise RuntimeError(
                f"GradBuckets: the gradient of leaf {self.buckets[bucket_index].leaf_indices[slot]}"
                " arrived twice; a collector serves exactly one backward pass"
            )
        delivered[slot] = True
        self._pending[bucket_index] -= 1

    def _hold(self, bucket_index: int, slot: int, grad: torch.Tensor) -> None:
        """Keep one leaf's gradient; build the bucket's buffer once all have arrived."""
        held = self._held[bucket_index]
        assert held is not None
        self._arrive(bucket_index, slot)
        held[slot] = grad
        if self._pending[bucket_index] == 0:
            self._build(bucket_index)

    def _write(
        self, bucket_index: int, slot: int, grad: torch.Tensor, placement: Placement
    ) -> torch.Tensor:
        """Copy one leaf's gradient into its bucket's buffer (allocated on first use)."""
        self._arrive(bucket_index, slot)
        data = self._data[bucket_index]
        if data is None:
            data = self._allocate(bucket_index)
        target = data.as_strided(*placement)
        _write_divided(target, grad, self.divide_by)
        if self.initial is not None:
            target.add_(self.initial[self.buckets[bucket_index].leaf_indices[slot]])
        return target

    def _allocate(self, bucket_index: int) -> torch.Tensor:
        """A new buffer for a bucket: the padding zeroed, the folded values after the last."""
        layout = self.buckets[bucket_index].layout
        trailing = self._trailing if bucket_index == len(self.buckets) - 1 else None
        extra = 0 if trailing is None else trailing.numel()
        data = torch.empty(layout.numel + extra, dtype=layout.dtype, device=layout.device)
        if self.zero_whole:
            data[: layout.numel].zero_()
        else:
            data[layout.numel_unpadded : layout.numel].zero_()
        if trailing is not None:
            _write_divided(data[layout.numel :], trailing, self.divide_by)
        self._data[bucket_index] = data
        if self.on_allocate is not None:
            self.on_allocate(data)
        return data

    def _build(self, bucket_index: int) -> None:
        """The buffer of a bucket whose gradients were held, in one concatenation: gaps,
        padding and leaves without a gradient zero, then any folded values."""
        held = self._held[bucket_index]
        assert held is not None
        self._held[bucket_index] = None
        layout = self.buckets[bucket_index].layout
        if any(grad is not None and grad.dtype != layout.dtype for grad in held):
            # Another dtype than the bucket's (rare): converted leaf by leaf as it is copied.
            data = self._allocate(bucket_index)
            for placement, grad in zip(layout.placements, held):
                target = data.as_strided(*placement)
                if grad is None:
                    target.zero_()
                else:
                    _write_divided(target, grad, self.divide_by)
            return
        parts: list[torch.Tensor] = []
        end = 0
        for offset, numel, grad in zip(layout.offsets, layout.numels, held):
            if offset > end:
                parts.append(_zero_run(offset - end, layout))
            parts.append(_zero_run(numel, layout) if grad is None else grad)
            end = offset + numel
        if layout.numel > end:
            parts.append(_zero_run(layout.numel - end, layout))
        if bucket_index == len(self.buckets) - 1 and self._trailing is not None:
            parts.append(self._trailing)
        if len(parts) == 1 and self.divide_by != 1:
            data = torch.div(parts[0].detach().reshape(-1), self.divide_by)  # one pass, new
        else:
            data = flat_copy(parts)  # new: the collective writes into it
            if self.divide_by != 1:
                data.div_(self.divide_by)
        self._data[bucket_index] = data
        if self.on_allocate is not None:
            self.on_allocate(data)

    def _hand_out_ready(self) -> None:
        """Pass every complete bucket from `_next_ready` on to `on_ready`, in index order."""
        while self._next_ready < len(self.buckets) and self._pending[self._next_ready] == 0:
            index = self._next_ready
            # Advanced first, so that `on_ready` may call `release` on this bucket.
            self._next_ready += 1
            data = self._data[index]
            assert data is not None  # a complete bucket has its buffer
            self.on_ready(self.buckets[index], data)

    def flush(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """After backward: write the late buckets' gradients from `grads`, deliver as zeros
        the leaves that got no gradient (unused leaves), and hand out every bucket.

        `grads` holds one gradient per parameter leaf, in leaf order (None for a leaf autograd
        gave none); only the late buckets' are read, and it is required when there are any.
        Autograd does not run hooks for leaves the loss does not depend on, so a bucket with
        such a leaf would never complete; every rank must still issue the same collectives.
        After `flush` every bucket has been handed to `on_ready` exactly once.

        Raises:
            ValueError: the collector has late buckets but `grads` is None (their gradients
                would be lost).
        """
        late = self.buckets[self.late_from :]
        if late and grads is None:
            raise ValueError(
                "GradBuckets.flush: buckets are written after backward (late_bytes, or no "
                "overlap); pass the gradients autograd returned, one per parameter leaf"
            )
        for bucket in late:
            for slot, leaf in enumerate(bucket.leaf_indices):
                if (grad := grads[leaf]) is not None:  # type: ignore[index]
                    if self._held[bucket.index] is None:
                        self._write(bucket.index, slot, grad, bucket.layout.placements[slot])
                    else:
                        self._hold(bucket.index, slot, grad)
        for bucket in self.buckets[self._next_ready :]:
            if self._pending[bucket.index] != 0:
                self._pending[bucket.index] = 0
                if self._held[bucket.index] is not None:
                    self._build(bucket.index)  # the leaves never delivered are zeros
                else:
                    self._fill_undelivered(bucket)
            # Buckets are completed one at a time, so at most one incomplete buffer is
            # allocated beyond those the hooks already filled.
            self._hand_out_ready()

    def _fill_undelivered(self, bucket: Bucket) -> None:
        """Zeros (or the sum to add) where a written bucket's leaves got no gradient."""
        data = self._data[bucket.index]
        if data is None:
            data = self._allocate(bucket.index)
        layout = bucket.layout
        for slot, delivered in enumerate(self._delivered[bucket.index]):
            if not delivered:  # never written: holds uninitialised memory
                offset = layout.offsets[slot]
                target = data[offset : offset + layout.numels[slot]]
                if self.initial is None:
                    target.zero_()
                else:
                    target.copy_(self.initial[bucket.leaf_indices[slot]].reshape(-1))

    def bucket_data(self, bucket_index: int) -> torch.Tensor | None:
        """The flat gradient buffer of a bucket (None before it exists, at its first gradient
        or, where they are held, its last, and after `release`)."""
        return self._data[bucket_index]

    def release(self, bucket_index: int) -> None:
        """Drop this collector's reference to a bucket's buffer once `on_ready` has used it.

        A strategy whose collective keeps its own copy (an all-reduce, a reduce-scatter)
        releases the bucket in `on_ready`, so the unreduced gradients are freed as soon as
        nothing else holds them.

        Raises:
            ValueError: the bucket has not been handed to `on_ready` yet (its gradients
                would be lost).
        """
        if not 0 <= bucket_index < self._next_ready:
            raise ValueError(
                f"GradBuckets.release: bucket {bucket_index} has not been handed to `on_ready` "
                f"yet (buckets 0..{self._next_ready - 1} have); release a bucket only after "
                "its gradients were used"
            )
        self._data[bucket_index] = None
