"""`value_and_grad`: the loss and its gradient w.r.t. a parameter pytree, the one place it is taken.

Gradients are taken with ``torch.autograd.grad`` w.r.t. detached aliases (no copies) of the
parameter leaves (measured: as fast as eager ``loss.backward()`` and the least memory), or with
``torch.func.grad`` (``grad_mode="func"``) for a step that outer torch.func transforms can see
through (it builds a second-order graph: about 2x the peak memory).

Plans change what happens around the differentiation through a `fscale.plan.Context`, so that a
plan need not know the plans wrapped around it:

- ``ctx.param_maps``: differentiable maps from the live leaves to what ``loss_fn`` receives (a
  fully sharded plan gathers its shards here);
- ``ctx.reducer``: how the gradients of the live leaves are reduced across ranks (bucketed and
  overlapped with backward through per-leaf hooks, or after backward under torch.func);
- ``ctx.accumulated`` / ``ctx.final``: gradients of earlier micro-batches to add in, and
  whether this backward completes the step's gradient (reductions run only then, once);
- ``ctx.loss_weight``: the factor the loss is scaled by before differentiation (a micro-batch's
  share of the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fscale import purity, tree
from fscale.outside_graph import outside_graph
from fscale.remat.early_stop import keeping_last
from fscale.step_means import StepMeans

if TYPE_CHECKING:
    from fscale.plan import Context

__all__ = ["GRAD_MODES", "LossOutput", "normalize_loss_output", "value_and_grad"]

PyTree = Any
Metrics = dict[str, Any]
GRAD_MODES = ("autograd", "func")


class LossOutput(NamedTuple):
    """What a loss function returned, normalised: the loss, the new buffers, extra metrics.

    `used` is filled in by `value_and_grad`: per leaf of the params, whether the loss used it
    (autograd returned a gradient for it), or None where that is not known (torch.func
    gradients, or params mapped before the loss sees them). `means`: the means over the data
    axes begun after the forward (`fscale.step_means.StepMeans`), or None.
    """

    loss: torch.Tensor
    buffers: PyTree
    metrics: Metrics
    used: tuple[bool, ...] | None = None
    means: StepMeans | None = None


# Metric names the step itself reports; a loss function's own metric must not replace them.
RESERVED_METRICS = ("loss", "grad_bytes", "grad_peak_bytes", "skipped")


def normalize_loss_output(out: Any, buffers: PyTree) -> LossOutput:
    """Accept ``loss``, ``(loss, new_buffers)`` or ``(loss, new_buffers, metrics)``."""
    if not isinstance(out, (torch.Tensor, tuple)) and isinstance(
        getattr(out, "loss", None), torch.Tensor
    ):
        raise TypeError(
            f"loss_fn returned a {type(out).__name__} (a model's output object); return its "
            "loss instead: `return out.loss` (or `(out.loss, new_buffers)`)"
        )
    if isinstance(out, torch.Tensor):
        loss, new_buffers, metrics = out, buffers, {}
    elif isinstance(out, tuple) and len(out) in (2, 3):
        loss, new_buffers = out[0], out[1]
        metrics = dict(out[2]) if len(out) == 3 else {}
        reserved = sorted(set(metrics) & set(RESERVED_METRICS))
        if reserved:
            raise ValueError(
                f"loss_fn returned a metric named {reserved[0]!r}, which the step reports itself "
                f"(reserved: {', '.join(RESERVED_METRICS)}); rename it, e.g. 'my_{reserved[0]}'"
            )
        if new_buffers is None:
            new_buffers = buffers
    else:
        raise TypeError(
            "loss_fn must return the loss, (loss, new_buffers) or (loss, new_buffers, metrics); "
            f"got {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple) else "")
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() > 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar loss (the mean over the local batch), got {shape}; "
            "reduce it with .mean() inside loss_fn"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn returned a loss of dtype {loss.dtype}; expected a float tensor")
    # Every field is given, the defaulted ones too. Under torch 2.11 the compiled step failed
    # in Dynamo's frame check on a NamedTuple shorter than its `_fields`; the defaulted fields
    # of LossOutput and GradAux, filled in by Dynamo's rebuild, are the suspected cause.
    return LossOutput(loss.reshape(()), new_buffers, metrics, None, None)


def value_and_grad(
    loss_fn: Callable[..., Any],
    params: PyTree,
    buffers: PyTree,
    batch: Any,
    key: torch.Tensor,
    *,
    grad_mode: str = "autograd",
    prepare: Callable[[PyTree], PyTree] | None = None,
    grad_hooks: list[Callable[[torch.Tensor], torch.Tensor] | None] | None = None,
    ctx: Context | None = None,
) -> tuple[LossOutput, PyTree]:
    """Loss outputs and the gradient of the loss w.r.t. every leaf of `params`.

    Args:
        loss_fn: ``loss_fn(params, buffers, batch, key)`` returning the mean loss over the
            batch, ``(loss, new_buffers)`` or ``(loss, new_buffers, metrics)``.
        params: the pytree to differentiate w.r.t.; it is not modified.
        buffers, batch, key: passed through to `loss_fn`.
        grad_mode: ``"autograd"`` (default, first-order, least memory) or ``"func"``
            (``torch.func.grad``; composes with outer torch.func transforms).
        prepare: a differentiable map applied to the live parameters before `loss_fn` sees
            them, after the context's maps.
        grad_hooks: one hook per leaf of `params` (``None`` entries allowed), registered on the
            live leaves on the autograd path; each runs as soon as that leaf's gradient is
            complete and may return a replacement.
        ctx: what the plans around the caller ask for (see the module docstring); None is
            the empty context.

    Returns:
        ``(LossOutput(loss, new_buffers, metrics, used), grads)`` with `grads` shaped like
        `params` (zeros for leaves the loss does not use; ``used`` says which those are) or,
        when the context's reducer scatters them, in the reducer's layout. The loss is detached
        and unweighted; the metrics include what the reducer reports (``grad_peak_bytes``).

    Raises:
        ValueError: the loss wrote into a leaf of `params` or `buffers` in place (it would
            change the caller's state), or does not depend on `params`.
    """
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"`grad_mode` must be one of {GRAD_MODES}, got {grad_mode!r}")
    leaves, treedef = tree.flatten(params)
    buffer_leaves = tree.leaves(buffers)
    before = purity.versions(leaves), purity.versions(buffer_leaves)
    maps = list(ctx.param_maps) if ctx is not None else []
    # Usage is known per state leaf only when the loss sees those leaves themselves.
    track_usage = not maps and prepare is None
    if prepare is not None:
        maps.append(prepare)
    weight = ctx.loss_weight if ctx is not None else 1.0
    reducing = ctx is not None and ctx.reducer is not None and ctx.final
    session = ctx.reducer.session(params, grad_mode) if reducing else None  # type: ignore[union-attr]
    accumulated = None
    if ctx is not None and ctx.accumulated is not None:
        accumulated = _accumulated_leaves(ctx.accumulated, treedef)
    if session is not None:
        session.seed(accumulated)
        maps.insert(0, session.prepare)
    means = _step_means(ctx, grad_mode, session)

    def call_loss(live_tree: PyTree) -> LossOutput:
        for fn in maps:
            live_tree = fn(live_tree)
        out = normalize_loss_output(loss_fn(live_tree, buffers, batch, key), buffers)
        if means is not None:
            means.after_forward(
                out.loss, out.metrics, buffers, out.buffers, scalars=accumulated is None
            )
        for fn in maps:
            after_forward = getattr(fn, "after_forward", None)
            if after_forward is not None:
                after_forward()
        return out

    if grad_mode == "func":
        out, grads = _value_and_grad_func(call_loss, leaves, treedef, weight)
    else:
        hooks = list(grad_hooks) if grad_hooks is not None else [None] * len(leaves)
        if session is not None:
            hooks = _chain_hooks(hooks, session.hooks(compiling=torch.compiler.is_compiling()))
        out, grads = _value_and_grad_autograd(call_loss, leaves, treedef, hooks, weight)
    for fn in maps:
        finish = getattr(fn, "after_backward", None)
        if finish is not None:
            finish()
    purity.check_not_written("params", params, leaves, before[0])
    purity.check_not_written("buffers", buffers, buffer_leaves, before[1])
    if not track_usage:
        out = tree.with_fields(out, used=None)
    if session is not None:
        grads = session.finish(grads)
        out = tree.with_fields(out, metrics={**out.metrics, **session.metrics()})
    elif accumulated is not None:
        grads = tree.unflatten(treedef, [g + a for g, a in zip(tree.leaves(grads), accumulated)])
    if means is not None:
        means.returned_loss(out.loss)  # the detached loss is what the step's metrics hold
    return tree.with_fields(out, means=means), grads


def _step_means(ctx: Context | None, grad_mode: str, session: Any) -> StepMeans | None:
    """The means over the data axes this backward's forward begins (the step's last).

    None under torch.compile: a collective begun inside the graph would end it, and an object
    made in the graph that outlives a graph break must be rebuilt by Dynamo, which fails for
    one that holds the reducer's session; the step's end averages everything there.
    """
    if ctx is None or not ctx.final or not ctx.metric_axes or ctx.metric_mesh is None:
        return None
    if grad_mode != "autograd" or torch.compiler.is_compiling():
        return None
    return StepMeans(ctx.metric_mesh, ctx.metric_axes, session=session)


def _accumulated_leaves(accumulated: PyTree, treedef: Any) -> list[torch.Tensor]:
    leaves, accumulated_def = tree.flatten(accumulated)
    if not tree.same_structure(accumulated_def, treedef):
        raise ValueError(
            f"value_and_grad: `ctx.accumulated` has structure {accumulated_def} but the params "
            f"have {treedef}; accumulate gradients in the layout of the params they belong to"
        )
    return leaves


def _chain_hooks(first: list[Any], second: list[Any]) -> list[Any]:
    def both(a: Callable[[torch.Tensor], Any], b: Callable[[torch.Tensor], Any]) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            replaced = a(grad)
            return b(grad if replaced is None else replaced)

        return hook

    return [b if a is None else a if b is None else both(a, b) for a, b in zip(first, second)]


def _weighted(loss: torch.Tensor, weight: float) -> torch.Tensor:
    return loss if weight == 1.0 else loss * weight


@outside_graph
def _live_leaves(leaves: list[torch.Tensor], hooks: list[Any]) -> list[torch.Tensor]:
    """Aliases of `leaves` that require grad, with `hooks` registered on them.

    Under torch.compile this runs outside the graph, as one call: Dynamo cannot make a traced
    tensor require grad, and a hook that writes the reducer's state makes it give up on the
    frame that registers it; run eagerly, that frame would unflatten with the stand-in treedef
    of the traced caller, which fails outside a graph (torch 2.13: "length mismatch").
    """
    live = [leaf.detach().requires_grad_(True) for leaf in leaves]
    for leaf, hook in zip(live, hooks):
        if hook is not None:
            leaf.register_hook(hook)
    return live


def _value_and_grad_autograd(
    call_loss: Callable[[PyTree], LossOutput],
    leaves: list[torch.Tensor],
    treedef: Any,
    hooks: list[Any],
    weight: float,
) -> tuple[LossOutput, PyTree]:
    # The forward's last checkpointed call keeps what its backward reads (`fscale.remat`).
    with torch.enable_grad(), keeping_last():
        live = _live_leaves(leaves, hooks)
        out = call_loss(tree.unflatten(treedef, live))
        if not out.loss.requires_grad:
            raise ValueError(
                "the loss does not depend on `params`: check that loss_fn uses the params it is "
                "given (not the module's own parameters)"
            )
        found = torch.autograd.grad(_weighted(out.loss, weight), live, allow_unused=True)
    if live and all(g is None for g in found):
        # The loss needs grad, yet through none of the given params: it was computed from other
        # tensors, typically the module's own parameters (calling the module, not `apply`).
        raise ValueError(
            "the loss does not depend on any of the `params` it was given: loss_fn computes it "
            "from other tensors (e.g. calls the nn.Module itself); call the functional "
            "`apply(params, buffers, ...)` from fscale.functionalize with the params it receives"
        )
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(found, live)]
    used = tuple(g is not None for g in found)
    return tree.with_fields(out, loss=out.loss.detach(), used=used), tree.unflatten(treedef, grads)


def _value_and_grad_func(
    call_loss: Callable[[PyTree], LossOutput],
    leaves: list[torch.Tensor],
    treedef: Any,
    weight: float,
) -> tuple[LossOutput, PyTree]:
    def objective(*flat_params: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        out = call_loss(tree.unflatten(treedef, list(flat_params)))
        # torch.func's aux holds tensors only: the usage mask (None here) stays out of it.
        return _weighted(out.loss, weight), (out.loss, out.buffers, out.metrics)

    argnums = tuple(range(len(leaves)))
    grads, (loss, buffers, metrics) = torch.func.grad(objective, argnums=argnums, has_aux=True)(
        *leaves
    )
    return LossOutput(loss.detach(), buffers, metrics, None, None), tree.unflatten(
        treedef, list(grads)
    )
