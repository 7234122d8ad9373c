"""`on_gradient`: observe the moment backward reaches a value, for ordering and overlap tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["on_gradient"]


class _OnGradient(torch.autograd.Function):
    """Identity forward; backward calls the callback with the gradient, then passes it on."""

    @staticmethod
    def forward(x: torch.Tensor, callback: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.callback = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.callback(grad)
        return grad, None


def on_gradient(x: torch.Tensor, callback: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """`x` unchanged; `callback(grad)` runs when backward computes the gradient w.r.t. it.

    Tests use it to check *when* something happens during backward, e.g. that a strategy
    started reducing gradient buckets before the first layer's gradient was computed:
    ``params["0.weight"] = on_gradient(params["0.weight"], lambda g: seen.append(n_records()))``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"on_gradient: `x` must be a tensor, got {type(x).__name__}")
    if not callable(callback):
        raise TypeError(f"on_gradient: `callback` must be callable, got {type(callback).__name__}")
    return _OnGradient.apply(x, callback)
