"""Put other tensors in a module's parameter and buffer slots, and other modes on it, for a call.

`functionalize`'s unit protocol and `fscale.checkpoint`'s recompute both run a module's own
forward on tensors they choose (gathered shards, recomputed leaves) in the train/eval mode of an
earlier call. They do it the way `torch.func.functional_call` does: by writing the slot dicts
directly for the duration of a block, which also skips `nn.Module.__setattr__`'s Parameter
check (the values are plain tensors). Modes are set the same way: every module's own
``training`` flag is saved before and written back after, so a block never leaves a mode behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "Slot",
    "holding",
    "holding_named",
    "mode",
    "named_slots",
    "state_slots",
    "training_modes",
]

Slot = tuple[nn.Module, str, str]
"""(owner module, "_parameters" or "_buffers", attribute name)."""


def state_slots(
    module: nn.Module, owners: Sequence[nn.Module] | None = None
) -> tuple[list[torch.Tensor], list[list[Slot]], int]:
    """`module`'s distinct parameters, then buffers, with every slot that holds each.

    `owners` is ``list(module.modules())`` when the caller has it already (walking the module
    tree is a sizeable part of a small call's cost).

    Returns:
        ``(tensors, slots, num_parameters)``: a tied tensor appears once (compiled, a tied
        tensor subclass twice: `_index_of`), and ``slots[i]`` lists every slot holding
        ``tensors[i]``; the first `num_parameters` are parameters.
    """
    tensors: list[torch.Tensor] = []
    slots: list[list[Slot]] = []
    index_of: dict[int, int] = {}
    num_parameters = 0
    compiling = torch.compiler.is_compiling()
    if owners is None:
        owners = list(module.modules())
    for kind in ("_parameters", "_buffers"):
        for owner in owners:
            for attr, value in getattr(owner, kind).items():
                if value is None:
                    continue
                i = _index_of(value, tensors, index_of, compiling)
                if i is None:
                    i = len(tensors)
                    if not compiling:
                        index_of[id(value)] = i
                    tensors.append(value)
                    slots.append([])
                    num_parameters += kind == "_parameters"
                slots[i].append((owner, kind, attr))
    return tensors, slots, num_parameters


def _index_of(
    value: torch.Tensor, tensors: list[torch.Tensor], index_of: dict[int, int], compiling: bool
) -> int | None:
    """Where `value` is in `tensors` already (a tied tensor), or None.

    Compiled, the search compares identities instead of looking up ``id(value)``: Dynamo guards
    a traced ``id(tensor)`` on that tensor's identity, and the parameters a step swaps in are
    new tensors every step, so every step recompiled the module's forward until Dynamo's
    recompile limit left it eager. A tensor subclass (`fully_shard`'s placeholders) is not
    compared there (Dynamo 2.6 fails to trace the comparison) and counts as distinct: listed
    twice, a tied tensor is still one tensor in every slot, and its gradients add up.
    """
    if compiling:
        if type(value) not in (torch.Tensor, nn.Parameter):
            return None
        return next((i for i, tensor in enumerate(tensors) if tensor is value), None)
    return index_of.get(id(value))


def named_slots(
    module: nn.Module, names: Sequence[str], aliases: Mapping[str, Sequence[str]]
) -> dict[str, Slot] | None:
    """The slot of every name of `names` and its `aliases`, or None if one is not in a slot.

    `aliases` maps a tied tensor's name to all the names it is registered under (itself first).

    Resolving a dotted name walks the module tree; a call that swaps the same names every time
    resolves them once here instead. None (an attribute that is not a registered parameter or
    buffer) leaves the caller on the general ``torch.func`` reparametrisation.
    """
    found: dict[str, Slot] = {}
    for name in (alias for leaf in names for alias in aliases.get(leaf, (leaf,))):
        prefix, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(prefix)
        except AttributeError:
            return None
        kind = next((k for k in ("_parameters", "_buffers") if attr in getattr(owner, k)), None)
        if kind is None:
            return None
        found[name] = (owner, kind, attr)
    return found


@contextlib.contextmanager
def holding_named(slots: Mapping[str, Slot], values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """The slot of each name of `slots` holds ``values[name]`` inside the block; restored after.

    `values` must hold exactly the names of `slots`.
    """
    swapped: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]] = []
    try:
        for name, (owner, kind, attr) in slots.items():
            table = owner.__dict__[kind]
            swapped.append((table, attr, table[attr]))
            table[attr] = values[name]
        yield
    finally:
        for table, attr, previous in reversed(swapped):
            table[attr] = previous


@contextlib.contextmanager
def holding(slots: Sequence[Sequence[Slot]], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Every slot in ``slots[i]`` holds ``values[i]`` inside the block; restored after."""
    originals = [[getattr(owner, kind)[attr] for owner, kind, attr in group] for group in slots]
    try:
        for group, value in zip(slots, values):
            for owner, kind, attr in group:
                getattr(owner, kind)[attr] = value
        yield
    finally:
        for group, previous in zip(slots, originals):
            for (owner, kind, attr), value in zip(group, previous):
                getattr(owner, kind)[attr] = value


@contextlib.contextmanager
def training_modes(modes: Sequence[tuple[nn.Module, bool]]) -> Iterator[None]:
    """Each module's ``training`` flag as given inside the block; every one restored after.

    The flags are written straight into each module's ``__dict__``, where ``nn.Module`` keeps
    them: its ``__setattr__`` first checks the value against parameters, buffers and submodules,
    which for a plain bool was most of the cost of a call that runs once per block and step.
    """
    previous = [(module, module.training) for module, _ in modes]
    try:
        for module, training in modes:
            vars(module)["training"] = training
        yield
    finally:
        for module, training in previous:
            vars(module)["training"] = training


@contextlib.contextmanager
def mode(module: nn.Module, train: bool, submodules: Sequence[nn.Module]) -> Iterator[None]:
    """`module` in `train` mode (``module.train(train)``) inside the block; every flag restored.

    `submodules` is ``list(module.modules())``, computed once by the caller: walking the module
    tree is most of this context's cost, and it runs on every call.
    """
    flags = [(submodule, submodule.training) for submodule in submodules]
    if all(flag == train for _, flag in flags):
        yield
        return
    module.train(train)
    try:
        yield
    finally:
        for submodule, flag in flags:
            submodule.training = flag
