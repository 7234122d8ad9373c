"""DiLoCo / local SGD as a plan of your own, from fscale's public names only.

Each replica trains alone for `every` steps with the step's optimizer; then the replicas average
their parameters and the outer optimizer moves a shared anchor along the mean change
(Douillard et al., 2023). With ``every=1``, ``outer=sgd(1.0)`` it is data parallelism.
Because it is an `fs.Plan` layer, `shard_optimizer` / `fully_shard` wrap it (within a replica)
and it wraps them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

import fscale as fs


class DiLoCoState(NamedTuple):
    inner: Any  # the wrapped plan's optimizer state
    anchor: Any  # the parameters at the last synchronisation
    outer: Any  # the outer optimizer's state


@dataclasses.dataclass(frozen=True, repr=False)
class DiLoCo(fs.Plan):
    inner: fs.Plan
    mesh: fs.Mesh
    axis: str
    outer: fs.optim.Optimizer
    every: int

    name = "diloco"

    def describe(self) -> str:
        return f"diloco(axis={self.axis!r}, every={self.every})"

    def own_data_axes(self) -> tuple[str, ...]:
        return (self.axis,)  # each replica reads its own data: no gradient reduction over it

    def own_mesh(self) -> fs.Mesh:
        return self.mesh

    def init(self, step, params, buffers, key, ctx):
        state = self.inner.init(step, params, buffers, key, ctx)
        anchor = fs.tree.map(torch.clone, state.params)
        return state._replace(
            opt_state=DiLoCoState(state.opt_state, anchor, self.outer.init(anchor))
        )

    def gradients(self, step, state, batch, ctx):
        return self.inner.gradients(
            step, state._replace(opt_state=state.opt_state.inner), batch, ctx
        )

    def apply_gradients(self, step, state, grads, aux, ctx):
        ours = state.opt_state
        new, metrics = self.inner.apply_gradients(
            step, state._replace(opt_state=ours.inner), grads, aux, ctx
        )
        anchor, outer = ours.anchor, ours.outer
        if int(new.step) % self.every == 0:  # synchronise: the mean change is the outer gradient
            mean = fs.spmd.mean_floating_leaves(new.params, self.mesh, self.axis)
            delta = fs.tree.map(torch.sub, anchor, mean)
            anchor, outer = fs.optim.step(self.outer, delta, outer, anchor)
            new = new._replace(params=fs.tree.map(torch.clone, anchor))
        return new._replace(opt_state=DiLoCoState(new.opt_state, anchor, outer)), metrics

    def consolidate(self, step, state):  # the full state is the inner one; resume re-anchors
        return self.inner.consolidate(step, state._replace(opt_state=state.opt_state.inner))

    def shard_state(self, step, full_state):
        state = self.inner.shard_state(step, full_state)
        anchor = fs.tree.map(torch.clone, state.params)
        return state._replace(
            opt_state=DiLoCoState(state.opt_state, anchor, self.outer.init(anchor))
        )


def diloco(
    step: fs.Step, mesh: fs.Mesh, axis: str = "dp", *, outer: fs.optim.Optimizer, every: int = 50
) -> fs.Step:
    """Local training over `axis`, synchronised every `every` steps by the `outer` optimizer."""
    return step.replace(plan=DiLoCo(step.plan, mesh, axis, outer, every))
