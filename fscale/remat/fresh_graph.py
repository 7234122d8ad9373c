"""The recompute that builds a fresh graph of the checkpointed function and differentiates it.

`fscale.remat.engine` uses it where the forward recorded no graph: a higher-order backward
(grad mode on: `torch.func.grad`, ``create_graph=True``), and a first-order one after a
forward inside torch.func or torch.compile, or with offload or a save policy. Elsewhere the
first-order backward runs through the forward's own graph (`fscale.remat.early_stop`).
`call` is the engine's `_Call`: ``call.rerun(inputs)`` runs the function again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["first_order_grads", "grads_through", "higher_order_grads"]


def grads_through(
    outputs: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, torch.Tensor]],
    needs: Sequence[bool],
    *,
    retain_graph: bool = False,
) -> list[torch.Tensor | None]:
    """One backward through a recorded graph: the gradients w.r.t. the `leaves` that `needs`
    marks (None for the rest), given ``(output index, gradient)`` `pairs`."""
    roots = [(outputs[j], g) for j, g in pairs if outputs[j].requires_grad]
    if not roots:
        return [None] * len(needs)
    found = iter(
        torch.autograd.grad(
            [o for o, _ in roots],
            [leaf for leaf, need in zip(leaves, needs) if need],
            [g for _, g in roots],
            retain_graph=retain_graph,
            allow_unused=True,
        )
    )
    return [next(found) if need else None for need in needs]


def first_order_grads(call, values, needs, pairs):  # type: ignore[no-untyped-def]
    """Classic recompute: rebuild fn's graph on detached inputs and differentiate it once."""
    leaves = [v.detach().requires_grad_(need) for v, need in zip(values, needs)]
    with torch.enable_grad():
        outs = call.rerun(leaves)
    return grads_through(outs, leaves, pairs, needs)


def higher_order_grads(call, values, needs, pairs):  # type: ignore[no-untyped-def]
    """Recompute inside `torch.func.grad` so the gradient stays differentiable in its inputs.

    `torch.func.vjp` here breaks nested checkpoints (functorch loses track of its level);
    the gradient of the scalar <fn(x), g> is the same vector-Jacobian product without it.
    """
    wrt = [i for i, need in enumerate(needs) if need]

    def contraction(*wrt_values: torch.Tensor) -> torch.Tensor:
        inputs = list(values)
        for i, value in zip(wrt, wrt_values):
            inputs[i] = value
        # Kept values are spliced in only where the inputs come from this transform level:
        # with inputs restored from host copies, functorch's wrapping of a replayed output
        # fails an internal assertion, so the whole function is recomputed (same values).
        outs = call.rerun(inputs, use_kept_values=not call.parked_inputs)
        terms = [(outs[j] * g).sum() for j, g in pairs]
        return torch.stack(terms).sum() if len(terms) > 1 else terms[0]

    grads = iter(
        torch.func.grad(contraction, argnums=tuple(range(len(wrt))))(*[values[i] for i in wrt])
    )
    return [next(grads) if need else None for need in needs]
