"""Means over the data axes that a step begins in its gradient phase and uses at its end.

A multi-rank step ends with the mean over its data axes of the loss (and of the loss function's
scalar metrics), and of the buffers the loss returned anew (BatchNorm statistics). Both are
known as soon as the forward pass returns, so `fscale.grad.value_and_grad` begins them there
and `Step.apply_gradients` waits for them instead of issuing collectives of its own after the
update: they travel while the backward pass computes.

- Where the reducer can take them (one data axis: ``session.fold``, see
  `fscale.parallel.reduce_sessions`), the scalars ride in the last gradient bucket's
  collective, and the buffers of their dtype (float32) after them, in the same one fold: a
  model with BatchNorm then issues no collective of its own for its means.
- Otherwise the scalars get a collective of their own, and the buffers one per dtype, all
  begun after the forward (the scalars' first).

Over two ranks every mean has two terms, which add to the same bits in any order and in any
position of a buffer, so the riding means equal those of separate collectives. Those are the
ones the end of the step would issue (`fscale.spmd.reduce_metrics`,
`fscale.spmd.average_updated_buffers`), only earlier, so every mean is bit for bit the same,
and so is every gradient of the bucket they rode in.

Over more ranks they still ride, and the bits are no longer those of separate collectives:
gloo's ring cuts a buffer into segments by its length and adds a segment's N terms in an
order set by the segment, so a riding mean is summed in the order its place in the bucket
gives, and the last bucket, longer by the riding values, may add some of its gradients in
another order than it would alone (a difference in the last bits, as between any two bucket
layouts: torch DDP's differ from fscale's in the same way). The bits are the same on every
rank and in every run of the same step; a step without riding values (under torch.compile,
or a loss function that returns other metrics) may differ from it there. What that buys: a
small collective of their own costs its every rank a ring of wake-ups, and over 4 ranks on 2
cores the two it replaces (scalars, BatchNorm buffers) cost 10–20 ms of a 130 ms ResNet step
(`bench/strategies.py --isolated --models cnn --ranks 4`, see the README).
Each mean is used only for the very values it was begun on: a metric a plan replaced after
the gradient phase (the mean over micro-batches of `fscale.accumulate`), or buffers other than
the ones the step returns, are averaged at the end as before. Under ``torch.compile`` and on
the ``grad_mode="func"`` path nothing is begun early and nothing rides in a bucket: the end of
the step averages all (a collective inside the graph would end it; under torch.func the
collectives are differentiable ones, run at once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fscale import spmd
from fscale.distributed.mesh import Mesh

__all__ = ["StepMeans", "mean_buffers", "mean_metrics"]

PyTree = Any


class StepMeans:
    """The means one step began over `axes` of `mesh`; see the module docstring.

    Args:
        mesh: the mesh of the data axes.
        axes: the step's data axes (its metrics' axes).
        session: the gradient reducer's session of this backward (None: none); where it can,
            it averages the scalars with its last bucket (``session.fold``), and holds their
            means in ``session.folded`` once its reduction is done.
    """

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], *, session: Any = None) -> None:
        self.mesh = mesh
        self.axes = tuple(axes)
        self.session = session
        self.local: dict[str, torch.Tensor] = {}
        self._stacked: Callable[[], torch.Tensor] | None = None
        self._has_folded = False  # the reducer takes one fold per step
        self._means: dict[str, torch.Tensor] | None = None
        self._buffers: spmd.StartedBufferMeans | None = None

    def after_forward(
        self,
        loss: torch.Tensor,
        metrics: dict[str, Any],
        old_buffers: PyTree,
        new_buffers: PyTree,
        *,
        scalars: bool = True,
    ) -> None:
        """Begin the means of the loss and scalar metrics (when `scalars`) and of the buffers."""
        axis = spmd.axis_arg(self.axes)
        stacked = None
        if scalars:
            names = spmd.scalar_metric_names(metrics)
            stacked = spmd.stack_scalars([loss, *(metrics[k] for k in names)])
            self.local = {"loss": loss, **{k: metrics[k] for k in names}}

        def carry(flat: torch.Tensor) -> Callable[[], torch.Tensor] | None:
            # Offered each dtype's packed buffers before their collective would begin: those of
            # the scalars' dtype ride after the scalars in the step's one fold; otherwise the
            # scalars begin first, as they would without buffers.
            if stacked is None:
                return self._ride(flat, 0)
            count = stacked.numel()
            if flat.dtype == stacked.dtype and self._stacked is None:
                carried = self._ride(torch.cat([stacked, flat]), count)
                if carried is not None:
                    self._stacked = lambda: self._folded()[:count]
                    return carried
            self._begin_scalars(stacked, axis)
            return None

        self._buffers = spmd.StartedBufferMeans(old_buffers, new_buffers, self.mesh, axis, carry)
        self._begin_scalars(stacked, axis)  # when no buffers were offered

    def _ride(self, values: torch.Tensor, start: int) -> Callable[[], torch.Tensor] | None:
        """Fold `values` into the reducer's last bucket (once per step, where it can); the
        `wait` of their means from `start` on, or None."""
        fold = getattr(self.session, "fold", None)
        if self._has_folded or fold is None or not fold(values, self.axes):
            return None
        self._has_folded = True
        return lambda: self._folded()[start:]

    def _begin_scalars(self, stacked: torch.Tensor | None, axis: str | tuple[str, ...]) -> None:
        """Begin the scalars' mean, unless begun: in the last bucket alone, or a collective."""
        if stacked is None or self._stacked is not None:
            return
        riding = self._ride(stacked, 0)
        if riding is None:
            riding = spmd.StartedMean(stacked, axis, self.mesh).wait
        self._stacked = riding

    def _folded(self) -> torch.Tensor:
        values = getattr(self.session, "folded", None)
        if values is None:
            raise RuntimeError(
                "StepMeans: the gradient reducer took the metrics into its last bucket but "
                "returned no means for them"
            )
        return values

    def returned_loss(self, loss: torch.Tensor) -> None:
        """`loss` stands for the loss begun on (the detached tensor the gradient phase returns)."""
        if "loss" in self.local:
            self.local["loss"] = loss

    def metric_means(self) -> dict[str, torch.Tensor]:
        """Metric name -> its mean over the axes, for the metrics in `local` (waits)."""
        if self._means is None:
            if self._stacked is None:
                self._means = {}
            else:
                stacked = self._stacked()
                self._means = {
                    k: stacked[i].to(v.dtype) for i, (k, v) in enumerate(self.local.items())
                }
        return self._means

    def buffers_for(self, new_buffers: PyTree) -> PyTree | None:
        """The averaged buffers if `new_buffers` are the very ones begun on, else None."""
        if self._buffers is None or not self._buffers.holds(new_buffers):
            return None
        return self._buffers.wait()

    def finish(self) -> None:
        """Wait for every collective begun, used or not (none is left in flight)."""
        self.metric_means()
        if self._buffers is not None:
            self._buffers.wait()


def mean_metrics(metrics: dict[str, Any], means: StepMeans) -> dict[str, Any]:
    """`spmd.reduce_metrics` over the step's axes, taking the means begun early for the
    metrics that still hold the values they were begun on (a collective only for the rest)."""
    axis = spmd.axis_arg(means.axes)
    begun = means.metric_means()
    done = {k: begun[k] for k, v in means.local.items() if metrics.get(k) is v}
    others = {k: v for k, v in metrics.items() if k not in done}
    rest = spmd.reduce_metrics(others, means.mesh, axis)
    return {k: done[k] if k in done else rest[k] for k in metrics}


def mean_buffers(old: PyTree, new: PyTree, means: StepMeans) -> PyTree:
    """`spmd.average_updated_buffers` over the step's axes, from the means begun early when
    `new` holds the very buffers they were begun on."""
    averaged = means.buffers_for(new)
    if averaged is not None:
        return averaged
    return spmd.average_updated_buffers(old, new, means.mesh, spmd.axis_arg(means.axes))
