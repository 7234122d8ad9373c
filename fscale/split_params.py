"""Parameters that a model spreads over ranks itself, so that a step can see them.

A `tensor_parallel` model's parameters are shards and replicas of the dense model's, one set per
rank of its axis. A pointwise optimizer updates them as the dense one would; a non-pointwise one
(`clip_by_global_norm`, `lamb`, `adafactor`) takes its norms and means over whole tensors and
must be told where the rest of each tensor is (`fscale.parallel.tensor.tensor_parallel_optimizer`).
`fscale.Step.init` asks `spread_over` of every parameter it is given and refuses such an
optimizer unwrapped, instead of letting each rank clip and scale by statistics of its own; and
refuses AdaScale, whose gain would come from the norms of each rank's shards.

A mark lives as long as the module's parameter it was put on (a weak reference), and is found
from any tensor that shares the parameter's memory (the detached leaves `fscale.functionalize`
hands out).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fscale import tree

__all__ = ["check_statistics_span_the_model", "mark_spread", "spread_over"]

_MARKS: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


def mark_spread(parameter: torch.Tensor, axis: str) -> None:
    """Note that `parameter` is one rank's part of a model spread over the mesh axis `axis`."""
    key = _address(parameter)
    if key is not None:
        _MARKS[key] = (weakref.ref(parameter, lambda _, key=key: _MARKS.pop(key, None)), axis)


def spread_over(tensor: torch.Tensor) -> str | None:
    """The axis over which the model of the parameter that `tensor` shares memory with is spread,
    or None."""
    key = _address(tensor)
    found = _MARKS.get(key) if key is not None else None
    if found is None:
        return None
    parameter = found[0]()
    return found[1] if parameter is not None and _address(parameter) == key else None


def _address(tensor: torch.Tensor) -> int | None:
    if tensor.device.type == "meta":
        return None
    pointer = tensor.untyped_storage().data_ptr()
    return pointer if pointer else None


def check_statistics_span_the_model(params: Any, optimizer: Any, *, adascale: bool) -> None:
    """Refuse, at `Step.init`, statistics over a tensor-parallel model's shards that would be
    this rank's own: a non-pointwise `optimizer` that `tensor_parallel_optimizer` does not
    wrap, and (`adascale`) AdaScale's gain."""
    # Wrapped, possibly inside another wrapper (offload_optimizer(tensor_parallel_optimizer(...))).
    wrapped = "tensor_parallel_optimizer(" in optimizer.description
    if not adascale and (optimizer.pointwise or wrapped):
        return
    paths, leaves, _ = tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        axis = spread_over(leaf) if isinstance(leaf, torch.Tensor) else None
        if axis is None:
            continue
        where = (
            f"Step.init: params leaf `{path}` is one rank's part of a model that tensor_parallel "
            f"spreads over {axis!r}"
        )
        if adascale:
            raise ValueError(
                f"{where}, and adascale's gain would come from the gradient norms of this rank's "
                "shards, different on every rank: adascale of a tensor-parallel model is not "
                "supported; train it without adascale"
            )
        raise ValueError(
            f"{where}, and {optimizer!r} is not pointwise: its norms and means would be this "
            "rank's own, different on every rank. Wrap it: "
            "fscale.parallel.tensor.tensor_parallel_optimizer(optimizer, model)"
        )
