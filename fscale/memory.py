"""Exact memory accounting: the bytes tensors actually hold, now and at their peak.

Views share storage (flat buffers hand out per-leaf views; a tied weight is one tensor used
twice), so summing ``numel * element_size`` over leaves over-counts. Both measures here count
each underlying storage once, which is what a rank really holds:

- `tree_bytes`: the bytes a pytree of tensors references now. Stride-0 expanded tensors (a
  scalar broadcast to a shape) count as the one element they store.
- `LiveBytes`: the peak, over time, of the bytes alive among tensors registered with it. It
  keeps a weak reference to each registered tensor's storage, so a storage counts exactly until
  the last tensor viewing it is freed (including views that autograd saved or a collective in
  flight holds): the figure is measured, not assumed. The peak is sampled when a tensor is
  registered and whenever `LiveBytes.sample` is called.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fscale import tree
from fscale.outside_graph import outside_graph

__all__ = ["LiveBytes", "state_bytes", "tree_bytes"]


def tree_bytes(values: Any) -> int:
    """Bytes of distinct storage referenced by the tensor leaves of `values`.

    A leaf that views part of a larger storage counts the whole storage once (that memory is
    held as long as the view lives).
    """
    seen: dict[tuple[torch.device, int], int] = {}
    bases: set[int] = set()  # views of one base share its storage: look it up once
    for leaf in tree.leaves(values):
        if not isinstance(leaf, torch.Tensor):
            continue
        base = leaf._base
        if base is not None:
            if id(base) in bases:
                continue
            bases.add(id(base))
        storage = leaf.untyped_storage()
        pointer = storage.data_ptr()
        if pointer == 0:  # zero-size storage
            continue
        ident = (leaf.device, pointer)
        seen[ident] = max(seen.get(ident, 0), storage.nbytes())
    return sum(seen.values())


def state_bytes(state: Any) -> dict[str, int]:
    """Per-rank bytes of a TrainState's params, buffers and optimizer state."""
    return {
        "params": tree_bytes(state.params),
        "buffers": tree_bytes(state.buffers),
        "opt_state": tree_bytes(state.opt_state),
    }


class LiveBytes:
    """The peak of storage bytes alive among the tensors registered with `track`.

    Attributes:
        peak: the most bytes alive at any sample so far.
    """

    def __init__(self) -> None:
        # (weak reference to a storage, its size); a storage registered twice counts once.
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    @property
    def live(self) -> int:
        """Bytes of the registered storages alive now."""
        self._drop_dead()
        return sum(nbytes for _, nbytes in self._storages.values())

    # Host bookkeeping through weak references to storages, which Dynamo cannot trace (2.13
    # breaks the graph inside; 2.9 rebuilt a weak reference as the storage itself): under
    # torch.compile each call is one call outside the graph.
    @outside_graph
    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage until it is freed, and sample the peak.

        Raises:
            TypeError: `tensor` is not a torch.Tensor.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"LiveBytes.track: `tensor` must be a torch.Tensor, got {type(tensor).__name__}"
            )
        storage = tensor.untyped_storage()
        self._drop_dead()
        self._storages.setdefault(id(storage), (weakref.ref(storage), storage.nbytes()))
        self.sample()

    @outside_graph
    def sample(self) -> None:
        """Update `peak` with the bytes alive now."""
        self.peak = max(self.peak, self.live)

    def _drop_dead(self) -> None:
        self._storages = {
            key: entry for key, entry in self._storages.items() if entry[0]() is not None
        }

    def __repr__(self) -> str:
        return f"LiveBytes(live={self.live}, peak={self.peak})"
