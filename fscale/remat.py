"""Rematerialisation: trade compute for activation memory, under every grad path.

`checkpoint(fn)` returns a function with fn's signature whose forward keeps nothing for backward
but fn's inputs, and whose backward runs fn again to rebuild what the gradient needs. Applied
per block of a deep network, the activations kept between forward and backward shrink from
"everything every layer saved" to "one input per block".

Why an own `autograd.Function` and not `torch.utils.checkpoint`: both torch's checkpoint and
saved-tensor hooks raise inside `torch.func` grad transforms. A new-style Function with
`setup_context` works under `torch.autograd.grad`, `torch.func.grad`, `torch.func.vjp`, nested
checkpoints and higher-order gradients. Its backward has two branches:

* grad mode off (first-order `autograd.grad`, a `vjp_fn` called without a graph): detach the
  saved inputs, run fn again under `enable_grad` and call `torch.autograd.grad` on that graph;
* grad mode on (`torch.func.grad`, `create_graph=True`): take `torch.func.grad` of
  ``<fn(inputs), grad_outputs>`` with respect to the saved inputs *as tracked by the outer
  transform*, so the gradient it returns is itself differentiable (grad of grad is exact).

The state that makes the recompute replay the forward exactly travels in a plain Python object
handed to `Function.apply` as a non-tensor argument (a tensor argument would be wrapped by
functorch): the RNG state of the CPU and of every CUDA device involved (dropout masks are
identical), the autocast state, and snapshots of module buffers the forward mutated in place.

Policies choose what else to keep. `save_names("attn_out")` keeps the values that fn marks with
`name(value, "attn_out")`: the operation that produced the marked value is not run again in
backward, its kept outputs are returned in its place (a `TorchDispatchMode` replays the
forward's operations by (operation, occurrence) below autograd, so the recomputed graph is the
forward's graph and gradients are exact). `save_matmuls()` keeps every matrix product.

`offload=True` parks what is kept in host memory: on CUDA a pinned buffer filled by an
asynchronous copy on a side stream, waited for on the compute stream just before the backward
uses it. On CPU the host is the device, so nothing moves (the bytes are still counted as
offloaded by `track`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fscale import slots as slots_lib
from fscale import tree

__all__ = [
    "RematStats",
    "SavePolicy",
    "checkpoint",
    "name",
    "save_matmuls",
    "save_names",
    "track",
]

F = TypeVar("F", bound=Callable[..., Any])

# ---------------------------------------------------------------------------------------------
# Accounting


@dataclasses.dataclass
class RematStats:
    """What checkpointed calls kept for backward while a `track()` context was open.

    Attributes:
        calls: checkpointed calls that kept state for backward (calls under `no_grad` or with
            no input requiring grad just run fn and are not counted).
        saved_bytes: bytes kept for backward: argument tensors, kept named values and
            snapshots of mutated buffers, each storage counted once per call. A checkpointed
            module's own parameters and unmodified buffers are not counted: the model holds
            them anyway.
        offloaded_bytes: the part of `saved_bytes` that `offload=True` parks in host memory
            (on CPU the host is the device, so this is every byte an offloading checkpoint
            keeps).
        recomputations: backward passes that ran fn again.
    """

    calls: int = 0
    saved_bytes: int = 0
    offloaded_bytes: int = 0
    recomputations: int = 0


_TRACKERS: list[RematStats] = []


@contextlib.contextmanager
def track() -> Iterator[RematStats]:
    """Count the bytes checkpoints keep and the recomputations they run inside the block.

    Yields:
        A `RematStats` filled in as checkpointed functions run; nested `track()` blocks each
        see every event.
    """
    stats = RematStats()
    _TRACKERS.append(stats)
    try:
        yield stats
    finally:
        _TRACKERS.remove(stats)


def _count(**increments: int) -> None:
    for stats in _TRACKERS:
        for field, amount in increments.items():
            setattr(stats, field, getattr(stats, field) + amount)


# ---------------------------------------------------------------------------------------------
# Policies and names


@dataclasses.dataclass(frozen=True)
class SavePolicy:
    """Which intermediate values a checkpoint keeps from forward instead of recomputing.

    Build one with `save_names` or `save_matmuls`; combine with ``|``.

    Attributes:
        names: values marked inside fn with `name(value, n)` for `n` in `names`.
        ops: ATen operator names (``"mm"``, ``"addmm"``...) whose outputs are all kept.
    """

    names: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()

    def __or__(self, other: SavePolicy) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return SavePolicy(self.names | other.names, self.ops | other.ops)


def save_names(*names: str) -> SavePolicy:
    """A policy that keeps the values fn marks with `name(value, n)` for each `n` in `names`.

    The operation that produced a marked value is not run again in backward; its outputs are
    kept from forward (all of them: an attention kernel's log-sum-exp is kept with its output,
    because its backward needs both). Mark the direct result of the expensive operation, e.g.
    ``name(F.scaled_dot_product_attention(q, k, v), "attn")``: marking a reshape of it keeps the
    reshape's result and still recomputes the attention.

    Cost: while a checkpointed call with names runs forward, every intermediate of that call is
    held until it returns (one block's activations, as without checkpointing), because a value
    can be marked after the operation that made it and before its siblings are freed.

    Args:
        *names: the names to keep; at least one.

    Returns:
        A `SavePolicy`.

    Raises:
        ValueError: if no name is given.
        TypeError: if a name is not a string.
    """
    if not names:
        raise ValueError("save_names: give at least one name, e.g. save_names('attn_out')")
    for value in names:
        if not isinstance(value, str):
            raise TypeError(f"save_names: names must be strings, got {value!r}")
    return SavePolicy(names=frozenset(names))


_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def save_matmuls() -> SavePolicy:
    """A policy that keeps the output of every matrix product (``mm``, ``addmm``, ``bmm``...).

    The backward then recomputes only the cheap element-wise work between products (norms,
    activations, softmax), at the memory cost of one output per product.

    Returns:
        A `SavePolicy`.
    """
    return SavePolicy(ops=_MATMUL_OPS)


class _NameStack(threading.local):
    def __init__(self) -> None:
        self.recorders: list[_RecordOps] = []


_ACTIVE = _NameStack()


def name(value: torch.Tensor, label: str) -> torch.Tensor:
    """Mark `value` as the intermediate called `label` for a checkpoint's `save_names` policy.

    An identity: it returns `value` itself. Outside a checkpoint whose policy lists `label`
    (or under `no_grad`, where checkpoints just run) it does nothing else.

    Args:
        value: a tensor computed inside the checkpointed function.
        label: the name a `save_names` policy refers to.

    Returns:
        `value`.

    Raises:
        TypeError: if `value` is not a tensor or `label` is not a string.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"name: `value` must be a tensor, got {type(value).__name__}")
    if not isinstance(label, str):
        raise TypeError(f"name: `label` must be a string, got {label!r}")
    if _ACTIVE.recorders:
        _ACTIVE.recorders[-1].mark(value, label)
    return value


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensor_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in tree.leaves(x) if isinstance(v, torch.Tensor)]


class _RecordOps(TorchDispatchMode):
    """Forward side of a policy: keep the outputs of the operations the policy selects.

    Operations are keyed by (operator, how many times it ran before in this call), the same in
    forward and in the recompute. To map a named value back to the operation that allocated its
    storage, every output is held until the call ends when the policy has names.
    """

    def __init__(self, policy: SavePolicy) -> None:
        super().__init__()
        self.policy = policy
        self.occurrences: dict[Any, int] = {}
        self.kept: dict[tuple[Any, int], Any] = {}
        self.held: dict[tuple[Any, int], Any] = {}
        self.versions: dict[tuple[Any, int], list[int]] = {}
        self.arg_shapes: dict[tuple[Any, int], list[tuple[int, ...]]] = {}
        self.producer: dict[int, tuple[Any, int]] = {}
        self.seen_names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op_key = (func, self.occurrences.get(func, 0))
        self.occurrences[func] = op_key[1] + 1
        outputs = _tensor_leaves(out)
        if not outputs:
            return out
        if func.overloadpacket.__name__ in self.policy.ops:
            self._hold(op_key, func, args, kwargs, out, outputs)
            self.kept[op_key] = out
        elif self.policy.names:
            # Only fresh allocations name an operation: a view or in-place op shares its
            # input's storage, and the allocating op is the one worth not running again.
            input_storages = {_storage_key(t) for t in _tensor_leaves((args, kwargs))}
            fresh = [t for t in outputs if _storage_key(t) not in input_storages]
            if fresh:
                self._hold(op_key, func, args, kwargs, out, outputs)
                for t in fresh:
                    if t.numel():
                        self.producer[_storage_key(t)] = op_key
        return out

    def _hold(self, op_key, func, args, kwargs, out, outputs) -> None:  # type: ignore[no-untyped-def]
        self.held[op_key] = out
        self.versions[op_key] = [t._version for t in outputs]
        self.arg_shapes[op_key] = [tuple(t.shape) for t in _tensor_leaves((args, kwargs))]

    def mark(self, value: torch.Tensor, label: str) -> None:
        self.seen_names.add(label)
        if label not in self.policy.names or not value.numel():
            return
        op_key = self.producer.get(_storage_key(value))
        if op_key is not None:  # None: an input of fn, which is kept anyway
            self.kept[op_key] = self.held[op_key]

    def finish(self) -> dict[tuple[Any, int], tuple[Any, list[tuple[int, ...]]]]:
        """The kept outputs, without those fn modified in place after making them."""
        missing = self.policy.names - self.seen_names
        if missing:
            raise ValueError(
                f"checkpoint: policy names {sorted(missing)} were never marked with "
                f"fscale.remat.name(...) during the forward of the checkpointed function; names "
                f"marked were {sorted(self.seen_names)}. Fix the spelling in save_names(...) or "
                "mark the value inside the checkpointed function."
            )
        # A kept output modified in place after its op ran holds the modified value; replaying it
        # would apply the modification twice, so such ops are recomputed instead.
        return {
            op_key: (out, self.arg_shapes[op_key])
            for op_key, out in self.kept.items()
            if [t._version for t in _tensor_leaves(out)] == self.versions[op_key]
        }


class _ReplayOps(TorchDispatchMode):
    """Backward side of a policy: return the kept outputs instead of running their operations."""

    def __init__(self, kept: dict[tuple[Any, int], tuple[Any, list[tuple[int, ...]]]]) -> None:
        super().__init__()
        self.kept = kept
        self.occurrences: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        op_key = (func, self.occurrences.get(func, 0))
        self.occurrences[func] = op_key[1] + 1
        entry = self.kept.get(op_key)
        if entry is None:
            return func(*args, **kwargs)
        out, arg_shapes = entry
        if [tuple(t.shape) for t in _tensor_leaves((args, kwargs))] != arg_shapes:
            raise RuntimeError(
                f"checkpoint: the recompute of the checkpointed function diverged from its "
                f"forward at {func} (call {op_key[1]}): different argument shapes. The function "
                "must run the same operations when called again with the same inputs."
            )
        return out


# ---------------------------------------------------------------------------------------------
# Offload


@dataclasses.dataclass
class _Parked:
    """A device tensor's value parked in host memory until backward."""

    host: torch.Tensor
    device: torch.device
    ready: Any  # a CUDA event recorded after the device-to-host copy, or None

    def restore(self) -> torch.Tensor:
        if self.ready is not None:
            # The compute stream waits for the side-stream copy; the host stays untouched.
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            return self.host.to(self.device, non_blocking=True)
        return self.host.to(self.device)


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _park(t: torch.Tensor) -> _Parked:
    """Start copying `t` (a non-CPU tensor) to host memory."""
    if t.device.type != "cuda":
        return _Parked(t.to("cpu", copy=True), t.device, None)
    stream = _SIDE_STREAMS.get(t.device)
    if stream is None:
        stream = _SIDE_STREAMS.setdefault(t.device, torch.cuda.Stream(t.device))
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t's producer has finished
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    # The allocator must not hand t's memory out again before the side stream has read it.
    t.record_stream(stream)
    return _Parked(host, t.device, stream.record_event())


def _in_host_memory(t: torch.Tensor) -> bool:
    # A CPU tensor already lives in host memory: offloading it is a no-op.
    return t.device.type == "cpu"


def _park_unless_on_host(t: torch.Tensor) -> torch.Tensor | _Parked:
    return t if _in_host_memory(t) else _park(t)


def _unpark(value: torch.Tensor | _Parked) -> torch.Tensor:
    return value.restore() if isinstance(value, _Parked) else value


def _map_tensors(fn: Callable[[Any], Any], values: Any) -> Any:
    """Apply `fn` to the tensor (or parked) leaves of an operator's outputs."""
    return tree.map(lambda v: fn(v) if isinstance(v, (torch.Tensor, _Parked)) else v, values)


# ---------------------------------------------------------------------------------------------
# Replay context: RNG and autocast


def _cuda_devices(tensors: list[torch.Tensor]) -> list[torch.device]:
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)


@dataclasses.dataclass
class _ExecutionState:
    """What makes the recompute draw the same random numbers and use the same precision."""

    cpu_rng: torch.Tensor
    cuda_rng: dict[torch.device, torch.Tensor]
    autocast: dict[str, tuple[bool, torch.dtype]]

    @classmethod
    def capture(cls, tensors: list[torch.Tensor]) -> _ExecutionState:
        devices = _cuda_devices(tensors)
        device_types = ["cpu"] + (["cuda"] if devices else [])
        return cls(
            cpu_rng=torch.get_rng_state(),
            cuda_rng={d: torch.cuda.get_rng_state(d) for d in devices},
            autocast={
                t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in device_types
            },
        )

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        # fork_rng puts the ambient generators back afterwards: backward must not move them.
        with torch.random.fork_rng(devices=list(self.cuda_rng)), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng.items():
                torch.cuda.set_rng_state(state, device)
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


# ---------------------------------------------------------------------------------------------
# The checkpointed call


@dataclasses.dataclass(frozen=True)
class _Options:
    offload: bool
    policy: SavePolicy | None


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
        # Tensor inputs [0, module_state) are a module's parameters and buffers.
        self._module_state = module_state
        self._buffer_indexes = buffer_indexes
        self.options = options
        # Per tensor input: None when saved through ctx.save_for_backward, else the value
        # (a parked host copy or a buffer snapshot) kept here.
        self.kept: list[Any] = []
        self.mutated: frozenset[int] = frozenset()
        self.replay: dict[tuple[Any, int], tuple[Any, list[tuple[int, ...]]]] = {}
        self.execution: _ExecutionState | None = None
        self.out_treedef: Any = None
        self.out_leaves: list[Any] = []
        self.out_positions: list[int] = []
        self.out_differentiable: list[bool] = []

    def run(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self._leaves)
        for position, value in zip(self._tensor_positions, tensors):
            leaves[position] = value
        return self._run(tree.unflatten(self._treedef, leaves))

    # forward ---------------------------------------------------------------------------

    def forward(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.execution = _ExecutionState.capture(list(tensors))
        self.kept = [None] * len(tensors)
        offload = self.options.offload
        for i, t in enumerate(tensors):
            # Parked before fn runs, so the copy overlaps fn's compute.
            if offload and i >= self._module_state and not _in_host_memory(t):
                self.kept[i] = _park(t)
        before = {i: tensors[i].clone() for i in self._buffer_indexes}

        policy = self.options.policy
        if policy is None:
            out = self.run(tensors)
        else:
            recorder = _RecordOps(policy)
            _ACTIVE.recorders.append(recorder)
            try:
                with recorder:
                    out = self.run(tensors)
            finally:
                _ACTIVE.recorders.pop()
            self.replay = recorder.finish()

        # A buffer fn updated in place (BatchNorm's running stats) is kept as it was before the
        # update, so the recompute sees the forward's value and updates only a throwaway copy.
        # Values are compared because native kernels update running stats without bumping the
        # version counter.
        self.mutated = frozenset(
            i for i, snapshot in before.items() if not torch.equal(snapshot, tensors[i])
        )
        for i in self.mutated:
            snapshot = before[i]
            self.kept[i] = _park_unless_on_host(snapshot) if offload else snapshot
        self._count_saved(tensors)
        if offload:
            self.replay = {
                op_key: (_map_tensors(_park_unless_on_host, out), arg_shapes)
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
        return out_tensors

    def _count_saved(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if self.options.offload:
            offload_set = set(range(self._module_state, len(tensors))) | set(self.mutated)
        else:
            offload_set = set()
        counted: set[int] = set()
        saved = offloaded = 0

        def add(t: torch.Tensor, parked: bool) -> None:
            nonlocal saved, offloaded
            if isinstance(t, _Parked):
                nbytes = t.host.untyped_storage().nbytes()
            else:
                key = _storage_key(t)
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
            for t in _tensor_leaves(out):
                add(t, self.options.offload)
        _count(calls=1, saved_bytes=saved, offloaded_bytes=offloaded)

    # backward --------------------------------------------------------------------------

    @property
    def parked_inputs(self) -> bool:
        return any(isinstance(kept, _Parked) for kept in self.kept)

    def restore_inputs(self, saved: tuple[Any, ...]) -> list[torch.Tensor]:
        return [from_ctx if kept is None else _unpark(kept) for from_ctx, kept in zip(saved, self.kept)]

    @contextlib.contextmanager
    def replaying(self, use_kept_values: bool) -> Iterator[None]:
        assert self.execution is not None  # set by forward, which always runs first
        with self.execution.restored(), contextlib.ExitStack() as stack:
            if self.replay and use_kept_values:
                kept = {
                    op_key: (_map_tensors(_unpark, out), arg_shapes)
                    for op_key, (out, arg_shapes) in self.replay.items()
                }
                stack.enter_context(_ReplayOps(kept))
            yield

    def rerun(self, values: list[torch.Tensor], use_kept_values: bool = True) -> list[torch.Tensor]:
        """Run fn again on `values` as the forward ran it; returns its tensor outputs.

        With `use_kept_values`, the operations whose outputs the policy kept are not run.
        """
        # The recompute mutates copies of the buffers forward mutated, never the kept snapshot
        # (a second backward with retain_graph needs it again).
        values = [v.clone() if i in self.mutated else v for i, v in enumerate(values)]
        with self.replaying(use_kept_values):
            out = self.run(values)
        _count(recomputations=1)
        out_leaves = tree.leaves(out)
        return [v for v in out_leaves if isinstance(v, torch.Tensor)]

    def rebuild_output(self, out_tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for position, value in zip(self.out_positions, out_tensors):
            leaves[position] = value
        return tree.unflatten(self.out_treedef, leaves)


def _first_order_grads(call, values, needs, pairs):  # type: ignore[no-untyped-def]
    """Classic recompute: rebuild fn's graph on detached inputs and differentiate it once."""
    leaves = [v.detach().requires_grad_(need) for v, need in zip(values, needs)]
    with torch.enable_grad():
        outs = call.rerun(leaves)
    roots = [(outs[j], g) for j, g in pairs if outs[j].requires_grad]
    wrt = [leaf for leaf, need in zip(leaves, needs) if need]
    if not roots:
        return [None] * len(values)
    grads = iter(
        torch.autograd.grad(
            [o for o, _ in roots], wrt, [g for _, g in roots], allow_unused=True
        )
    )
    return [next(grads) if need else None for need in needs]


def _higher_order_grads(call, values, needs, pairs):  # type: ignore[no-untyped-def]
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

    grads = iter(torch.func.grad(contraction, argnums=tuple(range(len(wrt))))(
        *[values[i] for i in wrt]
    ))
    return [next(grads) if need else None for need in needs]


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
            grads = _higher_order_grads(call, values, needs, pairs)
        else:
            grads = _first_order_grads(call, values, needs, pairs)
        return (None, *grads)


def _checkpointed_call(
    run: Callable[[Any], Any],
    inputs: Any,
    options: _Options,
    module_state: int = 0,
    buffer_indexes: frozenset[int] = frozenset(),
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


# ---------------------------------------------------------------------------------------------
# Modules


class _CheckpointedModule(nn.Module):
    """Mixin placed before a module's own class: its forward is checkpointed."""

    _checkpoint_options: _Options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        base_forward = super().forward
        if not torch.is_grad_enabled():
            return base_forward(*args, **kwargs)
        # Collected at call time: under functional_call these are the swapped-in tensors, which
        # must enter the Function as inputs for their gradients to flow.
        state, slots, num_parameters = slots_lib.state_slots(self)
        # The recompute runs in backward, after the caller (e.g. functionalize's apply with an
        # explicit train flag) may have put the modules back in another mode: replay the mode
        # of this forward, or dropout and BatchNorm would compute another function.
        modes = [(m, m.training) for m in self.modules()]

        def run(inputs: Any) -> Any:
            state_values, call_args, call_kwargs = inputs
            with slots_lib.holding(slots, state_values), slots_lib.training_modes(modes):
                return base_forward(*call_args, **call_kwargs)

        return _checkpointed_call(
            run,
            (state, args, kwargs),
            self._checkpoint_options,
            module_state=len(state),
            buffer_indexes=frozenset(range(num_parameters, len(state))),
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The class is made at run time, so pickle (and deepcopy) rebuild it from the base class.
        base = type(self).__mro__[2]
        return (_new_checkpointed, (base,), self.__getstate__())


@functools.cache
def _checkpointed_class(base: type[nn.Module]) -> type[nn.Module]:
    return type(f"Checkpointed{base.__name__}", (_CheckpointedModule, base), {"__module__": base.__module__})


def _new_checkpointed(base: type[nn.Module]) -> nn.Module:
    cls = _checkpointed_class(base)
    return cls.__new__(cls)


def _checkpoint_module(module: nn.Module, options: _Options) -> nn.Module:
    if isinstance(module, _CheckpointedModule):
        raise ValueError(
            f"checkpoint: {type(module).__name__} is already checkpointed; pass the original "
            "module to checkpoint it with other options"
        )
    wrapped = _new_checkpointed(type(module))
    # A shallow copy: same parameters, buffers and children (so the model's weights are shared
    # and names are unchanged), but its own registries, so the original module is not altered.
    wrapped.__dict__.update(
        {k: v.copy() if isinstance(v, (dict, set)) else v for k, v in module.__dict__.items()}
    )
    object.__setattr__(wrapped, "_checkpoint_options", options)
    return wrapped


# ---------------------------------------------------------------------------------------------
# Public entry point


def checkpoint(
    fn: F | nn.Module | None = None, *, offload: bool = False, policy: SavePolicy | None = None
) -> Any:
    """Rematerialise `fn`: keep only its inputs for backward and run it again there.

    Usable as ``checkpoint(fn)``, ``@checkpoint`` or ``@checkpoint(offload=True)``. Gradients
    equal those of `fn` (bit-exact on the first-order paths) under `torch.autograd.grad`,
    `torch.func.grad`, `torch.func.vjp`, nested checkpoints and higher-order gradients.
    Randomness replays exactly (the CPU RNG and that of every CUDA device among the inputs are
    restored for the recompute, so dropout draws the same masks; a key-seeded
    `fscale.functionalize` apply works unchanged). Under `torch.no_grad`, or when no input
    requires grad, fn just runs.

    Inputs and outputs may be nested pytrees and keyword arguments; tensor leaves are
    differentiable, other leaves are passed (and returned) as they are. Tensors hidden inside
    non-pytree objects, or captured by closure, are constants to the checkpoint: pass them as
    arguments to differentiate them.

    Given an `nn.Module`, returns a copy of it sharing its parameters, buffers and children,
    with the same parameter names and class (a subclass named ``Checkpointed<Class>``), whose
    forward is checkpointed; the original is not modified. Use it before `functionalize`
    (``model.blocks[i] = checkpoint(block)``). Its parameters and buffers are read at call
    time, so under `functional_call` the swapped-in tensors get gradients. A buffer the
    forward updates in place (BatchNorm's running statistics) is updated once: the recompute
    sees its pre-update value and updates a throwaway copy. Forward hooks of the module run
    once, in forward.

    Args:
        fn: the function or module; omit it to get a decorator.
        offload: park what is kept for backward in host memory. On CUDA: pinned buffers
            filled by an asynchronous copy on a side stream, waited for before use. On CPU
            nothing moves (host and device are one memory). A module's own parameters and
            buffers are not offloaded (the model holds them anyway). On CUDA, gradients do not
            flow to second order through offloaded inputs; use ``offload=False`` for
            higher-order gradients.
        policy: what to keep besides the inputs: None (nothing), `save_names(...)` or
            `save_matmuls()`. Kept values are not recomputed in backward.

    Returns:
        A function with `fn`'s signature (`functools.wraps`), a checkpointed module, or a
        decorator when `fn` is omitted.

    Raises:
        TypeError: if `fn` is not callable, `offload` is not a bool or `policy` is not a
            `SavePolicy`.
        ValueError: at the forward of the first call that records gradients, if a policy name
            was never marked with `name` inside fn (the message lists the names that were).

    Example:
        >>> import torch
        >>> from fscale.remat import checkpoint
        >>> layer = checkpoint(torch.nn.Linear(4, 4))
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> layer.weight.grad.shape
        torch.Size([4, 4])
    """
    if not isinstance(offload, bool):
        raise TypeError(f"checkpoint: `offload` must be True or False, got {offload!r}")
    if policy is not None and not isinstance(policy, SavePolicy):
        raise TypeError(
            "checkpoint: `policy` must be None or a SavePolicy from fscale.remat.save_names(...)"
            f" or fscale.remat.save_matmuls(), got {type(policy).__name__}"
        )
    options = _Options(offload=offload, policy=policy)
    if fn is None:
        return functools.partial(checkpoint, offload=offload, policy=policy)
    if isinstance(fn, nn.Module):
        return _checkpoint_module(fn, options)
    if not callable(fn):
        raise TypeError(
            f"checkpoint: `fn` must be a callable or an nn.Module, got {type(fn).__name__}"
        )

    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return _checkpointed_call(lambda inputs: fn(*inputs[0], **inputs[1]), (args, kwargs), options)

    return checkpointed
