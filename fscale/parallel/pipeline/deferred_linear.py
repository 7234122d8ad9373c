"""Linear layers whose weight gradient waits for W: the input's gradient alone in B.

A zero-bubble schedule wants B, the backward that feeds the previous stage, to do as little as
it can, and W, the weights' part, to run later where the pipeline would idle. Most of a
stage's weight-gradient work is in its linear layers (``grad_weight = gradᵀ · x``). While the
runner holds a micro-batch's `deferring` block, a module stage runs its plain ``nn.Linear``
layers (`linear_layers`, under `recording`) on detached weights whenever their weight and
bias are among the stage's own parameter leaves and their input needs a gradient: the backward
computes the input's gradient only, and a hook on the output leaves the pair (input, output
gradient) in the micro-batch's `LinearStore`. B is
then one ordinary backward over the whole graph — the input's gradient and every other
parameter's (layer norms, embeddings: cheap) — which frees the graph; W
(`LinearStore.weight_grads`) is a matrix product per recorded layer. The unsplit schedules use
the same store to send a stage's input gradient before its linear layers' weight gradients,
which the runner then computes at once, in the same B.

This costs no graph walk and no extra autograd call per weight, unlike differentiating the
kept graph from recorded frontier nodes (`fscale.parallel.pipeline.split_backward`, which
stays the general method: stage functions, a stage with no plain linear layer, a checkpointed
micro-batch, weights seen through a cast). The products are those autograd's own linear
backward computes (``gᵀ·x`` and the sum over rows), in the same order, so the gradients
equal the unsplit backward's bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["LinearStore", "deferring", "linear_layers", "recording"]

Tensor = torch.Tensor
# The store of the stage forward running in this context, if it defers (`deferring`).
_ACTIVE: contextvars.ContextVar[LinearStore | None] = contextvars.ContextVar(
    "fscale_deferred_linears", default=None
)


class LinearStore:
    """The linear layers of one micro-batch's stage forward whose weight gradient is deferred.

    `index` maps ``id(tensor)`` of each parameter leaf to its position among the stage's
    weights."""

    def __init__(self, index: dict[int, int]) -> None:
        self.index = index
        # (weight position, bias position or None, input, output gradient once B ran, the
        # input's version counter when the layer ran)
        self.entries: list[list[Any]] = []

    def weight_grads(self, num_weights: int) -> list[Tensor | None]:
        """W: the recorded layers' weight and bias gradients (summed per parameter)."""
        found: list[Tensor | None] = [None] * num_weights
        for weight_at, bias_at, x, grad, version in self.entries:
            if grad is None:  # the layer's output did not reach the roots
                continue
            if x._version != version:  # autograd's own check, for the input it no longer saves
                raise RuntimeError(
                    "pipeline: the input of a linear layer was modified in place after the "
                    f"layer used it (shape {tuple(x.shape)}); the deferred weight gradient would "
                    "use the modified values. Make that operation out of place, or use a "
                    "schedule that does not split B and W"
                )
            g = grad.reshape(-1, grad.shape[-1])
            # gᵀ·x, autograd's own product for a linear layer's weight (its mm backward
            # computes it so for a transposed weight): contiguous, where (xᵀ·g)ᵀ would be a
            # transposed view that every later sum reads across the grain.
            parts = [(weight_at, g.t().mm(x.reshape(-1, x.shape[-1])))]
            if bias_at is not None:
                parts.append((bias_at, g.sum(0)))
            for at, value in parts:
                held = found[at]
                found[at] = value if held is None else held + value
        self.entries = []
        return found


def _deferred_forward(module: nn.Linear, store: LinearStore, x: Tensor) -> Tensor:
    """`module`'s forward, recorded in `store` when its weight and bias are stage leaves.

    The layer runs on detached weights, so its backward computes the input's gradient alone
    (autograd's own kernel, which skips the weight's product); a hook on the output keeps the
    output's gradient beside the input for W. Plain operations and one hook, no Function: a
    Python Function per layer cost ~50 µs of each micro-batch's forward on small layers."""
    weight, bias = module.weight, module.bias
    index = store.index
    weight_at = index.get(id(weight))
    bias_at = None if bias is None else index.get(id(bias))
    if (
        weight_at is None
        or (bias is not None and bias_at is None)
        or not torch.is_grad_enabled()
        or not x.requires_grad  # no backward reaches the layer's output
    ):
        return torch.nn.functional.linear(x, weight, bias)
    entry: list[Any] = [weight_at, bias_at, x.detach(), None, x._version]
    store.entries.append(entry)
    y = torch.nn.functional.linear(x, weight.detach(), None if bias is None else bias.detach())
    y.register_hook(functools.partial(_keep_output_grad, entry))
    return y


def _keep_output_grad(entry: list[Any], grad: Tensor) -> None:
    entry[3] = grad


@contextlib.contextmanager
def deferring(weights: Sequence[Tensor]) -> Iterator[LinearStore]:
    """The block's `linear_layers` on `weights` record into the yielded store."""
    store = LinearStore({id(t): j for j, t in enumerate(weights)})
    token = _ACTIVE.set(store)
    try:
        yield store
    finally:
        _ACTIVE.reset(token)


def linear_layers(module: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers in `module` (a subclass may compute something else)."""
    return [m for m in module.modules() if type(m) is nn.Linear]


@contextlib.contextmanager
def recording(linears: Sequence[nn.Linear]) -> Iterator[None]:
    """Inside a `deferring` block, run `linears` as deferred layers; else change nothing.

    The layers' forward is shadowed on the instances for the block (an instance attribute, so
    the class and every other instance are untouched) and restored after."""
    store = _ACTIVE.get()
    if store is None or not linears:
        yield
        return
    for layer in linears:
        object.__setattr__(layer, "forward", functools.partial(_deferred_forward, layer, store))
    try:
        yield
    finally:
        for layer in linears:
            layer.__dict__.pop("forward", None)
