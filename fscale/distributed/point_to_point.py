"""`ppermute`, `send` and `recv`: point-to-point exchanges, each dual to the reverse exchange.

One Function, `_Exchange`, sends to one index along the axis and/or receives from one. Its
backward is the reverse exchange, so gradients go back to where the values came from:
``ppermute`` with `perm` is dual to ``ppermute`` with the inverse permutation, and ``send`` to
a peer is dual to ``recv`` from it. A rank that receives nothing in a ``ppermute`` gets zeros;
``send`` returns a 0-dim zero "token" connected to the sent tensor, through which its gradient
arrives from the receiver's backward. A self-pair moves nothing and is a copy.

The ledger records what this rank sends: the tensor for ``send`` and a ``ppermute`` that
sends, nothing for ``recv``. With the debug check on, ``ppermute`` compares a digest of the
permutation across the axis, and a send/recv pair swaps one metadata row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm, check_index, check_tensor, resolve_comm
from fscale.distributed.debug import check_pair, debug_enabled, issue
from fscale.distributed.ledger import record
from fscale.distributed.mesh import Mesh
from fscale.distributed.watchdog import admit_pair, wait

__all__ = ["ppermute", "recv", "send"]

Tensor = torch.Tensor


class _Exchange(torch.autograd.Function):
    """Send `x` to index `send_to` and receive from `recv_from` along the axis (either None).

    `kind` names the operation for the ledger and fixes what a rank that receives nothing
    returns: zeros like `x` for "ppermute", a 0-dim zero for "send" (a token through which the
    gradient of `x` arrives). For "recv", `x` only gives the shape, dtype and device. Backward
    is the reverse exchange: gradients go back to where the values came from.
    """

    @staticmethod
    def forward(
        x: Tensor, comm: Comm, send_to: int | None, recv_from: int | None, kind: str, extra: int
    ) -> Tensor:
        if kind == "ppermute":
            sends = send_to is not None and send_to != comm.index
            ticket = issue(comm, kind, x, x.numel() if sends else 0, extra)
        else:
            peer = send_to if kind == "send" else recv_from
            if peer is None:  # `send` and `recv` always name their peer
                raise ValueError(f"{kind}: the peer index is None")
            me, other = (
                comm.mesh.global_rank(comm.axis, comm.index),
                comm.mesh.global_rank(comm.axis, peer),
            )
            src, dst = (me, other) if kind == "send" else (other, me)
            ticket = admit_pair(src, dst, comm.axis, kind, x, not debug_enabled())
            if debug_enabled():
                check_pair(comm, kind, x, peer, ticket)
            record(kind, comm.axis, x.dtype, x.numel(), comm.size)
        if send_to is not None and send_to == comm.index:
            return x.clone()  # a self-pair moves nothing
        works = []
        if send_to is not None:
            works.append(dist.isend(x.contiguous(), group=comm.group, group_dst=send_to))
        received = None
        if recv_from is not None:
            received = torch.empty_like(x, memory_format=torch.contiguous_format)
            works.append(dist.irecv(received, group=comm.group, group_src=recv_from))
        for work in works:
            wait(work, ticket)
        if received is not None:
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

    Every rank of the axis must call it with the same `perm`. A pipeline shifts activations
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
    check_tensor(x, "x", "ppermute")
    comm = resolve_comm(axis, mesh, "ppermute")
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
            f"ppermute: `perm` must be a sequence of (source, destination) int pairs, got {perm!r}"
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
    check_tensor(x, "x", "send")
    comm = resolve_comm(axis, mesh, "send")
    check_index(to, "to", comm, "send", other=True)
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
    check_tensor(like, "like", "recv")
    comm = resolve_comm(axis, mesh, "recv")
    check_index(from_, "from_", comm, "recv", other=True)
    return _Exchange.apply(like, comm, None, from_, "recv", 0)
