"""`DeferredBatchNorm`: BatchNorm whose running statistics are those of the whole batch.

Under micro-batches a plain BatchNorm updates its running mean and variance once per
micro-batch, from that micro-batch's statistics: after a step they differ from a full-batch
BatchNorm's. `DeferredBatchNorm` (torchgpipe's idea) normalises each micro-batch with its own
statistics, as in training, but only accumulates the per-channel sum, sum of squares and count
in buffers; after `micro_batches` micro-batches it commits one update of the running statistics
from the accumulated ones — mean ``Σx / n`` and unbiased variance ``(Σx² − n·mean²) / (n − 1)``
— with the layer's momentum, exactly as one BatchNorm call on the concatenated batch would.

Everything it keeps is a buffer, so under `fscale.functionalize` the accumulation is threaded
through the micro-batches as any buffer is (and a recomputed stage updates a throwaway copy).
In eval mode it is a BatchNorm using the running statistics.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferredBatchNorm", "deferred_batch_norm"]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm over dim 1 whose running statistics are committed once per `micro_batches`.

    Args:
        num_features: channels (dim 1 of the input).
        micro_batches: micro-batches per batch: the statistics are committed after this many.
        eps, momentum, affine: as ``nn.BatchNorm1d`` (`momentum` None is not supported: the
            cumulative average needs no deferral).
    """

    sum: torch.Tensor
    sum_squares: torch.Tensor
    count: torch.Tensor
    tracked: torch.Tensor

    def __init__(
        self,
        num_features: int,
        micro_batches: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
    ) -> None:
        if (
            isinstance(micro_batches, bool)
            or not isinstance(micro_batches, int)
            or micro_batches < 1
        ):
            raise ValueError(
                f"DeferredBatchNorm: `micro_batches` must be a positive int, got {micro_batches!r}"
            )
        if momentum is None:
            raise ValueError("DeferredBatchNorm: `momentum` must be a number, not None")
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.micro_batches = micro_batches
        self.register_buffer("sum", torch.zeros(num_features))
        self.register_buffer("sum_squares", torch.zeros(num_features))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("tracked", torch.zeros((), dtype=torch.int64))

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm: expected an input with a channel dim 1, got shape "
                f"{tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        dims = [d for d in range(input.dim()) if d != 1]
        with torch.no_grad():
            values = input.detach()
            self.sum.add_(values.sum(dims))
            self.sum_squares.add_((values * values).sum(dims))
            self.count.add_(values.numel() // values.shape[1])
            self.tracked.add_(1)
            if int(self.tracked) == self.micro_batches:
                self._commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _commit(self) -> None:
        n = int(self.count)
        mean = self.sum / n
        var = (self.sum_squares - n * mean * mean) / max(n - 1, 1)
        momentum = float(self.momentum)  # type: ignore[arg-type]
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)  # type: ignore[union-attr]
        self.running_var.mul_(1 - momentum).add_(var, alpha=momentum)  # type: ignore[union-attr]
        self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count.zero_()
        self.tracked.zero_()


def deferred_batch_norm(module: nn.Module, micro_batches: int) -> nn.Module:
    """A copy of `module` with every BatchNorm (1d/2d/3d, tracking running statistics) replaced
    by a `DeferredBatchNorm` holding the same parameters and statistics."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"deferred_batch_norm: `module` must be an nn.Module, got {module!r}")
    module = copy.deepcopy(module)
    return _convert(module, micro_batches)


def _convert(module: nn.Module, micro_batches: int) -> Any:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
        if isinstance(module, DeferredBatchNorm):
            return module
        replacement = DeferredBatchNorm(
            module.num_features,
            micro_batches,
            module.eps,
            0.1 if module.momentum is None else module.momentum,
            module.affine,
        )
        with torch.no_grad():
            if module.affine:
                replacement.weight.copy_(module.weight)
                replacement.bias.copy_(module.bias)
            replacement.running_mean.copy_(module.running_mean)  # type: ignore[union-attr]
            replacement.running_var.copy_(module.running_var)  # type: ignore[union-attr]
            replacement.num_batches_tracked.copy_(module.num_batches_tracked)  # type: ignore[union-attr]
        replacement.train(module.training)
        return replacement
    for name, child in module.named_children():
        setattr(module, name, _convert(child, micro_batches))
    return module
