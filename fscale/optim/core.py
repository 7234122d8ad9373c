"""Shared machinery of the optimizers: argument checks, step inputs, packed state buffers.

Every optimizer step follows the same pattern: flatten `grads`, `params` and each per-leaf state
tree, check that they agree, take *writable* copies of the params and state (or the caller's own
tensors when they donate them), run in-place kernels on those, and rebuild the trees.
`pointwise_optimizer` is that pattern once, for optimizers whose update math runs on one
(device, dtype) group at a time: their modules hold only hyper-parameter checks and the math.

Writable copies are packed: the copies of all leaves of one (device, dtype) live back to back in
one fresh 1-D buffer and the returned leaves are views of it, exactly like the state `init`
creates. When the incoming leaves are already consecutive views of one storage (what the previous
step returned), the copy is a single `clone` of that span instead of one copy per leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fscale import tree
from fscale.optim.base import Optimizer, Sharding
from fscale.optim.packing import (
    Signature,
    contiguous,
    device_groups,
    gradient_runs,
    packed_full,
    signatures,
    writable,
)
from fscale.outside_graph import outside_graph

PyTree = Any
# What torch's `_foreach_*` kernels take and return (their results are tuples, not lists).
TensorList = list[torch.Tensor] | tuple[torch.Tensor, ...]


# ----------------------------------------------------------------------------- params and state


def float_leaves(name: str, params: PyTree) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Leaves and structure of `params`; a TypeError if a leaf is not a floating-point tensor."""
    paths, leaves, treedef = tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{name}: params leaf {path!r} is a {type(leaf).__name__}, not a tensor"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"{name}: params leaf {path!r} has dtype {leaf.dtype}; optimizers update "
                "floating-point tensors only (keep integer buffers out of the params tree)"
            )
    return leaves, treedef


def new_count() -> torch.Tensor:
    """The step counter of a fresh state: a host int64 scalar (read every step, never on device)."""
    return torch.zeros((), dtype=torch.int64)


def next_count(count: int) -> torch.Tensor:
    return torch.scalar_tensor(count + 1, dtype=torch.int64)


def read_count(name: str, count: Any) -> int:
    return int(check_count(name, count))


def check_count(name: str, count: Any) -> torch.Tensor:
    """The state's step counter, checked; its value is read only where the update runs."""
    if not isinstance(count, torch.Tensor) or count.numel() != 1:
        raise TypeError(f"{name}: the state's `count` must be a scalar tensor, got {count!r}")
    return count


def check_state_type(name: str, state: Any, state_type: type) -> None:
    if not isinstance(state, state_type):
        raise TypeError(
            f"{name}: `state` must be the {state_type.__name__} that {name}'s init returned, "
            f"got {type(state).__name__}"
        )


def _signature(t: Any) -> Signature:
    return (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None


_NOT_THIS_STATE = (
    "the optimizer state does not belong to these params (a layer resized, params cast or "
    "moved): rebuild it with step.init(params), or fscale.shard_state(step, full_state) from a "
    "matching state"
)


def _check_like_params(
    name: str,
    what: str,
    leaves: list[Any],
    params: list[torch.Tensor],
    params_tree: PyTree,
    expected: list[Signature],
    why: str = _NOT_THIS_STATE,
) -> None:
    """Each leaf of `what` must be a tensor of its parameter's shape, dtype and device.

    `expected` holds the params' signatures, computed once per step for every tree checked
    (both read from `fscale.optim.packing`'s records for the buffers it packed).
    """
    if signatures(leaves) == expected:
        return
    for path, leaf, p in zip(tree.paths(params_tree), leaves, params):
        if _signature(leaf) != _signature(p):
            found = (
                f"{tuple(leaf.shape)} {leaf.dtype} on {leaf.device}"
                if isinstance(leaf, torch.Tensor)
                else type(leaf).__name__
            )
            raise ValueError(
                f"{name}: {what} leaf {path!r} is {found} but the param is "
                f"{tuple(p.shape)} {p.dtype} on {p.device}; {why}"
            )


class StepInputs(NamedTuple):
    """Flattened, checked inputs of one optimizer step."""

    treedef: optree.PyTreeSpec
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    states: dict[str, list[torch.Tensor] | None]


def step_inputs(
    name: str,
    grads: PyTree,
    params: PyTree,
    states: Mapping[str, PyTree],
    *,
    donate: bool,
    copy_params: bool = True,
    param_shaped: Collection[str] | None = None,
    packed: bool = False,
) -> StepInputs:
    """Flatten and check one step's inputs; params (if `copy_params`) and states made writable.

    `states` maps a state field's name to its per-leaf tree (None for an absent optional
    field). Every tree must have the structure of `params`; a mismatch raises a ValueError that
    names both structures. The leaves of the fields in `param_shaped` (default: every field)
    must have their parameter's shape, dtype and device: a state from other params (a layer
    widened, params cast) would otherwise reach the fused kernels, which do not check.
    `packed`: when the gradients lie in few buffers (`fscale.optim.packing.gradient_runs`), the
    writable leaves are made one span per gradient run even when donated (see `writable`), so
    that update math can run on whole buffers; with gradients in separate tensors that copy
    would buy nothing.
    """
    if params is None:
        raise ValueError(
            f"{name}: `params` is required (the update is computed from the current values)"
        )
    param_leaves, treedef = tree.flatten(params)
    grad_leaves = _leaves_like(name, "grads", grads, treedef)
    expected = signatures(param_leaves)
    _check_like_params(
        name,
        "grads",
        grad_leaves,
        param_leaves,
        params,
        expected,
        "each gradient must match its parameter",
    )
    grad_leaves = contiguous(grad_leaves)
    runs = gradient_runs(grad_leaves) if packed else None
    state_leaves: dict[str, list[torch.Tensor] | None] = {}
    for field, state_tree in states.items():
        if state_tree is None:
            state_leaves[field] = None
            continue
        leaves = _leaves_like(name, f"state.{field}", state_tree, treedef)
        if param_shaped is None or field in param_shaped:
            _check_like_params(name, f"state.{field}", leaves, param_leaves, params, expected)
        state_leaves[field] = writable(leaves, donate, runs=runs)
    if copy_params:
        param_leaves = writable(param_leaves, donate, runs=runs)
    return StepInputs(treedef, grad_leaves, param_leaves, state_leaves)


def required_state(name: str, inputs: StepInputs, field: str) -> list[torch.Tensor]:
    """The leaves of state field `field`; a TypeError if the state left it out (None)."""
    leaves = inputs.states[field]
    if leaves is None:
        raise TypeError(
            f"{name}: the state's `{field}` is None, but this configuration updates it; pass "
            f"the state that {name}'s init returned"
        )
    return leaves


def _leaves_like(
    name: str, what: str, value: PyTree, treedef: optree.PyTreeSpec
) -> list[torch.Tensor]:
    leaves, value_def = tree.flatten(value)
    if not tree.same_structure(value_def, treedef):
        raise ValueError(
            f"{name}: `{what}` has structure {value_def} but `params` has structure {treedef}; "
            "pass trees of the same structure (the state must come from init on these params)"
        )
    return leaves


def derive_update(
    apply: Callable[..., tuple[PyTree, Any]],
) -> Callable[..., tuple[PyTree, Any]]:
    """An optax-style `update` from an `apply` that produces new params directly."""

    def update(
        grads: PyTree, state: Any, params: PyTree = None, *, sharding: Any = None
    ) -> tuple[PyTree, Any]:
        new_params, new_state = apply(grads, state, params, sharding=sharding, donate=False)
        with torch.no_grad():
            return tree.map(torch.sub, new_params, params), new_state

    return update


def sum_of_squares(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``sum(t**2)`` as a 0-d tensor on `device`, in float32 or wider.

    Low-precision leaves are upcast so that norms do not overflow or lose bits; float64 leaves
    stay float64 (a float32 sum would round a float64 run's norms).
    """
    flat = t.reshape(-1).to(torch.promote_types(t.dtype, torch.float32))
    return torch.dot(flat, flat).to(device)


def bias_correction(beta: float, step: int) -> float:
    """``1 - beta**step`` in Python floats, as torch.optim's single-tensor paths compute it."""
    return 1 - beta ** float(step)


def picker(indices: list[int], total: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """Select `indices` from a list; the identity when they are all of it."""
    if len(indices) == total:
        return lambda leaves: leaves
    return lambda leaves: [leaves[i] for i in indices]


def unflattener(treedef: optree.PyTreeSpec) -> Callable[[list[Any] | None], PyTree]:
    """Rebuild trees of structure `treedef` from leaf lists (None for an absent state field)."""
    return lambda leaves: None if leaves is None else tree.unflatten(treedef, leaves)


def regularized_grads(
    grads: list[torch.Tensor], params: list[torch.Tensor], *, maximize: bool, weight_decay: float
) -> TensorList:
    """The gradients negated for `maximize` and with the L2 term ``weight_decay * param`` added.

    The first operations of torch.optim's single-tensor paths, as new tensors (`grads` are the
    caller's and stay untouched); `grads` itself when neither applies.
    """
    regularized: TensorList = grads
    if maximize:
        regularized = torch._foreach_neg(regularized)
    if weight_decay != 0:
        regularized = torch._foreach_add(regularized, params, alpha=weight_decay)
    return regularized


# ----------------------------------------------------------------------------- pointwise optimizers


class Group(NamedTuple):
    """The leaves of one (device, dtype) group at one step, as an optimizer's update math sees them.

    Attributes:
        params: the writable params, updated in place.
        grads: the gradients, read only.
        buffers: the writable state buffers by field name, updated in place; only the fields
            that the optimizer's configuration uses.
        step: the number of this update, counting from 1 (torch's ``step`` after its increment).
        lr: the learning rate of this update.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    buffers: dict[str, list[torch.Tensor]]
    step: int
    lr: float


def fused_steps(group: Group) -> list[torch.Tensor]:
    """The ``state_steps`` argument of torch's fused kernels: the step as float32, per param.

    torch keeps a float32 step per tensor and increments it before the kernel; the kernels only
    read it, so one tensor on the group's device, shared by every param, is equivalent.
    """
    step = torch.full((), group.step, dtype=torch.float32, device=group.params[0].device)
    return [step] * len(group.params)


@outside_graph
@torch.no_grad()
def update_groups(
    name: str,
    update_group: Callable[[Group], None],
    inputs: StepInputs,
    buffers: Sequence[str],
    count: torch.Tensor,
    lr: Callable[[int], float],
) -> torch.Tensor:
    """`update_group` on each (device, dtype) group of `inputs`, outside any torch.compile graph,
    as update number ``count + 1`` at learning rate ``lr(count)``; returns the next count.

    Functionalization rejects torch's in-place fused kernels when an optional state list is
    empty (``_fused_adamw_`` without amsgrad: "mutating a non-functional tensor with a
    functional tensor"), so the kernels run eagerly, bit for bit as in an eager step. The loop
    is inside: a graph break inside a loop would make Dynamo run the whole caller eagerly. The
    step counter's value is read here too, outside the graph, where reading it costs no break.
    """
    done = int(count)
    step, rate = done + 1, lr(done)
    for indices in device_groups(inputs.params):
        pick = picker(indices, len(inputs.params))
        group_buffers = {field: pick(required_state(name, inputs, field)) for field in buffers}
        update_group(Group(pick(inputs.params), pick(inputs.grads), group_buffers, step, rate))
    return next_count(done)


def pointwise_optimizer(
    name: str,
    state_type: type,
    buffers: Sequence[str],
    update_group: Callable[[Group], None],
    *,
    lr: Callable[[int], float],
    fill: float = 0.0,
    packed: bool = False,
) -> Optimizer:
    """A pointwise `Optimizer` whose step runs `update_group` on each (device, dtype) group.

    The state is ``state_type(count=..., **fields)``: a host step counter and one per-leaf tree
    per field. The fields named in `buffers` start as `fill`, packed in one buffer per device and
    dtype; the other fields of `state_type` are None (a buffer this configuration does not use).
    `apply` checks and flattens its inputs, makes params and buffers writable (or takes them
    when donated), calls `update_group` without autograd, and rebuilds the trees.

    Args:
        name: the optimizer's name, for error messages.
        state_type: its state NamedTuple; ``count`` must be its first field.
        buffers: the fields of `state_type` that hold per-parameter buffers in this configuration.
        update_group: the update math, run once per (device, dtype) group (fused kernels take one
            device and dtype per call); it updates ``group.params`` and ``group.buffers`` in place.
        lr: the checked learning-rate schedule (see `learning_rate`), read at ``count``.
        fill: the initial value of every buffer.
        packed: keep params and buffers in one buffer per device and dtype also when donated
            (for update math that runs on whole buffers, `fscale.optim.flat_group`).

    Returns:
        The `Optimizer`, with `update` derived from the exact `apply`.
    """
    fields = state_type._fields[1:]
    absent = {field: None for field in fields if field not in buffers}

    def init(params: PyTree, *, sharding: Sharding | None = None) -> Any:
        leaves, treedef = float_leaves(name, params)
        filled = {field: tree.unflatten(treedef, packed_full(leaves, fill)) for field in buffers}
        return state_type(count=new_count(), **filled, **absent)

    # Outside any torch.compile graph as a whole, like `update_groups`: Dynamo rebuilds the
    # trees' specs held across that call's break wrongly (torch 2.13: "length mismatch" when
    # unflattening the new state under data_parallel).
    @outside_graph
    def apply(
        grads: PyTree,
        state: Any,
        params: PyTree,
        *,
        sharding: Sharding | None = None,
        donate: bool = False,
    ) -> tuple[PyTree, Any]:
        check_state_type(name, state, state_type)
        count = check_count(name, state.count)
        inputs = step_inputs(
            name,
            grads,
            params,
            {field: getattr(state, field) if field in buffers else None for field in fields},
            donate=donate,
            packed=packed,
        )
        following = update_groups(name, update_group, inputs, buffers, count, lr)
        unflatten = unflattener(inputs.treedef)
        new_buffers = {field: unflatten(leaves) for field, leaves in inputs.states.items()}
        new_state = state_type(count=following, **new_buffers)
        return unflatten(inputs.params), new_state

    return Optimizer(init=init, update=derive_update(apply), apply=apply, pointwise=True)
