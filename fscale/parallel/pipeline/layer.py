"""`PipelinePlan`: the pipeline as a layer of a plan; the stage's own plan runs inside it.

Each rank along the pipeline axis holds its stages' parameters (a tuple, one pytree per local
stage), their buffers, and the optimizer state of those alone. The layer inside (`inner`) is
the plan of one stage: `LocalPlan`, or `data_parallel` / `shard_optimizer` / `fully_shard`
over another axis of the mesh (``per_stage=`` of `fscale.pipeline`); fully_shard, which cuts
named parameters into units, is given the local stages' parameters as one flat dict (the
Sequential's names, or ``"<stage>.<path>"`` for stage functions) and hands the runner its
`UnitParams`, each unit gathered on first use and kept for the step's micro-batches. The
pipeline reaches the inner plan only through the Plan protocol:

- ``init`` keeps this rank's pieces of the full model and initialises the inner plan on them;
- ``gradients`` runs the inner plan's gradient phase with a loss function that executes this
  rank's part of the schedule (`run_schedule`) and returns the loss plus a zero (`_carrying`)
  whose gradient w.r.t. the live parameters is exactly the pipeline's gradient ``g``. So
  whatever the inner plan does with a loss's gradient — DDP's bucketed all-reduce, ZeRO's
  reduce-scatter, accumulation's seeding and weighting — it does with the pipeline's,
  unchanged. The value is the mean loss over the batch, summed from the last stage over the
  pipeline axis, equal on every rank. A mixed-precision policy or loss scale around the
  pipeline is applied inside the schedule (`fscale.parallel.pipeline.precision`);
- ``apply_gradients`` is the inner plan's: each rank updates its own stages;
- ``consolidate`` / ``shard_state`` map the inner plan's full state of the local stages to and
  from the whole model's (an all-gather of the pieces over the pipeline axis).

An optimizer state leaf that mirrors the parameters (a moment) is joined or cut per stage; any
other leaf (a step count) is the same on every rank and taken from the first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch
import torch.distributed as dist

from fscale import remat, spmd, tree
from fscale.data import split_batch
from fscale.distributed.comm import Comm, resolve_comm
from fscale.distributed.mesh import Mesh
from fscale.parallel.pipeline.contract import probe_stages
from fscale.parallel.pipeline.precision import stage_policy
from fscale.parallel.pipeline.runner import run_schedule
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.stages import Stages
from fscale.parallel.pipeline.transport import check_transport
from fscale.plan import PlainOptimizer, Plan, TrainState

__all__ = ["PipelinePlan"]

PyTree = Any


@dataclasses.dataclass(frozen=True, repr=False)
class PipelinePlan(Plan):
    """Stages over `axis` run by `schedule`; `inner` is the plan of each rank's stages."""

    inner: Plan
    mesh: Mesh
    axis: str
    stages: Stages
    schedule: Schedule
    loss_fn: Any
    checkpoint: str
    pad: bool = False
    receive_ahead: int | None = None  # None: every receive of the step posted at its start
    # Per batch signature (shapes, dtypes, devices): the output shapes the first step's
    # contract check found, and the device this rank's stages run on (messages arrive there).
    _contracts: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # For an inner plan that needs one flat dict of parameters (fully_shard), the names and
    # structures of the local stages' pieces in it; recorded by `init` / `shard_state`.
    _flat: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def name(self) -> str:
        return "pipeline"

    def describe(self) -> str:
        s = self.schedule
        return (
            f"pipeline(axis={self.axis!r} of size {s.num_ranks}, schedule={s.name!r}, "
            f"stages={s.num_stages}, micro_batches={s.micro_batches}, "
            f"checkpoint={self.checkpoint!r}"
            + (", pad=True" if self.pad else "")
            + ("" if self.receive_ahead is None else f", receive_ahead={self.receive_ahead}")
            + ")"
        )

    def own_mesh(self) -> Mesh:
        return self.mesh

    @property
    def index(self) -> int:
        return self.mesh.rank(self.axis)

    @property
    def local(self) -> tuple[int, ...]:
        return self.schedule.local_stages(self.index)

    def _comm(self) -> Comm | None:
        return (
            resolve_comm(self.axis, self.mesh, "pipeline") if self.schedule.num_ranks > 1 else None
        )

    # ---- phases --------------------------------------------------------------------------

    def init(self, step, params, buffers, key, ctx):
        if ctx.optimizer != PlainOptimizer() or ctx.param_maps:
            raise ValueError(
                "pipeline: a layer outside the pipeline shards the state (shard_optimizer or "
                "fully_shard); shard each stage instead: fscale.pipeline(..., per_stage=lambda "
                "s: fscale.shard_optimizer(s, mesh, 'dp'))"
            )
        local_params, local_buffers = self._local_pieces(params, buffers)
        if not tree.leaves(local_params):
            raise ValueError(
                f"pipeline: the stages {list(self.local)} of rank {self.index} along "
                f"{self.axis!r} have no trainable parameters; move a layer with parameters "
                "into them (change `balance`)"
            )
        if self.flat_params:
            local_params = self._to_flat(local_params)
        self._check_schedule_agrees()
        return self.inner.init(step, local_params, local_buffers, key, ctx)

    def _check_schedule_agrees(self) -> None:
        """Every rank of the axis runs the same table (one built from measured costs differs
        with the costs); else an error on every rank, not a wait for a message never sent."""
        if self._comm() is None:
            return
        s = self.schedule
        lines = [f"schedule: {s.name}", f"activation bound: {s.activation_bound}"] + [
            f"rank {r}: "
            + " ".join(f"{a.kind}{a.micro_batch}(stage {a.stage}, tick {a.tick})" for a in row)
            for r, row in enumerate(s.rank_actions(r) for r in range(s.num_ranks))
        ]
        spmd.check_same_on_all_ranks(
            self.mesh,
            self.axis,
            lines,
            "the schedule",
            "pipeline",
            fix="Build it from the same arguments on every rank (for zero_bubble(..., costs=...), "
            "the same costs: measured_costs gathers them).",
        )

    def gradients(self, step, state, batch, ctx):
        # The step's policy and loss scale, applied where the stages run (`precision`).
        casts = stage_policy(step.plan, ctx)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            batch = (casts.cast_batch(batch[0]), casts.cast_batch(batch[1]))
        inputs, targets, real_sizes = self._micro_batches(batch)
        loss_fn = casts.loss_fn(self.loss_fn)

        def run_rank(live_params: PyTree, buffers: PyTree, _batch: Any, key: torch.Tensor):
            pieces = self._from_flat(live_params) if self.flat_params else live_params
            seen_buffers = casts.cast_buffers(buffers)
            comm = self._comm()
            shapes, device = self._contract(
                comm, casts.cast_params(pieces), seen_buffers, inputs[0], targets[0], key, loss_fn
            )
            # The checkpoint mode says which micro-batches are recomputed; a schedule's last
            # checkpointed call is rarely the next one differentiated, so none keeps more.
            with remat.keep_last(False):
                result = run_schedule(
                    self.schedule,
                    self.index,
                    comm,
                    self.stages,
                    pieces,
                    seen_buffers,
                    inputs,
                    targets,
                    loss_fn,
                    key,
                    self.checkpoint,
                    shapes,
                    real_sizes,
                    param_cast=casts.param_cast(),
                    loss_weight=casts.loss_weight,
                    receive_ahead=self.receive_ahead,
                    device=device,
                )
            new_buffers = casts.restore_buffers(buffers, seen_buffers, result.buffers)
            loss, count = result.loss, result.count
            grads = tree.leaves(result.grads)
            if count is not None:  # weighted by counts: divide by the global count
                grads = [g / count.to(g.dtype) for g in grads]
            live = tree.leaves(pieces)
            dtype = live[0].dtype if live else loss.dtype
            return loss.to(dtype) + _carrying(grads, live), new_buffers

        if casts.loss_weight != 1.0:  # already in every micro-batch's backward
            ctx = ctx.replace(loss_weight=1.0)
        return self.inner.gradients(step.replace(loss_fn=run_rank), state, batch, ctx)

    # ---- state in and out ----------------------------------------------------------------

    def consolidate(self, step, state):
        local_full = self.inner.consolidate(step, state)
        if self.flat_params:
            local_full = self._state_of_pieces(local_full)
        pieces = (self.local, local_full.params, local_full.buffers, local_full.opt_state)
        gathered = spmd.all_gather_objects(pieces, self.mesh, self.axis)
        num_stages = self.schedule.num_stages
        params: list[Any] = [None] * num_stages
        buffers: list[Any] = [None] * num_stages
        for local, rank_params, rank_buffers, _ in gathered:
            for position, stage in enumerate(local):
                params[stage] = rank_params[position]
                buffers[stage] = rank_buffers[position]
        opt_state = self._merge_opt_state([(g[0], g[1], g[3]) for g in gathered])
        return tree.with_fields(
            local_full,
            params=self.stages.merge(params),
            buffers=self.stages.merge(buffers),
            opt_state=opt_state,
        )

    def shard_state(self, step, full_state):
        local_params, local_buffers = self._local_pieces(full_state.params, full_state.buffers)
        items, outer = _param_shaped(full_state.opt_state, tree.structure(full_state.params))
        local_items = [self._local_of(item) if shaped else item for shaped, item in items]
        local_state = TrainState(
            local_params,
            local_buffers,
            optree.tree_unflatten(outer, local_items),
            full_state.step,
            full_state.key,
        )
        if self.flat_params:
            local_state = self._flat_state(local_state)
        return self.inner.shard_state(step, local_state)

    # ---- helpers -------------------------------------------------------------------------

    @property
    def flat_params(self) -> bool:
        """Whether the stage's plan holds the local stages' parameters as one flat dict
        name -> tensor (fully_shard needs one; the names are the Sequential's, or
        ``"<stage>.<path>"`` for stage functions) instead of one pytree per stage."""
        return self.inner.find("fully_shard") is not None

    def _to_flat(self, pieces: tuple) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        layout = []
        for stage, piece in zip(self.local, pieces):
            paths, values, treedef = tree.flatten_with_paths(piece)
            names = list(paths) if self.stages.param_names else [f"{stage}.{p}" for p in paths]
            flat.update(zip(names, values))
            layout.append((names, treedef))
        self._flat[:] = layout
        return flat

    def _from_flat(self, flat: Any) -> tuple:
        if not self._flat:
            raise ValueError(
                "pipeline: the step has no model yet; build its state with step.init(params, "
                "buffers) or fscale.shard_state(step, full_state) first"
            )
        # Reading a name of fully_shard's UnitParams gathers its unit (once per step).
        return tuple(
            tree.unflatten(treedef, [flat[name] for name in names]) for names, treedef in self._flat
        )

    def _state_of_pieces(self, state: TrainState) -> TrainState:
        """A state of the flat dict as one of the local stages' pieces."""
        items, outer = _param_shaped(state.opt_state, tree.structure(state.params))
        opt_state = [self._from_flat(v) if shaped else v for shaped, v in items]
        return tree.with_fields(
            state,
            params=self._from_flat(state.params),
            opt_state=optree.tree_unflatten(outer, opt_state),
        )

    def _flat_state(self, state: TrainState) -> TrainState:
        """A state of the local stages' pieces as one of the flat dict."""
        items, outer = _param_shaped(state.opt_state, tree.structure(state.params))
        params = self._to_flat(state.params)
        opt_state = [self._to_flat(v) if shaped else v for shaped, v in items]
        return tree.with_fields(
            state, params=params, opt_state=optree.tree_unflatten(outer, opt_state)
        )

    def _local_pieces(self, params: PyTree, buffers: PyTree) -> tuple[tuple, tuple]:
        stage_params = self.stages.split(params, "params", "pipeline")
        stage_buffers = self.stages.split(buffers, "buffers", "pipeline")
        return (
            tuple(stage_params[s] for s in self.local),
            tuple(stage_buffers[s] for s in self.local),
        )

    def _local_of(self, full_like_params: PyTree) -> tuple:
        pieces = self.stages.split(full_like_params, "params", "pipeline")
        return tuple(pieces[s] for s in self.local)

    def _merge_opt_state(self, ranks: list[tuple[tuple[int, ...], tuple, PyTree]]) -> PyTree:
        flattened = []
        for local, rank_params, opt_state in ranks:
            items, outer = _param_shaped(opt_state, tree.structure(rank_params))
            flattened.append((local, items, outer))
        _, first_items, outer = flattened[0]
        merged = []
        for k, (shaped, value) in enumerate(first_items):
            if not shaped:
                merged.append(value)
                continue
            stage_pieces: list[Any] = [None] * self.schedule.num_stages
            for local, items, _ in flattened:
                for position, stage in enumerate(local):
                    stage_pieces[stage] = items[k][1][position]
            merged.append(self.stages.merge(stage_pieces))
        return optree.tree_unflatten(outer, merged)

    def _micro_batches(self, batch: Any) -> tuple[list[Any], list[Any], list[int] | None]:
        """The micro-batches' inputs and targets, and with padding the real samples of each."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                "pipeline: the batch must be a pair (inputs, targets), given whole to every "
                f"rank of the pipeline; got {type(batch).__name__}"
            )
        inputs, targets = batch
        leaves = tree.leaves(inputs)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
            raise TypeError(
                "pipeline: the batch's inputs must be a tensor (or a pytree of tensors) with a "
                "batch dim 0"
            )
        m = self.schedule.micro_batches
        size = leaves[0].shape[0]
        if any(t.shape[0] != size for t in leaves + tree.leaves(targets)):
            raise ValueError(
                "pipeline: the batch's inputs and targets must have the same size along dim 0, "
                f"got {[tuple(t.shape) for t in leaves + tree.leaves(targets)]}"
            )
        if size % m == 0:
            return (
                [split_batch(inputs, i, m) for i in range(m)],
                [split_batch(targets, i, m) for i in range(m)],
                None,
            )
        if not self.pad:
            raise ValueError(
                f"pipeline: the batch of {size} samples does not split into "
                f"`micro_batches`={m} equal micro-batches; use a batch size that is a "
                f"multiple of {m}, or fscale.pipeline(..., pad=True) to pad the last one"
            )
        per = -(-size // m)
        # Padding repeats the last sample: finite values whatever the model; the loss never
        # sees them, so their gradient is zero.
        padded = tree.map(
            lambda t: torch.cat([t, t[-1:].expand(per * m - size, *t.shape[1:])]), inputs
        )
        real = [max(0, min(per, size - i * per)) for i in range(m)]
        return (
            [split_batch(padded, i, m) for i in range(m)],
            [tree.map(lambda t, i=i: t[i * per : i * per + real[i]], targets) for i in range(m)],
            real,
        )

    def _contract(self, comm, params, buffers, inputs, targets, key, loss_fn):
        signature = (
            tree.structure(inputs),
            tuple((tuple(t.shape), t.dtype, t.device) for t in tree.leaves(inputs)),
            tuple((tuple(t.shape), t.dtype, t.device) for t in tree.leaves(targets)),
        )
        found = self._contracts.get(signature)
        if found is None:
            leaves = tree.leaves((params, inputs, targets))
            devices = {t.device for t in leaves if isinstance(t, torch.Tensor)}
            backend = "gloo" if comm is None else str(dist.get_backend(comm.group))
            device = check_transport(backend, devices, self.axis)
            shapes = probe_stages(
                self.schedule,
                self.index,
                comm,
                self.mesh,
                self.axis,
                self.stages,
                params,
                buffers,
                inputs,
                targets,
                loss_fn,
                key,
                device,
            )
            found = self._contracts[signature] = (shapes, device)
        return found


class _Carrying(torch.autograd.Function):
    """A zero whose gradient w.r.t. each leaf is the given gradient (times the seed)."""

    @staticmethod
    def forward(grads: list[torch.Tensor], *leaves: torch.Tensor) -> torch.Tensor:
        return leaves[0].new_zeros(())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.grads = inputs[0]

    @staticmethod
    def backward(ctx: Any, seed: torch.Tensor) -> tuple[Any, ...]:
        if seed.device.type == "cpu" and bool(seed == 1):  # the usual seed: no copy
            return (None, *ctx.grads)
        return (None, *(grad * seed for grad in ctx.grads))


def _carrying(grads: list[torch.Tensor], leaves: list[torch.Tensor]) -> torch.Tensor:
    """0, with gradient `grads` w.r.t. `leaves`: the pipeline's gradient handed to the plan
    inside (its seed, e.g. accumulation's weight, applied as to any loss)."""
    if not leaves:
        return torch.zeros(())
    return _Carrying.apply(grads, *leaves)


def _param_shaped(value: PyTree, params_def: Any) -> tuple[list[tuple[bool, Any]], Any]:
    """`value` flattened down to its subtrees shaped like the params (marked True) and its
    other leaves (False), with the outer structure."""

    def is_params(node: Any) -> bool:
        return tree.structure(node) == params_def

    items, outer = optree.tree_flatten(value, is_leaf=is_params, none_is_leaf=False)
    return [(is_params(item), item) for item in items], outer
