"""Parameter units for fully sharded training: which parameters are gathered together, and how
each unit is laid out as a flat buffer split into equal shards.

A *unit* is a group of parameters that is all-gathered as one collective, used, and released.
`assign_units` turns a user's unit spec into ``{unit name: [parameter names]}``:

- ``None`` (the default): one unit per element of the first list-like level of the module
  tree: a parameter's unit is its dotted path up to and including the first integer component
  (``"blocks.3.mlp.fc.weight"`` -> ``"blocks.3"``, ``"0.weight"`` -> ``"0"``). Parameters
  without an integer component (embeddings, final norm, output layer) form the root unit.
- a list of path prefixes (``["blocks.0", "blocks.1"]``): a parameter belongs to the longest
  prefix its path starts with (at a dot boundary); the rest form the root unit.
- a function ``path -> unit name or None``: None puts the parameter in the root unit.

`ShardLayout` is the static description of the result (names, shapes, dtype per unit, and the
number of shards): what turns ``{unit name: shard}`` back into named parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fscale.flat import FlatBuffer, Fragment, aligned_elements

__all__ = ["ROOT", "ShardLayout", "UnitLayout", "UnitSpec", "assign_units"]

# The name of the unit of every parameter no other unit claims. Angle brackets keep it from
# colliding with a submodule path.
ROOT = "<root>"

UnitSpec = None | Sequence[str] | Callable[[str], "str | None"]


def assign_units(names: Sequence[str], spec: UnitSpec, caller: str) -> dict[str, list[str]]:
    """``{unit name: parameter names}`` for `spec` (see the module docstring), root unit last.

    Units are ordered by their first parameter in `names` (the model's registration order,
    which for sequential models is the order of use); within a unit, names keep that order.

    Raises:
        TypeError: `spec` is not None, a list of strings or a callable; or the callable returns
            something other than a string or None.
        ValueError: a prefix matches no parameter, or no parameter falls in any unit (the
            available paths are listed).
    """
    names = list(names)
    if spec is None:
        unit_of = _default_unit
    elif callable(spec):
        unit_of = _checked_function(spec, caller)
    elif isinstance(spec, (list, tuple)) and all(isinstance(p, str) for p in spec):
        unit_of = _prefix_units(list(spec), names, caller)
    else:
        raise TypeError(
            f"{caller}: `units` must be None, a list of path prefixes (e.g. ['blocks.0', "
            f"'blocks.1']) or a function path -> unit name, got {type(spec).__name__}"
        )
    units: dict[str, list[str]] = {}
    root: list[str] = []
    for name in names:
        unit = unit_of(name)
        (root if unit is None else units.setdefault(unit, [])).append(name)
    if not units and spec is not None:
        raise ValueError(
            f"{caller}: `units` put every parameter in the root unit, so nothing would be "
            f"gathered at its point of use. Parameters: {_listing(names)}"
        )
    if root:
        units[ROOT] = root
    return units


def _default_unit(path: str) -> str | None:
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _checked_function(spec: Callable[[str], Any], caller: str) -> Callable[[str], str | None]:
    def unit_of(path: str) -> str | None:
        unit = spec(path)
        if unit is None or unit == ROOT:
            return None
        if not isinstance(unit, str) or not unit:
            raise TypeError(
                f"{caller}: the `units` function returned {unit!r} for {path!r}; it must return "
                "a non-empty unit name (str) or None for the root unit"
            )
        return unit

    return unit_of


def _prefix_units(
    prefixes: list[str], names: list[str], caller: str
) -> Callable[[str], str | None]:
    def matches(prefix: str, path: str) -> bool:
        return path == prefix or path.startswith(prefix + ".")

    unmatched = [p for p in prefixes if not any(matches(p, n) for n in names)]
    if unmatched:
        raise ValueError(
            f"{caller}: `units` prefixes {unmatched} match no parameter. A prefix is a dotted "
            f"module path such as 'blocks.0'. Parameters: {_listing(names)}"
        )
    by_length = sorted(set(prefixes), key=len, reverse=True)

    def unit_of(path: str) -> str | None:
        return next((p for p in by_length if matches(p, path)), None)

    return unit_of


def _listing(names: Sequence[str], limit: int = 40) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """One unit: its parameters packed back to back in a flat buffer of `num_shards` shards.

    Attributes:
        name: the unit's name (`ROOT` for the root unit).
        names: the parameter names, in packing order.
        shapes: their shapes.
        dtype: their common dtype.
        num_shards: the number of ranks the buffer is split over (the buffer is zero-padded to a
            multiple of it; a unit smaller than `num_shards` leaves some ranks only padding).
    """

    name: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    num_shards: int

    @functools.cached_property
    def flat(self) -> FlatBuffer:
        """The packing, on the meta device (shapes and offsets only)."""
        return _meta_flat_buffer(self.shapes, self.dtype, self.num_shards)

    @property
    def numel(self) -> int:
        """Elements of the padded flat buffer: what one all-gather of the unit moves."""
        return self.flat.numel

    @property
    def shard_size(self) -> int:
        return self.flat.shard_size

    def fragments(self, rank: int) -> list[Fragment]:
        """For each parameter, the element range of it that shard `rank` holds."""
        return self.flat.fragments(rank)


@functools.lru_cache(maxsize=256)
def _meta_flat_buffer(
    shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, num_shards: int
) -> FlatBuffer:
    # Aligned so that no shard boundary cuts a vector of torch's fused optimizer kernels: a
    # sharded update is then bit-identical to the whole-tensor one (see FlatBuffer's `align`).
    tensors = [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes]
    return FlatBuffer(tensors, num_shards, align=aligned_elements(dtype))


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The units of a model, in order of use (root last), sharded `num_shards` ways."""

    units: tuple[UnitLayout, ...]
    num_shards: int
    param_order: tuple[str, ...]  # the names in the order of the params dict given to init

    @classmethod
    def build(
        cls,
        params: dict[str, torch.Tensor],
        units: dict[str, list[str]],
        num_shards: int,
        caller: str,
    ) -> ShardLayout:
        layouts = []
        for unit, names in units.items():
            dtypes = {params[n].dtype for n in names}
            devices = {params[n].device for n in names}
            if len(dtypes) > 1 or len(devices) > 1:
                found = sorted({f"{params[n].dtype} on {params[n].device}" for n in names})
                raise ValueError(
                    f"{caller}: unit {unit!r} mixes {found}; a unit is gathered as one flat "
                    "buffer, so its parameters need one dtype and device. Put the others in "
                    "their own unit (`units=`)."
                )
            layouts.append(
                UnitLayout(
                    unit,
                    tuple(names),
                    tuple(tuple(params[n].shape) for n in names),
                    params[names[0]].dtype,
                    num_shards,
                )
            )
        return cls(tuple(layouts), num_shards, tuple(params))

    def __getitem__(self, unit: str) -> UnitLayout:
        for layout in self.units:
            if layout.name == unit:
                return layout
        raise KeyError(unit)

    @property
    def names(self) -> list[str]:
        """Every parameter name, unit by unit."""
        return [name for unit in self.units for name in unit.names]

    def describe(self) -> list[str]:
        """One line per unit (what ranks must agree on)."""
        return [
            f"unit {u.name}: {len(u.names)} params, {u.flat.numel_unpadded} {u.dtype} elements, "
            f"first {u.names[0]!r}"
            for u in self.units
        ]

    def shard(self, params: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """This rank's shard of every unit of the full `params`, each in its own storage."""
        shards = {}
        for unit in self.units:
            flat = FlatBuffer(
                [params[n].detach() for n in unit.names],
                self.num_shards,
                align=aligned_elements(unit.dtype),
            )
            shards[unit.name] = flat.shard(rank).clone()
        return shards

    def unshard(self, gathered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` in `param_order` from each unit's full flat buffer (copies)."""
        params: dict[str, torch.Tensor] = {}
        for unit in self.units:
            params.update(zip(unit.names, unit.flat.views(gathered[unit.name])))
        return {name: params[name].clone() for name in self.param_order}

    def meta_params(self) -> dict[str, torch.Tensor]:
        """Full-shape meta tensors in `param_order` (structure and shapes, no memory)."""
        params = {
            name: torch.empty(shape, dtype=unit.dtype, device="meta")
            for unit in self.units
            for name, shape in zip(unit.names, unit.shapes)
        }
        return {name: params[name] for name in self.param_order}

    def meta_fragments(self, rank: int) -> dict[str, torch.Tensor]:
        """1-D meta tensors shaped like the fragments shard `rank` holds, in `param_order`."""
        fragments = self.fragments(rank)
        dtypes = {name: unit.dtype for unit in self.units for name in unit.names}
        return {
            name: torch.empty(fragments[name].numel, dtype=dtypes[name], device="meta")
            for name in self.param_order
        }

    def fragments(self, rank: int) -> dict[str, Fragment]:
        """``{name: the fragment of it that shard `rank` holds}``."""
        return {
            name: fragment
            for unit in self.units
            for name, fragment in zip(unit.names, unit.fragments(rank))
        }

    def fragment_views(self, shards: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """``{name: 1-D view of its fragment in this rank's shard}``: what the optimizer steps."""
        views: dict[str, torch.Tensor] = {}
        for unit in self.units:
            views.update(zip(unit.names, unit.flat.fragment_views(rank, shards[unit.name])))
        return views

    def pack(
        self, fragments: dict[str, torch.Tensor], previous: dict[str, torch.Tensor], rank: int
    ) -> dict[str, torch.Tensor]:
        """Shards holding `fragments`; a previous shard is reused when they already live in it.

        An optimizer that updated the fragment views in place (donation) leaves them inside the
        previous shards, which are then returned as they are; otherwise each unit's fragments
        are copied into a new zero-padded shard.
        """
        shards = {}
        for unit in self.units:
            values = [fragments[n] for n in unit.names]
            old = previous[unit.name]
            in_place = unit.flat.fragment_views(rank, old)
            if all(
                v.numel() == 0 or (v.data_ptr() == o.data_ptr() and v.shape == o.shape)
                for v, o in zip(values, in_place)
            ):
                shards[unit.name] = old
                continue
            shard = torch.zeros(unit.shard_size, dtype=unit.dtype, device=old.device)
            for view, value in zip(unit.flat.fragment_views(rank, shard), values):
                view.copy_(value.reshape(-1))
            shards[unit.name] = shard
        return shards
