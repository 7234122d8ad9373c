"""`to_list`: a tensor's values as Python numbers, on every torch fscale supports.

Host-side decisions (a key's words, collective metadata compared across ranks, token counts)
read small tensors back with ``tolist()``. Under torch < 2.7, a tensor made inside a
``torch.func`` transform (``grad_mode="func"``) is a wrapper without storage of its own, and
``tolist()`` raises "Cannot access data pointer"; ``item()`` reads it, one element at a time.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_list"]


def to_list(t: torch.Tensor) -> Any:
    """``t.tolist()``: nested lists of Python numbers (a number for a 0-d tensor)."""
    try:
        return t.tolist()
    except RuntimeError:
        if t.dim() == 0:
            return t.item()
        return [to_list(row) for row in t.unbind(0)]
