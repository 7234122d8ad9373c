"""The unit protocol: parameters held in groups that exist only where they are used.

A sharded strategy keeps each group of parameters (a *unit*, e.g. one transformer block) as a
1/N shard and materializes it just before use. It hands ``loss_fn`` a `UnitParams` in place of
the params dict: a mapping over every parameter name whose values come from `ParamUnit`s. Read
by hand (``params[name]``), a unit is materialized whole on first access (`ParamUnit.materialize`,
once per `UnitParams`). Passed to a `FunctionalModule`, a unit whose name is the path of a
submodule gets that submodule's calls instead (`ParamUnit.call` with a `UnitCall`), so the unit
decides when its parameters exist and whether backward recomputes them (see
``fscale.functional.unit_calls``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["ParamUnit", "UnitCall", "UnitParams"]


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
    submodule is instead materialized inside that submodule's call (see
    ``fscale.functional.unit_calls``).

    Args:
        eager: name -> tensor of the parameters that are available at once.
        units: the units, in the order the model uses them.

    Raises:
        ValueError: a name held twice (by two units, or by a unit and `eager`).
    """

    def __init__(self, eager: Mapping[str, torch.Tensor], units: Sequence[ParamUnit]) -> None:
        self.eager: dict[str, torch.Tensor] = dict(eager)
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
