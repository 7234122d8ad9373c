"""Materialise a module built on the meta device, one submodule at a time, by its own init.

A model built under ``with torch.device("meta"):`` has shapes and no values. `materialize`
creates its tensors by walking the module tree in ``named_modules()`` order (pre-order, each
module once) and, for every submodule that directly holds one of the requested tensors:

1. creates the tensors it is the first holder of on `device` (floating-point ones filled with
   NaN, integer ones with zeros), in all of their slots (so a tied tensor is one tensor);
2. calls ``init(path, submodule)`` under ``torch.no_grad()``: ``"reset_parameters"`` calls the
   submodule's own ``reset_parameters()`` when it has one;
3. hands every tensor it is the last holder of to ``keep(name, tensor)`` (which returns what to
   keep of it: the whole tensor, or nothing after copying out this rank's shard), checks that
   init set it (no NaN left), and puts a meta tensor back in its slots.

So at most the tensors of one submodule (and tied tensors between their first and last holder)
exist in full at a time. Every holder's init writes a tied tensor; the last write stays, as in
the same loop over a full model whose tied weights are one tensor.

The whole walk runs under a forked torch RNG seeded with `seed`: the values are a function of
the seed alone, equal on every rank and equal to ``torch.manual_seed(seed)``,
``module.to_empty(device=device)`` (tied weights kept tied) and ``init(path, m)`` for
every ``(path, m)`` in ``module.named_modules()`` that holds tensors of its own, provided each
``init`` sets the tensors of the module it is given (as ``reset_parameters`` and per-module
initialisers such as transformers' ``_init_weights`` do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from fscale.functional import ownership

__all__ = ["INIT_MODES", "InitFn", "check_init", "materialize", "require_init"]

InitFn = Callable[[str, nn.Module], None]
INIT_MODES = ("reset_parameters",)


def check_init(init: object, caller: str) -> InitFn | None:
    """`init` as a function ``(path, submodule) -> None``, or None when not given.

    Raises:
        TypeError: `init` is neither None, ``"reset_parameters"`` nor callable.
    """
    if init is None:
        return None
    if init == "reset_parameters":
        return _reset_parameters
    if isinstance(init, str) or not callable(init):
        raise TypeError(
            f"{caller}: `init` must be None, 'reset_parameters' or a function "
            f"init(path, submodule) that sets the submodule's own tensors, got {init!r}"
        )
    return init  # type: ignore[return-value]


def require_init(init: InitFn | None, module: nn.Module, caller: str) -> InitFn:
    """`init`, or a ValueError (naming `caller`) saying how to give one."""
    if init is None:
        raise ValueError(
            f"{caller}: the module {type(module).__name__} is on the meta device and has no "
            "values; say how to initialise it: fscale.functionalize(module, "
            "init='reset_parameters') or init=fn(path, submodule)"
        )
    return init


def _reset_parameters(path: str, submodule: nn.Module) -> None:
    reset = getattr(submodule, "reset_parameters", None)
    if callable(reset):
        reset()


def materialize(
    module: nn.Module,
    names: Sequence[str],
    *,
    init: InitFn,
    device: torch.device,
    seed: int,
    aliases: Mapping[str, tuple[str, ...]],
    keep: Callable[[str, torch.Tensor], torch.Tensor | None],
) -> dict[str, torch.Tensor]:
    """Create the tensors `names` of `module` (meta tensors) as the module docstring says.

    Args:
        module: the model; its slots for `names` hold meta tensors, before and after.
        names: the tensors to create: parameter and buffer names (each tied tensor once).
        init: ``init(path, submodule)``.
        device: where the tensors are created.
        seed: the torch seed of the walk.
        aliases: for each tied tensor, its name mapped to all of its names.
        keep: what to keep of each tensor once it is initialised; None keeps nothing.

    Returns:
        ``{name: kept}`` for the names whose `keep` returned a tensor.

    Raises:
        ValueError: a tensor of `names` is not on the meta device, or ``init`` left NaN in it
            (it did not set it: the message names the tensor and its module).
    """
    holders = _holders(module, names, aliases)
    kept: dict[str, torch.Tensor] = {}
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        try:
            _walk(module, names, holders, init, device, aliases, keep, kept)
        except BaseException:
            _back_to_meta(module, names, aliases)  # as it was, so a fixed init can run again
            raise
    return kept


def _walk(
    module: nn.Module,
    names: Sequence[str],
    holders: dict[str, set[int]],
    init: InitFn,
    device: torch.device,
    aliases: Mapping[str, tuple[str, ...]],
    keep: Callable[[str, torch.Tensor], torch.Tensor | None],
    kept: dict[str, torch.Tensor],
) -> None:
    first = {name: min(indices) for name, indices in holders.items()}
    last = {name: max(indices) for name, indices in holders.items()}
    held_by: dict[int, list[str]] = {}
    for name in names:
        for index in sorted(holders[name]):
            held_by.setdefault(index, []).append(name)
    for index, (path, submodule) in enumerate(module.named_modules()):
        held = held_by.get(index)
        if not held:
            continue
        for name in held:
            if first[name] == index:
                _create(module, name, device, aliases)
        with torch.no_grad():
            init(path, submodule)
        for name in held:
            if last[name] == index:
                tensor = _finish(module, name, path, submodule)
                value = keep(name, tensor)
                if value is not None:
                    kept[name] = value
                ownership.release_slots(module, [name], aliases)


def _holders(
    module: nn.Module, names: Sequence[str], aliases: Mapping[str, tuple[str, ...]]
) -> dict[str, set[int]]:
    """For each name, the indices in ``named_modules()`` of the modules holding it directly."""
    index_of = {path: i for i, (path, _) in enumerate(module.named_modules())}
    holders: dict[str, set[int]] = {}
    for name in names:
        tensor = ownership.tensor_at(module, name)
        if tensor is None or tensor.device.type != "meta":
            where = "missing" if tensor is None else f"on {tensor.device}"
            raise ValueError(
                f"materialize: {name!r} must be a meta tensor of the module to be materialised, "
                f"it is {where}"
            )
        holders[name] = {index_of[alias.rpartition(".")[0]] for alias in aliases.get(name, (name,))}
    return holders


def _back_to_meta(
    module: nn.Module, names: Sequence[str], aliases: Mapping[str, tuple[str, ...]]
) -> None:
    for name in names:
        tensor = ownership.tensor_at(module, name)
        if tensor is not None and tensor.device.type != "meta":
            meta = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
            ownership.place(module, name, meta, aliases)


def _create(
    module: nn.Module, name: str, device: torch.device, aliases: Mapping[str, tuple[str, ...]]
) -> None:
    meta = ownership.tensor_at(module, name)
    assert meta is not None
    # NaN marks what init did not set (checked in `_finish`); integers have no such value.
    fill = float("nan") if meta.is_floating_point() or meta.is_complex() else 0
    tensor = torch.full(meta.shape, fill, dtype=meta.dtype, device=device)
    if isinstance(meta, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=meta.requires_grad)
    ownership.place(module, name, tensor, aliases)


def _finish(module: nn.Module, name: str, path: str, submodule: nn.Module) -> torch.Tensor:
    tensor = ownership.tensor_at(module, name)
    assert tensor is not None
    tensor = tensor.detach()
    if (tensor.is_floating_point() or tensor.is_complex()) and bool(tensor.isnan().any()):
        raise ValueError(
            f"materialize: the init left {name!r} unset (NaN) after it ran on "
            f"{path or 'the root module'!r} ({type(submodule).__name__}). The init must set "
            "every tensor of the module it is given: give that module a reset_parameters(), or "
            "pass `init=fn(path, submodule)` that sets it (also buffers a constructor computes, "
            "which the meta device leaves without values)."
        )
    return tensor
