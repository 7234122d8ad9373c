"""What every multi-rank plan needs, public for strategy authors: agreement, broadcast, keys, means.

- `check_axis`: a mesh with the named axis, or a clear error at the boundary.
- `check_same_on_all_ranks` / `describe_tree`: ranks that build different models fail at once,
  naming the first difference, instead of hanging in a collective whose shapes disagree;
  `lines_where_ranks_differ`, the exchange under it, for checks that report differently.
- `broadcast_tree`: index 0's values on every rank (the start of a data-parallel run).
- `rank_key`: the key of one step on one rank: folded by the step count and the rank's
  coordinate along the data axes, so dropout differs across ranks and replays exactly.
- `average_updated_buffers`, `mean_floating_leaves`, `reduce_metrics`: the end of a step.
- `all_gather_objects`: set-up metadata from every rank.

The set-up traffic (`check_same_on_all_ranks`, `broadcast_tree`, `all_gather_objects`) is
counted and bounded like a step's collectives (`fscale.distributed.setup_traffic`: a rank that
never arrives is named within twice the collective timeout) and not recorded in the comm
ledger, which counts what a training step moves.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from fscale import random as fsrandom
from fscale import tree
from fscale.distributed import collectives, setup_traffic
from fscale.distributed.comm import REDUCTIONS, resolve_comm
from fscale.distributed.debug import issue
from fscale.distributed.mesh import Mesh
from fscale.distributed.pending import Work
from fscale.distributed.watchdog import CollectiveTimeoutError, note_step
from fscale.flat import flat_copy

_MEAN = REDUCTIONS.index("mean")

__all__ = [
    "all_gather_objects",
    "average_updated_buffers",
    "axis_arg",
    "broadcast_tree",
    "check_axis",
    "check_same_on_all_ranks",
    "describe_tree",
    "first_difference",
    "lines_where_ranks_differ",
    "mean_floating_leaves",
    "rank_key",
    "reduce_metrics",
    "scalar_metric_names",
    "stack_scalars",
]


def rank_key(
    key: torch.Tensor, step: int, mesh: Mesh | None, axes: tuple[str, ...]
) -> torch.Tensor:
    """The key of step `step` on this rank: `key` folded with the step, then with this rank's
    row-major index over the data `axes` (not folded when there are none).

    A Step asks for it once at the start of each gradient phase, so it also tells the
    collective watchdog which step this rank is in (`fscale.distributed.watchdog.note_step`):
    a collective that times out names it.
    """
    note_step(step)
    ranks = () if mesh is None or not axes else (mesh.rank(axis_arg(axes)),)
    return fsrandom.fold_in_all(key, (step, *ranks))


def axis_arg(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """`axes` as a collective's `axis` argument: the name itself when there is one."""
    return axes[0] if len(axes) == 1 else axes


def check_axis(mesh: Any, axis: str, caller: str) -> None:
    """`mesh` is a Mesh with an axis called `axis`; else a clear error."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{caller}: `mesh` must be an fscale.Mesh (e.g. fscale.Mesh(dp=2)), got "
            f"{type(mesh).__name__}"
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{caller}: the mesh has no axis {axis!r}; its axes are {mesh.axis_names}. "
            f"Build it with that axis, e.g. fscale.Mesh({axis}=world_size), or pass axis=..."
        )


def describe_tree(values: Any) -> list[str]:
    """One line per leaf: path, shape and dtype (what ranks must agree on)."""
    paths, leaves, _ = tree.flatten_with_paths(values)
    return [
        f"{p}: {tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
        if isinstance(leaf, torch.Tensor)
        else f"{p}: {type(leaf).__name__}"
        for p, leaf in zip(paths, leaves)
    ]


_SAME_MODEL = "Every rank must build the same model (same shapes, dtypes and pytree structure)."


def check_same_on_all_ranks(
    mesh: Mesh, axis: str, lines: list[str], what: str, caller: str, fix: str = _SAME_MODEL
) -> None:
    """Raise on every rank when ranks of `axis` describe `what` differently.

    Ranks exchange a digest of `lines` (cheap); on a mismatch they exchange the lines and the
    error names the first difference and says what to do (`fix`), so a bad configuration fails
    at once instead of hanging in a collective whose shapes disagree.
    """
    all_lines = lines_where_ranks_differ(lines, mesh, axis, what, caller)
    if all_lines is None:
        return
    reference = all_lines[0]
    for index, other in enumerate(all_lines):
        if other == reference:
            continue
        detail = first_difference(reference, other, index)
        raise ValueError(
            f"{caller}: the ranks along axis {axis!r} disagree on {what}: rank 0 and rank "
            f"{index} of the axis differ — {detail}. {fix}"
        )


def lines_where_ranks_differ(
    lines: list[str], mesh: Mesh, axis: str, what: str, caller: str
) -> list[list[str]] | None:
    """Every rank's `lines` in axis order when they differ anywhere along `axis`; else None.

    Ranks that agree (the usual case) exchange only a digest of their lines. A peer that never
    makes the call is a `CollectiveTimeoutError` naming `caller` and `what`, and what to do.
    """
    if mesh.group(axis) is None:
        return None
    digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()
    try:
        digests = all_gather_objects(digest, mesh, axis)
    except CollectiveTimeoutError as error:
        raise CollectiveTimeoutError(
            f"{caller}: not every rank along axis {axis!r} reached the check of {what}; every "
            "rank of the axis must make the same call (one made on some ranks only, as under "
            f"`if rank == 0:`, leaves the others waiting).\n{error}"
        ) from error
    if len(set(digests)) == 1:
        return None
    return all_gather_objects(lines, mesh, axis)


def all_gather_objects(value: Any, mesh: Mesh, axis: str) -> list[Any]:
    """Every rank's picklable `value`, in axis order (set-up metadata, not a step's tensors).

    Counted and bounded like every collective (`fscale.distributed.setup_traffic`): a peer
    that never arrives is named within twice `collective_timeout()`. Not recorded in the comm
    ledger: it is set-up traffic, not a training step's.
    """
    return setup_traffic.all_gather_objects(value, resolve_comm(axis, mesh, "all_gather_objects"))


def first_difference(a: list[str], b: list[str], index: int = 1) -> str:
    """The first difference between two `describe_tree` listings (rank 0's and rank `index`'s).

    When the listings name different leaves (a model with another layer count), pairing lines
    by position would compare unrelated leaves: then the leaf counts and the first names
    missing on and extra on rank `index` are given instead.
    """
    names_a, names_b = [_leaf_name(x) for x in a], [_leaf_name(y) for y in b]
    if names_a != names_b:
        missing = [n for n in names_a if n not in set(names_b)]
        extra = [n for n in names_b if n not in set(names_a)]
        detail = f"rank 0 has {len(a)} entries, rank {index} has {len(b)}"
        if missing:
            detail += f"; missing on rank {index}: {_first_names(missing)}"
        if extra:
            detail += f"; extra on rank {index}: {_first_names(extra)}"
        if not missing and not extra:
            detail += "; the same names in another order"
        return detail
    for x, y in zip(a, b):
        if x != y:
            return f"{x!r} vs {y!r}"
    return f"{len(a)} entries vs {len(b)} entries"


def _leaf_name(line: str) -> str:
    return line.rpartition(": ")[0] or line


def _first_names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def broadcast_tree(values: Any, mesh: Mesh, axis: str) -> Any:
    """Copies of the tensor leaves of `values` holding the values of index 0 along `axis`.

    Used once at init (as torch DDP does at construction) so every rank starts from the same
    parameters; the input tensors are not modified.
    """
    comm = resolve_comm(axis, mesh, "broadcast_tree")
    if comm.size == 1:
        return values

    def copy_from_source(leaf: torch.Tensor) -> torch.Tensor:
        out = leaf.detach().clone()
        setup_traffic.broadcast_from_first(out, comm)
        return out

    return tree.map(copy_from_source, values)


def mean_floating_leaves(values: Any, mesh: Mesh, axis: str | tuple[str, ...]) -> Any:
    """Average the floating-point tensor leaves over `axis` (integer leaves are kept as is).

    One collective for all leaves of a dtype: they are packed into one flat buffer first.
    """
    if mesh.size(axis) == 1:
        return values
    return StartedLeafMeans(values, mesh, axis).wait()


def average_updated_buffers(old: Any, new: Any, mesh: Mesh, axis: str | tuple[str, ...]) -> Any:
    """Average over `axis` the floating-point buffers the loss returned anew.

    BatchNorm statistics differ across ranks and are averaged, so every rank holds the same
    buffers. A buffer returned as the very tensor it was given (a frozen parameter:
    `functionalize` passes those through) is the same on every rank already and is not sent.
    """
    return StartedBufferMeans(old, new, mesh, axis).wait()


class StartedMean:
    """The mean over `axis` of the 1-D `flat`, computed in `flat`: begun now, ended by `wait`.

    The collective over the first axis is issued at once and runs while the caller computes;
    `wait` ends it, then averages over any further axes in turn. The arithmetic and the ledger
    records are ``collectives.all_reduce(flat, axis, "mean")``'s (divide, then sum; axis after
    axis), without its two autograd Functions per axis, whose argument binding is a fixed cost
    of every step. Under a torch.func transform that differentiable collective runs, at once.
    """

    def __init__(self, flat: torch.Tensor, axis: str | tuple[str, ...], mesh: Mesh) -> None:
        self.mesh = mesh
        self.work: Work | None = None
        self.axes: list[str] = []
        if torch._C._are_functorch_transforms_active():
            self.flat = collectives.all_reduce(flat, axis, "mean", mesh=mesh)
            return
        self.flat = flat
        self.axes = [a for a in ((axis,) if isinstance(axis, str) else axis) if mesh.size(a) > 1]
        if self.axes:
            self.work = self._start(self.axes[0])

    def _start(self, name: str) -> Work:
        comm = resolve_comm(name, self.mesh, "reduce_metrics")
        work = Work()
        work.ticket = issue(comm, "all_reduce", self.flat, self.flat.numel(), extra=_MEAN)
        self.flat.div_(comm.size)
        work.work = dist.all_reduce(self.flat, group=comm.group, async_op=True)
        return work

    def wait(self) -> torch.Tensor:
        """The means; a second call returns them again."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            for name in self.axes[1:]:
                self._start(name).wait()
        return self.flat


# Given one dtype's packed leaves, the `wait` of a mean that another collective carries for
# them (a gradient bucket, see `fscale.step_means`), or None to average them here.
Carry = Callable[[torch.Tensor], Callable[[], torch.Tensor] | None]


class StartedLeafMeans:
    """`mean_floating_leaves` begun at once: its collectives run while the caller computes.

    `carry`, when given, is offered each dtype's packed buffer first; the dtypes it takes get no
    collective here (see `Carry`).
    """

    def __init__(
        self, values: Any, mesh: Mesh, axis: str | tuple[str, ...], carry: Carry | None = None
    ) -> None:
        self.leaves, self.treedef = tree.flatten(values)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, leaf in enumerate(self.leaves):
            if leaf.is_floating_point():
                by_dtype.setdefault(leaf.dtype, []).append(i)
        self.groups: list[tuple[list[int], Callable[[], torch.Tensor]]] = []
        for indices in by_dtype.values():
            flat = flat_copy([self.leaves[i] for i in indices])
            carried = None if carry is None else carry(flat)
            if carried is None:
                carried = StartedMean(flat, axis, mesh).wait
            self.groups.append((indices, carried))

    def wait(self) -> Any:
        """The tree of means (each floating leaf a view of its dtype's averaged buffer)."""
        out = list(self.leaves)
        for indices, wait in self.groups:
            views = _unflatten_dense_tensors(wait(), [self.leaves[i] for i in indices])
            for i, view in zip(indices, views):
                out[i] = view
        return tree.unflatten(self.treedef, out)


class StartedBufferMeans:
    """`average_updated_buffers` begun at once (right after a forward pass, its collectives
    travel during the backward pass); `wait` gives its result.

    `holds` tells whether a tree is made of the very buffers averaged here: the end of a step
    uses these means only for the buffers it actually returns. `carry`: as `StartedLeafMeans`'s.
    """

    def __init__(
        self,
        old: Any,
        new: Any,
        mesh: Mesh,
        axis: str | tuple[str, ...],
        carry: Carry | None = None,
    ) -> None:
        self.new_leaves, self.treedef = tree.flatten(new)
        old_leaves, old_def = tree.flatten(old)
        if not tree.same_structure(old_def, self.treedef):
            self.updated = list(range(len(self.new_leaves)))
        else:
            pairs = zip(self.new_leaves, old_leaves)
            self.updated = [i for i, (n, o) in enumerate(pairs) if n is not o]
        self.started: StartedLeafMeans | None = None
        if self.updated and mesh.size(axis) > 1:
            updated = [self.new_leaves[i] for i in self.updated]
            self.started = StartedLeafMeans(updated, mesh, axis, carry)
        self._result: Any = None

    def holds(self, new: Any) -> bool:
        """Whether `new` is the tree of the very tensors this averages."""
        leaves, treedef = tree.flatten(new)
        same = len(leaves) == len(self.new_leaves) and tree.same_structure(treedef, self.treedef)
        return same and all(map(operator.is_, leaves, self.new_leaves))

    def wait(self) -> Any:
        """The buffers, those the loss returned anew averaged over the axis (the same tree on
        every call)."""
        if self._result is None:
            out = list(self.new_leaves)
            if self.started is not None:
                for i, value in zip(self.updated, self.started.wait()):
                    out[i] = value
            self._result = tree.unflatten(self.treedef, out)
        return self._result


def scalar_metric_names(metrics: dict[str, Any]) -> list[str]:
    """The metrics a step averages over its data axes: floating-point scalar tensors."""
    return [
        k
        for k, v in metrics.items()
        if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()
    ]


def stack_scalars(values: list[torch.Tensor]) -> torch.Tensor:
    """Scalar tensors as one new 1-D float32 buffer (detached: a collective may write into it)."""
    return torch.stack([v.detach().reshape(()).float() for v in values])


def reduce_metrics(
    metrics: dict[str, Any], mesh: Mesh, axis: str | tuple[str, ...]
) -> dict[str, Any]:
    """Mean of the scalar floating-point metrics over `axis`, in one collective."""
    if mesh.size(axis) == 1:
        return metrics
    names = scalar_metric_names(metrics)
    if not names:
        return metrics
    stacked = StartedMean(stack_scalars([metrics[k] for k in names]), axis, mesh).wait()
    reduced = dict(metrics)
    for i, k in enumerate(names):
        reduced[k] = stacked[i].to(metrics[k].dtype)
    return reduced
