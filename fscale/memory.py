"""Exact memory accounting: the bytes a pytree of tensors actually holds.

Views share storage (flat buffers hand out per-leaf views; a tied weight is one tensor used
twice), so summing ``numel * element_size`` over leaves over-counts. `tree_bytes` counts each
underlying storage once, which is what a rank really holds. Stride-0 expanded tensors (a scalar
broadcast to a shape) count as the one element they store.
"""

from __future__ import annotations

from typing import Any

import torch

from fscale import tree

__all__ = ["state_bytes", "tree_bytes"]


def tree_bytes(values: Any) -> int:
    """Bytes of distinct storage referenced by the tensor leaves of `values`.

    A leaf that views part of a larger storage counts the whole storage once (that memory is
    held as long as the view lives).
    """
    seen: dict[tuple[torch.device, int], int] = {}
    for leaf in tree.leaves(values):
        if not isinstance(leaf, torch.Tensor):
            continue
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
