"""`balance_by_time` / `balance_by_size`: cut a list of layers into contiguous stages of even cost.

Both measure a cost per layer by running the layers once in order on a sample (each layer on
the output of the one before), then `partition` the costs into `partitions` contiguous parts
minimising the largest part — the slowest stage sets a pipeline's pace. The loss counts too:
given `loss_fn` and `targets`, its forward and backward are measured and added to the last
layer, which is where the pipeline runs it (a head and loss left uncounted made the last stage
of a 2-stage GPT the slowest by far).

- time: the forward and backward of each layer, the fastest of `repeats` runs (microseconds);
- size: the bytes each layer saves for backward (measured with saved-tensor hooks: its
  activation memory per sample batch) plus `param_scale` times its parameter bytes (weights,
  gradient and optimizer state: 2 for SGD, about 4 for Adam).

`partition` is exact: dynamic programming over (layers, parts), O(n²·k).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["balance_by_size", "balance_by_time", "layer_costs", "partition"]


def partition(costs: Sequence[float], partitions: int) -> list[int]:
    """The sizes of `partitions` contiguous, non-empty parts of `costs` whose largest sum is the
    smallest possible (ties: the earliest cut points)."""
    n = len(costs)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partition: `partitions` must be a positive int, got {partitions!r}")
    if partitions > n:
        raise ValueError(
            f"partition: cannot cut {n} layers into {partitions} non-empty stages; use at most "
            f"{n} partitions"
        )
    if any(c < 0 for c in costs):
        raise ValueError("partition: `costs` must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest largest part cutting the first i layers into k parts.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(partitions, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _layers(layers: Any, caller: str) -> list[nn.Module]:
    if isinstance(layers, nn.Sequential):
        return list(layers.children())
    if (
        isinstance(layers, (list, tuple))
        and layers
        and all(isinstance(m, nn.Module) for m in layers)
    ):
        return list(layers)
    raise TypeError(
        f"{caller}: `layers` must be an nn.Sequential or a list of modules, got "
        f"{type(layers).__name__}"
    )


def _run_layer(layer: nn.Module, x: Any, loss: Callable[[torch.Tensor], torch.Tensor] | None):
    """One forward and backward of `layer` on `x`, its gradients returned, not accumulated."""
    x_in = x.detach().requires_grad_(True) if x.is_floating_point() else x
    y = layer(x_in)
    out = loss(y) if loss is not None else y
    wanted = [x_in] if x_in.requires_grad else []
    wanted += [p for p in layer.parameters() if p.requires_grad]
    if wanted and out.requires_grad:
        grad = torch.ones_like(out)
        torch.autograd.grad(out, wanted, grad, allow_unused=True)
    return y.detach()


def _saved_bytes(layer: nn.Module, x: Any, loss: Any) -> tuple[float, torch.Tensor]:
    """The bytes `layer` (and `loss`) save for backward on `x`, and the layer's output."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _run_layer(layer, x, loss)
    return float(sum(saved)), y


def layer_costs(
    layers: Any,
    sample: Any,
    kind: str,
    *,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    targets: Any = None,
    repeats: int = 3,
    param_scale: float = 2.0,
) -> list[float]:
    """Per-layer cost, ``kind`` "time" (microseconds) or "size" (bytes): see the module doc."""
    caller = f"balance_by_{kind}"
    modules = _layers(layers, caller)
    if (loss_fn is None) != (targets is None):
        raise ValueError(f"{caller}: give `loss_fn` and `targets` together, or neither")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{caller}: `repeats` must be a positive int, got {repeats!r}")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"{caller}: `sample` must be a tensor (a batch of inputs)")
    costs, x = [], sample
    for index, layer in enumerate(modules):
        last = index == len(modules) - 1
        loss = (lambda y: loss_fn(y, targets)) if last and loss_fn is not None else None
        if kind == "time":
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                _run_layer(layer, x, loss)
                runs.append((time.perf_counter() - start) * 1e6)
            costs.append(min(runs))
            x = _run_layer(layer, x, loss)
        else:
            saved_bytes, x = _saved_bytes(layer, x, loss)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            costs.append(saved_bytes + param_scale * params)
    return costs


def balance_by_time(
    layers: Any,
    sample: torch.Tensor,
    partitions: int,
    *,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    targets: Any = None,
    repeats: int = 3,
) -> list[int]:
    """The balance (layers per stage) that evens the measured forward + backward time.

    Args:
        layers: an ``nn.Sequential`` or list of modules, as given to `fscale.pipeline`.
        sample: a batch of inputs for the first layer (a micro-batch's size measures best).
        partitions: the number of stages.
        loss_fn, targets: the pipeline's loss and a batch of targets, timed with the last layer.
        repeats: runs per layer; the fastest is kept.

    Returns:
        A list of `partitions` positive ints summing to the number of layers.
    """
    costs = layer_costs(layers, sample, "time", loss_fn=loss_fn, targets=targets, repeats=repeats)
    return partition(costs, partitions)


def balance_by_size(
    layers: Any,
    sample: torch.Tensor,
    partitions: int,
    *,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    targets: Any = None,
    param_scale: float = 2.0,
) -> list[int]:
    """The balance that evens the memory per stage: saved activations plus `param_scale` times
    the parameter bytes (arguments as `balance_by_time`)."""
    if (
        not isinstance(param_scale, (int, float))
        or isinstance(param_scale, bool)
        or param_scale < 0
    ):
        raise ValueError(f"balance_by_size: `param_scale` must be >= 0, got {param_scale!r}")
    costs = layer_costs(
        layers, sample, "size", loss_fn=loss_fn, targets=targets, param_scale=param_scale
    )
    return partition(costs, partitions)
