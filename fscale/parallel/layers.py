"""The checks every transformation makes before it wraps a plan: the rules of composition.

A transformation accepts any Step whose plan follows the `fscale.Plan` protocol, user plans
included, and refuses at once — with what to write instead — the compositions that cannot
mean anything: an axis that two layers would both split the batch over, two layers sharding the
optimizer state, layers on different meshes.
"""

from __future__ import annotations

from typing import Any

from fscale import spmd
from fscale.distributed.mesh import Mesh
from fscale.plan import Plan
from fscale.train import Step

__all__ = ["bucket_bytes", "check_axis_free", "check_step", "sharding_layer"]

# Layers whose state is sharded over an axis: at most one per plan.
_SHARDING = ("shard_optimizer", "fully_shard")


def check_step(step: Any, caller: str) -> None:
    """`step` is a Step whose plan follows the protocol."""
    if not isinstance(step, Step):
        raise TypeError(
            f"{caller}: `step` must be a Step (from fscale.train_step, possibly transformed), "
            f"got {type(step).__name__}"
        )
    if not isinstance(step.plan, Plan):
        raise TypeError(
            f"{caller}: the step's plan is a {type(step.plan).__name__}, not an fscale.Plan; "
            "write strategies as subclasses of fscale.Plan (see the README's guide)"
        )


def sharding_layer(plan: Plan) -> Plan | None:
    """The layer that shards the optimizer state (shard_optimizer or fully_shard), or None."""
    return next((layer for layer in plan.layers() if layer.name in _SHARDING), None)


def check_not_expert_parallel(step: Any, caller: str) -> None:
    """Refuse to shard a step that is expert-parallel: `expert_parallel` slices the named expert
    leaves at init, and a sharding layer around it would have laid the full ones out already."""
    if step.plan.find("expert_parallel") is not None:
        raise ValueError(
            f"{caller}: the step is expert_parallel, which must be outside the sharding: "
            f"fscale.expert_parallel(fscale.{caller}(step, mesh, 'dp'), mesh, 'ep')"
        )


def check_axis_free(
    step: Step, mesh: Any, axis: str, caller: str, *, replaces: tuple[str, ...] = ()
) -> None:
    """`mesh` has `axis`, is the mesh of the step's other layers, and no layer splits over it
    (except layers named in `replaces`, whose reduction over the axis the new layer subsumes)."""
    spmd.check_axis(mesh, axis, caller)
    existing = step.plan.data_mesh()
    if existing is not None and not _same_mesh(existing, mesh):
        raise ValueError(
            f"{caller}: the step's plan runs on another mesh ({_mesh(existing)}) than the one "
            f"given ({_mesh(mesh)}); build one fscale.Mesh with every axis and pass it to "
            "every transformation"
        )
    for layer in step.plan.layers():
        if axis in layer.own_data_axes() and layer.name not in replaces:
            raise ValueError(
                f"{caller}: the step already splits its batch over axis {axis!r} "
                f"({layer.describe()}); each data axis belongs to one layer. Use another "
                "mesh axis for this one (e.g. fscale.Mesh(replica=2, dp=2)), or drop one of "
                "the two transformations"
            )


def bucket_bytes(bucket_mb: Any, caller: str) -> int:
    """`bucket_mb` MiB in bytes, or a clear error."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"{caller}: `bucket_mb` must be a positive number, got {bucket_mb!r}")
    return int(bucket_mb * 2**20)


def _same_mesh(a: Mesh, b: Mesh) -> bool:
    return a is b or (
        a.axis_names == b.axis_names
        and all(a.size(n) == b.size(n) and a.rank(n) == b.rank(n) for n in a.axis_names)
    )


def _mesh(mesh: Mesh) -> str:
    return "Mesh(" + ", ".join(f"{n}={mesh.size(n)}" for n in mesh.axis_names) + ")"
