"""The stages of a pipeline: user functions, or an ``nn.Sequential`` cut by a `balance` list.

Either form becomes `Stages`: one call per stage, ``call(params_s, buffers_s, x, key) ->
(y, buffers_s)`` with `key` the micro-batch's key, and the map between the full model's state
and the stages' pieces (`split` / `merge`):

- **functions**: ``stage_i(params_i, buffers_i, x, key) -> (y, buffers_i)`` (or just ``y``
  when it is one tensor; an output that is a pytree of tensors comes with the buffers);
  the full params and buffers are lists with one pytree per stage. The key a stage sees is the
  micro-batch's key folded with the stage index.
- **modules**: an ``nn.Sequential`` (or a list of modules, named ``"0"``, ``"1"`` ... as a
  Sequential would name them) and `balance`, the number of consecutive layers per stage. A
  stage's layers are held under their Sequential names by one container module, functionalized
  once, so a stage runs as one functional call (the fixed cost of a call is paid per stage and
  micro-batch, not per layer); its params and buffers are dicts keyed by the Sequential's own
  names (``"3.weight"``), so the full state is exactly what ``fscale.functionalize(sequential)``
  returns. Each layer runs under the RNG seeded by the micro-batch's key folded with the
  layer's index, so dropout masks do not depend on the balance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fscale import random as fsrandom
from fscale import tree
from fscale.functional import functionalize
from fscale.functional.rng import reseeding
from fscale.parallel.pipeline import deferred_linear

__all__ = ["StageCall", "Stages", "function_stages", "module_stages"]

PyTree = Any
StageCall = Callable[[PyTree, PyTree, PyTree, torch.Tensor], tuple[PyTree, PyTree]]


@dataclasses.dataclass(frozen=True)
class Stages:
    """The stages' calls and how the full model's pytrees split into per-stage pieces.

    Attributes:
        calls: one call per stage.
        deferrable: per stage, whether its backward can leave its linear layers' weight
            gradients for later (module stages with plain ``nn.Linear`` layers).
        param_names: for the modules form, the Sequential's parameter names of each stage, and
            `buffer_names` its buffer names; None for the functions form.
    """

    calls: tuple[StageCall, ...]
    param_names: tuple[tuple[str, ...], ...] | None = None
    buffer_names: tuple[tuple[str, ...], ...] | None = None
    deferrable: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.deferrable:  # nothing said: no stage defers
            object.__setattr__(self, "deferrable", (False,) * len(self.calls))

    def __len__(self) -> int:
        return len(self.calls)

    def split(self, full: PyTree, which: str, caller: str) -> list[PyTree]:
        """The per-stage pieces of the full model's `which` ("params" or "buffers")."""
        count = len(self.calls)
        if self.param_names is None:
            if full is None or (isinstance(full, dict) and not full and which == "buffers"):
                return [{} for _ in range(count)]
            if not isinstance(full, (list, tuple)) or len(full) != count:
                raise ValueError(
                    f"{caller}: `{which}` must be a list with one pytree per stage ({count}), "
                    f"got {type(full).__name__}"
                    + (f" of length {len(full)}" if isinstance(full, (list, tuple)) else "")
                )
            return list(full)
        names = self.param_names if which == "params" else self.buffer_names
        assert names is not None
        full = {} if full is None else full
        if not isinstance(full, dict):
            raise TypeError(
                f"{caller}: `{which}` must be the dict that fscale.functionalize(sequential) "
                f"returns, got {type(full).__name__}"
            )
        wanted = {name for stage in names for name in stage}
        missing, extra = sorted(wanted - set(full)), sorted(set(full) - wanted)
        if missing or extra:
            raise ValueError(
                f"{caller}: `{which}` does not match the pipeline's layers (missing: "
                f"{missing[:3]}, unexpected: {extra[:3]}); pass the {which} of "
                "fscale.functionalize(sequential) for the Sequential the pipeline was built from"
            )
        return [{name: full[name] for name in stage} for stage in names]

    def merge(self, pieces: Sequence[PyTree]) -> PyTree:
        """The full model's pytree from one piece per stage (the inverse of `split`)."""
        if self.param_names is None:
            return list(pieces)
        merged: dict[str, Any] = {}
        for piece in pieces:
            merged.update(piece)
        return merged


def function_stages(functions: Sequence[Any], caller: str) -> Stages:
    """`Stages` of user functions ``stage_i(params_i, buffers_i, x, key)``."""
    calls = []
    for index, fn in enumerate(functions):
        if not callable(fn):
            raise TypeError(
                f"{caller}: `stages[{index}]` must be callable as stage(params, buffers, x, key),"
                f" got {type(fn).__name__}"
            )
        calls.append(_function_call(fn, index))
    return Stages(tuple(calls))


def _function_call(fn: Callable[..., Any], index: int) -> StageCall:
    def call(params: PyTree, buffers: PyTree, x: PyTree, key: torch.Tensor) -> Any:
        out = fn(params, buffers, x, fsrandom.fold_in(key, index))
        # A lone tensor is the output; anything else is the pair (output pytree, buffers).
        return (out, buffers) if isinstance(out, torch.Tensor) else out

    return call


def module_stages(module: Any, balance: Any, caller: str) -> Stages:
    """`Stages` of an ``nn.Sequential`` (or list of modules) cut by `balance`."""
    if isinstance(module, nn.Sequential):
        named = list(module.named_children())
    elif isinstance(module, (list, tuple)) and all(isinstance(m, nn.Module) for m in module):
        named = [(str(i), m) for i, m in enumerate(module)]
    else:
        raise TypeError(
            f"{caller}: `stages` must be a sequence of stage functions, an nn.Sequential or a "
            f"list of modules, got {type(module).__name__}"
        )
    bounds = _check_balance(balance, len(named), caller)
    _check_untied(named, caller)
    calls, param_names, buffer_names, deferrable = [], [], [], []
    for start, stop in bounds:
        container = _StageLayers([(i, named[i][0], named[i][1]) for i in range(start, stop)])
        apply, params, buffers = functionalize(container)
        calls.append(_stage_call(apply))
        param_names.append(tuple(params))
        buffer_names.append(tuple(buffers))
        deferrable.append(bool(container._linears))
    return Stages(tuple(calls), tuple(param_names), tuple(buffer_names), tuple(deferrable))


class _StageLayers(nn.Module):
    """A stage's layers under their Sequential names, each run under its own layer key."""

    def __init__(self, layers: list[tuple[int, str, nn.Module]]) -> None:
        super().__init__()
        self._layer_indices: list[int] = []
        for index, name, layer in layers:
            self.add_module(name, layer)
            self._layer_indices.append(index)
        # Plain references in call order: the functional call swaps tensors inside the
        # modules, never the modules themselves.
        self._layers: list[nn.Module] = [layer for _, _, layer in layers]
        self._linears = deferred_linear.linear_layers(self)

    def forward(self, x: PyTree, key: torch.Tensor) -> PyTree:
        # Layer i runs under the seed of fold_in(key, i), as under `seeded_by`; the generators
        # are saved and restored once per stage. The stage's input tells the accelerator in
        # use (the layers' tensors live with it), cheaper to ask than every layer's parameters.
        inputs = tree.leaves(x)
        seeds = fsrandom.fold_in_seeds(key, self._layer_indices)
        with reseeding(lambda: inputs) as reseed, deferred_linear.recording(self._linears):
            for layer, seed in zip(self._layers, seeds):
                reseed(seed)
                x = layer(x)
        return x


def _stage_call(apply: Any) -> StageCall:
    def call(params: PyTree, buffers: PyTree, x: torch.Tensor, key: torch.Tensor) -> Any:
        return apply(params, buffers, x, key)

    return call


def _check_balance(balance: Any, num_layers: int, caller: str) -> list[tuple[int, int]]:
    if balance is None:
        raise ValueError(
            f"{caller}: a module pipeline needs `balance`, the number of layers of each stage "
            f"(e.g. fscale.balance_by_time(layers, sample, partitions)); it has {num_layers} "
            "layers"
        )
    if not isinstance(balance, (list, tuple)) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in balance
    ):
        raise ValueError(f"{caller}: `balance` must be a list of positive ints, got {balance!r}")
    if sum(balance) != num_layers:
        raise ValueError(
            f"{caller}: `balance` {list(balance)} sums to {sum(balance)}, but the model has "
            f"{num_layers} layers; the stages must cover every layer once"
        )
    bounds, start = [], 0
    for size in balance:
        bounds.append((start, start + size))
        start += size
    return bounds


def _check_untied(named: list[tuple[str, nn.Module]], caller: str) -> None:
    owner: dict[int, str] = {}
    for name, layer in named:
        for param_name, param in layer.named_parameters():
            first = owner.setdefault(id(param), f"{name}.{param_name}")
            if not first.startswith(f"{name}."):
                raise ValueError(
                    f"{caller}: layers share the parameter {first} (also {name}.{param_name}); "
                    "a module pipeline needs untied layers. Tie them in the functions form: "
                    "one stage function that uses the weight twice"
                )
