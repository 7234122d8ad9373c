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
(`LinearStore.add_weight_grads`) is a matrix product per recorded layer. The unsplit schedules
use the same store to send a stage's input gradient before its linear layers' weight
gradients, which the runner then computes at once, in the same B.

This costs no graph walk and no extra autograd call per weight, unlike differentiating the
kept graph from recorded frontier nodes (`fscale.parallel.pipeline.split_backward`, which
stays the general method: stage functions, a stage with no plain linear layer, a checkpointed
micro-batch, weights seen through a cast). The products are those autograd's own linear
backward computes (``gᵀ·x`` and the sum over rows). The first micro-batch's are the gradients
autograd would give, bit for bit, for every weight that serves one layer alone (one that two
layers, or a layer and other code, share gets its parts added one after the other, equal
within rounding); each later one is accumulated into the sum by the product
itself (``addmm_`` with the sum as its input: Megatron-LM's gradient accumulation fusion),
which skips writing the product out and reading it back to add it (about 3% of a 1F1B step
of the bench GPT at P = 2, M = 8, its head's 4096 x 128 weight above all; a diagnostic
comparison). The sum then equals autograd's product-then-add within fp32 rounding, not always
bit for bit: the BLAS may add the sum into its partial dot products (MKL does for a few rows
per micro-batch, and for many, where it splits the inner dimension).
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

    def add_weight_grads(self, sums: list[Tensor | None]) -> None:
        """W: add the recorded layers' weight and bias gradients into `sums` (one entry per
        weight of the stage, in `index` order), in place.

        Where ``sums[j]`` is None the layer's gradient becomes it (a new tensor in the weight's
        layout); otherwise it must be a tensor the caller owns, and the weight's product is
        accumulated into it by the matrix product itself (``addmm_``; see the module docstring
        for the rounding), a bias's column sum added to it. A weight that several layers
        record gets their products added in turn."""
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
            x2 = x.reshape(-1, x.shape[-1])
            # gᵀ·x, autograd's own product for a linear layer's weight (its mm backward
            # computes it so for a transposed weight): contiguous, where (xᵀ·g)ᵀ would be a
            # transposed view that every later sum reads across the grain.
            held = sums[weight_at]
            if held is None:
                sums[weight_at] = g.t().mm(x2)
            else:
                held.addmm_(g.t(), x2)
            if bias_at is not None:
                bias_sum = sums[bias_at]
                if bias_sum is None:
                    sums[bias_at] = g.sum(0)
                else:
                    bias_sum.add_(g.sum(0))
        self.entries = []

    def positions(self) -> set[int]:
        """The positions among the stage's weights that `add_weight_grads` would add to."""
        found = set()
        for weight_at, bias_at, _, grad, _ in self.entries:
            if grad is not None:
                found.add(weight_at)
                if bias_at is not None:
                    found.add(bias_at)
        return found


def _deferred_forward(
    module: nn.Linear, store: LinearStore, weight_at: int | None, bias_at: int | None, x: Tensor
) -> Tensor:
    """`module`'s forward, recorded in `store` when its weight and bias are stage leaves (at
    `weight_at` and `bias_at` among them, which `recording` looked up).

    The layer runs on detached weights, so its backward computes the input's gradient alone
    (autograd's own kernel, which skips the weight's product); a hook on the output keeps the
    output's gradient beside the input for W. Plain operations and one hook, no Function: a
    Python Function per layer cost ~50 µs of each micro-batch's forward on small layers."""
    weight, bias = module.weight, module.bias
    if (
        weight_at is None
        or (bias is not None and bias_at is None)
        or not torch.is_grad_enabled()
        or not x.requires_grad  # no backward reaches the layer's output
        # Under autocast the layer computes on cast copies, whose casts autograd differentiates
        # back to the weights' dtype: autograd keeps such a layer's weight gradient.
        or torch.is_autocast_enabled(x.device.type)
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
        # Looked up here, outside any compiled layer: traced, id() would guard on the identity
        # of the weights, which are new tensors every step, and recompile the layer every step.
        weight_at = store.index.get(id(layer.weight))
        bias_at = None if layer.bias is None else store.index.get(id(layer.bias))
        forward = functools.partial(_deferred_forward, layer, store, weight_at, bias_at)
        object.__setattr__(layer, "forward", forward)
    try:
        yield
    finally:
        for layer in linears:
            layer.__dict__.pop("forward", None)
