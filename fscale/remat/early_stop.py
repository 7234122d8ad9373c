"""The first-order recompute that stops once backward has what it needs.

A checkpointed function's last operations often save nothing for backward: in a transformer
block the output projection's matmul keeps its input and weight, not its result, and the
residual add keeps nothing. Rebuilding a fresh graph of the whole function and differentiating
it (`fscale.remat.engine`'s general path) runs them again anyway. Here the forward builds the
function's graph as usual but saves no tensor in it: a saved-tensor hook replaces each by its
position. When backward first unpacks one, the function runs again and each tensor it saves is
kept at its position; once the last position is filled the rerun is stopped, before the
operations that only lead to the output. Then backward runs through the graph the forward
built, reading the kept tensors. Same operations on the same values, so the gradients are the
same bits; the rerun skips what comes after the last saved tensor.

Saved-tensor hooks raise inside `torch.func` transforms and do not trace under
`torch.compile`, so the engine takes this path only outside them, in first-order backward,
without offload or a save policy (`eligible`).

The last call of a forward need not be recomputed at all. Backward begins with it, so the
recompute would rebuild its saved tensors at once, at the point where the forward left them.
Inside `keep_last` (a train step's forward and backward run inside one) the most recent
top-level call keeps the tensors its forward saved, and releases them when the next one begins;
the call still alive at backward is differentiated through what its forward saved, the same
tensors and the same bits. What it costs: that call's saved tensors are held from its forward
on, beside whatever the forward computes after it (an LM head's logits), where the recompute
would have made them after that part's backward freed its own. A kept tensor changed in place
after the call (its version moved) is dropped and the call recomputed, as without keeping.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fscale import tracking
from fscale.remat.fresh_graph import grads_through

__all__ = [
    "EarlyStopGraph",
    "eligible",
    "keep_last",
    "keeping_last",
    "not_top_level",
    "release_kept",
]


def eligible() -> bool:
    """Whether a checkpoint called now may take this path: grad mode on, no torch.func
    transform around it, not being compiled."""
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
    )


class _StopRecomputeError(Exception):
    """Raised inside the rerun once every saved position is filled."""


class _Scope:
    """One `keep_last` block: whether it keeps, and the graph keeping now (weakly held)."""

    def __init__(self, enabled: bool | None) -> None:
        self.enabled = enabled
        self.keeping: weakref.ref[EarlyStopGraph] | None = None

    def release(self) -> None:
        graph = None if self.keeping is None else self.keeping()
        if graph is not None:
            graph.release()
        self.keeping = None


class _ThreadScopes(threading.local):
    def __init__(self) -> None:
        self.scopes: list[_Scope] = []
        self.building = 0  # forwards of checkpointed calls running now (nested ones count)


_SCOPES = _ThreadScopes()


def _reset() -> None:
    """A block a program left open (see `fscale.tracking.reset`) keeps nothing for the next."""
    _SCOPES.scopes.clear()
    _SCOPES.building = 0


tracking.register(__name__, _reset)


@contextlib.contextmanager
def keep_last(enabled: bool = True) -> Iterator[None]:
    """Whether the last checkpointed call of a forward keeps what backward needs (see the
    module docstring). A train step keeps it by default; ``with keep_last(False):`` around the
    step makes every checkpointed call recompute, each holding only its inputs."""
    if not isinstance(enabled, bool):
        raise TypeError(f"keep_last: `enabled` must be True or False, got {enabled!r}")
    with _scope(enabled):
        yield


def keeping_last() -> contextlib.AbstractContextManager[None]:
    """The block of one forward and its backward (a train step's gradient phase): the last
    checkpointed call keeps its saved tensors, unless an enclosing `keep_last(False)` says not;
    whatever is still kept is released when the block ends. Nothing under torch.compile, where
    no checkpointed call takes this path."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _scope(None)


@contextlib.contextmanager
def _scope(enabled: bool | None) -> Iterator[None]:
    scope = _Scope(enabled)
    _SCOPES.scopes.append(scope)
    try:
        yield
    finally:
        if scope in _SCOPES.scopes:  # not when a `tracking.reset` cleared it meanwhile
            _SCOPES.scopes.remove(scope)
        scope.release()


@contextlib.contextmanager
def not_top_level() -> Iterator[None]:
    """Checkpointed calls begun inside (within another's forward or recompute) never keep."""
    _SCOPES.building += 1
    try:
        yield
    finally:
        _SCOPES.building -= 1


def release_kept() -> bool:
    """A checkpointed call begins: unless it runs inside another's forward or recompute, the
    call kept before it (in any enclosing scope) is recomputed after all, since only the
    forward's last call keeps. Whether the call beginning is a top-level one."""
    if _SCOPES.building:
        return False
    for scope in _SCOPES.scopes:
        scope.release()
    return True


def _keeps() -> bool:
    """Whether to keep: as the innermost scope that decides says (a train step's scope leaves
    it to an enclosing `keep_last`; none: keep)."""
    return next((s.enabled for s in reversed(_SCOPES.scopes) if s.enabled is not None), True)


class EarlyStopGraph:
    """One checkpointed call's forward graph, its saved tensors replaced by positions.

    `build` runs the forward; `grads` runs backward through it, rerunning the function
    (through `rerun`) when the first saved tensor is read.
    """

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self._saved = 0  # positions handed out in forward
        self._specs: list[tuple[torch.Size, torch.dtype]] = []  # what forward saved at each
        self._kept: dict[int, torch.Tensor] = {}
        self._filled = 0
        self._rerun: Callable[[list[torch.Tensor]], Any] | None = None
        self._values: list[torch.Tensor] = []
        # Under `keep_last`: what the forward saved, by position, with each tensor's version
        # then; None when this call does not keep (or no longer does).
        self._held: dict[int, tuple[torch.Tensor, int]] | None = None
        self._read: set[int] = set()  # positions backward has read

    def build(
        self, run: Callable[[list[torch.Tensor]], Any], tensors: Sequence[torch.Tensor]
    ) -> Any:
        """Run `run` on leaves that alias `tensors` with the graph recorded; returns its
        result, whose tensors `grads` differentiates (the caller hands out detached aliases)."""
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        # The graph's nodes keep the hooks and this object keeps the graph's outputs: hooks
        # that held it strongly would close a cycle through autograd's C++ nodes, which the
        # garbage collector cannot see, and every call would leak its graph.
        this: weakref.ref[EarlyStopGraph] = weakref.ref(self)

        def pack(tensor: torch.Tensor) -> int:
            return _alive(this)._pack_position(tensor)

        def unpack(position: int) -> torch.Tensor:
            return _alive(this)._unpack(position)

        if release_kept() and _SCOPES.scopes and _keeps():
            self._held = {}
            _SCOPES.scopes[-1].keeping = this
        with (
            not_top_level(),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
        ):
            return run(self.leaves)

    def release(self) -> None:
        """Drop what the forward saved: backward recomputes this call (see `keep_last`)."""
        self._held = None

    def runs_compiled_code(self) -> bool:
        """Whether the recorded graph holds the backward of a compiled function
        (``torch.compile``, AOTAutograd), which early stop cannot serve: it refuses to run
        through a retained graph when it reuses its saved buffers, and a recompute run outside
        the compiled forward's conditions may save other tensors."""
        seen: set[Any] = set()
        pending = [t.grad_fn for t in self.outputs]
        while pending:
            node = pending.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if "CompiledFunction" in node.name():
                return True
            pending.extend(next_node for next_node, _ in node.next_functions)
        return False

    def grads(
        self,
        rerun: Callable[[list[torch.Tensor]], Any],
        values: list[torch.Tensor],
        pairs: list[tuple[int, torch.Tensor]],
        needs: list[bool],
    ) -> list[torch.Tensor | None]:
        """The gradients w.r.t. the inputs `needs` marks, given output gradients `pairs`
        ((output index, gradient)); `rerun(inputs)` runs the function again on `values`."""
        self._rerun, self._values = rerun, values
        self._read = set()
        try:
            # Retained: the graph holds positions, not tensors, so keeping it costs nothing,
            # and a backward of the outer graph with retain_graph may come through again.
            return grads_through(self.outputs, self.leaves, pairs, needs, retain_graph=True)
        finally:
            self._rerun, self._values = None, []

    # hooks -----------------------------------------------------------------------------

    def _pack_position(self, tensor: torch.Tensor) -> int:
        position = self._saved
        self._saved += 1
        self._specs.append((tensor.shape, tensor.dtype))
        if self._held is not None:
            # Detached: the tensor may be an output whose node holds this very entry.
            self._held[position] = (tensor.detach(), tensor._version)
        return position

    def _unpack(self, position: int) -> torch.Tensor:
        held = None if self._held is None else self._held.pop(position, None)
        if held is not None and held[0]._version == held[1]:
            self._read.add(position)
            return held[0]
        if held is not None:
            self._held = None  # changed in place since: recompute the call instead
        if position not in self._kept:
            self._fill()
        self._read.add(position)
        # Released once read: what backward has used need not outlive its node (a second
        # backward with retain_graph reruns the function again).
        return self._kept.pop(position)

    def _fill(self) -> None:
        if self._rerun is None:
            raise RuntimeError(
                "fscale.checkpoint: a saved tensor of a checkpointed call was read outside its "
                "backward; read the graph's saved tensors only while backward runs"
            )
        self._filled = 0
        inputs = [
            v.detach().requires_grad_(leaf.requires_grad)
            for v, leaf in zip(self._values, self.leaves)
        ]
        try:
            with (
                not_top_level(),
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(self._pack_kept, _refuse_unpack),
            ):
                self._rerun(inputs)
        except _StopRecomputeError:
            pass
        if self._filled != self._saved:
            raise RuntimeError(
                f"fscale.checkpoint: the recompute saved {self._filled} tensors for backward "
                f"where the forward saved {self._saved}; the checkpointed function must run "
                "the same operations both times"
            )
        # A rerun after backward read some kept tensors fills their positions again: drop them.
        for position in self._read:
            self._kept.pop(position, None)

    def _pack_kept(self, tensor: torch.Tensor) -> None:
        if self._filled >= self._saved:
            raise RuntimeError(
                f"fscale.checkpoint: the recompute saved more tensors for backward than the "
                f"forward's {self._saved}; the checkpointed function must run the same "
                "operations both times"
            )
        expected = self._specs[self._filled]
        if (tensor.shape, tensor.dtype) != expected:
            raise RuntimeError(
                f"fscale.checkpoint: the recompute saved a {tuple(tensor.shape)} "
                f"{tensor.dtype} tensor for backward where the forward saved a "
                f"{tuple(expected[0])} {expected[1]} one (saved tensor {self._filled}); the "
                "checkpointed function must run the same operations both times"
            )
        self._kept[self._filled] = tensor.detach()
        self._filled += 1
        if self._filled == self._saved:
            raise _StopRecomputeError


def _alive(ref: weakref.ref[EarlyStopGraph]) -> EarlyStopGraph:
    graph = ref()
    if graph is None:
        raise RuntimeError(
            "fscale.checkpoint: a saved tensor of a checkpointed call was read after the call's "
            "backward graph was freed"
        )
    return graph


def _refuse_unpack(_: None) -> torch.Tensor:
    raise RuntimeError("fscale.checkpoint: the recompute's own graph is never differentiated")
