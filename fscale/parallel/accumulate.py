"""`accumulate(step, micro_batches)`: gradient accumulation as a transformation of any Step.

Each batch is split into `micro_batches` equal, contiguous slices along `dim`
(`fscale.data.split_batch`: dim 0 for batch-major batches, 1 for time-major ``[T, B]`` ones); the
wrapped plan's gradient phase runs once per slice and the gradients are summed in the plan's
own layout. Each slice's loss is weighted by its share of the batch before differentiation, so
the step's gradient is the gradient of the mean loss over the whole batch — counted by samples,
not by micro-batch — and its ``loss`` metric is that mean: equal, to fp32 round-off, to one step
on the whole batch.

One reduction per step where the plan allows it: the context marks every slice but the last as
not final, so data-parallel reducers (DDP's all-reduce, ZeRO's reduce-scatter, HSDP's all-reduce
of shards) run once, on the last slice's backward, with the earlier slices' sum seeded into
their buckets — the reduction still overlaps that backward. Under `fully_shard` each slice's
gradient is reduce-scattered by the all-gather's dual (the full gradient never exists there),
and the shards are summed. Buffers (BatchNorm statistics) are threaded through the slices in
order; the key is folded with the slice index (when there is more than one), so dropout
differs between slices and replays exactly.

Memory: between slices the plan holds one accumulated gradient in its state layout (full
gradients under DDP and ZeRO, as torch DDP's ``no_sync``; shards under ``fully_shard``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fscale import random as fsrandom
from fscale import tree
from fscale.data import split_batch
from fscale.parallel import layers
from fscale.plan import GradAux, Plan
from fscale.train import Step

__all__ = ["AccumulatePlan", "accumulate"]


@dataclasses.dataclass(frozen=True, repr=False)
class AccumulatePlan(Plan):
    """Split the batch, run the inner gradient phase per slice, sum the gradients."""

    inner: Plan
    micro_batches: int
    dim: int

    @property
    def name(self) -> str:
        return "accumulate"

    def describe(self) -> str:
        return f"accumulate(micro_batches={self.micro_batches}, dim={self.dim})"

    def gradients(self, step, state, batch, ctx):
        if ctx.key is None:
            raise ValueError("accumulate: `ctx.key` is None; call step.gradients(...)")
        count = self.micro_batches
        weight = 1.0 / count
        total, buffers = ctx.accumulated, state.buffers
        losses: list[torch.Tensor] = []
        scalars: dict[str, list[torch.Tensor]] = {}
        aux: GradAux | None = None
        used: tuple[bool, ...] | None = None
        for index in range(count):
            micro = split_batch(batch, index, count, self.dim)
            key = fsrandom.fold_in(ctx.key, index) if count > 1 else ctx.key
            micro_ctx = ctx.replace(
                key=key,
                loss_weight=ctx.loss_weight * weight,
                accumulated=total,
                final=ctx.final and index == count - 1,
            )
            total, aux = self.inner.gradients(
                step, tree.with_fields(state, buffers=buffers), micro, micro_ctx
            )
            buffers = aux.buffers
            used = _either(used, aux.used) if index else aux.used
            losses.append(aux.loss)
            for name, value in aux.metrics.items():
                if _is_scalar(value):
                    scalars.setdefault(name, []).append(value)
        assert aux is not None
        metrics = dict(aux.metrics)
        for name, values in scalars.items():
            if len(values) == count:  # reported by every slice: the mean over the batch
                metrics[name] = _mean(values, weight)
        return total, tree.with_fields(
            aux, loss=_mean(losses, weight), buffers=buffers, metrics=metrics, used=used
        )


def _either(a: tuple[bool, ...] | None, b: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
    """A leaf is used by the step when some micro-batch used it (None: usage not tracked)."""
    if a is None or b is None:
        return None
    return tuple(x or y for x, y in zip(a, b))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _mean(values: list[torch.Tensor], weight: float) -> torch.Tensor:
    total = values[0] * weight
    for value in values[1:]:
        total = total + value * weight
    return total


def accumulate(step: Step, micro_batches: int, *, dim: int = 0) -> Step:
    """Accumulate gradients over `micro_batches` slices of each batch (see the module docstring).

    Args:
        step: any Step (local, data parallel, ZeRO, fully sharded, a plan of your own). Inside
            a data-parallel layer or outside it, the reduction runs once per step.
        micro_batches: the number of slices; it must divide every batch leaf's size along `dim`.
        dim: the batch dimension of the batch's tensors (1 for time-major ``[T, B]`` batches).

    Returns:
        A Step whose gradient is that of the mean loss over the whole batch, and whose
        ``loss`` metric is that mean.

    Raises:
        TypeError / ValueError: `step` is not a Step, `micro_batches` is not a positive int,
            `dim` is not an int. At the first step: a batch not divisible into the slices.
    """
    layers.check_step(step, "accumulate")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(
            f"accumulate: `micro_batches` must be a positive int, got {micro_batches!r}"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"accumulate: `dim` must be an int, got {type(dim).__name__}")
    return step.replace(plan=AccumulatePlan(step.plan, micro_batches, dim))
