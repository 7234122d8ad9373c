"""Which module a tensor of `functionalize` came from, and taking the module's tensors out of it.

`functionalize` hands out the module's own tensors (detached, same memory) and records, for each,
the `FunctionalModule` and the name it came from (`record`, `owner_of`). A training state that
has taken those tensors (kept them, copied them, or sharded them) makes the module's copy a
second one, so `Step.init` calls `release_taken` on what it was given: every recorded tensor's
slots in its module (all names of a tied tensor) then hold a meta tensor of the same shape,
dtype and ``requires_grad`` instead. The module keeps its structure, names, shapes and dtypes and
holds no tensor memory; ``apply`` supplies every tensor of every call, so it runs as before.
`load_into` does the reverse: it puts given tensors (a consolidated state) back into the slots,
one object for all names of a tied tensor, so the module runs eagerly again.

The record holds weak references only: it keeps neither the tensors nor the module alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fscale import tree
from fscale.functional import slots as slots_lib

__all__ = [
    "LENT_ATTR",
    "RELEASED_ATTR",
    "guard_eager_calls",
    "handed_out",
    "is_released",
    "load_into",
    "mark_released",
    "owner_of",
    "place",
    "record",
    "release_slots",
    "release_taken",
    "restore_lent",
    "tensor_at",
    "tied_names",
]

# id(tensor) -> (weak tensor, weak owner, name). The tensor's weak reference removes the entry.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
# The attribute that marks a meta tensor `release_slots` put in a module (or one `functionalize`
# handed out for such a slot), to tell it from a module built on the meta device.
RELEASED_ATTR = "fscale_released"
# The attribute holding a weak reference to the tensor that was handed out for the slot.
LENT_ATTR = "fscale_lent"


def record(owner: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Remember that each of `tensors` (name -> tensor handed out) belongs to `owner`."""
    owner_ref = weakref.ref(owner)
    for name, tensor in tensors.items():
        ident = id(tensor)
        # The registry is bound to the callback: a tensor that outlives the module's globals
        # (held by a compiled graph until the interpreter exits) still finds it.
        tensor_ref = weakref.ref(
            tensor, lambda _, ident=ident, owners=_OWNERS: owners.pop(ident, None)
        )
        _OWNERS[ident] = (tensor_ref, owner_ref, name)


def owner_of(tensor: object) -> tuple[Any, str] | None:
    """``(FunctionalModule, name)`` for a tensor `functionalize` handed out, else None."""
    entry = _OWNERS.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    owner = entry[1]()
    return None if owner is None else (owner, entry[2])


def release_taken(values: Any) -> None:
    """Release, in its module, every tensor leaf of `values` that `functionalize` handed out."""
    names_by_owner: dict[int, tuple[Any, list[str]]] = {}
    for leaf in tree.leaves(values):
        found = owner_of(leaf)
        if found is not None:
            owner, name = found
            names_by_owner.setdefault(id(owner), (owner, []))[1].append(name)
    for owner, names in names_by_owner.values():
        owner.release(names)


def handed_out(owner: Any) -> dict[str, weakref.ref]:
    """``{name: weak reference}`` to the tensors `record` noted for `owner` (live or dead)."""
    return {
        name: tensor_ref
        for tensor_ref, owner_ref, name in list(_OWNERS.values())
        if owner_ref() is owner
    }


def release_slots(
    module: nn.Module,
    names: Iterable[str],
    aliases: Mapping[str, tuple[str, ...]],
    lent: Mapping[str, weakref.ref] | None = None,
) -> None:
    """Put a meta tensor like each named tensor in all of its slots of `module`.

    `lent` (name -> weak reference to the tensor handed out for it) lets `restore_lent` put
    that tensor back while something else keeps it alive.
    """
    for name in names:
        current = tensor_at(module, name)
        if current is None or current.device.type == "meta":
            continue
        meta = torch.empty_like(current, device="meta")
        if isinstance(current, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=current.requires_grad)
        mark_released(meta)
        if lent is not None and name in lent:
            setattr(meta, LENT_ATTR, lent[name])
        place(module, name, meta, aliases)


def restore_lent(module: nn.Module) -> bool:
    """Put back every released tensor of `module` whose lent tensor is still alive.

    Nothing is allocated: the module shares the memory of tensors someone else holds (the
    caller's ``params``, a state). Returns True when no released tensor is left.
    """
    complete = True
    tensors, slots, _ = slots_lib.state_slots(module)
    for tensor, tensor_slots in zip(tensors, slots):
        if not is_released(tensor):
            continue
        lent_ref = getattr(tensor, LENT_ATTR, None)
        lent = None if lent_ref is None else lent_ref()
        if lent is None:
            complete = False
            continue
        value = (
            nn.Parameter(lent, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else lent
        )
        for owner, kind, attr in tensor_slots:
            getattr(owner, kind)[attr] = value
    return complete


def mark_released(tensor: torch.Tensor) -> None:
    """Mark `tensor` as standing for one whose memory a training state has taken."""
    setattr(tensor, RELEASED_ATTR, True)


def guard_eager_calls(module: nn.Module, probe: str) -> Any:
    """Make a call of `module` itself fail clearly while slot `probe` holds a released tensor
    (unless `restore_lent` can put every tensor back).

    ``apply``'s calls pass: they fill every slot first. Returns the hook's handle.
    """

    def refuse_released(called: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or not is_released(tensor_at(called, probe)):
            return
        if restore_lent(called):  # the caller still holds every tensor: the module as it was
            return
        raise ValueError(
            f"the {type(called).__name__} was called by itself, but a loss computed so does not "
            "depend on any of the `params` (and the module has no values: step.init gave its "
            "tensors to the training state); call the functional `apply(params, buffers, ...)` "
            "from fscale.functionalize with the params loss_fn receives, or put tensors back "
            "into the module with apply.load(params, buffers)"
        )

    return module.register_forward_pre_hook(refuse_released)


def is_released(tensor: object) -> bool:
    """Whether `tensor` was marked by `mark_released`."""
    return getattr(tensor, RELEASED_ATTR, False) is True


def load_into(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    param_names: Iterable[str],
    aliases: Mapping[str, tuple[str, ...]],
) -> None:
    """Put each of `tensors` in all slots of its name (trainable names as ``nn.Parameter``)."""
    trainable = set(param_names)
    for name, tensor in tensors.items():
        current = tensor_at(module, name)
        value = tensor.detach()
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(value, requires_grad=name in trainable)
        place(module, name, value, aliases)


def tensor_at(module: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer in `module`'s slot `name` (a dotted path), None if empty."""
    owner, attr = _split(module, name)
    if attr in owner._parameters:
        return owner._parameters[attr]
    return owner._buffers.get(attr)


def place(
    module: nn.Module, name: str, value: torch.Tensor, aliases: Mapping[str, tuple[str, ...]]
) -> None:
    """Put `value` in the slot `name` and in the slots of all names tied to it."""
    # Written to the slot dicts directly (as functional_call does), so a tensor keeps its kind:
    # a parameter slot gets a Parameter, a buffer slot a plain tensor.
    for alias in aliases.get(name, (name,)):
        owner, attr = _split(module, alias)
        slots: dict[str, Any] = owner._parameters if attr in owner._parameters else owner._buffers
        slots[attr] = value


def tied_names(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """For each tensor registered under several names: first name -> all names, in order."""
    names_by_tensor: dict[int, list[str]] = {}
    registered = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in registered:
        names_by_tensor.setdefault(id(tensor), []).append(name)
    return {names[0]: tuple(names) for names in names_by_tensor.values() if len(names) > 1}


def _split(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr
