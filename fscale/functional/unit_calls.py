"""Run a `UnitParams` through a module call, each unit materialized inside its own submodule.

Given a `UnitParams`, `FunctionalModule` runs the module with the ``eager`` parameters swapped
in as usual, and for each unit whose name is the path of a submodule that has a forward and
holds all of the unit's parameters (``"blocks.3"``), it installs for the duration of the call a
forward on that submodule which hands the submodule's computation to the unit
(`ParamUnit.call`), so the unit decides when its parameters are materialized and whether
backward recomputes them. The installed forwards are instance attributes, removed when the call
returns or raises; the module is left as it was. Until a unit's submodule runs, its parameter
slots hold placeholders that raise a clear error if something outside the submodule reads them.
Any other unit (a grouping by predicate, a ``ModuleList`` that is iterated rather than called)
is materialized before the call.

Units may not nest, and every name of a tied tensor must be used in one place (one unit, or
outside all of them): a unit's parameters exist only while its submodule runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fscale import tree
from fscale.functional import checks
from fscale.functional import slots as slots_lib
from fscale.functional.units import ParamUnit, UnitCall, UnitParams

__all__ = ["forwards", "module_units", "unit_tensors"]


def module_units(
    module: nn.Module,
    params: UnitParams,
    *,
    param_names: Sequence[str],
    aliases: Mapping[str, tuple[str, ...]],
    hint: Callable[[str], str],
) -> dict[str, ParamUnit]:
    """The units of `params` that run as a submodule of `module`, by name.

    Args:
        module: the functionalized module.
        params: the call's parameters.
        param_names: the names of `module`'s trainable parameters (`params` must hold exactly
            these).
        aliases: leaf name -> all names of each tied tensor (as in `FunctionalModule.aliases`).
        hint: returns a hint to append to the error for an unknown name (``""`` for none).

    Raises:
        TypeError: an eager parameter is not a tensor.
        ValueError: `params` does not hold exactly `param_names`, two units' submodules nest,
            or a tied tensor is used in more than one unit.
    """
    _check_unit_names(module, params, param_names, hint)
    _check_tied_weights(params, param_names, aliases)
    units: dict[str, ParamUnit] = {}
    for unit in params.units.values():
        if _is_submodule_unit(module, unit, aliases):
            units[unit.name] = unit
    nested = [(outer, inner) for outer in units for inner in units if inner.startswith(outer + ".")]
    if nested:
        outer, inner = nested[0]
        raise ValueError(
            f"apply: units {outer!r} and {inner!r} nest (the submodule {inner!r} is inside "
            f"{outer!r}); a parameter unit's submodule may not contain another unit's. "
            "Choose units that do not overlap, e.g. one per block."
        )
    return units


def unit_tensors(
    module: nn.Module,
    params: UnitParams,
    units: Mapping[str, ParamUnit],
    param_names: Sequence[str],
) -> dict[str, torch.Tensor]:
    """What `functional_call` gets per parameter: a placeholder for the `units`' ones.

    The parameters of other units (not a submodule) are materialized here, before the call.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name in param_names:
        unit = params.unit_of(name)
        if unit is not None and unit.name in units:
            tensors[name] = _Placeholder(module.get_parameter(name), name, unit.name)
        else:
            tensors[name] = params[name]
    return tensors


def _check_unit_names(
    module: nn.Module,
    params: UnitParams,
    param_names: Sequence[str],
    hint: Callable[[str], str],
) -> None:
    checks.check_name_set(
        "apply",
        "params",
        params,
        param_names,
        type(module).__name__,
        hint,
        "  Every unit together must hold exactly the names functionalize returned.",
    )
    for name, tensor in params.eager.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"apply: `params[{name!r}]` must be a tensor, got {type(tensor).__name__}"
            )


def _is_submodule_unit(
    module: nn.Module, unit: ParamUnit, aliases: Mapping[str, tuple[str, ...]]
) -> bool:
    """Whether `unit` is a submodule's path and every name of its parameters lies inside it."""
    if not unit.name:
        return False
    try:
        submodule = module.get_submodule(unit.name)
    except AttributeError:
        return False
    if type(submodule).forward is nn.Module.forward:
        return False  # a container (ModuleList, ModuleDict) is never called itself
    prefix = unit.name + "."
    return all(
        alias.startswith(prefix) for name in unit.names for alias in aliases.get(name, (name,))
    )


def _check_tied_weights(
    params: UnitParams, param_names: Sequence[str], aliases: Mapping[str, tuple[str, ...]]
) -> None:
    """Every name of a tied tensor must be used in the same place: one unit, or outside all.

    A unit's parameters exist only while its submodule runs, so a tied tensor whose names
    lie in two units (or in a unit and outside it) would be needed where it does not exist.
    """

    def place(path: str) -> str | None:
        return next((unit for unit in params.units if path.startswith(unit + ".")), None)

    trainable = set(param_names)
    for leaf, names in aliases.items():
        if leaf not in trainable:
            continue
        owner = params.unit_of(leaf)
        # The leaf is where its unit holds it; another name is in the unit whose submodule
        # path contains it, if any.
        places = {leaf: None if owner is None else owner.name}
        places.update({name: place(name) for name in names[1:]})
        if len(set(places.values())) > 1:
            described = ", ".join(
                f"{name!r} ({'unit ' + repr(unit) if unit else 'outside every unit: root'})"
                for name, unit in places.items()
            )
            raise ValueError(
                f"apply: the tied parameter {leaf!r} (one tensor registered under several "
                f"names) is used in more than one parameter unit: {described}; it is held "
                f"by {'unit ' + repr(owner.name) if owner else 'the root unit'}. All uses of "
                "a tied weight must be in ONE unit: leave them all in the root unit (e.g. a "
                "GPT's token embedding and output layer), or pick units whose submodule "
                "contains every name."
            )


class _Placeholder(torch.Tensor):
    """Stands in a parameter slot for a unit's parameter until the unit's submodule runs.

    Metadata (shape, dtype, ...) reads work; any computation raises, so a parameter used
    outside its unit's submodule is an error instead of a silent use of stale values.
    """

    param_name: str
    unit: str

    # Properties that describe the tensor without reading its values. torch.compile reads
    # most of them when it meets a placeholder in a parameter slot (it builds a fake tensor of
    # the same kind), so each is allowed; values and computation still raise.
    _METADATA = frozenset(
        {
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "is_leaf",
            "ndim",
            "layout",
            "grad_fn",
            "is_nested",
            "is_sparse",
            "is_quantized",
            "is_meta",
            "is_cpu",
            "is_cuda",
            "is_mkldnn",
            "is_sparse_csr",
            "is_xpu",
            "is_mps",
            "itemsize",
            "names",
            "_base",
            "grad",
            "_version",
        }
    )
    _METADATA_METHODS = (
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.element_size,
        torch.Tensor._is_view,
        torch.Tensor.is_conj,
        torch.Tensor.is_neg,
        torch.Tensor.untyped_storage,  # a meta tensor's: no values in it
    )

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, unit: str) -> _Placeholder:
        empty = torch.empty(like.shape, dtype=like.dtype, device="meta")
        placeholder = torch.Tensor._make_subclass(cls, empty)
        placeholder.param_name = name
        placeholder.unit = unit
        return placeholder

    def __repr__(self) -> str:  # type: ignore[override]
        return f"<placeholder of {self.param_name!r}, unit {self.unit!r}>"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        owner = getattr(func, "__self__", None)
        reads_metadata = (
            getattr(func, "__name__", "") == "__get__"
            and getattr(owner, "__name__", "") in cls._METADATA
        )
        if reads_metadata or func in cls._METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        placeholder = next(a for a in tree.leaves((args, kwargs)) if isinstance(a, _Placeholder))
        used_by = getattr(func, "__name__", func)
        if used_by == "__get__":
            used_by = f"reading .{getattr(owner, '__name__', owner)}"
        raise RuntimeError(
            f"apply: parameter {placeholder.param_name!r} of unit {placeholder.unit!r} was used "
            f"outside that unit's submodule (by {used_by}); a unit's "
            f"parameters exist only while the submodule {placeholder.unit!r} runs. Use it inside "
            "that submodule, or put it in another unit (fscale.parallel.fully_shard(units=...))."
        )


def _unit_forward(submodule: nn.Module, unit: ParamUnit) -> Callable[..., Any]:
    """A forward for `submodule` that hands its computation to `unit`."""
    original = submodule.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        unit_slots: dict[str, list[slots_lib.Slot]] = {}
        state: list[torch.Tensor] = []
        state_slots: list[list[slots_lib.Slot]] = []
        mutable: set[int] = set()
        owners = list(submodule.modules())
        tensors, tensor_slots, _ = slots_lib.state_slots(submodule, owners)
        for tensor, slots in zip(tensors, tensor_slots):
            if isinstance(tensor, _Placeholder) and tensor.unit == unit.name:
                unit_slots.setdefault(tensor.param_name, []).extend(slots)
                continue
            if slots[0][1] == "_buffers":
                mutable.add(len(state))
            state.append(tensor)
            state_slots.append(slots)
        # The flags are read now: a recompute in backward runs after `apply` restored them.
        flags = [(module, module.training) for module in owners]
        names = list(unit_slots)

        def run(
            params: Mapping[str, torch.Tensor],
            values: Sequence[torch.Tensor],
            call_args: tuple,
            call_kwargs: dict,
        ) -> Any:
            slots = [unit_slots[name] for name in names] + state_slots
            with (
                slots_lib.training_modes(flags),
                slots_lib.holding(slots, [params[name] for name in names] + list(values)),
            ):
                return original(*call_args, **call_kwargs)

        return unit.call(UnitCall(run, state, frozenset(mutable), args, kwargs))

    return forward


_NO_FORWARD = object()


@contextlib.contextmanager
def forwards(module: nn.Module, units: Mapping[str, ParamUnit]) -> Iterator[None]:
    """Each unit's submodule hands its calls to the unit inside the block; always undone after."""
    installed: list[tuple[nn.Module, Any]] = []
    try:
        for name, unit in units.items():
            submodule = module.get_submodule(name)
            installed.append((submodule, submodule.__dict__.get("forward", _NO_FORWARD)))
            submodule.__dict__["forward"] = _unit_forward(submodule, unit)
        yield
    finally:
        for submodule, previous in reversed(installed):
            if previous is _NO_FORWARD:
                submodule.__dict__.pop("forward", None)
            else:
                submodule.__dict__["forward"] = previous
