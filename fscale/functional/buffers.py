"""The buffers a functional call leaves behind: captured at the end of the forward, checked in eval.

A functional call installs the given tensors in the module for the duration of one forward and
restores the module's own afterwards, so a buffer the forward *rebound* (``self.b = self.b + 1``)
would be lost. `call` therefore reads every buffer while the call's tensors are still installed,
inside the same reparametrisation ``torch.func.functional_call`` uses; no hook is registered, so
the call traces under ``torch.compile`` without a graph break (registering a hook is one).
`capture` does the same for a module called directly, with a forward hook. In evaluation mode
the caller's tensors are passed without copying, so their version counters are compared before
and after the call to catch an in-place update, which would have changed the caller's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless

from fscale.functional import slots as slots_lib
from fscale.outside_graph import outside_graph

__all__ = ["call", "capture", "check_not_modified", "versions"]

# Whether Dynamo reads a version counter inside a graph as a value of each run (an unbacked
# integer, torch 2.13), which makes the comparison a runtime assertion of the graph. The earlier
# releases checked (2.6, 2.7, 2.9, 2.11) bake the value read while tracing into the graph as a
# constant, so the comparison would always pass: there both reads run outside the graph (one
# break each), on the real tensors, after the graph before them has written its inputs.
_GRAPHS_READ_VERSIONS = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13)


def call(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    names: Sequence[str],
    slots: Mapping[str, slots_lib.Slot] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``module(*args, **kwargs)`` on `tensors`, and its buffers `names` as the forward left them.

    As ``torch.func.functional_call(module, tensors, args, kwargs, tie_weights=False,
    strict=True)``: every parameter and buffer name must be given, and a tensor given under
    several names is not tied by the call itself. `slots` (`slots_lib.named_slots` of exactly
    the names of `tensors`, resolved once by the caller) swaps the tensors straight into their
    slots, which skips the module-tree walks of ``functional_call``'s name checks and lookups
    (most of an eager call's fixed cost); under ``torch.compile`` the traced path is taken.
    """
    if slots is not None and not torch.compiler.is_compiling():
        with slots_lib.holding_named(slots, tensors):
            output = module(*args, **kwargs)
            captured = {name: _slot_table(slots[name])[slots[name][2]] for name in names}
        return output, captured
    # torch.func.functional_call runs exactly this context around the forward; Dynamo traces it
    # (it has a rule for it), and the buffers are read before it restores the module's own.
    with stateless._reparametrize_module(module, tensors, tie_weights=False, strict=True):
        output = module(*args, **kwargs)
        captured = {name: module.get_buffer(name) for name in names}
    return output, captured


def _slot_table(slot: slots_lib.Slot) -> dict[str, Any]:
    return getattr(slot[0], slot[1])


@contextlib.contextmanager
def capture(
    module: nn.Module, names: Sequence[str], captured: dict[str, torch.Tensor]
) -> Iterator[None]:
    """Inside the block, the end of `module`'s forward writes its buffers `names` to `captured`."""

    def hook(*_: object) -> None:
        captured.update({name: module.get_buffer(name) for name in names})

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def versions(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's version counter, to compare with `check_not_modified` after a call."""
    if torch.compiler.is_compiling() and not _GRAPHS_READ_VERSIONS:
        return _versions_outside_the_graph(tensors)
    return {name: tensor._version for name, tensor in tensors.items()}


@outside_graph
def _versions_outside_the_graph(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    return versions(tensors)


def check_not_modified(tensors: Mapping[str, torch.Tensor], before: Mapping[str, int]) -> None:
    """Raise if a tensor of `tensors` was updated in place since `versions` returned `before`.

    The version counter catches in-place updates issued as tensor ops (``add_``, ``copy_``,
    ...). Native kernels that update running statistics internally do not bump it, but those
    only do so in training mode, where the call works on clones.

    Under ``torch.compile`` on torch 2.13 and later, each comparison is an assertion of the
    graph (a branch on a symbolic version counter would end it); it fails as a RuntimeError that
    names the compared expression, not the buffer (the graph keeps the condition, not the
    message). On earlier releases the check runs outside the graph and names the buffer.

    Raises:
        RuntimeError: naming every buffer that changed.
    """
    if torch.compiler.is_compiling() and not _GRAPHS_READ_VERSIONS:
        _check_outside_the_graph(tensors, before)
        return
    if torch.compiler.is_compiling():
        # Symbolic version counters inside a graph: an assertion of the graph, not a branch.
        for name, tensor in tensors.items():
            torch._check(tensor._version == before[name], _constant(_modified([name])))
        return
    changed_in_place = [name for name, tensor in tensors.items() if tensor._version != before[name]]
    if changed_in_place:
        raise RuntimeError(_modified(changed_in_place))


def _constant(message: str) -> Any:
    # Dynamo accepts a check's message as a function of constants only.
    return lambda: message


def _modified(names: list[str]) -> str:
    return (
        f"apply: in evaluation mode the module modified buffers {names} "
        "in place, so the caller's tensors have changed. Evaluation mode passes "
        "buffers without copying; call apply with train=True for a module that "
        "updates its state, or make the module update it out of place."
    )


@outside_graph
def _check_outside_the_graph(
    tensors: Mapping[str, torch.Tensor], before: Mapping[str, int]
) -> None:
    check_not_modified(tensors, before)
