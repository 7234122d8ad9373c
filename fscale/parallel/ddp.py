"""`data_parallel(step, mesh)`: DDP as a transformation of any Step.

Forward collective: none (`replicate` — parameters are used as they are on every rank).
Backward collective: the dual of `replicate`, an all-reduce (mean) of the gradients, bucketed:
leaves are packed into buckets of `bucket_mb` in reverse order. With ``overlap`` (the default
on an accelerator or across hosts) hooks take each gradient as autograd produces it, and a
bucket's all-reduce is started the moment its last gradient arrives, so it runs while backward
computes the next bucket; without (the default for CPU ranks on one host, where the collective
would compete with backward for the same cores) every bucket is built and started after
backward.
The step waits for all buckets only before the optimizer update.

Memory per rank: full parameters, full gradients (once: in the bucket buffers, which are
averaged in place and which the gradients are views of; without overlap, autograd's gradients
and the buckets built from them are both held for a moment at the end of backward), full
optimizer state. With
``donate=False`` the update writes new parameter and optimizer-state buffers while the caller
still holds the old state, so the step's peak holds both: Ψ·(4 + the optimizer's state bytes per
element) more than a donated step (Adam in float32: 12 bytes per parameter, 89 MB for 7.4M
parameters). That is the price of a pure step, not a copy the step could avoid; train with
``donate=True`` when the old state is not needed again.

Traffic per rank per step: one all-reduce of Ψ elements, 2·Ψ·(N−1)/N under the ring model, plus
the mean of the scalar metrics and of the floating-point buffers, if any (over one data axis
without a reduction hook, the loss, the scalar metrics and the buffers of the bucket's dtype
ride at the end of the last bucket, in no collective of their own; otherwise, and for buffers of
other dtypes, a small all-reduce each: see `fscale.step_means`).

Composition: the layer adds its axis to the step's gradient reducer (`fscale.parallel.reduce`),
so it reduces the gradients of whatever the wrapped plan holds: full parameters, ZeRO's buckets
(reduce-scattered over ZeRO's axis, then all-reduced over this one), or `fully_shard`'s shards
(HSDP). A reduction hook replaces each bucket's all-reduce (PowerSGD and other compression run
inside the overlapped, bucketed path).

Buffers (BatchNorm running statistics): averaged over the axis after every step, so every rank
holds the same buffers — the rule that keeps a data-parallel model one model. (torch DDP instead
broadcasts rank 0's buffers before each forward; with ``broadcast_buffers=False`` it keeps them
per rank. Parameters and gradients are the same under any of these rules, because train-mode
BatchNorm normalises with batch statistics.)

Randomness: the step's key is folded with the step count and then with this rank's index along
`axis`, so dropout differs across ranks (they see different data) and is reproducible.

Numerics: each rank computes the gradient of its local mean loss; the mean over N ranks of those
gradients is the gradient of the mean loss over the global batch. The all-reduce pre-divides by
N (as torch DDP does) and sums, so at N = 2 the result equals torch DDP bit for bit (at N = 4
to rtol 1e-4: the two lay out
their buckets differently, and gloo's ring adds four terms in an order that depends on the offset);
against one process on the concatenated batch it differs by reduction order only (one GEMM over
the whole batch sums in another order than per-rank GEMMs plus an all-reduce).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from fscale import tree
from fscale.distributed.hosts import on_one_host
from fscale.distributed.mesh import Mesh
from fscale.parallel import layers
from fscale.parallel.reduce import ReduceHook, add_mean_axis, bucket_infos
from fscale.plan import Context, Plan, TrainState
from fscale.train import Step

__all__ = ["DataParallelPlan", "HookState", "data_parallel"]


class HookState(NamedTuple):
    """The optimizer state of a data-parallel step whose reduction hook keeps state.

    Attributes:
        inner: the wrapped plan's optimizer state.
        hook: one state per gradient bucket (``hook.init(bucket)``), updated every step.
    """

    inner: Any
    hook: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, repr=False)
class DataParallelPlan(Plan):
    """Replicate over `axis`: gradients averaged over it by a bucketed all-reduce (during
    backward where `overlap` resolves to True, after it otherwise)."""

    inner: Plan
    mesh: Mesh
    axis: str
    bucket_bytes: int
    hook: ReduceHook | None = None
    overlap: bool | None = None

    @property
    def name(self) -> str:
        return "data_parallel"

    def describe(self) -> str:
        hook = "" if self.hook is None else f", hook={_name(self.hook)}"
        return (
            f"data_parallel(axis={self.axis!r} of size {self.mesh.size(self.axis)}, "
            f"bucket={self.bucket_bytes / 2**20:g} MiB{hook})"
        )

    def own_data_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def own_mesh(self) -> Mesh:
        return self.mesh

    @property
    def _stateful(self) -> bool:
        return self.hook is not None and callable(getattr(self.hook, "init", None))

    def context(
        self, ctx: Context, hook_states: Any = None, hook_out: dict[str, Any] | None = None
    ) -> Context:
        reducer = add_mean_axis(
            ctx.reducer,
            self.mesh,
            self.axis,
            self.bucket_bytes,
            self.hook,
            hook_states,
            hook_out,
            self.overlap,
        )
        return ctx.replace(reducer=reducer)

    def init(self, step, params, buffers, key, ctx):
        state = self.inner.init(step, params, buffers, key, self.context(ctx))
        if self.overlap is None:
            # Init is collective already: learn here whether the axis crosses hosts (the
            # default `overlap` asks), so that no step has to.
            on_one_host(self.mesh, self.axis)
        return self._with_hook_state(state) if self._stateful else state

    def gradients(self, step, state, batch, ctx):
        if not self._stateful:
            return self.inner.gradients(step, state, batch, self.context(ctx))
        opt_state = _hook_state(state.opt_state)
        out: dict[str, Any] = {}
        grads, aux = self.inner.gradients(
            step,
            tree.with_fields(state, opt_state=opt_state.inner),
            batch,
            self.context(ctx, opt_state.hook, out),
        )
        # Under accumulation the hook runs on the last micro-batch only; a step whose
        # reduction never ran keeps the states it had.
        carry = {**aux.carry, self._carry_key: out.get("states", opt_state.hook)}
        return grads, tree.with_fields(aux, carry=carry)

    def apply_gradients(self, step, state, grads, aux, ctx):
        if not self._stateful:
            return self.inner.apply_gradients(step, state, grads, aux, self.context(ctx))
        opt_state = _hook_state(state.opt_state)
        new_state, metrics = self.inner.apply_gradients(
            step, tree.with_fields(state, opt_state=opt_state.inner), grads, aux, self.context(ctx)
        )
        hook = aux.carry.get(self._carry_key, opt_state.hook)
        return tree.with_fields(new_state, opt_state=HookState(new_state.opt_state, hook)), metrics

    def consolidate(self, step, state):
        if self._stateful:
            # The full state is what a step without the hook takes: the hook's state (error
            # feedback, warm starts) starts afresh after resharding.
            state = tree.with_fields(state, opt_state=_hook_state(state.opt_state).inner)
        return self.inner.consolidate(step, state)

    def shard_state(self, step, full_state):
        state = self.inner.shard_state(step, full_state)
        return self._with_hook_state(state) if self._stateful else state

    @property
    def _carry_key(self) -> str:
        return f"data_parallel:{self.axis}"

    def _with_hook_state(self, state: TrainState) -> TrainState:
        infos = bucket_infos(state.params, self.bucket_bytes, self.mesh, (self.axis,))
        hook_states = tuple(self.hook.init(info) for info in infos)  # type: ignore[union-attr]
        return tree.with_fields(state, opt_state=HookState(state.opt_state, hook_states))


def _hook_state(opt_state: Any) -> HookState:
    if not isinstance(opt_state, HookState):
        raise ValueError(
            "data_parallel: the step has a stateful reduction hook but `state.opt_state` is a "
            f"{type(opt_state).__name__}, not a HookState; build the state with this step's "
            "init (or fscale.shard_state(step, full_state))"
        )
    return opt_state


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def data_parallel(
    step: Step,
    mesh: Mesh,
    axis: str = "dp",
    *,
    bucket_mb: float = 25.0,
    reduce_hook: ReduceHook | None = None,
    overlap: bool | None = None,
) -> Step:
    """DDP: replicate over `axis`, average gradients with a bucketed all-reduce.

    Args:
        step: any Step: from `fscale.train_step`, or already transformed (`fully_shard` for
            HSDP, `shard_optimizer` over another axis, `accumulate`, a plan of your own).
        mesh: the mesh; `axis` must be one of its axes.
        axis: the data-parallel axis: each rank along it reads its own slice of the global batch
            (see `fscale.data.LMBatches(rank=..., world_size=...)`).
        bucket_mb: bucket size in MiB. Larger buckets mean fewer collectives; smaller ones start
            communicating earlier in backward.
        reduce_hook: ``hook(flat_grad, bucket, state) -> (Pending, new_state)`` to run instead
            of each bucket's all-reduce (mean); ``hook.init(bucket) -> state``, if present,
            makes each bucket's state, kept in ``state.opt_state`` (a `HookState`). See
            `fscale.parallel.reduce` and ``examples/powersgd.py``.
        overlap: start each bucket's all-reduce during backward, as soon as the bucket is
            complete (True), or every bucket's after backward (False). None (the default):
            during backward where the parameters are on an accelerator or the axis crosses
            hosts, after it where they are on the CPU and every rank of the axis is on one
            host. There the all-reduce is work for the same cores that compute backward, so
            overlapping it gains nothing, while each leaf's gradient hook is a Python call
            inside backward (measured: `bench/ddp.py`, README "When the all-reduce starts").
            Across hosts a CPU step waits on the network, which overlap hides. Without overlap
            there is no small first bucket (nothing starts early), so a model's gradients take
            fewer, larger all-reduces.

    Returns:
        A Step whose metrics (the loss and any scalar extras) are means over the axis, equal on
        every rank. See the module docstring for traffic, memory, buffers and numerics.

    Raises:
        TypeError / ValueError: `step` is not a Step, `mesh` lacks `axis`, `bucket_mb` is not
            positive, the step is already data parallel or sharded over `axis`, or a reduction
            hook is combined with torch.func gradients or ZeRO. At init, ranks that disagree on
            the parameter tree get an error naming the first difference.
    """
    layers.check_step(step, "data_parallel")
    layers.check_axis_free(step, mesh, axis, "data_parallel")
    bucket_bytes = layers.bucket_bytes(bucket_mb, "data_parallel")
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(
            f"data_parallel: `overlap` must be True, False or None (by device), got {overlap!r}"
        )
    if reduce_hook is not None:
        if not callable(reduce_hook):
            raise TypeError(
                "data_parallel: `reduce_hook` must be callable as hook(flat_grad, bucket, "
                f"state) -> (Pending, new_state), got {type(reduce_hook).__name__}"
            )
        if step.grad_mode != "autograd":
            raise ValueError(
                "data_parallel: a `reduce_hook` runs on gradient buckets during backward, which "
                "torch.func gradients do not have; use grad_mode='autograd'"
            )
        if step.plan.find("data_parallel") is not None:
            raise ValueError(
                "data_parallel: a `reduce_hook` reduces each bucket over its own axis alone, but "
                "the step is already data parallel over another axis; use a single "
                "data_parallel layer when it has a hook"
            )
        if step.plan.find("shard_optimizer") is not None:
            raise ValueError(
                "data_parallel: a `reduce_hook` replaces the all-reduce of full gradient "
                "buckets, but shard_optimizer reduce-scatters them; put the hook on a step "
                "without shard_optimizer"
            )
    hooked = next(
        (
            layer
            for layer in step.plan.layers()
            if isinstance(layer, DataParallelPlan) and layer.hook is not None
        ),
        None,
    )
    if hooked is not None:
        raise ValueError(
            f"data_parallel: the step's {hooked.describe()} reduces each bucket over its own axis "
            "alone with its hook; use a single data_parallel layer when it has a hook"
        )
    plan = DataParallelPlan(step.plan, mesh, axis, bucket_bytes, reduce_hook, overlap)
    return step.replace(plan=plan)
