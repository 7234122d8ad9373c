"""Where a collective runs and what it may be called with: one mesh axis seen from this rank.

Every collective resolves its axis to a `Comm` (the axis's process group, its size and this
rank's index on it) and validates its arguments with the checks below on every rank before
anything is sent, so bad input fails with a message naming the argument instead of a hang.
The c10d calls on flat tensors are named here once for every module that issues them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fscale.distributed.mesh import Axis, Mesh, resolve_mesh

__all__ = [
    "REDUCTIONS",
    "Comm",
    "all_gather_flat",
    "axes",
    "check_divisible",
    "check_index",
    "check_op",
    "check_tensor",
    "normalize_dim",
    "reduce_scatter_flat",
    "resolve_comm",
]

Tensor = torch.Tensor

REDUCTIONS = ("sum", "mean")
"""The reductions a collective's `op` may name, in the order the debug check encodes them."""

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those.
# Both are called on 1-D views: the output is the N inputs end to end.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm(NamedTuple):
    """Where a collective runs: one mesh axis, seen from this rank."""

    mesh: Mesh
    axis: str
    group: Any  # ProcessGroup; None when size == 1
    size: int
    index: int  # this rank's index along the axis


def resolve_comm(axis: str, mesh: Mesh | None, caller: str) -> Comm:
    """The `Comm` of a single axis of `mesh` (the current mesh when None)."""
    mesh = resolve_mesh(mesh, caller)
    if not isinstance(axis, str):
        raise TypeError(f"{caller}: `axis` must be an axis name, got {axis!r}")
    # Every collective of a step resolves its axis; a mesh never changes once built.
    comm = mesh._comms.get(axis)
    if comm is None:
        comm = mesh._comms[axis] = Comm(
            mesh, axis, mesh.group(axis), mesh.size(axis), mesh.rank(axis)
        )
    return comm


def axes(axis: Axis, caller: str) -> tuple[str, ...]:
    """`axis` (a name or a tuple of distinct names) as a tuple of names."""
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis):
        if len(set(axis)) != len(axis):
            raise ValueError(f"{caller}: `axis` names an axis twice: {axis!r}")
        return axis
    raise TypeError(f"{caller}: `axis` must be an axis name or a tuple of names, got {axis!r}")


def check_tensor(x: Any, name: str, caller: str, *, min_dim: int = 0) -> None:
    """Raise unless argument `name` is a tensor with at least `min_dim` dimensions."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{caller}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(
            f"{caller}: `{name}` must have at least {min_dim} dimension(s), got shape "
            f"{tuple(x.shape)}"
        )


def check_op(op: Any, x: Tensor, caller: str) -> None:
    """Raise unless `op` is a reduction that applies to `x`'s dtype."""
    if op not in REDUCTIONS:
        raise ValueError(f"{caller}: `op` must be 'sum' or 'mean', got {op!r}")
    if op == "mean" and not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise TypeError(
            f"{caller}: op='mean' needs a floating-point or complex tensor, got {x.dtype}; "
            "use op='sum' and divide yourself"
        )


def normalize_dim(dim: Any, x: Tensor, name: str, caller: str) -> int:
    """Dimension argument `name` of `x` as a non-negative int."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{caller}: `{name}` must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{caller}: `{name}`={dim} is out of range for a tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def check_divisible(x: Tensor, dim: int, comm: Comm, name: str, caller: str) -> None:
    """Raise unless dimension `dim` of `x` splits evenly over the ranks of the axis."""
    if x.shape[dim] % comm.size:
        raise ValueError(
            f"{caller}: dimension {name}={dim} of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by the {comm.size} ranks of axis {comm.axis!r}; "
            "pad it to a multiple of the axis size"
        )


def check_index(index: Any, name: str, comm: Comm, caller: str, *, other: bool = False) -> None:
    """Raise unless argument `name` is a rank index along the axis (another rank's if `other`)."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{caller}: `{name}` must be an int index along the axis, got {index!r}")
    if other and (not 0 <= index < comm.size or index == comm.index):
        raise ValueError(
            f"{caller}: `{name}`={index} must be another rank's index along axis "
            f"{comm.axis!r} (size {comm.size}, this rank is {comm.index})"
        )
    if not 0 <= index < comm.size:
        raise ValueError(
            f"{caller}: `{name}`={index} is out of range for axis {comm.axis!r} of size "
            f"{comm.size}; it must be in [0, {comm.size})"
        )
