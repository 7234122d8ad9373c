"""The one gradient-reduction engine: bucketed, overlapped with backward, for every data axis.

Data parallel layers add their axis to a `GradReducer` (mean over the axis); `shard_optimizer`
makes it scatter over its axis; the innermost plan opens a session on the state's leaves for the
backward that completes a step's gradient (`fscale.grad.value_and_grad`). So
``data_parallel(data_parallel(step, mesh, "a"), mesh, "b")`` is one all-reduce over ("a", "b"),
ZeRO inside data parallelism over another axis reduce-scatters over its own axis and then
all-reduces the shard over the other, and data parallelism around `fully_shard` (HSDP)
all-reduces the gradient shards, whatever the order the transformations were written in.

How a session reduces each backward's gradients (buckets, overlap, the torch.func path, the
step's means riding in the last bucket) is `fscale.parallel.reduce_sessions`.

A reduction hook ``hook(flat_grad, bucket, state) -> (Pending, new_state)`` replaces the
bucket's all-reduce (gradient compression in the overlapped path, as DDP's comm hooks). `state`
is the hook's state for that bucket, kept in the TrainState by `data_parallel`
(`hook.init(bucket)` makes it; a hook without ``init`` has the state None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fscale import tree
from fscale.distributed import collectives
from fscale.distributed.hosts import on_one_host
from fscale.distributed.mesh import Mesh
from fscale.parallel.reduce_sessions import (
    FIRST_BUCKET_BYTES,
    MAX_IN_FLIGHT,
    AllReduceSession,
    BucketInfo,
    ScatterSession,
    bucket_info,
    reducer_buckets,
)

__all__ = [
    "FIRST_BUCKET_BYTES",
    "MAX_IN_FLIGHT",
    "BucketInfo",
    "GradReducer",
    "ReduceHook",
    "add_mean_axis",
    "add_scatter_axis",
    "bucket_infos",
]

PyTree = Any

ReduceHook = Callable[[torch.Tensor, BucketInfo, Any], tuple[collectives.Pending, Any]]


@dataclasses.dataclass(frozen=True)
class GradReducer:
    """How the gradients of the state's leaves are reduced; see the module docstring.

    Attributes:
        mesh: the mesh of the axes.
        mean_axes: axes the gradients are averaged over (outermost layer first).
        scatter_axis: the axis they are reduce-scattered over (ZeRO), or None.
        bucket_bytes: the bucket size.
        shard_grads: with a scatter axis, reduce-scatter during backward (ZeRO-2) or after.
        hook: a reduction hook replacing each bucket's all-reduce, or None.
        hook_states: the hook's per-bucket states for this step.
        hook_out: where the session leaves the hook's new states (one dict per step call).
        overlap: start each bucket's all-reduce during backward (True), or all of them after
            it (False); None: during backward unless the gradients are on the CPU and every
            rank of the axes on one host (see `fscale.data_parallel`). ZeRO-2's reduce-scatters
            always start during backward (it frees each bucket's gradients there); ZeRO-1's
            start after it, and only whether its hooks run follows this policy.
    """

    mesh: Mesh
    mean_axes: tuple[str, ...] = ()
    scatter_axis: str | None = None
    bucket_bytes: int = 25 << 20
    shard_grads: bool = True
    hook: ReduceHook | None = None
    hook_states: tuple[Any, ...] | None = None
    hook_out: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    overlap: bool | None = None

    def overlaps(self, devices: Iterable[torch.device]) -> bool:
        """Whether buckets of gradients on `devices` start reducing during backward: as
        `overlap` says, else on an accelerator, or where an axis crosses hosts (the first call
        is then a collective over the axes: `fscale.distributed.hosts`)."""
        if self.overlap is not None:
            return self.overlap
        if any(device.type != "cpu" for device in devices):
            return True
        return not all(on_one_host(self.mesh, axis) for axis in self.all_reduce_axes)

    @property
    def all_reduce_axes(self) -> tuple[str, ...]:
        """The axes left for the all-reduce once the scatter axis has averaged its own."""
        return tuple(a for a in self.mean_axes if a != self.scatter_axis)

    def session(self, params: PyTree, grad_mode: str) -> Any:
        if self.scatter_axis is not None:
            return ScatterSession(self, params, grad_mode)
        return AllReduceSession(self, params, grad_mode)


def _ours(reducer: Any) -> GradReducer | None:
    if reducer is not None and not isinstance(reducer, GradReducer):
        raise TypeError(
            f"the context's reducer is a {type(reducer).__name__}; data_parallel and "
            "shard_optimizer extend only a GradReducer: wrap no plan that reduces its own way"
        )
    return reducer


def add_mean_axis(
    reducer: Any,
    mesh: Mesh,
    axis: str,
    bucket_bytes: int,
    hook: ReduceHook | None = None,
    hook_states: Any = None,
    hook_out: dict[str, Any] | None = None,
    overlap: bool | None = None,
) -> GradReducer:
    """`reducer` (or a new one) that also averages over `axis`."""
    reducer = _ours(reducer)
    if reducer is None:
        return GradReducer(
            mesh, (axis,), None, bucket_bytes, True, hook, hook_states, hook_out, overlap
        )
    changes: dict[str, Any] = {"mean_axes": (*reducer.mean_axes, axis)}
    if hook is not None:
        changes.update(hook=hook, hook_states=hook_states, hook_out=hook_out)
    if overlap is not None:
        changes.update(overlap=overlap)
    return dataclasses.replace(reducer, **changes)


def add_scatter_axis(
    reducer: Any, mesh: Mesh, axis: str, bucket_bytes: int, shard_grads: bool
) -> GradReducer:
    """`reducer` (or a new one) that reduce-scatters over `axis` (the ZeRO layout's buckets)."""
    reducer = _ours(reducer)
    if reducer is None:
        return GradReducer(mesh, (), axis, bucket_bytes, shard_grads)
    return dataclasses.replace(
        reducer, scatter_axis=axis, bucket_bytes=bucket_bytes, shard_grads=shard_grads
    )


def bucket_infos(
    params: PyTree, reducer_bucket_bytes: int, mesh: Mesh, axes: tuple[str, ...]
) -> list[BucketInfo]:
    """The buckets a data-parallel reducer forms over `params` (for a hook's `init`)."""
    buckets = reducer_buckets(tree.leaves(params), params, reducer_bucket_bytes)
    return [bucket_info(bucket, mesh, axes) for bucket in buckets]
