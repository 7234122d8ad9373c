"""`fully_shard(step, mesh)`: ZeRO-3 / FSDP as a transformation of a Step.

FSDP here is not a module wrapper with a state machine; it is three ideas placed around the
user's loss:

1. **At rest, every rank holds 1/N of everything.** Parameters are grouped into *units*
   (`fscale.parallel.fsdp.units`: by default one per block of the first module list, plus a root
   unit); each unit is a flat buffer zero-padded to a multiple of N, and rank r keeps only
   slice r of it: ``state.params == {unit name: 1-D shard}``. Gradients and
   optimizer state are sharded the same way, so fp32 Adam holds
   (4 params + 4 grads + 8 moments)·Ψ/N bytes per rank (Ψ with each unit's padding).
2. **A unit's parameters are all-gathered at their point of use.** The step hands ``loss_fn`` a
   `fscale.functional.UnitParams` instead of the params dict. A `FunctionalModule` given one runs
   each unit's submodule through the unit: ``all_gather(shard, axis, op="mean")``, the views of
   the gathered buffer swapped in, the submodule's forward, and the buffer released when the
   submodule returns. The gradient of ``all_gather`` is its dual, a reduce-scatter (mean), so
   each unit's gradient arrives already reduced and sharded the moment that unit's backward is
   done; nobody writes the gradient collective.
3. **Backward gathers a unit again instead of recomputing it.** With
   ``reshard_after_forward=True`` (on the default ``grad_mode="autograd"`` path) a unit's
   forward runs normally and autograd keeps its activations, but every tensor it saves that
   views the gathered buffer (a weight for a matmul's input gradient, a norm's scale) is saved
   as a *place* in the unit (offset, shape, strides) through saved-tensor hooks, so nothing
   holds the buffer and it is freed when the submodule returns. The first backward node of the
   unit that unpacks one of those places all-gathers the shard again (no graph: the all-gather
   of the forward already carries the gradient) and reads the view out of the new buffer; the
   buffer is dropped when the gradient of the forward's gathered buffer is complete, right
   before that gather's dual reduce-scatters it. This is torch FSDP2's resharding (free after
   forward, gather before backward, keep activations), with no recompute. A unit whose
   backward reads none of its parameters (the first layer when the model's input needs no
   gradient) is not gathered again. The default, ``reshard_after_forward="except_last"``, does
   this for every unit but the last one in order of use, which stays gathered from its forward
   to its backward: backward begins with it, so freeing and gathering it again would only cost
   a transfer. The gradient reaching its output starts the re-gathers of the units before it,
   so they overlap its backward.
   ``reshard_after_forward="remat"`` runs each unit under `fscale.remat` instead (the
   mechanism of `fscale.checkpoint`): the unit keeps only its shard and its inputs, and
   backward gathers it again and recomputes it, which also discards its activations; this is
   what ``True`` means under ``grad_mode="func"``, where torch.func transforms refuse
   saved-tensor hooks. To discard activations inside a unit only, wrap blocks (or parts of
   them) in `fscale.checkpoint`: it composes with either mode (its saved parameters are
   places too). Saved-tensor hooks opened by the caller around the step (e.g.
   ``torch.autograd.graph.save_on_cpu``) do not reach inside a resharded unit: the unit's own
   hooks are innermost there. ``reshard_after_forward=False`` keeps the gathered parameters
   until backward (one all-gather less per unit, every unit resident at the end of the
   forward). Peak
   gathered parameters when resharding: the unit being computed plus `prefetch` units in
   flight, in forward and in backward (the root unit aside: it is gathered before the forward
   and kept until its gradient, like torch FSDP's root), and by default the last unit too
   while the layers after it run.

Prefetch: when unit i is called, the all-gathers of the next `prefetch` units (in parameter
registration order, the order of use for sequential models) are issued with
``all_gather_start`` before unit i's own gather is waited on, so communication overlaps the
compute of unit i. In backward, when unit i is gathered again, the re-gathers of the
`prefetch` units called before it are issued too, before unit i's gradient is reduce-scattered,
so they overlap unit i's backward. A model that calls its units in another order stays correct;
a unit prefetched but never called is gathered for nothing and released at the end of the
forward (or of the backward).

Communication per rank per step, ring model, units' padded sizes Ψ_u, N ranks on `axis`:
3·Ψ_u·(N−1)/N per resharded unit (forward gather, backward re-gather, gradient reduce-scatter),
2·Ψ_u·(N−1)/N for a unit kept to its backward (every unit with ``reshard_after_forward=False``,
the last one by default), for the root unit, and for a unit whose backward reads none of its
parameters; plus one all-reduce
of the scalar metrics (and of the floating-point buffers, if any). Under `data_parallel` over
another axis of R ranks
(HSDP; ``replicate_axis=`` is sugar for it) each unit's gradient shard is also all-reduced (mean)
over that axis, bucketed (overlapped as `data_parallel`'s ``overlap`` says): 2·(Ψ_u/N)·(R−1)/R.

The optimizer runs on the shards: each parameter's fragment in this rank's shard is one leaf
(``{name: 1-D fragment}``), and a `fscale.optim.Sharding` built from the units' fragments lets
non-pointwise optimizers (LAMB, Adafactor, clip_by_global_norm) complete their per-tensor
statistics with an all-reduce over `axis`, so they stay exact.

Fallback: a ``loss_fn`` that does not use `functionalize` (it indexes ``params[name]``) gets
each unit gathered lazily on the first access of one of its names, with no recompute (the
gathered unit lives until backward; its gradient is still reduce-scattered).

Buffers (BatchNorm statistics) are replicated, and averaged over the data axes after every step
as `data_parallel` does; frozen parameters are buffers, never sharded. Randomness: the key is
folded with the step and this rank's data-parallel index, as under `data_parallel`.

State in and out: `fscale.consolidate(step, state)` gathers the full TrainState
(params as the dict given to init, optimizer state as the optimizer makes it on full tensors)
on every rank, and `fscale.shard_state(step, full_state)` shards a full state for
this step at any world size; both dispatch to this plan (`fscale.parallel.fsdp.state`), which
converts the optimizer state by the rule `shard_optimizer` shares (`fscale.parallel.opt_state`).

Mixed precision is not implemented yet. The intended rule: gather in the compute dtype (the
unit's shard cast before the all-gather), reduce gradients in fp32.

Code: this module holds the transformation; its layer and optimizer role are in
`fscale.parallel.fsdp.plan`, the gathers, prefetch and their accounting in
`fscale.parallel.fsdp.gather`, the backward re-gather in `fscale.parallel.fsdp.regather`, the
state in and out in `fscale.parallel.fsdp.state`, the units in `fscale.parallel.fsdp.units`.
"""

from __future__ import annotations

from fscale import spmd
from fscale.distributed.mesh import Mesh
from fscale.parallel import layers
from fscale.parallel.ddp import data_parallel
from fscale.parallel.fsdp.plan import FullyShardPlan
from fscale.parallel.fsdp.units import UnitSpec
from fscale.train import Step

__all__ = ["RESHARD_MODES", "fully_shard"]

RESHARD_MODES = ("except_last", "remat")
"""The string values of `reshard_after_forward` (besides True and False)."""


def fully_shard(
    step: Step,
    mesh: Mesh,
    axis: str = "dp",
    *,
    units: UnitSpec = None,
    reshard_after_forward: bool | str = "except_last",
    prefetch: int = 1,
    replicate_axis: str | None = None,
) -> Step:
    """ZeRO-3 / FSDP: shard parameters, gradients and optimizer state over `axis`.

    Forward collective: ``all_gather`` of each unit at its point of use. Backward collective:
    its dual, a ``reduce_scatter`` (mean) of the unit's gradient, plus (with
    `reshard_after_forward`) the re-gather of the unit before its backward. Resident per rank:
    1/N of parameters, gradients and optimizer state, plus the units in use. See the module
    docstring for the exact traffic and memory.

    Args:
        step: any Step whose parameters are full (from `fscale.train_step`, `accumulate`,
            `data_parallel` over another axis, or a plan of your own). Its ``loss_fn`` receives a
            `fscale.functional.UnitParams`: pass it to a `FunctionalModule` (gather at the point of
            use) or index it by name (each unit gathered on first access).
        mesh: the mesh; `axis` (and `replicate_axis`) must be among its axes.
        axis: the axis to shard over. Each rank along it (and along `replicate_axis`) reads its
            own slice of the global batch.
        units: which parameters are gathered together: None (one unit per element of the
            first module list, e.g. per GPT block, the rest in the root unit), a list of path
            prefixes, or a function ``path -> unit name`` (None for the root unit). See
            `fscale.parallel.fsdp.units`. A unit is padded to a multiple of N; a unit smaller than
            N leaves some ranks holding only padding. All names of a tied weight must be in
            one unit (for a GPT's embedding and output layer: the root unit).
        reshard_after_forward: True: release each unit's gathered parameters after its
            forward and gather them again when its backward needs them, keeping its
            activations (3 transfers of the unit per step, at most ``prefetch + 1`` units
            resident; under ``grad_mode="func"`` this recomputes, as "remat").
            "except_last" (the default): the same for every unit but the last in order of
            use, which backward needs first and which is kept from its forward (2 transfers
            of it: one all-gather per step fewer; the price is that unit's gathered
            parameters held through the layers after it, e.g. a GPT's output layer and loss).
            "remat": keep
            only the unit's inputs and recompute the unit in backward after gathering it
            again (activation checkpointing per unit, same traffic). False: keep them until
            backward (2 transfers, every unit resident at the end of the forward).
        prefetch: how many units ahead to issue all-gathers, in the forward and for the
            re-gathers of the backward (0: none).
        replicate_axis: an outer axis to replicate over (HSDP): sugar for
            ``data_parallel(fully_shard(step, mesh, axis), mesh, replicate_axis)``, which
            averages each gradient shard over the replicas.

    Returns:
        A Step whose state holds ``{unit name: 1-D shard}`` as its params and whose metrics
        (the loss and scalar extras) are means over the data axes, equal on every rank.

    Raises:
        TypeError / ValueError: `step` is not a Step or already shards its state or splits its
            batch over `axis`, `mesh` lacks an axis, bad
            `units`, `prefetch` or flags. At init: a unit spec matching nothing, a unit mixing
            dtypes, a tied weight split across units (at the first step), or ranks that
            disagree on the parameters or units.

    Example:
        >>> import fscale as fs
        >>> model = fs.models.mlp([4, 8, 2])
        >>> apply, params, buffers = fs.functionalize(model)
        >>> def loss_fn(p, b, batch, key):
        ...     out, b = apply(p, b, batch)
        ...     return out.square().mean(), b
        >>> step = fully_shard(fs.train_step(loss_fn, fs.optim.adam(1e-3)), fs.Mesh(dp=1))
        >>> state = step.init(params, buffers)
        >>> sorted(state.params)
        ['0', '2']
        >>> state, metrics = step(state, torch.ones(3, 4))
    """
    layers.check_step(step, "fully_shard")
    layers.check_not_expert_parallel(step, "fully_shard")
    sharding = layers.sharding_layer(step.plan)
    if sharding is not None:
        raise ValueError(
            f"fully_shard: the step already shards its state ({sharding.describe()}); shard it "
            "once: fully_shard for ZeRO-3 or shard_optimizer for ZeRO-1/2"
        )
    layers.check_axis_free(step, mesh, axis, "fully_shard")
    if replicate_axis is not None:
        spmd.check_axis(mesh, replicate_axis, "fully_shard")
        if replicate_axis == axis:
            raise ValueError(
                f"fully_shard: `replicate_axis` must differ from `axis`, both are {axis!r}"
            )
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward not in RESHARD_MODES:
        raise ValueError(
            "fully_shard: `reshard_after_forward` must be True, False, 'except_last' or "
            f"'remat', got {reshard_after_forward!r}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fully_shard: `prefetch` must be an int >= 0, got {prefetch!r}")
    if units is not None and not callable(units):
        if (
            isinstance(units, str)
            or not isinstance(units, (list, tuple))
            or not all(isinstance(p, str) for p in units)
        ):
            raise TypeError(
                "fully_shard: `units` must be None, a list of path prefixes (e.g. ['blocks.0', "
                f"'blocks.1']) or a function path -> unit name, got {units!r}"
            )
        units = tuple(units)
    plan = FullyShardPlan(step.plan, mesh, axis, units, reshard_after_forward, prefetch)
    sharded = step.replace(plan=plan)
    if replicate_axis is None:
        return sharded
    return data_parallel(sharded, mesh, replicate_axis)
