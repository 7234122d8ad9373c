"""Turn an ``nn.Module`` into a pure function of explicit parameters and buffers.

``functionalize(module)`` returns ``(apply, params, buffers)``: two flat dicts keyed by the
module's own names, and ``apply(params, buffers, *args, key=None, train=None, **kwargs) ->
(output, new_buffers)``, a call of the module through ``torch.func.functional_call`` whose
result depends only on its arguments:

- **Parameters are leaves.** ``params`` holds every trainable parameter once. A parameter
  registered under several names (tied weights, such as a GPT's token embedding and output
  layer) is one leaf under its first name; ``apply`` hands it to every alias, so the gradients
  of all its uses sum into that one leaf, exactly as in eager training.
- **Everything not trained is a buffer.** ``buffers`` holds the module's buffers *and* its
  frozen parameters (``requires_grad=False``). Both are state that is read, never given a
  gradient; keeping frozen parameters out of ``params`` means an optimizer, a gradient
  all-reduce or a sharding plan never sees them.
- **Inputs are never mutated.** Modules such as BatchNorm update their buffers in place in
  training mode, so in training mode ``apply`` runs the module on clones of the buffers and
  returns the updated state in ``new_buffers`` (a new dict). Evaluation mode copies nothing:
  ``new_buffers`` then holds the very tensors that were passed in (or a buffer the forward
  rebound to a new tensor).
- **The mode is an argument.** ``train`` (default: the value given to ``functionalize``) sets
  ``module.train(mode)`` for the call; every submodule's own ``.training`` flag is restored
  afterwards, so the user's module is left as it was.
- **Randomness is an argument.** With ``key`` (an ``fscale.random`` key) the call runs under a
  forked RNG seeded with ``fscale.random.seed(key)``: dropout draws the same masks as the eager
  module run right after ``torch.manual_seed(fscale.random.seed(key))``, and the ambient RNG is
  untouched. ``key=None`` draws from the ambient torch RNG (and advances it), as eager code does.

``params`` and ``buffers`` share memory with the module (they are detached views, not copies).
``apply`` works under ``torch.autograd.grad`` (give the ``params`` leaves ``requires_grad``),
``torch.func.grad`` and ``torch.func.vjp``.

Parameters materialized at their point of use
---------------------------------------------
``params`` may also be a `UnitParams`: a mapping whose parameters are held in *units* that
exist only while they are needed (fully sharded training keeps each unit as a 1/N shard and
all-gathers it just before use). ``apply`` then runs the module with the ``eager`` parameters
swapped in as usual, and for each unit whose name is the path of a submodule that has a forward and holds
all of the unit's parameters (``"blocks.3"``), it installs for the duration of the call a forward
on that submodule which hands the submodule's computation to the unit (`ParamUnit.call`), so
the unit decides when its parameters are materialized and whether backward recomputes them.
The installed forwards are instance attributes, removed when the call returns or raises; the
module is left as it was. Until a unit's submodule runs, its parameter slots hold
placeholders that raise a clear error if something outside the submodule reads them. Any other
unit (a grouping by predicate, a ``ModuleList`` that is iterated rather than called) is
materialized before the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from fscale import random as fsrandom
from fscale import slots as slots_lib
from fscale import tree

__all__ = ["FunctionalModule", "ParamUnit", "UnitCall", "UnitParams", "functionalize"]

Tensors = dict[str, torch.Tensor]


def functionalize(
    module: nn.Module, *, train: bool = True
) -> tuple[FunctionalModule, Tensors, Tensors]:
    """Split `module` into a pure function and the state it reads.

    Args:
        module: the model. It is not modified, neither here nor by ``apply``.
        train: the mode ``apply`` runs in when its own ``train`` argument is not given.

    Returns:
        ``(apply, params, buffers)``. ``params`` maps the name of every trainable parameter to
        the parameter's tensor, detached (same memory, no autograd history); tied parameters
        appear once, under their first name in ``module.named_parameters()``. ``buffers`` maps
        the name of every buffer and every frozen parameter (``requires_grad=False``) to its
        tensor, detached. ``apply`` is a `FunctionalModule`.

    Raises:
        TypeError: `module` is not an ``nn.Module`` or `train` is not a bool.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"functionalize: `module` must be a torch.nn.Module, got {type(module).__name__}"
        )
    _check_bool("functionalize", "train", train)
    params: Tensors = {}
    buffers: Tensors = {}
    for name, parameter in module.named_parameters():
        (params if parameter.requires_grad else buffers)[name] = parameter.detach()
    frozen_names = tuple(buffers)
    for name, buffer in module.named_buffers():
        buffers[name] = buffer.detach()
    apply = FunctionalModule(
        module,
        train=train,
        param_names=tuple(params),
        frozen_names=frozen_names,
        buffer_names=tuple(name for name in buffers if name not in frozen_names),
        aliases=_aliases(module),
    )
    return apply, params, buffers


class FunctionalModule:
    """``apply(params, buffers, *args, key=None, train=None, **kwargs) -> (output, new_buffers)``.

    Made by `functionalize`; see the module docstring for the contract. ``args`` and ``kwargs``
    go to the module's ``forward`` (so a ``forward`` argument named ``key`` or ``train`` cannot
    be passed through).

    Attributes:
        module: the wrapped module.
        train: the default mode.
        param_names: names of the trainable leaves, in ``module.named_parameters()`` order.
        buffer_names: names of the module's buffers.
        frozen_names: names of the frozen parameters (held in ``buffers``).
        aliases: for each tied tensor, its leaf name mapped to all the names it is registered
            under (the leaf name first).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        train: bool,
        param_names: tuple[str, ...],
        frozen_names: tuple[str, ...],
        buffer_names: tuple[str, ...],
        aliases: dict[str, tuple[str, ...]],
    ) -> None:
        self.module = module
        self.train = train
        self.param_names = param_names
        self.frozen_names = frozen_names
        self.buffer_names = buffer_names
        self.aliases = aliases
        # The module tree as of functionalize (its parameter names are fixed then too).
        self._submodules = list(module.modules())

    def __repr__(self) -> str:
        return (
            f"FunctionalModule({type(self.module).__name__}, train={self.train}, "
            f"params={len(self.param_names)}, buffers={len(self.buffer_names)}, "
            f"frozen={len(self.frozen_names)}, tied={len(self.aliases)})"
        )

    def __call__(
        self,
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        *args: Any,
        key: torch.Tensor | None = None,
        train: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Any, Tensors]:
        """Run the module on `params` and `buffers`.

        Args:
            params: one tensor per name in `param_names` (the ``params`` of `functionalize`,
                or any tensors of the same names: updated, sharded-and-gathered, tracked by a
                torch.func transform).
            buffers: one tensor per name in `buffer_names` and `frozen_names`.
            *args: positional arguments of the module's ``forward``.
            key: an ``fscale.random`` key that seeds the call's randomness (dropout), or None
                to draw from the ambient torch RNG.
            train: the mode of this call; None means the default given to `functionalize`.
            **kwargs: keyword arguments of the module's ``forward``.

        Returns:
            ``(output, new_buffers)``: the module's output and a new dict with the same names as
            `buffers` holding the state after the call (running statistics updated in training
            mode). In evaluation mode, entries the call did not rebind are the tensors that
            were passed in; frozen parameters always are.

        Raises:
            TypeError: `params` or `buffers` is not a mapping of tensors, `key` is not a key,
                or `train` is not a bool.
            ValueError: a name is missing from `params` or `buffers`, or is not one of the
                module's (all offending names are listed).
            RuntimeError: in evaluation mode the module modified a buffer in place (the
                caller's tensor has then changed; such a module needs ``train=True``).
        """
        mode = self.train if train is None else train
        _check_bool("apply", "train", mode)
        if key is not None and not fsrandom.is_key(key):
            raise TypeError(
                "apply: `key` must be an fscale.random key (an int64 tensor of shape (2,) made "
                f"by `fscale.random.key(seed)`) or None, got {_describe(key)}"
            )
        module_units: dict[str, ParamUnit] = {}
        if isinstance(params, UnitParams):
            module_units = self._module_units(params)
            params = self._unit_tensors(params, module_units)
        else:
            self._check_names("params", params, self.param_names)
        self._check_names("buffers", buffers, self.buffer_names + self.frozen_names)

        # Mutable state is passed as clones in training mode, so in-place updates (BatchNorm's
        # running statistics) land in tensors this call owns rather than in the caller's.
        passed_buffers = {
            name: buffers[name].clone() if mode else buffers[name] for name in self.buffer_names
        }
        # Evaluation mode passes the caller's own tensors, so it checks afterwards that they
        # were not updated in place.
        versions_before = (
            {} if mode else {name: tensor._version for name, tensor in passed_buffers.items()}
        )
        tensors = self._with_aliases(params)
        tensors.update(self._with_aliases({name: buffers[name] for name in self.frozen_names}))
        tensors.update(self._with_aliases(passed_buffers))

        captured: Tensors = {}
        with (
            _mode(self.module, mode, self._submodules),
            _capture_buffers(self.module, self.buffer_names, captured),
            _rng_seeded_by(key, lambda: [*tensors.values(), *tree.leaves((args, kwargs))]),
            _unit_forwards(self.module, module_units),
        ):
            # The aliases are mapped above, so tying by functional_call itself is not needed;
            # strict=True turns any name this wrapper failed to map into an error.
            output = torch.func.functional_call(
                self.module, tensors, args, kwargs, tie_weights=False, strict=True
            )

        new_buffers = self._new_buffers(buffers, passed_buffers, versions_before, captured, mode)
        return output, new_buffers

    def _module_units(self, params: UnitParams) -> dict[str, ParamUnit]:
        """The units of `params` that run as a submodule, after checking names and tied weights."""
        self._check_unit_names(params)
        self._check_tied_weights(params)
        module_units: dict[str, ParamUnit] = {}
        for unit in params.units.values():
            if self._is_submodule_unit(unit):
                module_units[unit.name] = unit
        nested = [
            (outer, inner)
            for outer in module_units
            for inner in module_units
            if inner.startswith(outer + ".")
        ]
        if nested:
            outer, inner = nested[0]
            raise ValueError(
                f"apply: units {outer!r} and {inner!r} nest (the submodule {inner!r} is inside "
                f"{outer!r}); a parameter unit's submodule may not contain another unit's. "
                "Choose units that do not overlap, e.g. one per block."
            )
        return module_units

    def _check_unit_names(self, params: UnitParams) -> None:
        given = list(params)
        expected_set = set(self.param_names)
        missing = [name for name in self.param_names if name not in params]
        unknown = [name for name in given if name not in expected_set]
        if missing or unknown:
            lines = [f"apply: `params` does not match the module {type(self.module).__name__}:"]
            if missing:
                lines.append(f"  - missing: {missing}")
            lines.extend(f"  - unknown: {name!r}{self._hint(name)}" for name in unknown)
            lines.append("  Every unit together must hold exactly the names functionalize returned.")
            raise ValueError("\n".join(lines))
        for name, tensor in params.eager.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"apply: `params[{name!r}]` must be a tensor, got {type(tensor).__name__}"
                )

    def _is_submodule_unit(self, unit: ParamUnit) -> bool:
        """Whether `unit` is a submodule's path and every name of its parameters lies inside it."""
        if not unit.name:
            return False
        try:
            submodule = self.module.get_submodule(unit.name)
        except AttributeError:
            return False
        if type(submodule).forward is nn.Module.forward:
            return False  # a container (ModuleList, ModuleDict) is never called itself
        prefix = unit.name + "."
        return all(
            alias.startswith(prefix)
            for name in unit.names
            for alias in self.aliases.get(name, (name,))
        )

    def _check_tied_weights(self, params: UnitParams) -> None:
        """Every name of a tied tensor must be used in the same place: one unit, or outside all.

        A unit's parameters exist only while its submodule runs, so a tied tensor whose names
        lie in two units (or in a unit and outside it) would be needed where it does not exist.
        """

        def place(path: str) -> str | None:
            return next((unit for unit in params.units if path.startswith(unit + ".")), None)

        for leaf, names in self.aliases.items():
            if leaf not in self.param_names:
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

    def _unit_tensors(self, params: UnitParams, module_units: dict[str, ParamUnit]) -> Tensors:
        """What `functional_call` gets per parameter: a placeholder for submodule units' ones.

        Other units (not a submodule) are materialized here, before the call.
        """
        tensors: Tensors = {}
        for name in self.param_names:
            unit = params.unit_of(name)
            if unit is not None and unit.name in module_units:
                like = self.module.get_parameter(name)
                tensors[name] = _Placeholder(like, name, unit.name)
            else:
                tensors[name] = params[name]
        return tensors

    def _new_buffers(
        self,
        buffers: Mapping[str, torch.Tensor],
        passed_buffers: Tensors,
        versions_before: dict[str, int],
        captured: Tensors,
        mode: bool,
    ) -> Tensors:
        if not mode:
            # The version counter catches in-place updates issued as tensor ops (``add_``,
            # ``copy_``, ...). Native kernels that update running statistics internally do not
            # bump it, but those only do so in training mode, where buffers are cloned.
            changed_in_place = [
                name
                for name, tensor in passed_buffers.items()
                if tensor._version != versions_before[name]
            ]
            if changed_in_place:
                raise RuntimeError(
                    f"apply: in evaluation mode the module modified buffers {changed_in_place} "
                    "in place, so the caller's tensors have changed. Evaluation mode passes "
                    "buffers without copying; call apply with train=True for a module that "
                    "updates its state, or make the module update it out of place."
                )
        # `captured` also holds buffers the forward rebound (``self.b = self.b + 1``), which
        # functional_call would otherwise drop when it restores the module.
        return {
            name: buffers[name]
            if name in self.frozen_names
            else captured.get(name, passed_buffers[name])
            for name in buffers
        }

    def _with_aliases(self, leaves: Mapping[str, torch.Tensor]) -> Tensors:
        named: Tensors = {}
        for name, tensor in leaves.items():
            for alias in self.aliases.get(name, (name,)):
                named[alias] = tensor
        return named

    def _check_names(self, argument: str, given: object, expected: tuple[str, ...]) -> None:
        if not isinstance(given, Mapping):
            raise TypeError(
                f"apply: `{argument}` must be a dict of name -> tensor (the `{argument}` "
                f"returned by functionalize), got {type(given).__name__}"
            )
        expected_set = set(expected)
        missing = [name for name in expected if name not in given]
        unknown = [name for name in given if name not in expected_set]
        if missing or unknown:
            module_name = type(self.module).__name__
            lines = [f"apply: `{argument}` does not match the module {module_name}:"]
            if missing:
                lines.append(f"  - missing: {missing}")
            lines.extend(f"  - unknown: {name!r}{self._hint(name)}" for name in unknown)
            lines.append(
                f"  Pass exactly the names of the `{argument}` dict returned by functionalize."
            )
            raise ValueError("\n".join(lines))
        for name in expected:
            if not isinstance(given[name], torch.Tensor):
                raise TypeError(
                    f"apply: `{argument}[{name!r}]` must be a tensor, got "
                    f"{type(given[name]).__name__}"
                )

    def _hint(self, name: object) -> str:
        for leaf, names in self.aliases.items():
            if name in names[1:]:
                return f" (tied to {leaf!r}; tied tensors are one entry, under {leaf!r})"
        if name in self.param_names:
            return " (a trainable parameter: it belongs in `params`)"
        if name in self.frozen_names:
            return " (a frozen parameter: it belongs in `buffers`)"
        if name in self.buffer_names:
            return " (a buffer: it belongs in `buffers`)"
        return ""


class UnitCall(NamedTuple):
    """One call of a unit's submodule, handed to `ParamUnit.call`.

    ``run(params, state, args, kwargs)`` runs the submodule's own forward with `params` (the
    unit's parameters by name, as `ParamUnit.materialize` returns them) and `state` (tensors
    for every other parameter and buffer slot of the submodule, in the order of `state`)
    swapped in, and the submodule's training flags as they were at this call. It reads
    nothing else from the module, so it may be run again later (in backward) with the same
    result.

    Attributes:
        run: the submodule's computation, a pure function of its arguments (see above).
        state: the submodule's other parameters and its buffers at this call.
        mutable: indexes into `state` of buffers, which `run` may update in place
            (BatchNorm's running statistics): a unit that runs `run` again must pass copies
            of their values as they were before the first run.
        args: the positional arguments of the call.
        kwargs: its keyword arguments.
    """

    run: Callable[[Mapping[str, torch.Tensor], Sequence[torch.Tensor], tuple, dict], Any]
    state: list[torch.Tensor]
    mutable: frozenset[int]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class ParamUnit(Protocol):
    """A group of parameters that exists only where it is used (see `UnitParams`).

    Attributes:
        name: the unit's name; when it is the path of a submodule holding all of the unit's
            parameters (``"blocks.3"``), `FunctionalModule` hands that submodule's calls to
            `call`.
        names: the parameter names the unit holds.
    """

    name: str
    names: tuple[str, ...]

    def materialize(self) -> Mapping[str, torch.Tensor]:
        """The unit's parameters by name, differentiable (the fallback: no recompute)."""
        ...

    def call(self, call: UnitCall) -> Any:
        """Run ``call.run(params, call.state, call.args, call.kwargs)`` with the unit's params."""
        ...


class UnitParams(Mapping[str, torch.Tensor]):
    """Parameters held in units that are materialized at their point of use.

    What a sharded strategy hands to ``loss_fn`` in place of the params dict. As a mapping it
    holds every parameter name: reading ``params[name]`` of a unit's parameter materializes the
    whole unit (`ParamUnit.materialize`, once per `UnitParams`) — the fallback for a loss_fn
    that indexes parameters by hand. Passed to a `FunctionalModule`, each unit that is a
    submodule is instead materialized inside that submodule's call (see the module docstring).

    Args:
        eager: name -> tensor of the parameters that are available at once.
        units: the units, in the order the model uses them.

    Raises:
        ValueError: a name held twice (by two units, or by a unit and `eager`).
    """

    def __init__(self, eager: Mapping[str, torch.Tensor], units: Sequence[ParamUnit]) -> None:
        self.eager: Tensors = dict(eager)
        self.units: dict[str, ParamUnit] = {}
        self._unit_of: dict[str, ParamUnit] = {}
        for unit in units:
            if unit.name in self.units:
                raise ValueError(f"UnitParams: two units are named {unit.name!r}")
            self.units[unit.name] = unit
            for name in unit.names:
                if name in self.eager or name in self._unit_of:
                    raise ValueError(
                        f"UnitParams: parameter {name!r} is held twice (unit {unit.name!r} and "
                        f"{'eager' if name in self.eager else repr(self._unit_of[name].name)})"
                    )
                self._unit_of[name] = unit
        self._materialized: dict[str, Mapping[str, torch.Tensor]] = {}

    def unit_of(self, name: str) -> ParamUnit | None:
        """The unit holding `name`, or None for an eager parameter (or an unknown name)."""
        return self._unit_of.get(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.eager:
            return self.eager[name]
        unit = self._unit_of.get(name)
        if unit is None:
            raise KeyError(name)
        values = self._materialized.get(unit.name)
        if values is None:
            values = self._materialized[unit.name] = unit.materialize()
        return values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.eager or name in self._unit_of

    def __iter__(self) -> Iterator[str]:
        yield from self.eager
        for unit in self.units.values():
            yield from unit.names

    def __len__(self) -> int:
        return len(self.eager) + len(self._unit_of)

    def __repr__(self) -> str:
        return f"UnitParams(eager={len(self.eager)}, units={list(self.units)})"


class _Placeholder(torch.Tensor):
    """Stands in a parameter slot for a unit's parameter until the unit's submodule runs.

    Metadata (shape, dtype, ...) reads work; any computation raises, so a parameter used
    outside its unit's submodule is an error instead of a silent use of stale values.
    """

    _METADATA = frozenset(
        {"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad_fn"}
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
        if getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") in (
            cls._METADATA
        ) or func in (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        placeholder = next(a for a in tree.leaves((args, kwargs)) if isinstance(a, _Placeholder))
        raise RuntimeError(
            f"apply: parameter {placeholder.param_name!r} of unit {placeholder.unit!r} was used "
            f"outside that unit's submodule (by {getattr(func, '__name__', func)}); a unit's "
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
        tensors, tensor_slots, _ = slots_lib.state_slots(submodule)
        for tensor, slots in zip(tensors, tensor_slots):
            if isinstance(tensor, _Placeholder) and tensor.unit == unit.name:
                unit_slots.setdefault(tensor.param_name, []).extend(slots)
                continue
            if slots[0][1] == "_buffers":
                mutable.add(len(state))
            state.append(tensor)
            state_slots.append(slots)
        # The flags are read now: a recompute in backward runs after `apply` restored them.
        flags = [(module, module.training) for module in submodule.modules()]
        names = list(unit_slots)

        def run(params: Mapping[str, torch.Tensor], values: Sequence[torch.Tensor],
                call_args: tuple, call_kwargs: dict) -> Any:
            slots = [unit_slots[name] for name in names] + state_slots
            with slots_lib.training_modes(flags), slots_lib.holding(
                slots, [params[name] for name in names] + list(values)
            ):
                return original(*call_args, **call_kwargs)

        return unit.call(UnitCall(run, state, frozenset(mutable), args, kwargs))

    return forward


_NO_FORWARD = object()


@contextlib.contextmanager
def _unit_forwards(module: nn.Module, units: Mapping[str, ParamUnit]) -> Iterator[None]:
    """Install `_unit_forward` on each unit's submodule for the block; always removed after."""
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


def _aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """For each tensor registered under several names: first name -> all names, in order."""
    names_by_tensor: dict[int, list[str]] = {}
    registered = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in registered:
        names_by_tensor.setdefault(id(tensor), []).append(name)
    return {names[0]: tuple(names) for names in names_by_tensor.values() if len(names) > 1}


@contextlib.contextmanager
def _mode(module: nn.Module, train: bool, submodules: Sequence[nn.Module]) -> Iterator[None]:
    """Put `module` in `train` mode; restore every submodule's own flag on exit.

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


@contextlib.contextmanager
def _capture_buffers(
    module: nn.Module, names: tuple[str, ...], captured: Tensors
) -> Iterator[None]:
    """Record the module's buffers at the end of its forward, while they are the call's own."""

    def hook(*_: object) -> None:
        captured.update({name: module.get_buffer(name) for name in names})

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _rng_seeded_by(
    key: torch.Tensor | None, call_tensors: Callable[[], list[Any]]
) -> Iterator[None]:
    """Seed the RNGs the call can draw from with `key`; restore them on exit.

    Forks and seeds the CPU generator and every generator of each accelerator type among
    `call_tensors()` (the call's parameters, buffers and inputs): the generators
    ``torch.manual_seed`` would seed that this call can draw from, and no others.
    """
    if key is None:
        yield
        return
    seed = fsrandom.seed(key)
    device_types = sorted(
        {t.device.type for t in call_tensors() if isinstance(t, torch.Tensor)} - {"cpu", "meta"}
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for device_type in device_types:
            device_module = torch.get_device_module(device_type)
            stack.enter_context(
                torch.random.fork_rng(
                    devices=list(range(device_module.device_count())), device_type=device_type
                )
            )
        torch.random.default_generator.manual_seed(seed)
        for device_type in device_types:
            device_module = torch.get_device_module(device_type)
            getattr(device_module, "manual_seed_all", device_module.manual_seed)(seed)
        yield


def _check_bool(function: str, argument: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{function}: `{argument}` must be a bool, got {_describe(value)}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
