"""Differentiable collectives over mesh axes, each defined once beside its dual.

A parallelism is a collective placed in the computation; its gradient is the dual collective.
Every primitive below is a new-style `torch.autograd.Function` (``forward`` + ``setup_context``)
whose backward calls only its dual's ``.apply``, never a raw c10d call: under `torch.func`
transforms a backward receives wrapped tensors, and only a Function's forward sees plain ones
that c10d can work on. So the primitives are exact under `torch.autograd.grad`,
`torch.func.grad`, `torch.func.vjp` and higher-order differentiation alike.

Pairs (``N`` ranks on the axis, ``g`` the cotangent, ``c`` = 1 for op="sum" and 1/N for
op="mean")::

    primitive                              forward                      backward
    -------------------------------------  ---------------------------  --------------------------
    replicate(x, op)                       identity                     all_reduce(g, op)
    all_reduce(x, op)                      c * sum over ranks           c * g
    all_gather(x, dim, op)                 concatenate the shards       reduce_scatter(g, dim, op)
    reduce_scatter(x, dim, op)             c * sum, keep own slice      c * all_gather(g, dim)
    all_to_all(x, split_dim, concat_dim)   chunk j to rank j            all_to_all(g, concat_dim,
                                                                                   split_dim)
    ppermute(x, perm)                      value of the source rank     ppermute(g, inverse perm)
    send(x, to)                            0-dim zero token             recv x's gradient from `to`
    recv(like, from_)                      value sent by `from_`        send g back to `from_`

Gradient convention
-------------------
Each rank seeds its own loss with 1 and differentiates with its own autograd. A value that
differs across the ranks of an axis ("varying": per-rank data, shards, per-rank losses) is one
variable per rank; a value that is the same on every rank ("replicated": parameters under data
parallelism, the output of an all-reduce) is ONE variable held N times. The global objective is
the sum of the per-rank losses when the loss varies along the axis, and the loss itself when it
is replicated (computed redundantly, counted once). Under this convention:

- ``all_reduce`` (varying -> replicated), ``reduce_scatter``, ``all_to_all``, ``ppermute``,
  ``send``/``recv`` backpropagate the exact adjoint of their forward; `op` is the forward
  reduction, and "mean" divides by N in both directions. Consume an all-reduced value
  replicatedly (the same way on every rank, Megatron's "g"); if the ranks go on to compute
  different losses from it, pass it through ``replicate`` so their gradients are summed.
- ``replicate`` (replicated -> varying: DDP, Megatron's "f") and ``all_gather`` (shards ->
  a full value each rank uses with its own loss: ZeRO-3) sum the ranks' gradients for
  op="sum", the gradient of the SUM of the per-rank losses; op="mean" averages them instead,
  the gradient of the MEAN of the per-rank losses, which is fscale's data-parallel convention
  (each rank's loss is the mean over its local batch and the global loss is the mean over
  ranks, so N ranks equal one process on the concatenated batch). For these two, `op` is the
  reduction applied in the BACKWARD pass. It gives the gradient of the mean to the values that
  reach the losses only through this collective (the parameters); values that bypass it (a
  rank's own data) keep the gradient of the sum, which for data that feeds only its own rank's
  loss is the gradient of that loss.

Never differentiate a loss that has already been averaged with ``all_reduce(op="mean")``
through ``replicate(op="mean")``: that divides by N twice. Report global losses under
``torch.no_grad()``, or use ``replicate(op="sum")`` above a replicated loss.

"mean" divides before the sum for all-reduce (on the copy the collective needs anyway) and
after it for reduce-scatter (on the 1/N-sized shard); both are exact for power-of-two N.

Asynchronous forms
------------------
``all_reduce_start``, ``all_gather_start`` and ``reduce_scatter_start`` issue the collective
and return a `Pending` at once; ``pending.wait()`` blocks and returns the result, so compute
placed in between overlaps the communication. Start and wait are a differentiable pair: the
start's backward is the dual collective, the wait is an identity; the in-flight work is held
in an opaque Python object passed to both Functions as a non-tensor argument, which is correct
under `torch.func` transforms. A start may also be issued inside another Function's backward on
plain tensors (a gradient bucket) and waited on later, e.g. before the optimizer step.
Like every collective, starts must be issued in the same order on every rank; each Pending
must be waited on before its result is used, in any order.

Checks
------
Arguments are validated on every rank before anything is sent. With ``set_debug(True)`` or
``FSCALE_DEBUG=1``, the ranks of the axis also exchange the operation, its reduction or
permutation, and the tensor's shape and dtype before every collective, forward or backward; on a
mismatch EVERY rank raises `CollectiveMismatchError` naming the operation, the axis and each
rank's shape and dtype, instead of hanging or silently computing garbage. It costs one small
all-gather per collective (a send/recv pair swaps one small message).

Every collective records a `fscale.distributed.ledger.CommRecord` where it is issued. Over an axis of
size 1 every collective is an identity (``ppermute`` without a self-pair gives zeros) and
nothing is sent or recorded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fscale.distributed import ledger
from fscale.distributed.mesh import Axis, Mesh, resolve_mesh

__all__ = [
    "CollectiveMismatchError",
    "Pending",
    "all_gather",
    "all_gather_start",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "debug_enabled",
    "ppermute",
    "recv",
    "reduce_scatter",
    "reduce_scatter_start",
    "replicate",
    "send",
    "set_debug",
]

Tensor = torch.Tensor
_REDUCTIONS = ("sum", "mean")

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those.
# Both are called on 1-D views: the output is the N inputs end to end.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ============================================================================================
# Axis resolution and argument checks


class _Comm(NamedTuple):
    """Where a collective runs: one mesh axis, seen from this rank."""

    mesh: Mesh
    axis: str
    group: Any  # ProcessGroup; None when size == 1
    size: int
    index: int  # this rank's index along the axis


def _comm(axis: str, mesh: Mesh | None, caller: str) -> _Comm:
    mesh = resolve_mesh(mesh, caller)
    if not isinstance(axis, str):
        raise TypeError(f"{caller}: `axis` must be an axis name, got {axis!r}")
    return _Comm(mesh, axis, mesh.group(axis), mesh.size(axis), mesh.rank(axis))


def _axes(axis: Axis, caller: str) -> tuple[str, ...]:
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis):
        if len(set(axis)) != len(axis):
            raise ValueError(f"{caller}: `axis` names an axis twice: {axis!r}")
        return axis
    raise TypeError(f"{caller}: `axis` must be an axis name or a tuple of names, got {axis!r}")


def _check_tensor(x: Any, name: str, caller: str, *, min_dim: int = 0) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{caller}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(
            f"{caller}: `{name}` must have at least {min_dim} dimension(s), got shape "
            f"{tuple(x.shape)}"
        )


def _check_op(op: Any, x: Tensor, caller: str) -> None:
    if op not in _REDUCTIONS:
        raise ValueError(f"{caller}: `op` must be 'sum' or 'mean', got {op!r}")
    if op == "mean" and not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise TypeError(
            f"{caller}: op='mean' needs a floating-point or complex tensor, got {x.dtype}; "
            "use op='sum' and divide yourself"
        )


def _normalize_dim(dim: Any, x: Tensor, name: str, caller: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{caller}: `{name}` must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{caller}: `{name}`={dim} is out of range for a tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def _check_divisible(x: Tensor, dim: int, comm: _Comm, name: str, caller: str) -> None:
    if x.shape[dim] % comm.size:
        raise ValueError(
            f"{caller}: dimension {name}={dim} of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by the {comm.size} ranks of axis {comm.axis!r}; "
            "pad it to a multiple of the axis size"
        )


# ============================================================================================
# Debug check: the ranks of an axis agree on (operation, arguments, shape, dtype)


def _debug_from_env(environ: Any = os.environ) -> bool:
    return str(environ.get("FSCALE_DEBUG", "0")).strip().lower() not in ("", "0", "false", "no")


_DEBUG = _debug_from_env()


def set_debug(enabled: bool) -> None:
    """Turn the cross-rank metadata check before every collective on or off.

    The check is also on when the environment variable ``FSCALE_DEBUG=1`` is set at import.
    Every rank must use the same setting (the check is itself a collective).
    """
    global _DEBUG
    _DEBUG = bool(enabled)


def debug_enabled() -> bool:
    """Whether the cross-rank metadata check runs before every collective."""
    return _DEBUG


class CollectiveMismatchError(ValueError):
    """The ranks of an axis called a collective with different operations, shapes or dtypes."""


_OP_CODES = {
    name: code
    for code, name in enumerate(
        ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "send", "recv")
    )
}
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool,
)  # fmt: skip
_MAX_DIMS = 8  # shapes are sent in full up to this many dimensions; ndim and numel always


def _describe(row: list[int]) -> str:
    op = next((name for name, code in _OP_CODES.items() if code == row[0]), f"op#{row[0]}")
    dtype = _DTYPES[row[1]] if 0 <= row[1] < len(_DTYPES) else f"dtype#{row[1]}"
    ndim, numel = row[2], row[3]
    dims = row[5 : 5 + min(ndim, _MAX_DIMS)]
    shape = "(" + ", ".join(map(str, dims)) + ("," if ndim == 1 else "")
    shape += (f", ... {ndim} dims, {numel} elements)" if ndim > _MAX_DIMS else ")")
    return f"{op} of shape {shape} {str(dtype).replace('torch.', '')}"


def _metadata(op: str, x: Tensor, extra: int) -> Tensor:
    dtype_code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    dims = list(x.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(x.dim(), _MAX_DIMS))
    row = [_OP_CODES[op], dtype_code, x.dim(), x.numel(), extra, *dims]
    return torch.tensor(row, dtype=torch.int64, device=x.device)


def _check_group(comm: _Comm, op: str, x: Tensor, extra: int = 0) -> None:
    """Raise on every rank of the axis unless all ranks issue the same collective."""
    mine = _metadata(op, x, extra)
    rows = mine.new_empty((comm.size, mine.numel()))
    _all_gather_flat(rows.view(-1), mine, group=comm.group)
    table = rows.tolist()
    if all(row == table[0] for row in table):
        return
    lines = [
        f"  rank {comm.mesh.global_rank(comm.axis, i)} ({comm.axis}={i}): {_describe(row)}"
        + (" [different op/perm argument]" if _only_extra_differs(row, table[0]) else "")
        for i, row in enumerate(table)
    ]
    raise CollectiveMismatchError(
        f"{op} over axis {comm.axis!r}: the {comm.size} ranks disagree:\n"
        + "\n".join(lines)
        + "\nEvery rank of the axis must issue the same collective, in the same order, with "
        "tensors of the same shape and dtype."
    )


def _only_extra_differs(row: list[int], reference: list[int]) -> bool:
    # Column 4 holds the reduction ("sum"/"mean") or a digest of the permutation.
    return row[4] != reference[4] and row[:4] + row[5:] == reference[:4] + reference[5:]


def _check_pair(comm: _Comm, op: str, x: Tensor, peer: int) -> None:
    """Raise on both ends of a send/recv unless the sent and expected tensors agree."""
    mine = _metadata(op, x, 0)
    theirs = torch.empty_like(mine)
    works = [
        dist.isend(mine, group=comm.group, group_dst=peer),
        dist.irecv(theirs, group=comm.group, group_src=peer),
    ]
    for work in works:
        work.wait()
    mine_row, their_row = mine.tolist(), theirs.tolist()
    if {mine_row[0], their_row[0]} == {_OP_CODES["send"], _OP_CODES["recv"]} and (
        mine_row[1:] == their_row[1:]
    ):
        return
    me = comm.mesh.global_rank(comm.axis, comm.index)
    other = comm.mesh.global_rank(comm.axis, peer)
    raise CollectiveMismatchError(
        f"{op} between ranks {me} ({comm.axis}={comm.index}) and {other} ({comm.axis}={peer}) "
        f"do not match:\n  rank {me}: {_describe(mine_row)}\n  rank {other}: "
        f"{_describe(their_row)}\nA send must meet a recv of a tensor of the same shape and "
        "dtype."
    )


def _issue(comm: _Comm, op: str, x: Tensor, numel: int, extra: int = 0) -> None:
    """What happens before every group collective: the debug check, then the ledger record."""
    if _DEBUG:
        _check_group(comm, op, x, extra)
    ledger.record(op, comm.axis, x.dtype, numel, comm.size)


# ============================================================================================
# Asynchronous start / wait


class _Work:
    """Opaque holder of an in-flight c10d Work, passed to Functions as a non-tensor argument."""

    __slots__ = ("work",)

    def __init__(self) -> None:
        self.work: Any = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _Wait(torch.autograd.Function):
    """Identity that first blocks until the collective writing its input has finished.

    Blocking must happen inside a Function's forward: gloo finishes some collectives (e.g.
    reduce-scatter) with a copy into the output during ``wait()``, and outside a forward a
    `torch.func` transform would intercept that copy as a mutation of a captured tensor.
    """

    @staticmethod
    def forward(buffer: Tensor, work: _Work) -> Tensor:
        work.wait()
        return buffer.view_as(buffer)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class Pending:
    """A collective in flight. `wait()` blocks until it is done and returns its result.

    Obtained from `all_reduce_start`, `all_gather_start` or `reduce_scatter_start`. Waiting is
    differentiable (the gradient flows to the start's input through the dual collective) and
    idempotent: a second `wait()` returns the same tensor.
    """

    __slots__ = ("_buffer", "_work", "_finish", "_result")

    def __init__(
        self,
        buffer: Tensor | None,
        work: _Work | None,
        finish: Callable[[Tensor], Tensor],
        result: Tensor | None = None,
    ) -> None:
        self._buffer = buffer
        self._work = work
        self._finish = finish
        self._result = result

    @classmethod
    def ready(cls, result: Tensor) -> Pending:
        """A Pending that is already complete (a collective over an axis of size 1)."""
        return cls(None, None, _identity, result)

    def wait(self) -> Tensor:
        """Block until the collective is done; return its result."""
        if self._result is None:
            self._result = self._finish(_Wait.apply(self._buffer, self._work))
            self._buffer = self._work = None
        return self._result

    def __repr__(self) -> str:
        return f"Pending({'done' if self._result is not None else 'in flight'})"


def _identity(x: Tensor) -> Tensor:
    return x


# ============================================================================================
# replicate <-> all_reduce


class _Replicate(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (sum or mean) backward."""

    @staticmethod
    def forward(x: Tensor, comm: _Comm, op: str) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.op = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_reduce(grad, ctx.comm, ctx.op), None, None


class _AllReduceStart(torch.autograd.Function):
    """Start an all-reduce (sum, or mean by pre-dividing); backward: identity (times 1/N)."""

    @staticmethod
    def forward(x: Tensor, comm: _Comm, op: str, work: _Work) -> Tensor:
        _issue(comm, "all_reduce", x, x.numel(), extra=_REDUCTIONS.index(op))
        # c10d reduces in place; the copy it needs anyway carries the 1/N of a mean.
        if op == "mean":
            buffer = torch.div(x, comm.size).contiguous()
        else:
            buffer = x.clone(memory_format=torch.contiguous_format)
        work.work = dist.all_reduce(buffer, group=comm.group, async_op=True)
        return buffer

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # The adjoint of "replicated result of a sum" is the identity into each rank; written
        # as replicate(sum) so that a second derivative sums over ranks again.
        grad = _Replicate.apply(grad, ctx.comm, "sum")
        if ctx.op == "mean":
            grad = grad / ctx.comm.size
        return grad, None, None, None


def _all_reduce_start(x: Tensor, comm: _Comm, op: str) -> Pending:
    if comm.size == 1:
        return Pending.ready(x)
    work = _Work()
    return Pending(_AllReduceStart.apply(x, comm, op, work), work, _identity)


def _all_reduce(x: Tensor, comm: _Comm, op: str) -> Tensor:
    return _all_reduce_start(x, comm, op).wait()


def replicate(x: Tensor, axis: Axis, op: str = "sum", *, mesh: Mesh | None = None) -> Tensor:
    """Use a replicated value on every rank: identity forward, all-reduce of gradients backward.

    The data-parallel and Megatron "f" primitive. Wrap each parameter with it and each rank's
    gradient becomes the reduction of all ranks' gradients.

    Args:
        x: a tensor that holds the same value on every rank of `axis`.
        axis: mesh axis name, or a tuple of names to reduce over all of them.
        op: the BACKWARD reduction: "sum" (gradient of the sum of per-rank losses) or "mean"
            (gradient of their mean: fscale's data-parallel convention).
        mesh: the mesh; None for the current one (``with mesh:``).

    Returns:
        `x` (a view of it).

    Raises:
        ValueError: bad `op`, unknown axis, or no mesh.
        TypeError: `x` is not a tensor, or op="mean" on an integer tensor.
    """
    _check_tensor(x, "x", "replicate")
    _check_op(op, x, "replicate")
    for name in _axes(axis, "replicate"):
        comm = _comm(name, mesh, "replicate")
        if comm.size > 1:
            x = _Replicate.apply(x, comm, op)
    return x


def all_reduce(x: Tensor, axis: Axis, op: str = "sum", *, mesh: Mesh | None = None) -> Tensor:
    """Sum (or average) `x` over the ranks of `axis`; backward: identity (times 1/N for mean).

    The Megatron "g" primitive: the result is replicated, and its consumers must use it the
    same way on every rank (see the module docstring). Not in place: `x` is unchanged.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank.
        axis: mesh axis name, or a tuple of names to reduce over all of them.
        op: "sum" or "mean".
        mesh: the mesh; None for the current one.

    Returns:
        The reduction, on every rank of the axis.

    Raises:
        ValueError: bad `op`, unknown axis, or no mesh.
        TypeError: `x` is not a tensor, or op="mean" on an integer tensor.
    """
    _check_tensor(x, "x", "all_reduce")
    _check_op(op, x, "all_reduce")
    for name in _axes(axis, "all_reduce"):
        x = _all_reduce(x, _comm(name, mesh, "all_reduce"), op)
    return x


def all_reduce_start(
    x: Tensor, axis: str, op: str = "sum", *, mesh: Mesh | None = None
) -> Pending:
    """Start `all_reduce` and return at once; ``.wait()`` on the result gives the reduction.

    Usable on plain tensors inside another Function's backward (e.g. a bucket of gradients),
    to be waited on later. Arguments as `all_reduce`, for a single axis.
    """
    _check_tensor(x, "x", "all_reduce_start")
    _check_op(op, x, "all_reduce_start")
    return _all_reduce_start(x, _comm(axis, mesh, "all_reduce_start"), op)


# ============================================================================================
# all_gather <-> reduce_scatter
#
# The Functions work on a "stacked" layout: all-gather maps a shard of shape S to (N, *S), row
# i from rank i, and reduce-scatter maps (N, *S) to S. The public functions move `dim` to and
# from the front with ordinary (differentiable) reshapes, which are views for dim=0.


class _AllGatherStart(torch.autograd.Function):
    """Start gathering shards into (N, *S); backward: reduce-scatter (sum or mean)."""

    @staticmethod
    def forward(shard: Tensor, comm: _Comm, op: str, work: _Work) -> Tensor:
        _issue(comm, "all_gather", shard, shard.numel() * comm.size, _REDUCTIONS.index(op))
        gathered = shard.new_empty((comm.size, *shard.shape))
        work.work = _all_gather_flat(
            gathered.view(-1), shard.reshape(-1), group=comm.group, async_op=True
        )
        return gathered

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _reduce_scatter_start(grad, ctx.comm, ctx.op).wait(), None, None, None


class _ReduceScatterStart(torch.autograd.Function):
    """Start summing (N, *S) over ranks, keeping row `index`; backward: all-gather."""

    @staticmethod
    def forward(stacked: Tensor, comm: _Comm, op: str, work: _Work) -> Tensor:
        # `op` is only checked here: a mean is divided out after the wait, on the shard.
        _issue(comm, "reduce_scatter", stacked, stacked.numel(), _REDUCTIONS.index(op))
        shard = stacked.new_empty(stacked.shape[1:])
        work.work = _reduce_scatter_flat(
            shard.view(-1), stacked.reshape(-1), group=comm.group, async_op=True
        )
        return shard

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # The adjoint of a sum-scatter is a plain gather; its own adjoint (for a second
        # derivative) sums again, hence op="sum".
        return _all_gather_start(grad, ctx.comm, "sum").wait(), None, None, None


def _all_gather_start(shard: Tensor, comm: _Comm, op: str) -> Pending:
    """Gather to the stacked layout (N, *S)."""
    if comm.size == 1:
        return Pending.ready(shard.unsqueeze(0))
    work = _Work()
    return Pending(_AllGatherStart.apply(shard, comm, op, work), work, _identity)


def _reduce_scatter_start(stacked: Tensor, comm: _Comm, op: str) -> Pending:
    """Reduce the stacked layout (N, *S) to this rank's S."""
    if comm.size == 1:
        return Pending.ready(stacked.squeeze(0))
    work = _Work()
    finish = _divide_by(comm.size) if op == "mean" else _identity
    return Pending(_ReduceScatterStart.apply(stacked, comm, op, work), work, finish)


def _divide_by(divisor: int) -> Callable[[Tensor], Tensor]:
    return lambda x: x / divisor


def all_gather_start(
    x: Tensor, axis: str, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Pending:
    """Start `all_gather` and return at once; ``.wait()`` gives the gathered tensor.

    For prefetching: start the next unit's gather, compute the current one, then wait. The
    backward of the pair is `reduce_scatter(g, dim, op)`. Arguments as `all_gather`, for a
    single axis.
    """
    _check_tensor(x, "x", "all_gather_start", min_dim=1)
    _check_op(op, x, "all_gather_start")
    dim = _normalize_dim(dim, x, "dim", "all_gather_start")
    pending = _all_gather_start(x, _comm(axis, mesh, "all_gather_start"), op)
    return _then(pending, lambda stacked: stacked.movedim(0, dim).flatten(dim, dim + 1))


def reduce_scatter_start(
    x: Tensor, axis: str, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Pending:
    """Start `reduce_scatter` and return at once; ``.wait()`` gives this rank's shard.

    Usable on plain tensors inside another Function's backward (ZeRO-2: reduce-scatter a
    gradient bucket as soon as it is complete, wait before the optimizer step). Arguments as
    `reduce_scatter`, for a single axis.
    """
    _check_tensor(x, "x", "reduce_scatter_start", min_dim=1)
    _check_op(op, x, "reduce_scatter_start")
    dim = _normalize_dim(dim, x, "dim", "reduce_scatter_start")
    comm = _comm(axis, mesh, "reduce_scatter_start")
    _check_divisible(x, dim, comm, "dim", "reduce_scatter_start")
    stacked = x.unflatten(dim, (comm.size, -1)).movedim(dim, 0)
    return _reduce_scatter_start(stacked, comm, op)


def _then(pending: Pending, after: Callable[[Tensor], Tensor]) -> Pending:
    if pending._result is not None:
        return Pending.ready(after(pending._result))
    finish = pending._finish
    return Pending(pending._buffer, pending._work, lambda x: after(finish(x)))


def all_gather(
    x: Tensor, axis: Axis, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Tensor:
    """Concatenate the ranks' shards along `dim`; backward: `reduce_scatter(g, dim, op)`.

    The ZeRO-3 / sequence-parallel primitive: each rank holds a shard, every rank gets the
    whole, rank i's shard at position i.

    Args:
        x: this rank's shard; the same shape and dtype on every rank.
        axis: mesh axis name, or a tuple of names (concatenated row-major, first outermost,
            i.e. in the order of `Mesh.rank` over the tuple).
        dim: the dimension to concatenate along.
        op: the BACKWARD reduction of the gradient: "sum" or "mean" (see `replicate`).
        mesh: the mesh; None for the current one.

    Returns:
        A tensor whose `dim` is N times longer.

    Raises:
        ValueError: bad `op` or `dim`, unknown axis, or no mesh.
        TypeError: `x` is not a tensor with at least one dimension, or op="mean" on an
            integer tensor.
    """
    _check_tensor(x, "x", "all_gather", min_dim=1)
    _check_op(op, x, "all_gather")
    dim = _normalize_dim(dim, x, "dim", "all_gather")
    # Gathering the innermost axis first makes the outermost one vary slowest.
    for name in reversed(_axes(axis, "all_gather")):
        stacked = _all_gather_start(x, _comm(name, mesh, "all_gather"), op).wait()
        x = stacked.movedim(0, dim).flatten(dim, dim + 1)
    return x


def reduce_scatter(
    x: Tensor, axis: Axis, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Tensor:
    """Reduce `x` over the ranks of `axis` and keep this rank's slice of `dim`.

    Rank i gets slice i of N equal slices; backward: `all_gather(g, dim)` (times 1/N for
    mean). The ZeRO-2/3 gradient primitive.

    Args:
        x: this rank's full-size tensor; the same shape and dtype on every rank, with
            ``x.shape[dim]`` divisible by the axis size.
        axis: mesh axis name, or a tuple of names (sliced row-major, first outermost).
        dim: the dimension to slice.
        op: "sum" or "mean".
        mesh: the mesh; None for the current one.

    Returns:
        This rank's slice of the reduction: `dim` is N times shorter.

    Raises:
        ValueError: bad `op` or `dim`, indivisible size, unknown axis, or no mesh.
        TypeError: `x` is not a tensor with at least one dimension, or op="mean" on an
            integer tensor.
    """
    _check_tensor(x, "x", "reduce_scatter", min_dim=1)
    _check_op(op, x, "reduce_scatter")
    dim = _normalize_dim(dim, x, "dim", "reduce_scatter")
    for name in _axes(axis, "reduce_scatter"):
        comm = _comm(name, mesh, "reduce_scatter")
        _check_divisible(x, dim, comm, "dim", "reduce_scatter")
        stacked = x.unflatten(dim, (comm.size, -1)).movedim(dim, 0)
        x = _reduce_scatter_start(stacked, comm, op).wait()
    return x


# ============================================================================================
# all_to_all (self-dual)


class _AllToAll(torch.autograd.Function):
    """Row j of (N, *C) goes to rank j, row i of the result comes from rank i. Self-dual."""

    @staticmethod
    def forward(stacked: Tensor, comm: _Comm) -> Tensor:
        _issue(comm, "all_to_all", stacked, stacked.numel())
        received = torch.empty_like(stacked, memory_format=torch.contiguous_format)
        dist.all_to_all_single(received, stacked.contiguous(), group=comm.group)
        return received

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # The exchange is a permutation of rows across ranks; its inverse sends each row back
        # where it came from, which is the same exchange.
        return _AllToAll.apply(grad, ctx.comm), None


def all_to_all(
    x: Tensor,
    axis: str,
    split_dim: int = 0,
    concat_dim: int = 0,
    *,
    mesh: Mesh | None = None,
) -> Tensor:
    """Split `x` into N chunks along `split_dim`, send chunk j to rank j, concatenate the
    chunks received (rank i's at position i) along `concat_dim`.

    The mixture-of-experts dispatch primitive. Backward: `all_to_all` with the two dims
    swapped, which returns every gradient chunk to the rank it came from.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank, with
            ``x.shape[split_dim]`` divisible by the axis size.
        axis: mesh axis name.
        split_dim: the dimension split into outgoing chunks.
        concat_dim: the dimension incoming chunks are concatenated along.
        mesh: the mesh; None for the current one.

    Returns:
        A tensor with `split_dim` N times shorter and `concat_dim` N times longer (the same
        shape as `x` when they are the same dimension).

    Raises:
        ValueError: bad dims, indivisible size, unknown axis, or no mesh.
        TypeError: `x` is not a tensor with at least one dimension.
    """
    _check_tensor(x, "x", "all_to_all", min_dim=1)
    split_dim = _normalize_dim(split_dim, x, "split_dim", "all_to_all")
    concat_dim = _normalize_dim(concat_dim, x, "concat_dim", "all_to_all")
    comm = _comm(axis, mesh, "all_to_all")
    _check_divisible(x, split_dim, comm, "split_dim", "all_to_all")
    if comm.size == 1:
        return x
    stacked = x.unflatten(split_dim, (comm.size, -1)).movedim(split_dim, 0)
    received = _AllToAll.apply(stacked, comm)
    return received.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


# ============================================================================================
# ppermute, send, recv: point-to-point exchanges (dual: the reverse exchange)


class _Exchange(torch.autograd.Function):
    """Send `x` to index `send_to` and receive from `recv_from` along the axis (either None).

    `kind` names the operation for the ledger and fixes what a rank that receives nothing
    returns: zeros like `x` for "ppermute", a 0-dim zero for "send" (a token through which the
    gradient of `x` arrives). For "recv", `x` only gives the shape, dtype and device. Backward
    is the reverse exchange: gradients go back to where the values came from.
    """

    @staticmethod
    def forward(
        x: Tensor, comm: _Comm, send_to: int | None, recv_from: int | None, kind: str, extra: int
    ) -> Tensor:
        if kind == "ppermute":
            sends = send_to is not None and send_to != comm.index
            _issue(comm, kind, x, x.numel() if sends else 0, extra)
        else:
            peer = send_to if kind == "send" else recv_from
            if _DEBUG:
                _check_pair(comm, kind, x, peer)
            ledger.record(kind, comm.axis, x.dtype, x.numel(), comm.size)
        if send_to is not None and send_to == comm.index:
            return x.clone()  # a self-pair moves nothing
        works = []
        if send_to is not None:
            works.append(dist.isend(x.contiguous(), group=comm.group, group_dst=send_to))
        if recv_from is not None:
            received = torch.empty_like(x, memory_format=torch.contiguous_format)
            works.append(dist.irecv(received, group=comm.group, group_src=recv_from))
        for work in works:
            work.wait()
        if recv_from is not None:
            return received
        return torch.zeros_like(x) if kind == "ppermute" else x.new_zeros(())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, ctx.comm, ctx.send_to, ctx.recv_from, ctx.kind, ctx.extra = inputs
        ctx.shape = x.shape

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.kind == "send":
            # The token's cotangent carries nothing; x's gradient arrives from the receiver.
            like = grad.expand(ctx.shape)
            grad_x = _Exchange.apply(like, ctx.comm, None, ctx.send_to, "recv", 0)
        elif ctx.kind == "recv":
            token = _Exchange.apply(grad, ctx.comm, ctx.recv_from, None, "send", 0)
            grad_x = token.expand(ctx.shape)  # the template's values never mattered
        else:
            grad_x = _Exchange.apply(
                grad, ctx.comm, ctx.recv_from, ctx.send_to, "ppermute", ctx.extra
            )
        return grad_x, None, None, None, None, None


def ppermute(
    x: Tensor,
    axis: str,
    perm: Sequence[tuple[int, int]],
    *,
    mesh: Mesh | None = None,
) -> Tensor:
    """Permute `x` across the ranks of `axis`: the rank at index s sends to index d for each
    pair ``(s, d)`` in `perm`; ranks that receive nothing get zeros.

    Every rank of the axis must call it with the same `perm`. Backward: `ppermute` with the
    inverse permutation, so gradients flow back to the sender. A pipeline shifts activations
    one stage forward with ``perm=[(i, i + 1) for i in range(n - 1)]``.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank.
        axis: mesh axis name.
        perm: pairs of (source index, destination index) along the axis; no index may appear
            twice as a source or twice as a destination.
        mesh: the mesh; None for the current one.

    Returns:
        The tensor received by this rank, or zeros like `x` if it receives none.

    Raises:
        ValueError: a malformed `perm`, unknown axis, or no mesh.
        TypeError: `x` is not a tensor.
    """
    _check_tensor(x, "x", "ppermute")
    comm = _comm(axis, mesh, "ppermute")
    pairs = _check_perm(perm, comm.size)
    send_to = next((d for s, d in pairs if s == comm.index), None)
    recv_from = next((s for s, d in pairs if d == comm.index), None)
    if comm.size == 1:
        return x if pairs else torch.zeros_like(x)
    # Ranks agree on the permutation itself, so the debug check compares a digest of it.
    digest = hash(pairs) % (2**62)
    return _Exchange.apply(x, comm, send_to, recv_from, "ppermute", digest)


def _check_perm(perm: Any, size: int) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
        valid_types = all(
            isinstance(v, int) and not isinstance(v, bool) for pair in perm for v in pair
        )
    except (TypeError, ValueError):
        raise TypeError(
            f"ppermute: `perm` must be a sequence of (source, destination) int pairs, "
            f"got {perm!r}"
        ) from None
    if not valid_types:
        raise TypeError(f"ppermute: `perm` indices must be ints, got {perm!r}")
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(
                f"ppermute: pair {(s, d)} in `perm` is outside the axis of size {size}; "
                f"indices must be in [0, {size})"
            )
    sources, destinations = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations):
        raise ValueError(
            f"ppermute: `perm` must be a permutation: each index at most once as a source and "
            f"once as a destination, got {list(pairs)}"
        )
    return pairs


def send(x: Tensor, axis: str, to: int, *, mesh: Mesh | None = None) -> Tensor:
    """Send `x` to the rank at index `to` along `axis`; returns a 0-dim zero "token".

    The matching call on the receiver is ``recv(like, axis, from_=<this rank's index>)``.
    Backward: the token's gradient is ignored and the gradient of `x` is received from the
    peer (the backward of its `recv`). So a pipeline stage's objective is its sent token,
    ``torch.autograd.grad(send(y, "pp", to=s + 1), params)``, or the token added to a loss;
    its backward waits until the next stage sends the gradient back.

    Args:
        x: the tensor to send.
        axis: mesh axis name.
        to: the receiver's index along `axis` (not this rank's own).
        mesh: the mesh; None for the current one.

    Returns:
        A 0-dim zero of `x`'s dtype, connected to `x` in the autograd graph.

    Raises:
        ValueError: `to` out of range or this rank's own index, unknown axis, or no mesh.
        TypeError: `x` is not a tensor.
    """
    _check_tensor(x, "x", "send")
    comm = _comm(axis, mesh, "send")
    _check_peer(to, "to", comm, "send")
    return _Exchange.apply(x, comm, to, None, "send", 0)


def recv(like: Tensor, axis: str, from_: int, *, mesh: Mesh | None = None) -> Tensor:
    """Receive a tensor shaped like `like` from the rank at index `from_` along `axis`.

    The values of `like` are not used; it gives the shape, dtype and device, and connects the
    result to the autograd graph. Backward: the result's gradient is sent back to `from_`
    (where the sender's `send` backward waits for it). For that backward to run, autograd must
    track the result: pass a `like` that requires grad (e.g. ``torch.zeros(shape,
    requires_grad=True)``), or one computed from the inputs being differentiated under
    `torch.func`; otherwise the sender's backward waits for a gradient that never comes.

    Args:
        like: a template for the received tensor.
        axis: mesh axis name.
        from_: the sender's index along `axis` (not this rank's own).
        mesh: the mesh; None for the current one.

    Returns:
        The received tensor.

    Raises:
        ValueError: `from_` out of range or this rank's own index, unknown axis, or no mesh.
        TypeError: `like` is not a tensor.
    """
    _check_tensor(like, "like", "recv")
    comm = _comm(axis, mesh, "recv")
    _check_peer(from_, "from_", comm, "recv")
    return _Exchange.apply(like, comm, None, from_, "recv", 0)


def _check_peer(peer: Any, name: str, comm: _Comm, caller: str) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise TypeError(f"{caller}: `{name}` must be an int index along the axis, got {peer!r}")
    if not 0 <= peer < comm.size or peer == comm.index:
        raise ValueError(
            f"{caller}: `{name}`={peer} must be another rank's index along axis "
            f"{comm.axis!r} (size {comm.size}, this rank is {comm.index})"
        )
