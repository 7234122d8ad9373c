"""The recompute engine: one `autograd.Function` that keeps a call's inputs and reruns it.

A checkpointed call's forward keeps nothing for backward but its inputs (and what a
`SavePolicy` selects); its backward runs the function again to rebuild what the gradient needs.
Why an own `autograd.Function` and not `torch.utils.checkpoint`: both torch's checkpoint and
saved-tensor hooks raise inside `torch.func` grad transforms. A new-style Function with
`setup_context` works under `torch.autograd.grad`, `torch.func.grad`, `torch.func.vjp`, nested
checkpoints and higher-order gradients. Its backward has two branches:

* grad mode off (first-order `autograd.grad`, a `vjp_fn` called without a graph): when the
  forward ran outside torch.func and torch.compile (`fscale.remat.early_stop`), recorded
  fn's graph with positions in place of its saved tensors, and that graph holds no compiled
  function's backward, backward runs through it and reruns fn only until it has rebuilt the
  last tensor backward reads. Otherwise detach the saved inputs, run fn again under
  `enable_grad` and call `torch.autograd.grad` on that graph;
* grad mode on (`torch.func.grad`, `create_graph=True`): take `torch.func.grad` of
  ``<fn(inputs), grad_outputs>`` with respect to the saved inputs *as tracked by the outer
  transform*, so the gradient it returns is itself differentiable (grad of grad is exact).

The state that makes the recompute replay the forward exactly travels in a plain Python object
(`_Call`) handed to `Function.apply` as a non-tensor argument (a tensor argument would be
wrapped by functorch): the RNG state of the CPU and of every CUDA device involved
(`fscale.random.RngState`, so dropout masks are identical), the autocast state, and snapshots
of buffers the forward mutated in place. With offload, the inputs and kept values are parked
in host memory (`fscale.offload.transfer`) from the forward until the backward uses them.

`checkpoint_call` is the entry point; `fscale.remat.checkpoint` builds on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fscale import tree
from fscale.offload import transfer
from fscale.outside_graph import outside_graph
from fscale.remat.early_stop import EarlyStopGraph, eligible, not_top_level, release_kept
from fscale.remat.execution import ExecutionState
from fscale.remat.fresh_graph import first_order_grads, higher_order_grads
from fscale.remat.mutation import Watch, describe_argument
from fscale.remat.policy import (
    KeptOutputs,
    ReplayOps,
    SavePolicy,
    recording,
    storage_key,
    tensor_leaves,
)
from fscale.remat.stats import count

__all__ = ["checkpoint_call"]


def _map_tensors(fn: Callable[[Any], Any], values: Any) -> Any:
    """Apply `fn` to the tensor (or parked) leaves of an operator's outputs."""
    return tree.map(
        lambda v: fn(v) if isinstance(v, (torch.Tensor, transfer.Parked)) else v, values
    )


@dataclasses.dataclass(frozen=True)
class _Options:
    offload: bool
    policy: SavePolicy | None
    early_stop: bool = True


class _Call:
    """One checkpointed call: how to run fn again and what forward kept for it.

    Created before `_Remat.apply` and passed to it as a non-tensor argument, so it survives
    functorch's unwrapping unchanged and is shared by every transform level's context.
    """

    def __init__(
        self,
        run: Callable[[Any], Any],
        leaves: list[Any],
        treedef: Any,
        tensor_positions: list[int],
        module_state: int,
        buffer_indexes: frozenset[int],
        options: _Options,
    ) -> None:
        self._run = run
        self._leaves = leaves
        self._treedef = treedef
        self._tensor_positions = tensor_positions
        # Tensor inputs [0, module_state) are the call's `state` (see `checkpoint_call`).
        self._module_state = module_state
        self._buffer_indexes = buffer_indexes
        self.options = options
        # Per tensor input: None when saved through ctx.save_for_backward, else the value
        # (a parked host copy or a buffer snapshot) kept here.
        self.kept: list[Any] = []
        self.mutated: frozenset[int] = frozenset()
        self.replay: KeptOutputs = {}
        self.execution: ExecutionState | None = None
        self.out_treedef: Any = None
        self.out_leaves: list[Any] = []
        self.out_positions: list[int] = []
        self.out_differentiable: list[bool] = []
        # Whether forward records the graph for a first-order backward that stops its
        # recompute early (`fscale.remat.early_stop`); decided when the call is made.
        self.early_stop = (
            options.early_stop and options.policy is None and not options.offload and eligible()
        )
        self.graph: EarlyStopGraph | None = None

    def run(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self._leaves)
        for position, value in zip(self._tensor_positions, tensors):
            leaves[position] = value
        return self._run(tree.unflatten(self._treedef, leaves))

    # forward ---------------------------------------------------------------------------

    def forward(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.execution = ExecutionState.capture(list(tensors))
        self.kept = [None] * len(tensors)
        offload = self.options.offload
        for i, t in enumerate(tensors):
            # Parked before fn runs, so the copy overlaps fn's compute.
            if offload and i >= self._module_state and not transfer.on_host(t):
                self.kept[i] = transfer.park(t)
        before = {i: tensors[i].clone() for i in self._buffer_indexes}
        watch = Watch(self._leaves, lambda i: describe_argument(self._treedef.paths()[i]))

        policy = self.options.policy
        if self.early_stop:
            self.graph = EarlyStopGraph()
            out = self.graph.build(self.run, tensors)
        else:
            release_kept()  # only a forward's last call keeps (`fscale.remat.early_stop`)
            with not_top_level():
                if policy is None:
                    out = self.run(tensors)
                else:
                    with recording(policy) as recorder:
                        out = self.run(tensors)
                    self.replay = recorder.finish()
        watch.check("checkpoint")  # a change the recompute would make a second time

        # A buffer fn updated in place (BatchNorm's running stats) is kept as it was before the
        # update, so the recompute sees the forward's value and updates only a throwaway copy.
        # Values are compared because native kernels update running stats without bumping the
        # version counter.
        self.mutated = frozenset(
            i for i, snapshot in before.items() if not torch.equal(snapshot, tensors[i])
        )
        for i in self.mutated:
            snapshot = before[i]
            self.kept[i] = transfer.park_unless_on_host(snapshot) if offload else snapshot
        self._count_saved(tensors)
        if offload:
            self.replay = {
                op_key: (_map_tensors(transfer.park_unless_on_host, out), arg_shapes)
                for op_key, (out, arg_shapes) in self.replay.items()
            }

        out_leaves, self.out_treedef = tree.flatten(out)
        self.out_positions = [i for i, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
        self.out_leaves = [None if isinstance(v, torch.Tensor) else v for v in out_leaves]
        # An input returned as is would be both output and saved input, which autograd refuses
        # under setup_context; a view of it is the same value.
        input_ids = {id(t) for t in tensors}
        out_tensors = tuple(
            t.view_as(t) if id(t) in input_ids else t
            for t in (out_leaves[i] for i in self.out_positions)
        )
        self.out_differentiable = [t.is_floating_point() or t.is_complex() for t in out_tensors]
        if self.graph is not None:
            # The graph's own outputs stay here for backward; the Function hands out aliases.
            self.graph.outputs = list(out_tensors)
            out_tensors = tuple(t.detach() for t in out_tensors)
            if self.graph.runs_compiled_code():
                self.graph = None  # backward recomputes fn whole, as without early stop
        return out_tensors

    # Host bookkeeping (storage sizes): under torch.compile it runs outside the graph as one call;
    # traced, Dynamo compiled its inner function anew for every saved tensor.
    @outside_graph
    def _count_saved(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if self.options.offload:
            offload_set = set(range(self._module_state, len(tensors))) | set(self.mutated)
        else:
            offload_set = set()
        counted: set[int] = set()
        saved = offloaded = 0

        def add(t: torch.Tensor, parked: bool) -> None:
            nonlocal saved, offloaded
            if isinstance(t, transfer.Parked):
                nbytes = t.host.untyped_storage().nbytes()
            else:
                key = storage_key(t)
                if key in counted:
                    return
                counted.add(key)
                nbytes = t.untyped_storage().nbytes()
            saved += nbytes
            offloaded += nbytes if parked else 0

        for i, t in enumerate(tensors):
            if i < self._module_state and i not in self.mutated:
                continue
            add(self.kept[i] if self.kept[i] is not None else t, i in offload_set)
        for out, _ in self.replay.values():
            for t in tensor_leaves(out):
                add(t, self.options.offload)
        count(calls=1, saved_bytes=saved, offloaded_bytes=offloaded)

    # backward --------------------------------------------------------------------------

    @property
    def parked_inputs(self) -> bool:
        return any(isinstance(kept, transfer.Parked) for kept in self.kept)

    def restore_inputs(self, saved: tuple[Any, ...]) -> list[torch.Tensor]:
        return [
            from_ctx if kept is None else transfer.unpark(kept)
            for from_ctx, kept in zip(saved, self.kept)
        ]

    @contextlib.contextmanager
    def replaying(self, use_kept_values: bool) -> Iterator[None]:
        assert self.execution is not None  # set by forward, which always runs first
        with self.execution.restored(), contextlib.ExitStack() as stack:
            if self.replay and use_kept_values:
                kept = {
                    op_key: (_map_tensors(transfer.unpark, out), arg_shapes)
                    for op_key, (out, arg_shapes) in self.replay.items()
                }
                stack.enter_context(ReplayOps(kept))
            yield

    def rerun(self, values: list[torch.Tensor], use_kept_values: bool = True) -> list[torch.Tensor]:
        """Run fn again on `values` as the forward ran it; returns its tensor outputs.

        With `use_kept_values`, the operations whose outputs the policy kept are not run.
        """
        # The recompute mutates copies of the buffers forward mutated, never the kept snapshot
        # (a second backward with retain_graph needs it again).
        values = [v.clone() if i in self.mutated else v for i, v in enumerate(values)]
        with self.replaying(use_kept_values), not_top_level():
            out = self.run(values)
        count(recomputations=1)
        out_leaves = tree.leaves(out)
        return [v for v in out_leaves if isinstance(v, torch.Tensor)]

    def rerun_to_stop(self, values: list[torch.Tensor]) -> None:
        """Run fn again on `values` for `EarlyStopGraph`, which stops it once backward has
        every tensor it saved."""
        values = [v.clone() if i in self.mutated else v for i, v in enumerate(values)]
        count(recomputations=1)
        with self.replaying(use_kept_values=False):
            self.run(values)

    def rebuild_output(self, out_tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for position, value in zip(self.out_positions, out_tensors):
            leaves[position] = value
        return tree.unflatten(self.out_treedef, leaves)


class _Remat(torch.autograd.Function):
    """Run fn without keeping its graph; run it again in backward."""

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return call.forward(tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        call, *tensors = inputs
        ctx.call = call
        # Saved at this transform level, so a higher-order backward differentiates through them.
        ctx.save_for_backward(*[t if k is None else None for t, k in zip(tensors, call.kept)])
        ctx.mark_non_differentiable(
            *[t for t, ok in zip(output, call.out_differentiable) if not ok]
        )
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grad_outputs):  # type: ignore[no-untyped-def]
        call: _Call = ctx.call
        needs = list(ctx.needs_input_grad[1:])
        pairs = [
            (j, g)
            for j, g in enumerate(grad_outputs)
            if g is not None and call.out_differentiable[j]
        ]
        if not pairs or not any(needs):
            return (None,) * (1 + len(needs))
        values = call.restore_inputs(ctx.saved_tensors)
        if torch.is_grad_enabled():
            grads = higher_order_grads(call, values, needs, pairs)
        elif call.graph is not None:
            grads = call.graph.grads(call.rerun_to_stop, values, pairs, needs)
        else:
            grads = first_order_grads(call, values, needs, pairs)
        return (None, *grads)


def _index(value: Any) -> int | None:
    """`value` as an index (an int, or a symbolic one under torch.compile), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def checkpoint_call(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    state: Sequence[torch.Tensor] = (),
    mutable: Iterable[int] = (),
    offload: bool = False,
    policy: SavePolicy | None = None,
    early_stop: bool = True,
) -> Any:
    """Call ``fn(state, *args, **kwargs)`` checkpointed: keep its inputs, run it again in backward.

    The one recompute entry point: `fscale.remat.checkpoint` (of functions and modules) and
    `fscale.fully_shard`'s remat units call it. Gradients flow to every tensor leaf of `args`
    and `kwargs` and to every tensor of `state`, under `torch.autograd.grad`,
    `torch.func.grad`, `torch.func.vjp` and higher orders. Under `torch.no_grad`, or when no
    input requires grad, fn runs once and nothing is kept.

    `state` holds the extra inputs fn reads besides its arguments, which the caller holds
    anyway: a module's parameters and buffers, or a sharded unit's flat shard. They are inputs
    of the recompute like the arguments (so they get gradients), but they are never offloaded
    and `track` does not count them as kept. A buffer of `state` that fn updates in place
    (BatchNorm's running statistics) is named by its index in `mutable`: its value before the
    call is kept, the recompute sees that value and updates a throwaway copy, so the update
    happens once.

    Args:
        fn: called as ``fn(list(state), *args, **kwargs)``, in forward and again in backward;
            it must compute the same function both times (randomness and autocast are
            replayed for it).
        args: positional arguments, a tuple or list of pytrees whose tensor leaves are inputs.
        kwargs: keyword arguments, likewise; default none.
        state: the extra input tensors (see above).
        mutable: indexes into `state` of buffers fn may update in place.
        offload: park the kept arguments (and kept named values, and snapshots of mutated
            buffers) in host memory until backward, as `checkpoint(offload=True)`.
        policy: what to keep besides the inputs, as `checkpoint(policy=...)`.
        early_stop: in a first-order backward outside torch.func and torch.compile, stop the
            recompute once it has rebuilt every tensor backward reads
            (`fscale.remat.early_stop`). That needs fn to save the same tensors in the same
            order both times; a fn that runs differently in its recompute by design (fully_shard's
            remat units gather differently there) passes False.

    Returns:
        fn's result; its tensor leaves are differentiable outputs of the checkpoint.

    Raises:
        TypeError: if `fn` is not callable, `args` is not a tuple or list, `kwargs` is not a
            mapping, an item of `state` is not a tensor, `offload` is not a bool or `policy`
            is not a `SavePolicy`.
        ValueError: if an index in `mutable` is not an index of `state`.
        MutatedArgumentError: (a ValueError) in forward, if fn changed a non-tensor argument.

    Example:
        >>> import torch
        >>> from fscale.remat import checkpoint_call
        >>> w, x = torch.ones(3, requires_grad=True), torch.arange(3.0, requires_grad=True)
        >>> y = checkpoint_call(lambda state, x: (state[0] * x).sin(), (x,), state=[w])
        >>> torch.autograd.grad(y.sum(), w)[0].shape
        torch.Size([3])
    """
    if not callable(fn):
        raise TypeError(f"checkpoint_call: `fn` must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"checkpoint_call: `args` must be a tuple or list, got {type(args).__name__}"
        )
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"checkpoint_call: `kwargs` must be a mapping, got {type(kwargs).__name__}")
    state = list(state)
    for i, value in enumerate(state):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"checkpoint_call: `state[{i}]` must be a tensor, got {type(value).__name__}"
            )
    # Plain ints: under torch.compile an index computed next to a 0-d integer buffer
    # (BatchNorm's num_batches_tracked) can arrive symbolic, which a set cannot hold.
    given = list(mutable)
    indexes = [_index(i) for i in given]
    outside = [g for g, i in zip(given, indexes) if i is None or not 0 <= i < len(state)]
    if outside:
        raise ValueError(
            f"checkpoint_call: `mutable` must hold indexes into `state` (0..{len(state) - 1}), "
            f"got {sorted(outside, key=repr)}"
        )
    buffer_indexes = frozenset([i for i in indexes if i is not None])  # all of them, checked
    if not isinstance(offload, bool):
        raise TypeError(f"checkpoint_call: `offload` must be True or False, got {offload!r}")
    if not isinstance(early_stop, bool):
        raise TypeError(f"checkpoint_call: `early_stop` must be True or False, got {early_stop!r}")
    if policy is not None and not isinstance(policy, SavePolicy):
        raise TypeError(
            "checkpoint_call: `policy` must be None or a SavePolicy from fscale.remat.save_names"
            f"(...) or fscale.remat.save_matmuls(), got {type(policy).__name__}"
        )

    def run(inputs: Any) -> Any:
        state_values, call_args, call_kwargs = inputs
        return fn(state_values, *call_args, **call_kwargs)

    return _checkpointed_call(
        run,
        (state, tuple(args), dict(kwargs)),
        _Options(offload=offload, policy=policy, early_stop=early_stop),
        module_state=len(state),
        buffer_indexes=buffer_indexes,
    )


def _checkpointed_call(
    run: Callable[[Any], Any],
    inputs: Any,
    options: _Options,
    module_state: int,
    buffer_indexes: frozenset[int],
) -> Any:
    leaves, treedef = tree.flatten(inputs)
    positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return run(inputs)  # nothing will be differentiated: no reason to keep or recompute
    # The call keeps only the non-tensor leaves: holding the tensors here would keep offloaded
    # inputs alive on the device.
    static_leaves = [None if isinstance(v, torch.Tensor) else v for v in leaves]
    call = _Call(run, static_leaves, treedef, positions, module_state, buffer_indexes, options)
    return call.rebuild_output(_Remat.apply(call, *tensors))
