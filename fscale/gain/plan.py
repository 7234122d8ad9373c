"""The layer of `adascale`: per-replica and averaged gradient norms in, a scaled update out.

Gradient phase: the layer opens a `fscale.gain.observe.Tally` and runs the plan inside it,
whose (wrapped) loss function reports each rank's squared norm of every micro-batch gradient
before any reduction. Then, from the gradients the plan returns (reduced: full under
`data_parallel`, one shard per rank under `shard_optimizer` and `fully_shard`):

    L = all-reduce_sum over the data axes of (c² · this rank's tally)
    T = ‖ḡ‖², the shards' squared norms all-reduced (sum) over the shard axis

(c micro-batches per step: each micro-batch's loss is weighted 1/c, so its gradient is c times
too small, as with FairScale's ``is_scaled_loss``). Both are carried to the update phase.

Update phase: the estimates and the gain r of `fscale.gain.estimate`; the plan's own update
runs with the optimizer's learning rate, and the layer then moves each parameter by
``factor`` times that update, ``p ← p + factor · (p' − p)``, with ``factor = r^power ·
schedule(progress)``. For every fscale optimizer the update is proportional to the learning
rate and the optimizer state does not depend on it, so this is the step with the learning rate
multiplied by ``factor`` (to round-off: the update is rounded once more). ``progress += r``.

A step whose update is skipped (non-finite gradients, ``on_nonfinite="skip"``) leaves the
statistics and progress as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fscale import spmd, tree
from fscale.distributed import collectives
from fscale.distributed.mesh import Mesh
from fscale.gain import estimate as est
from fscale.gain.observe import Tally, observing
from fscale.gain.precondition import adam_weights
from fscale.plan import Context, Plan, TrainState

__all__ = ["AdaScalePlan", "AdaScaleState"]

PyTree = Any
_CARRY = "adascale"


class AdaScaleState(NamedTuple):
    """The optimizer state of an `adascale` step.

    Attributes:
        inner: the wrapped plan's optimizer state.
        stats: the gain's running estimates and the progress (`fscale.gain.GainStats`).
    """

    inner: Any
    stats: est.GainStats


@dataclasses.dataclass(frozen=True)
class AdamNoise:
    """The preconditioner of the Adam variant: ``w = 1 / (sqrt(v / (1 - beta2^t)) + eps)``.

    Attributes:
        beta2, eps: the Adam optimizer's own.
        warmup: updates before the preconditioner is used (w = 1 until then).
    """

    beta2: float
    eps: float
    warmup: int


@dataclasses.dataclass(frozen=True, repr=False)
class AdaScalePlan(Plan):
    """Gain ratio from per-replica gradient norms, learning rate scaled by it; see the module."""

    inner: Plan
    mesh: Mesh
    axes: tuple[str, ...]
    micro_batches: int
    scale: float
    smoothing: float
    shard_axis: str | None
    power: float = 1.0
    schedule: Callable[[float], float] | None = None
    adam: AdamNoise | None = None

    @property
    def name(self) -> str:
        return "adascale"

    @property
    def samples(self) -> int:
        """Small-batch gradients per step: replicas × micro-batches."""
        return self.mesh.size(spmd.axis_arg(self.axes)) * self.micro_batches

    def describe(self) -> str:
        rule = "sgd" if self.adam is None else f"adam(beta2={self.adam.beta2}, eps={self.adam.eps})"
        return (
            f"adascale(axis={spmd.axis_arg(self.axes)!r}, samples={self.samples}, "
            f"scale={self.scale:g}, smoothing={self.smoothing:g}, rule={rule})"
        )

    def own_mesh(self) -> Mesh:
        return self.mesh

    # ---- phases --------------------------------------------------------------------------

    def init(self, step, params, buffers, key, ctx):
        state = self.inner.init(step, params, buffers, key, ctx)
        stats = est.init_stats(self.scale)
        return tree.with_fields(state, opt_state=AdaScaleState(state.opt_state, stats))

    def gradients(self, step, state, batch, ctx):
        _check_outermost(ctx)
        opt_state = _adascale_state(state.opt_state)
        inner_state = tree.with_fields(state, opt_state=opt_state.inner)
        weights = None
        if self.adam is not None:
            weights = adam_weights(inner_state, self.adam.beta2, self.adam.eps, self.adam.warmup)
        tally = Tally(weights)
        with observing(tally):
            grads, aux = self.inner.gradients(step, inner_state, batch, ctx)
        self._check_tally(tally)
        with torch.no_grad():
            total = _squared_norm(grads, weights)
            local = tally.local_sqr(total.device) * float(self.micro_batches**2)
            norms = self._complete(local, total)
        return grads, tree.with_fields(aux, carry={**aux.carry, _CARRY: norms})

    def apply_gradients(self, step, state, grads, aux, ctx):
        opt_state = _adascale_state(state.opt_state)
        stats = est.rescale(opt_state.stats, self.scale)
        if _CARRY not in aux.carry:
            raise ValueError(
                "adascale: `aux` lacks the gradient norms; pass the GradAux that this step's "
                "gradients returned"
            )
        local_sqr, total_sqr = (float(v) for v in aux.carry[_CARRY])
        inner_aux = tree.with_fields(aux, carry={k: v for k, v in aux.carry.items() if k != _CARRY})
        inner_state = tree.with_fields(state, opt_state=opt_state.inner)
        if ctx.skip_update:
            new_state, metrics = self.inner.apply_gradients(
                step, inner_state, grads, inner_aux, ctx
            )
            return self._finish(new_state, metrics, stats, est.gain(stats))
        grad_sqr, grad_var = est.estimate(local_sqr, total_sqr, self.samples, self.scale)
        stats = est.update(stats, grad_sqr, grad_var, self.smoothing)
        gain = est.gain(stats)
        factor = gain**self.power
        if self.schedule is not None:
            factor *= float(self.schedule(float(stats.progress)))
        old = tree.leaves(state.params)
        if step.donate:  # the inner update may overwrite them
            old = [leaf.detach().clone() for leaf in old]
        new_state, metrics = self.inner.apply_gradients(step, inner_state, grads, inner_aux, ctx)
        _scale_update(old, tree.leaves(new_state.params), factor, step.donate)
        stats = tree.with_fields(stats, progress=stats.progress + gain)
        return self._finish(new_state, metrics, stats, gain)

    def _finish(
        self, state: TrainState, metrics: dict[str, Any], stats: est.GainStats, gain: float
    ) -> tuple[TrainState, dict[str, Any]]:
        clash = sorted({"gain", "progress"} & set(metrics))
        if clash:
            raise ValueError(
                f"adascale: the loss function returned a metric named {clash[0]!r}, which "
                f"adascale reports itself; rename it, e.g. 'my_{clash[0]}'"
            )
        metrics = {
            **metrics,
            "gain": torch.tensor(gain, dtype=torch.float64),
            "progress": stats.progress.clone(),
        }
        return tree.with_fields(state, opt_state=AdaScaleState(state.opt_state, stats)), metrics

    def consolidate(self, step, state):
        opt_state = _adascale_state(state.opt_state)
        full = self.inner.consolidate(step, tree.with_fields(state, opt_state=opt_state.inner))
        return tree.with_fields(full, opt_state=AdaScaleState(full.opt_state, opt_state.stats))

    def shard_state(self, step, full_state):
        stats = est.init_stats(self.scale)
        if isinstance(full_state.opt_state, AdaScaleState):
            stats = full_state.opt_state.stats
            full_state = tree.with_fields(full_state, opt_state=full_state.opt_state.inner)
        state = self.inner.shard_state(step, full_state)
        return tree.with_fields(state, opt_state=AdaScaleState(state.opt_state, stats))

    # ---- statistics ----------------------------------------------------------------------

    def _check_tally(self, tally: Tally) -> None:
        if tally.loss_calls != self.micro_batches:
            raise ValueError(
                f"adascale: the loss function ran {tally.loss_calls} times in one step, but the "
                f"plan accumulates {self.micro_batches} micro-batches; the per-replica norms "
                "need one loss call per micro-batch (a pipelined step is not supported)"
            )
        if tally.repeated is not None:
            raise ValueError(
                f"adascale: unit {tally.repeated!r} was called more than once in one forward; "
                "under fully_shard a rank never holds the sum of those calls' gradients, so its "
                "per-replica gradient norm is unknown. Put the repeated module in the root unit "
                "(fully_shard(..., units=[...]) without it) or use shard_optimizer"
            )

    def _complete(self, local: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``[L, T]``: L summed over the data axes, T's shards summed over the shard axis."""
        mesh = self.mesh
        if self.shard_axis is None:
            if mesh.size(spmd.axis_arg(self.axes)) > 1:
                local = collectives.all_reduce(local, spmd.axis_arg(self.axes), "sum", mesh=mesh)
            return torch.stack([local, total])
        norms = torch.stack([local, total])
        if mesh.size(self.shard_axis) > 1:
            norms = collectives.all_reduce(norms, self.shard_axis, "sum", mesh=mesh)
        rest = tuple(a for a in self.axes if a != self.shard_axis)
        if rest and mesh.size(spmd.axis_arg(rest)) > 1:
            local = collectives.all_reduce(norms[0], spmd.axis_arg(rest), "sum", mesh=mesh)
            norms = torch.stack([local, norms[1]])
        return norms


def _squared_norm(grads: PyTree, weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """``Σ (w · g)²`` over the leaves of `grads`, in float64, on the first leaf's device."""
    paths, leaves, _ = tree.flatten_with_paths(grads)
    if not leaves:
        return torch.zeros((), dtype=torch.float64)
    sums = []
    for path, grad in zip(paths, leaves):
        if weights is not None:
            grad = grad * weights[path]
        sums.append(grad.square().sum(dtype=torch.float64).to(leaves[0].device))
    return torch.stack(sums).sum()


def _scale_update(
    old: list[torch.Tensor], new: list[torch.Tensor], factor: float, donated: bool
) -> None:
    """``new ← old + factor · (new − old)`` in place, leaf by leaf."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for before, after in zip(old, new):
            if after is before or (not donated and _same_memory(after, before)):
                continue  # a leaf the update left as it was (a parameter the loss did not use)
            after.sub_(before).mul_(factor).add_(before)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.shape == b.shape)


def _adascale_state(opt_state: Any) -> AdaScaleState:
    if not isinstance(opt_state, AdaScaleState):
        raise ValueError(
            "adascale: `state.opt_state` is a "
            f"{type(opt_state).__name__}, not an AdaScaleState; build the state with this "
            "step's init (or fscale.shard_state(step, full_state))"
        )
    return opt_state


def _check_outermost(ctx: Context) -> None:
    if ctx.reducer is not None or ctx.param_maps or ctx.accumulated is not None or not ctx.final:
        raise ValueError(
            "adascale: another layer wraps the adascale layer; apply adascale last, around the "
            "finished step: adascale(data_parallel(accumulate(step, k), mesh), mesh)"
        )
