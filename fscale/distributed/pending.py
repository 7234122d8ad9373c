"""Asynchronous collectives: `Pending`, a collective in flight, and the Functions around it.

``all_reduce_start``, ``all_gather_start`` and ``reduce_scatter_start`` issue a collective and
return a `Pending` at once; ``pending.wait()`` blocks and returns the result, so compute placed
in between overlaps the communication. Start and wait are a differentiable pair: the start's
backward is the dual collective, the wait is an identity. The in-flight c10d work is held in a
`Work`, an opaque Python object passed to both Functions as a non-tensor argument, which is
correct under `torch.func` transforms. A start may also be issued inside another Function's
backward on plain tensors (a gradient bucket) and waited on later, e.g. before the optimizer
step. Like every collective, starts must be issued in the same order on every rank; each
Pending must be waited on before its result is used, in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fscale.distributed.watchdog import Ticket, wait

__all__ = ["Pending", "Work"]

Tensor = torch.Tensor


class Work:
    """Opaque holder of an in-flight c10d Work, passed to Functions as a non-tensor argument.

    A start Function's forward sets `work` and the collective's `ticket`
    (`fscale.distributed.watchdog`); `wait` blocks on it once, bounded by the ticket.
    """

    __slots__ = ("ticket", "work")

    def __init__(self) -> None:
        self.work: Any = None
        self.ticket: Ticket | None = None

    def wait(self) -> None:
        """Block until the collective is done (at once if it already was)."""
        if self.work is not None:
            wait(self.work, self.ticket)
            self.work = None


class _Wait(torch.autograd.Function):
    """Identity that first blocks until the collective writing its input has finished.

    Blocking must happen inside a Function's forward: gloo finishes some collectives (e.g.
    reduce-scatter) with a copy into the output during ``wait()``, and outside a forward a
    `torch.func` transform would intercept that copy as a mutation of a captured tensor.
    """

    @staticmethod
    def forward(buffer: Tensor, work: Work) -> Tensor:
        work.wait()
        return buffer.view_as(buffer)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _identity(x: Tensor) -> Tensor:
    return x


class Pending:
    """A collective in flight. `wait()` blocks until it is done and returns its result.

    Obtained from `all_reduce_start`, `all_gather_start` or `reduce_scatter_start`. Waiting is
    differentiable (the gradient flows to the start's input through the dual collective) and
    idempotent: a second `wait()` returns the same tensor.

    Args:
        buffer: the start Function's output, which the collective is writing into.
        work: the `Work` the start Function filled in.
        finish: applied to the buffer after the wait (a reshape, a division for a mean).
        result: the finished result, for a collective that needed no communication.
    """

    __slots__ = ("_buffer", "_finish", "_result", "_work")

    def __init__(
        self,
        buffer: Tensor | None,
        work: Work | None,
        finish: Callable[[Tensor], Tensor] = _identity,
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

    def then(self, after: Callable[[Tensor], Tensor]) -> Pending:
        """A Pending whose `wait()` returns ``after(self.wait())``; `self` is consumed."""
        if self._result is not None:
            return Pending.ready(after(self._result))
        finish = self._finish
        return Pending(self._buffer, self._work, lambda x: after(finish(x)))

    def wait(self) -> Tensor:
        """Block until the collective is done; return its result."""
        if self._result is None:
            self._result = self._finish(_Wait.apply(self._buffer, self._work))
            self._buffer = self._work = None
        return self._result

    def __repr__(self) -> str:
        return f"Pending({'done' if self._result is not None else 'in flight'})"
