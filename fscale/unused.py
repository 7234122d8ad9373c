"""Parameters the loss did not use: left as they were by the update, as torch.optim leaves them.

torch.optim skips a parameter whose ``.grad`` is None: no weight decay, no momentum, no change
to its optimizer state. `fscale.grad.value_and_grad` reports which state leaves the loss used
(on the autograd path, autograd returns no gradient for a leaf the loss did not use); a step
whose `train_step(unused_params=...)` resolves to ``"skip"`` agrees on that mask across its data
axes (a leaf counts as used when any rank used it, as torch DDP with
``find_unused_parameters=True``), and the update keeps the unused leaves' params and optimizer
state: `hold` copies them before the optimizer runs (donated buffers are overwritten in place)
and `restore` writes them back into the new state. When every leaf is used (the common case)
neither does any work.

Where usage is not known per state leaf every parameter counts as used (a zero gradient):
under ``grad_mode="func"`` (torch.func returns zeros, not None) and under `fully_shard`, whose
loss sees gathered units rather than the state's shards (as torch FSDP's flat parameters).

The optimizer state's per-parameter parts are found by structure: every subtree of the state
with the params' structure holds one leaf per parameter (each buffer field of the built-in
optimizers' states, each state of a `chain`, an offloaded optimizer's master copy). State kept in
another structure (the groups of `fscale.optim.partition`) is not restored. The optimizer's step
count is one for all parameters and advances at every step, where torch keeps one per
parameter: a parameter unused at some steps and used at later ones is bias-corrected by the
step's count (the two agree for a parameter used at every step or at none).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fscale import tree

__all__ = ["Held", "hold", "per_param_parts", "restore"]

PyTree = Any


class Held(NamedTuple):
    """Copies of the unused leaves' params and per-parameter optimizer state."""

    indices: tuple[int, ...]
    params: list[torch.Tensor]
    parts: list[list[torch.Tensor]]


def per_param_parts(opt_state: PyTree, treedef: optree.PyTreeSpec) -> list[list[Any]]:
    """The leaves of every subtree of `opt_state` that has the params' structure `treedef`."""

    def matches(node: Any) -> bool:
        return tree.structure(node) == treedef

    nodes = optree.tree_leaves(opt_state, is_leaf=matches, none_is_leaf=False)
    return [tree.leaves(node) for node in nodes if matches(node)]


def hold(used: tuple[bool, ...] | None, params: PyTree, opt_state: PyTree) -> Held | None:
    """Copies of what the update must not change for the leaves `used` marks False (or None)."""
    if used is None or all(used):
        return None
    leaves, treedef = tree.flatten(params)
    if len(used) != len(leaves):
        raise ValueError(
            f"the usage mask has {len(used)} entries but the params have {len(leaves)} leaves; "
            "pass the GradAux that step.gradients returned for this state"
        )
    indices = tuple(i for i, is_used in enumerate(used) if not is_used)
    with torch.no_grad():
        saved = [leaves[i].clone() for i in indices]
        parts = [[part[i].clone() for i in indices] for part in per_param_parts(opt_state, treedef)]
    return Held(indices, saved, parts)


def restore(held: Held | None, params: PyTree, opt_state: PyTree) -> None:
    """Write `held` back into the new `params` and `opt_state` (in place: they are the step's)."""
    if held is None:
        return
    leaves, treedef = tree.flatten(params)
    parts = per_param_parts(opt_state, treedef)
    if len(parts) != len(held.parts):
        raise ValueError(
            "the optimizer returned a state of another structure than it was given; an "
            "optimizer's update must keep its state's structure"
        )
    with torch.no_grad():
        for k, i in enumerate(held.indices):
            leaves[i].copy_(held.params[k])
            for part, saved in zip(parts, held.parts):
                part[i].copy_(saved[k])
