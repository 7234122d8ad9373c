"""Per-replica squared gradient norms, read in backward before any reduction sees the gradient.

AdaScale needs L = Σ‖g_i‖² over the small-batch gradients each rank computes, before data
parallelism averages them (FairScale reads them in a tensor hook that runs before DDP's
all-reduce). Under every plan, the one place a rank's own gradient exists whole is at the loss
function's inputs: the full parameters under `data_parallel` and `shard_optimizer`, each unit's
gathered parameters under `fully_shard` (whose gradient is reduce-scattered right after). So
the loss function is wrapped (`ObservedLoss`): while a `Tally` is open, every tensor the loss
receives passes through an identity whose backward adds ``Σ (w · g)²`` to the tally (w the
optional per-element weight of a preconditioned estimate) and hands the gradient on unchanged.

What passes through the identity: each leaf of a params tree; the eager parameters and each
unit's parameters of a `fscale.functional.UnitParams`, inside the unit's own call (so a
resharded or recomputed unit is observed where its gathered parameters exist). A tensor hook
fires once with a tensor's whole gradient, however often the loss uses it; a unit called twice
in one forward would give two partial gradients, whose squares do not add up to the square of
their sum, so the tally counts calls and the caller refuses that case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fscale import tracking, tree
from fscale.functional import ParamUnit, UnitCall, UnitParams

__all__ = ["ObservedLoss", "Tally", "observing"]

PyTree = Any
Weights = Mapping[str, torch.Tensor] | None


class Tally:
    """The squared norms of one step's local gradients, summed as backward produces them.

    Attributes:
        loss_calls: how many times the loss function ran (one per micro-batch).
        unit_calls: per unit name, the differentiated calls in the current loss call.
        repeated: the name of a unit called more than once in one forward, or None.
        weights: per parameter name (or leaf path), the preconditioner's weight, or None.
    """

    def __init__(self, weights: Weights = None) -> None:
        self._sums: list[torch.Tensor] = []
        self.loss_calls = 0
        self.unit_calls: dict[str, int] = {}
        self.repeated: str | None = None
        self.weights = weights

    def add(self, grad: torch.Tensor, weight: torch.Tensor | None) -> None:
        if weight is not None:
            grad = grad * weight
        # Kept on the gradient's device: a copy to the host here would wait for the device
        # once per parameter, in the middle of backward.
        self._sums.append(grad.detach().square().sum(dtype=torch.float64))

    def local_sqr(self, device: torch.device) -> torch.Tensor:
        """Σ over the observed gradients of ``Σ (w · g)²`` (float64, on `device`), this rank."""
        if not self._sums:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack([s.to(device) for s in self._sums]).sum()

    def observe(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        weight = None if self.weights is None else self.weights.get(name)
        return _Observed.apply(tensor, self, weight)

    def observe_named(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.observe(name, tensor) for name, tensor in named.items()}


class _Observed(torch.autograd.Function):
    """Identity; its backward adds the squared norm of the gradient to a `Tally`."""

    @staticmethod
    def forward(tensor: torch.Tensor, tally: Tally, weight: torch.Tensor | None) -> torch.Tensor:
        # A view, so a resharded unit's saved-tensor hooks still see its gathered buffer.
        return tensor.view_as(tensor)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.tally, ctx.weight = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.tally.add(grad, ctx.weight)
        return grad, None, None


class _ObservedUnit:
    """A `ParamUnit` whose parameters pass through the tally's identity at each call."""

    def __init__(self, unit: ParamUnit, tally: Tally) -> None:
        self.inner = unit
        self.name = unit.name
        self.names = unit.names
        self.tally = tally

    def materialize(self) -> Mapping[str, torch.Tensor]:
        self._count()
        return self.tally.observe_named(self.inner.materialize())

    def call(self, call: UnitCall) -> Any:
        def run(params: Mapping[str, torch.Tensor], state: Any, args: tuple, kwargs: dict) -> Any:
            if torch.is_grad_enabled():  # a recomputing unit's no-graph forward is not counted
                self._count()
            return call.run(self.tally.observe_named(params), state, args, kwargs)

        return self.inner.call(tree.with_fields(call, run=run))

    def _count(self) -> None:
        calls = self.tally.unit_calls
        calls[self.name] = calls.get(self.name, 0) + 1
        if calls[self.name] > 1 and self.tally.repeated is None:
            self.tally.repeated = self.name


def _observe_params(params: PyTree, tally: Tally) -> PyTree:
    if isinstance(params, UnitParams):
        units = [_ObservedUnit(unit, tally) for unit in params.units.values()]
        return UnitParams(tally.observe_named(params.eager), units)
    paths, leaves, treedef = tree.flatten_with_paths(params)
    return tree.unflatten(treedef, [tally.observe(p, t) for p, t in zip(paths, leaves)])


_TALLIES: tracking.Stack[Tally] = tracking.stack(__name__)


def observing(tally: Tally) -> Any:
    """A ``with`` block in which `ObservedLoss` functions report to `tally`."""
    return _TALLIES.open(tally)


class ObservedLoss:
    """`loss_fn` whose parameter gradients are observed while a `Tally` is open.

    Outside an `observing` block it is `loss_fn` itself (an evaluation call, say).
    """

    def __init__(self, loss_fn: Callable[..., Any]) -> None:
        self.loss_fn = loss_fn
        functools.update_wrapper(self, loss_fn)

    def __call__(self, params: PyTree, buffers: PyTree, batch: Any, key: torch.Tensor) -> Any:
        if not _TALLIES:
            return self.loss_fn(params, buffers, batch, key)
        tally = _TALLIES.top()
        assert tally is not None  # the stack is not empty
        tally.loss_calls += 1
        tally.unit_calls = {}
        return self.loss_fn(_observe_params(params, tally), buffers, batch, key)
