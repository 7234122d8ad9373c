"""`Mesh`: the ranks of a job arranged on named axes, one process group per axis slice.

``Mesh(dp=2, pp=2)`` on 4 ranks lays the ranks out row-major, first axis outermost (as
`torch.distributed.device_mesh.DeviceMesh` does)::

             pp=0  pp=1
    dp=0  [  0     1  ]
    dp=1  [  2     3  ]

Rank 1 has coordinate ``(dp=0, pp=1)``; its "dp" group is ranks {1, 3} and its "pp" group is
ranks {0, 1}. Collectives name an axis and run within this rank's slice along it, so the same
program line means "average over data-parallel replicas" whatever the other axes are.

An axis of size 1 needs no process group and every collective over it is an identity, so
``Mesh(dp=1)`` in one process without torch.distributed is the N=1 case of every strategy.

Building a mesh with axes of size > 1 is a collective call over the default group: every rank
must build the same meshes in the same order. Meshes with the same axes share their process
groups, so building one again is cheap.

The ``with mesh:`` blocks open now are a `fscale.tracking` stack, which
`fscale.tracking.reset` empties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from fscale import tracking

__all__ = ["Mesh", "current_mesh"]

Axis = str | tuple[str, ...]


class Mesh:
    """Named axes over the ranks of the default process group.

    Args:
        **axes: axis name -> number of ranks along it, outermost first. The product must equal
            the world size (1 without torch.distributed). At most one axis may be -1, meaning
            "the world size divided by the other axes" (e.g. ``Mesh(dp=-1, tp=2)``).

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size below 1 (other than one -1), or sizes whose product is not the world
            size. Checked before any collective, so a wrong mesh fails on every rank at once.

    Example::

        mesh = Mesh(dp=2, pp=2)  # on 4 ranks
        with mesh:  # collectives default to this mesh
            grad = all_reduce(grad, "dp", op="mean")
    """

    def __init__(self, **axes: int) -> None:
        world = dist.get_world_size() if _distributed() else 1
        self._names: tuple[str, ...] = tuple(axes)
        self._shape: tuple[int, ...] = _resolve_sizes(axes, world)
        global_rank = dist.get_rank() if _distributed() else 0
        self._coordinate = _unravel(global_rank, self._shape)
        self._strides = _row_major_strides(self._shape)
        self._groups: dict[str, Any] = {}
        # A mesh never changes once built; steps ask for the same axes every call.
        self._resolved: dict[tuple[Any, bool], tuple[int, ...]] = {}
        self._comms: dict[str, Any] = {}  # axis -> its `fscale.distributed.comm.Comm`
        self._device_mesh = None
        if any(size > 1 for size in self._shape):
            self._device_mesh = _device_mesh_for(self._names, self._shape)
            for name, size in zip(self._names, self._shape):
                if size > 1:
                    self._groups[name] = self._device_mesh.get_group(name)

    # ---- layout --------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, outermost first."""
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        """The number of ranks along each axis, in `axis_names` order."""
        return self._shape

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's index along each axis, in `axis_names` order."""
        return self._coordinate

    @property
    def device_type(self) -> str:
        """The DeviceMesh device type: "cuda" when the default group uses NCCL, else "cpu"."""
        return _device_type()

    @property
    def device_mesh(self) -> Any:
        """The torch `DeviceMesh` over the axes of size > 1 (None when there are none).

        For interoperating with torch APIs that take a DeviceMesh; fscale itself only names
        axes.
        """
        return self._device_mesh

    def size(self, axis: Axis) -> int:
        """Number of ranks along `axis` (a name, or a tuple of names: the product)."""
        return math.prod(self._shape[i] for i in self._indices(axis))

    def rank(self, axis: Axis) -> int:
        """This rank's index along `axis`.

        For a tuple of axes, the row-major index over them, first axis outermost: the order in
        which `all_gather` over that tuple concatenates the ranks' pieces.
        """
        index = 0
        for i in self._indices(axis):
            index = index * self._shape[i] + self._coordinate[i]
        return index

    def global_rank(self, axis: str, index: int) -> int:
        """The global rank of the peer at `index` along `axis`, other coordinates as this rank's.

        Raises:
            ValueError: an unknown axis, or `index` outside ``[0, size(axis))``.
        """
        (i,) = self._indices(axis, single=True)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"`index` must be an int, got {type(index).__name__}")
        if not 0 <= index < self._shape[i]:
            raise ValueError(
                f"`index` {index} is outside axis {axis!r} of size {self._shape[i]}; "
                f"expected 0 <= index < {self._shape[i]}"
            )
        coordinate = list(self._coordinate)
        coordinate[i] = index
        return sum(c * s for c, s in zip(coordinate, self._strides))

    def peers(self, axis: str) -> tuple[int, ...]:
        """Global ranks of this rank's slice along `axis`, in axis order (this rank included)."""
        return tuple(self.global_rank(axis, index) for index in range(self.size(axis)))

    def group(self, axis: str) -> Any:
        """The process group of this rank's slice along `axis`; None for an axis of size 1.

        For fscale's collectives: user code names axes and never needs a group.
        """
        self._indices(axis, single=True)
        return self._groups.get(axis)

    # ---- the current mesh ----------------------------------------------------------------

    def __enter__(self) -> Mesh:
        _CURRENT.push(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _CURRENT.pop(self)

    def __deepcopy__(self, memo: dict[int, object]) -> Mesh:
        # A handle on process groups, not state: a copied module (`tensor_parallel` copies the
        # model it splits) uses the same groups as the original.
        return self

    def __repr__(self) -> str:
        axes = ", ".join(f"{name}={size}" for name, size in zip(self._names, self._shape))
        return f"Mesh({axes})"

    # ---- validation ----------------------------------------------------------------------

    def _indices(self, axis: Axis, *, single: bool = False) -> tuple[int, ...]:
        """Positions of `axis` (a name or, unless `single`, a tuple of distinct names)."""
        try:
            return self._resolved[axis, single]
        except (KeyError, TypeError):  # not seen yet, or not hashable (refused below)
            pass
        indices = self._resolve_indices(axis, single)
        self._resolved[axis, single] = indices
        return indices

    def _resolve_indices(self, axis: Axis, single: bool) -> tuple[int, ...]:
        names: Sequence[Any]
        if isinstance(axis, str):
            names = (axis,)
        elif isinstance(axis, tuple) and not single:
            if not axis or len(set(axis)) != len(axis):
                raise ValueError(
                    f"a tuple `axis` must name distinct axes, at least one; got {axis!r}"
                )
            names = axis
        else:
            expected = "an axis name (str)" if single else "an axis name or a tuple of names"
            raise TypeError(f"`axis` must be {expected}, got {axis!r}")
        indices = []
        for name in names:
            if name not in self._names:
                raise ValueError(_unknown_axis_message(name, self))
            indices.append(self._names.index(name))
        return tuple(indices)


def current_mesh() -> Mesh | None:
    """The mesh of the innermost active ``with mesh:`` block, or None outside any."""
    return _CURRENT.top()


def resolve_mesh(mesh: Mesh | None, caller: str) -> Mesh:
    """`mesh`, or the current mesh when it is None; a clear error when there is neither."""
    if mesh is None:
        mesh = current_mesh()
        if mesh is None:
            raise ValueError(
                f"{caller}: no mesh given and none is active; pass `mesh=` or call it inside "
                "`with mesh:`"
            )
    elif not isinstance(mesh, Mesh):
        raise TypeError(
            f"{caller}: `mesh` must be a fscale.distributed.Mesh, got {type(mesh).__name__}"
        )
    return mesh


_CURRENT: tracking.Stack[Mesh] = tracking.stack(__name__)


def _unknown_axis_message(name: Any, mesh: Mesh) -> str:
    axes = ", ".join(repr(n) for n in mesh.axis_names) or "none"
    hint = (
        "; a one-process mesh still names its axes, e.g. Mesh(dp=1)" if not mesh.axis_names else ""
    )
    return f"unknown mesh axis {name!r}: {mesh!r} has axes {axes}{hint}"


def _resolve_sizes(axes: dict[str, Any], world: int) -> tuple[int, ...]:
    for name, size in axes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"Mesh: size of axis {name!r} must be an int, got {size!r}")
        if size < 1 and size != -1:
            raise ValueError(
                f"Mesh: size of axis {name!r} must be a positive int (or -1 for the rest of "
                f"the world), got {size}"
            )
    rest = [name for name, size in axes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"Mesh: at most one axis may be -1, got {rest}")
    known = math.prod(size for size in axes.values() if size != -1)
    if rest:
        if world % known:
            raise ValueError(
                f"Mesh: axis {rest[0]!r}=-1 takes the rest of the world, but the world size "
                f"{world} is not divisible by the other axes' product {known}"
            )
        axes = {name: (world // known if size == -1 else size) for name, size in axes.items()}
    shape = tuple(axes.values())
    if math.prod(shape) != world:
        given = ", ".join(f"{name}={size}" for name, size in axes.items()) or "no axes"
        source = (
            f"the default process group has {world} ranks"
            if _distributed()
            else "torch.distributed is not initialized (a world of 1 process)"
        )
        raise ValueError(
            f"Mesh({given}) covers {math.prod(shape)} ranks but {source}. The product of the "
            f"axis sizes must equal the world size: change the sizes (one axis may be -1 for "
            f"the rest of the world) or start {math.prod(shape)} ranks "
            "(fscale.launch or torchrun)"
        )
    return shape


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        coordinate.append(index % size)
        index //= size
    return tuple(reversed(coordinate))


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device_type() -> str:
    if not _distributed():
        return "cpu"
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


# DeviceMeshes by (default group, axes of size > 1, device type). Creating process groups is a
# collective over the whole world and each gloo group holds sockets, so meshes with the same
# axes share them instead of creating new ones on every construction. Keying on the default
# group object (kept alive by the key) makes a re-initialised world start afresh.
_DEVICE_MESHES: dict[tuple[Any, ...], Any] = {}


def _device_mesh_for(names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    # Size-1 axes stay out of the DeviceMesh: they need no group, and the row-major order of
    # the remaining axes is unchanged by dropping them.
    kept = [(name, size) for name, size in zip(names, shape) if size > 1]
    kept_names = tuple(name for name, _ in kept)
    kept_shape = tuple(size for _, size in kept)
    device_type = _device_type()
    key = (dist.group.WORLD, kept_names, kept_shape, device_type)
    device_mesh = _DEVICE_MESHES.get(key)
    if device_mesh is None:
        device_mesh = init_device_mesh(device_type, kept_shape, mesh_dim_names=kept_names)
        _DEVICE_MESHES[key] = device_mesh
    return device_mesh
