"""`data_parallel(step, mesh)`: DDP as a transformation of a Step.

Forward collective: none (`replicate` — parameters are used as they are on every rank).
Backward collective: the dual of `replicate`, an all-reduce (mean) of the gradients, bucketed:
leaves are packed into buckets of `bucket_mb` in reverse order, each bucket's gradients are
written straight into its flat buffer as autograd produces them, and the bucket's all-reduce is
started the moment its last gradient arrives, so it runs while backward computes the next
bucket. The step waits for all buckets only before the optimizer update.

Memory per rank: full parameters, full gradients (once: in the reduced bucket buffers, which
the gradients are views of), full optimizer state. Traffic per rank per step: one all-reduce of
Ψ elements, 2·Ψ·(N−1)/N under the ring model, plus one small all-reduce of the scalar metrics
(and of the floating-point buffers, if any).

Buffers (BatchNorm running statistics): averaged over the axis after every step, so every rank
holds the same buffers — the rule that keeps a data-parallel model one model. (torch DDP instead
broadcasts rank 0's buffers before each forward; with ``broadcast_buffers=False`` it keeps them
per rank. Parameters and gradients are the same under any of these rules, because train-mode
BatchNorm normalises with batch statistics.)

Randomness: the step's key is folded with the step count and then with this rank's index along
`axis`, so dropout differs across ranks (they see different data) and is reproducible.

Numerics: each rank computes the gradient of its local mean loss; the mean over N ranks of those
gradients is the gradient of the mean loss over the global batch. The all-reduce pre-divides by
N (as torch DDP does) and sums, so at N = 2 and N = 4 the result equals torch DDP bit for bit;
against one process on the concatenated batch it differs by reduction order only (one GEMM over
the whole batch sums in another order than per-rank GEMMs plus an all-reduce).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fscale import optim as optim_lib
from fscale import random as fsrandom
from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.memory import tree_bytes
from fscale.parallel import common
from fscale.parallel.buckets import GradBuckets, assign_buckets, forward_order
from fscale.train import LocalPlan, Step, TrainState, value_and_grad

__all__ = ["DataParallelPlan", "data_parallel"]

# As torch DDP: the first bucket (the last layers' gradients) is small, so the first all-reduce
# starts early in backward; later buckets use `bucket_mb`.
FIRST_BUCKET_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class DataParallelPlan:
    """Replicated parameters and optimizer state; gradients all-reduced (mean) over `axis`."""

    mesh: Mesh
    axis: str
    bucket_bytes: int

    def init(self, step: Step, params: Any, buffers: Any, key: torch.Tensor) -> TrainState:
        lines = common.describe_tree(params) + ["buffers:"] + common.describe_tree(buffers)
        common.check_same_on_all_ranks(
            self.mesh, self.axis, lines, "the parameter and buffer trees", "data_parallel"
        )
        params = common.broadcast_tree(params, self.mesh, self.axis)
        buffers = common.broadcast_tree(buffers, self.mesh, self.axis)
        key = common.broadcast_tree(key, self.mesh, self.axis)
        return LocalPlan().init(step, params, buffers, key)

    def run(self, step: Step, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        key = fsrandom.fold_in(fsrandom.fold_in(state.key, int(state.step)), self.mesh.rank(self.axis))
        if step.grad_mode == "func":
            out, grads = self._grads_by_replicate(step, state, batch, key)
        else:
            out, grads = self._grads_by_buckets(step, state, batch, key)
        params, opt_state = optim_lib.step(
            step.optimizer, grads, state.opt_state, state.params, donate=step.donate
        )
        buffers = common.average_updated_buffers(state.buffers, out.buffers, self.mesh, self.axis)
        metrics = common.reduce_metrics({"loss": out.loss, **out.metrics}, self.mesh, self.axis)
        metrics["grad_bytes"] = tree_bytes(grads)
        return TrainState(params, buffers, opt_state, state.step + 1, state.key), metrics

    def _grads_by_buckets(self, step: Step, state: TrainState, batch: Any, key: torch.Tensor):
        leaves, treedef = tree.flatten(state.params)
        buckets = assign_buckets(
            leaves,
            self.bucket_bytes,
            order=forward_order(state.params),
            first_bucket_bytes=FIRST_BUCKET_BYTES,
        )
        in_flight: dict[int, collectives.Pending] = {}

        def start_reduce(bucket, flat_grad):
            in_flight[bucket.index] = collectives.all_reduce_start(
                flat_grad, self.axis, "mean", mesh=self.mesh
            )
            # The all-reduce works on its own copy: drop the unreduced buffer now.
            collector.release(bucket.index)

        # The hooks copy each gradient into its bucket and hand autograd a stride-0 zero, so
        # once a bucket's all-reduce has started the only copy of its gradients is the one
        # being reduced.
        collector = GradBuckets(buckets, len(leaves), start_reduce, keep_grads=False)
        out, _ = value_and_grad(
            step.loss_fn, state.params, state.buffers, batch, key, grad_hooks=collector.hooks()
        )
        collector.flush()
        grads: list[Any] = [None] * len(leaves)
        for bucket in buckets:
            reduced = in_flight.pop(bucket.index).wait()
            for leaf_index, view in zip(bucket.leaf_indices, bucket.layout.views(reduced)):
                grads[leaf_index] = view
        return out, tree.unflatten(treedef, grads)

    def _grads_by_replicate(self, step: Step, state: TrainState, batch: Any, key: torch.Tensor):
        # Under torch.func transforms autograd hooks do not run: place the dual pair directly,
        # one `replicate` per leaf (correct and composable; no bucketing, no overlap).
        def prepare(params):
            return tree.map(
                lambda p: collectives.replicate(p, self.axis, "mean", mesh=self.mesh), params
            )

        return value_and_grad(
            step.loss_fn, state.params, state.buffers, batch, key, grad_mode="func", prepare=prepare
        )

    def __repr__(self) -> str:
        return (
            f"data_parallel(axis={self.axis!r} of size {self.mesh.size(self.axis)}, "
            f"bucket={self.bucket_bytes / 2**20:g} MiB)"
        )


def data_parallel(step: Step, mesh: Mesh, axis: str = "dp", *, bucket_mb: float = 25.0) -> Step:
    """DDP: replicate parameters over `axis`, average gradients with a bucketed all-reduce.

    Args:
        step: a single-process Step from `fscale.train_step`.
        mesh: the mesh; `axis` must be one of its axes.
        axis: the data-parallel axis: each rank along it reads its own slice of the global batch
            (see `fscale.data.LMBatches(rank=..., world_size=...)`).
        bucket_mb: bucket size in MiB. Larger buckets mean fewer collectives; smaller ones start
            communicating earlier in backward.

    Returns:
        A Step whose metrics (the loss and any scalar extras) are means over the axis, equal on
        every rank. See the module docstring for traffic, memory, buffers and numerics.

    Raises:
        TypeError / ValueError: `step` is not a Step, `mesh` lacks `axis`, `step` is already
            data parallel or sharded, or `bucket_mb` is not positive. At init, ranks that
            disagree on the parameter tree get an error naming the first difference.
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"data_parallel: `step` must be a Step from fscale.train_step, got {type(step).__name__}"
        )
    common.check_axis(mesh, axis, "data_parallel")
    if not isinstance(step.plan, LocalPlan):
        raise ValueError(
            f"data_parallel: the step is already transformed ({step.plan!r}); apply "
            "data_parallel to a single-process step from fscale.train_step, once per axis"
        )
    if not bucket_mb > 0:
        raise ValueError(f"data_parallel: `bucket_mb` must be positive, got {bucket_mb!r}")
    return step.replace(plan=DataParallelPlan(mesh, axis, int(bucket_mb * 2**20)))
