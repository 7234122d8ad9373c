"""Host offload: optimizer state and master params (ZeRO-Offload), stage params (OffloadModel).

Two transformations move the bulk of a model's memory from the accelerator to host memory and
bring it back only when needed:

- `offload_optimizer(optimizer)` (ZeRO-Offload, Ren et al., 2021) keeps the wrapped optimizer's
  state *and a master copy of the parameters* on the host and runs the update there. Per step,
  the gradients go down (device -> host) and the new parameters come up (host -> device); the
  optimizer state never crosses the bus.
- `offload_params(stages, device)` (FairScale's OffloadModel, after L2L) keeps the parameters of
  a sequence of stages on the host and copies each stage's parameters to the device just before
  it runs, freeing them right after. Every stage is rematerialised: backward copies the stage's
  parameters up again, recomputes its forward from the saved input and sends the parameter
  gradients down to the host.

On CUDA the copies run on side streams (one per direction) from page-locked ("pinned") host
memory, ordered against the compute stream by events, so an upload overlaps the computation
before it. Elsewhere, including a host that is its own device ("cpu" -> "cpu"), the same logic
runs with synchronous copies, so results are identical and the schedule is testable on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fscale import optim as optim_lib
from fscale import tree
from fscale.tree import FlatBuffer

__all__ = [
    "OffloadState",
    "OffloadedStages",
    "ResidencyEvent",
    "offload_optimizer",
    "offload_params",
]

PyTree = Any

# Host memory is where offloaded tensors live; this is the one place "cpu" is meant literally.
_HOST = torch.device("cpu")


# ----------------------------------------------------------------------------- devices, copies


def _checked_device(name: str, arg: str, device: Any) -> torch.device:
    """`device` as a torch.device that can hold tensors here, else a ValueError naming `arg`."""
    if isinstance(device, torch.device):
        resolved = device
    elif isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError as error:
            raise ValueError(
                f"{name}: `{arg}`={device!r} is not a device torch knows "
                "(expected e.g. 'cpu', 'cuda', 'cuda:1')"
            ) from error
    else:
        raise TypeError(
            f"{name}: `{arg}` must be a device string or torch.device, got {type(device).__name__}"
        )
    try:  # a probe allocation is the one check that covers every backend and index
        torch.empty(0, device=resolved)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(
            f"{name}: `{arg}`={str(resolved)!r} is not available on this machine ({error})"
        ) from error
    return resolved


def _pinned_packed_copy(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `leaves` in page-locked host memory, packed in one buffer per dtype.

    Packing keeps the leaves consecutive in one allocation, which is what the optimizers expect
    of their state (one copy per step instead of one per leaf).
    """
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in FlatBuffer.group_by_dtype(leaves).values():
        group = [leaves[i] for i in indices]
        total = sum(t.numel() for t in group)
        if not total:
            views = [t.to(_HOST, copy=True) for t in group]
        else:
            data = torch.empty(total, dtype=group[0].dtype, device=_HOST, pin_memory=True)
            torch.cat([t.reshape(-1).to(_HOST) for t in group], out=data)
            views = FlatBuffer(group, data=data).views()
        for i, view in zip(indices, views):
            out[i] = view
    return out  # type: ignore[return-value]


class _Transfer:
    """Copies between host memory and one accelerator, asynchronous where the backend allows.

    On CUDA, uploads run on their own stream and downloads on another, so both directions and
    the compute stream proceed together; an event orders every consumer after its copy. On any
    other device the copies are plain synchronous ``.to`` calls, with the same results.
    """

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self._streams: tuple[Any, Any] | None = None
        self._last_upload_into: Any = None

    @property
    def is_async(self) -> bool:
        return self.device.type == "cuda"

    def _upload_download_streams(self) -> tuple[Any, Any]:
        if self._streams is None:  # created lazily: building an offload needs no CUDA context
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def start_upload(self, host: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Begin copying `host` tensors to the device; returns ``(device_tensors, event)``.

        The device tensors must not be read before `finish_upload`.
        """
        if not self.is_async:
            return [t.detach().to(self.device) for t in host], None
        upload, _ = self._upload_download_streams()
        # Allocating inside the upload stream ties the memory to that stream, so a copy that is
        # dropped unused (and freed) can never be overwritten while the copy is still running.
        with torch.cuda.stream(upload):
            on_device = [t.detach().to(self.device, non_blocking=True) for t in host]
            event = torch.cuda.Event()
            event.record(upload)
        return on_device, event

    def finish_upload(self, on_device: list[torch.Tensor], event: Any) -> list[torch.Tensor]:
        """Make the compute stream wait for an upload; the tensors are then safe to use."""
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in on_device:
                # Freed later from the compute stream: the allocator must wait for its kernels.
                t.record_stream(compute)
        return on_device

    def upload_into(
        self, host: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Copy `host` tensors into `targets` (device tensors of the same shape and dtype).

        Returns the targets, usable on the compute stream as soon as this returns.
        """
        if not self.is_async:
            with torch.no_grad():
                for dst, src in zip(targets, host):
                    dst.copy_(src)
            return list(targets)
        upload, _ = self._upload_download_streams()
        compute = torch.cuda.current_stream(self.device)
        # The targets may still be read by queued kernels (donated params) or sit in memory the
        # compute stream just released: write only after everything queued so far.
        upload.wait_stream(compute)
        with torch.no_grad(), torch.cuda.stream(upload):
            for dst, src in zip(targets, host):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(upload)
        compute.wait_event(event)
        self._last_upload_into = event
        return list(targets)

    def wait_for_sources(self) -> None:
        """Block until the host sources of `upload_into` have been read (before mutating them)."""
        if self._last_upload_into is not None:
            self._last_upload_into.synchronize()
            self._last_upload_into = None

    def download(self, on_device: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `on_device`, complete when this returns (the host reads them next)."""
        if not self.is_async:
            return [t.detach().to(_HOST) for t in on_device]
        _, download = self._upload_download_streams()
        compute = torch.cuda.current_stream(self.device)
        download.wait_stream(compute)  # the tensors are produced by kernels queued on compute
        with torch.no_grad(), torch.cuda.stream(download):
            host = []
            for t in on_device:
                buffer = torch.empty(
                    t.shape, dtype=t.dtype, device=_HOST, pin_memory=self.pin_memory
                )
                buffer.copy_(t, non_blocking=True)
                t.record_stream(download)
                host.append(buffer)
            event = torch.cuda.Event()
            event.record(download)
        event.synchronize()
        return host


def _default_pin_memory(device: torch.device) -> bool:
    return device.type == "cpu" and torch.cuda.is_available()


def _checked_pin_memory(name: str, device: torch.device, pin_memory: bool | None) -> bool:
    if pin_memory is None:
        return _default_pin_memory(device)
    if not isinstance(pin_memory, bool):
        raise TypeError(f"{name}: `pin_memory` must be a bool or None, got {pin_memory!r}")
    if pin_memory and not (device.type == "cpu" and torch.cuda.is_available()):
        raise ValueError(
            f"{name}: `pin_memory`=True needs host memory (device 'cpu', got {str(device)!r}) "
            "and a CUDA device to copy to; pass pin_memory=None to decide automatically"
        )
    return pin_memory


# ----------------------------------------------------------------------------- optimizer offload


class OffloadState(NamedTuple):
    """State of `offload_optimizer`, all of it in host memory.

    Attributes:
        inner: the wrapped optimizer's state.
        master: the master copy of the parameters the update runs on, in the params' dtype
            promoted to at least float32 (bf16/fp16 params get fp32 masters, as ZeRO-Offload).
    """

    inner: Any
    master: PyTree


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def offload_optimizer(
    optimizer: optim_lib.Optimizer,
    device: str | torch.device = "cpu",
    *,
    pin_memory: bool | None = None,
) -> optim_lib.Optimizer:
    """Run `optimizer` in host memory: ZeRO-Offload's optimizer-state and master-param offload.

    What lives where:

    - host (`device`): the wrapped optimizer's state and a master copy of the parameters
      (`OffloadState`). Low-precision params (bf16, fp16) get float32 masters; float32 and
      float64 params get masters of their own dtype, so the update is the wrapped optimizer's
      exactly.
    - accelerator: the parameters the model computes with, and the gradients. They are a
      cache of the master: every `apply` overwrites them with the master's new values.

    Traffic per step (Ψ parameters): the gradients down (Ψ elements in the grads' dtype) and the
    new parameters up (Ψ elements in the params' dtype); the state (2Ψ fp32 for Adam) never
    moves. The price is that the update runs at host speed and the host holds the master and
    state; the gain is that the accelerator holds only params and grads.

    With CUDA params, the master and gradient staging buffers are pinned and the copies are
    asynchronous on side streams; the step waits for the gradients (the host reads them next)
    and the compute stream waits for the new params, so nothing reads a half-copied tensor.
    Results equal the wrapped optimizer run on the host; a CPU kernel may round differently from
    the accelerator's.

    The wrapper composes: `layout` passes through unchanged, so a sharded optimizer wrapper
    that offloads its shard keeps a host master of that shard only; ``chain`` and
    ``clip_by_global_norm`` go *inside* (``offload_optimizer(chain(clip, adamw))``), so the whole
    update runs on the host. The returned updates of `update` must be applied as given (by
    `fscale.optim.apply_updates`), because the master has already been moved by them.

    Args:
        optimizer: the `fscale.optim.Optimizer` to run on the host.
        device: where the state and master live; any device string torch accepts ("cpu" is
            host memory, the point of the transformation).
        pin_memory: page-lock the master and the gradient staging buffers so copies can run
            asynchronously. Default: True when `device` is "cpu" and CUDA is available.

    Returns:
        An `Optimizer` whose state is an `OffloadState`, with an `apply` that moves only the
        gradients down and the new parameters up (donated device params are overwritten in
        place; ``donate=False`` with pinned memory costs one extra host copy of the master).

    Raises:
        TypeError: if `optimizer` is not an `Optimizer`.
        ValueError: for an unknown or unavailable `device`, or `pin_memory` without CUDA.

    Example:
        >>> import torch, fscale as fs
        >>> opt = fs.offload_optimizer(fs.optim.adam(0.1))
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> params, state = fs.optim.step(opt, {"w": torch.ones(3)}, state, params)
        >>> params["w"], state.master["w"].device
        (tensor([0.9000, 0.9000, 0.9000]), device(type='cpu'))
    """
    name = "offload_optimizer"
    if not isinstance(optimizer, optim_lib.Optimizer):
        raise TypeError(
            f"{name}: `optimizer` must be an fscale.optim.Optimizer "
            f"(e.g. fscale.optim.adamw(1e-3)), got {type(optimizer).__name__}"
        )
    host = _checked_device(name, "device", device)
    pin = _checked_pin_memory(name, host, pin_memory)
    transfers: dict[torch.device, _Transfer] = {}

    def transfer_for(accelerator: torch.device) -> _Transfer:
        if accelerator not in transfers:
            transfers[accelerator] = _Transfer(accelerator, pin)
        return transfers[accelerator]

    def wait_for_uploads() -> None:
        # The previous step's new params were uploaded from the master; a donated step updates
        # the master in place, so it must not start before those copies have read it.
        for transfer in transfers.values():
            transfer.wait_for_sources()

    def to_host(
        values: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
    ) -> list[torch.Tensor]:
        """`values` on the host in `dtypes`, grouped by source device for batched copies."""
        out: list[torch.Tensor | None] = [None] * len(values)
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(values):
            by_device.setdefault(t.device, []).append(i)
        for source, indices in by_device.items():
            group = [values[i] for i in indices]
            if source == host:
                moved = [t.detach() for t in group]
            elif source.type == "cuda" and host == _HOST:
                moved = transfer_for(source).download(group)
            else:
                moved = [t.detach().to(host) for t in group]
            for i, t in zip(indices, moved):
                out[i] = t if t.dtype == dtypes[i] else t.to(dtypes[i])
        return out  # type: ignore[return-value]

    def to_devices(
        values: Sequence[torch.Tensor], likes: Sequence[torch.Tensor], into: bool
    ) -> list[torch.Tensor]:
        """`values` (host) as new tensors shaped like `likes` on their devices and dtypes.

        With `into`, the `likes` themselves are overwritten (the caller donated them).
        """
        out: list[torch.Tensor | None] = [None] * len(values)
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(likes):
            by_device.setdefault(t.device, []).append(i)
        for target, indices in by_device.items():
            sources = []
            for i in indices:
                src = values[i]
                if src.dtype != likes[i].dtype:
                    cast = torch.empty(
                        src.shape, dtype=likes[i].dtype, device=host, pin_memory=pin
                    )
                    src = cast.copy_(src)
                sources.append(src)
            if into:
                targets = [likes[i] for i in indices]
            else:
                # Fresh tensors even when `target` is the host: the result must never alias the
                # master, which the next donated step updates in place.
                targets = [torch.empty_like(likes[i]) for i in indices]
            if target.type == "cuda" and host == _HOST:
                moved = transfer_for(target).upload_into(sources, targets)
            else:
                with torch.no_grad():
                    moved = [dst.copy_(src) for dst, src in zip(targets, sources)]
            for i, t in zip(indices, moved):
                out[i] = t
        return out  # type: ignore[return-value]

    def keep_pinned(master: list[torch.Tensor]) -> list[torch.Tensor]:
        if not pin or all(t.is_pinned() for t in master if t.numel()):
            return master
        return _pinned_packed_copy(master)

    def init(params: PyTree, *, layout: Any = None) -> OffloadState:
        leaves, treedef = tree.flatten(params)
        for path, leaf in zip(tree.paths(params), leaves):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                found = leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise TypeError(
                    f"{name}: params leaf {path!r} is {found}; the optimizer updates "
                    "floating-point tensors only"
                )
        # Always a copy: the master must not alias the caller's params. Meta params (a state's
        # shapes computed without memory, as `fscale.consolidate` does) get a meta master.
        with torch.no_grad():
            master = [
                leaf.detach().to(
                    leaf.device if leaf.is_meta else host, _master_dtype(leaf.dtype), copy=True
                )
                for leaf in leaves
            ]
        if pin and not any(t.is_meta for t in master):
            master = _pinned_packed_copy(master)
        master_tree = tree.unflatten(treedef, master)
        return OffloadState(optimizer.init(master_tree, layout=layout), master_tree)

    def unpack(
        grads: PyTree, state: Any
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], optree.PyTreeSpec]:
        if not isinstance(state, OffloadState):
            raise TypeError(
                f"{name}: `state` must be the OffloadState that offload_optimizer's init "
                f"returned, got {type(state).__name__}"
            )
        master, treedef = tree.flatten(state.master)
        grad_leaves, grads_def = tree.flatten(grads)
        if grads_def != treedef:
            raise ValueError(
                f"{name}: `grads` has structure {grads_def} but the offloaded params have "
                f"structure {treedef}; pass gradients of the params given to init"
            )
        return grad_leaves, master, treedef

    def update(
        grads: PyTree, state: OffloadState, params: PyTree = None, *, layout: Any = None
    ) -> tuple[PyTree, OffloadState]:
        grad_leaves, master, treedef = unpack(grads, state)
        host_grads = to_host(grad_leaves, [m.dtype for m in master])
        wait_for_uploads()
        master_tree = tree.unflatten(treedef, master)
        host_updates, inner_state = optimizer.update(
            tree.unflatten(treedef, host_grads), state.inner, master_tree, layout=layout
        )
        # The caller adds exactly these updates to its params; the master takes the same step.
        new_master = optim_lib.apply_updates(master_tree, host_updates)
        new_master = tree.unflatten(treedef, keep_pinned(tree.leaves(new_master)))
        updates = to_devices(tree.leaves(host_updates), grad_leaves, into=False)
        return tree.unflatten(treedef, updates), OffloadState(inner_state, new_master)

    def apply(
        grads: PyTree,
        state: OffloadState,
        params: PyTree,
        *,
        layout: Any = None,
        donate: bool = False,
    ) -> tuple[PyTree, OffloadState]:
        grad_leaves, master, treedef = unpack(grads, state)
        param_leaves, params_def = tree.flatten(params)
        if params_def != treedef:
            raise ValueError(
                f"{name}: `params` has structure {params_def} but the offloaded params have "
                f"structure {treedef}; pass the params given to init"
            )
        host_grads = tree.unflatten(treedef, to_host(grad_leaves, [m.dtype for m in master]))
        wait_for_uploads()
        # The master is the state's own buffer, so donating the state donates it too.
        new_master, inner_state = optim_lib.step(
            optimizer,
            host_grads,
            state.inner,
            tree.unflatten(treedef, master),
            layout=layout,
            donate=donate,
        )
        new_master_leaves = keep_pinned(tree.leaves(new_master))
        new_params = to_devices(new_master_leaves, param_leaves, into=donate)
        return (
            tree.unflatten(treedef, new_params),
            OffloadState(inner_state, tree.unflatten(treedef, new_master_leaves)),
        )

    return optimizer._replace(init=init, update=update, apply=apply)


# ----------------------------------------------------------------------------- parameter offload


class ResidencyEvent(NamedTuple):
    """One entry of `OffloadedStages.residency_log`.

    Attributes:
        phase: "forward" or "backward".
        action: "fetch" (a copy of the stage's params to the device was issued: from here on
            they occupy device memory), "compute" (the stage runs on its device params) or
            "release" (the device copy was dropped).
        stage: the stage's index.
        resident: the stages whose params are on the device after the event, sorted.
    """

    phase: str
    action: str
    stage: int
    resident: tuple[int, ...]


class _Schedule:
    """The device residency of one forward pass and the backward passes through it.

    A stage's params are *resident* from the moment their upload is issued until they are
    released; `fetch` issues uploads ahead (prefetch), `acquire` returns a stage's usable device
    params, issuing the upload itself if no prefetch did.
    """

    def __init__(self, stages: OffloadedStages, host_leaves: list[list[torch.Tensor]]) -> None:
        self.stages = stages
        self.host_leaves = host_leaves
        self.in_flight: dict[int, tuple[list[torch.Tensor], Any]] = {}
        self.resident: set[int] = set()
        self.in_graph: set[int] = set()  # stages whose backward autograd will run
        self.rng_states: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.log: list[ResidencyEvent] = []

    def _record(self, phase: str, action: str, stage: int) -> None:
        self.log.append(ResidencyEvent(phase, action, stage, tuple(sorted(self.resident))))

    def fetch(self, stage: int, phase: str) -> None:
        if stage in self.resident:
            return
        self.in_flight[stage] = self.stages.transfer.start_upload(self.host_leaves[stage])
        self.resident.add(stage)
        self._record(phase, "fetch", stage)

    def acquire(self, stage: int, phase: str) -> list[torch.Tensor]:
        self.fetch(stage, phase)
        on_device, event = self.in_flight.pop(stage)
        return self.stages.transfer.finish_upload(on_device, event)

    def release(self, stage: int, phase: str) -> None:
        self.in_flight.pop(stage, None)
        self.resident.discard(stage)
        self._record(phase, "release", stage)

    def prefetch_after(self, stage: int) -> None:
        last = min(stage + self.stages.prefetch, len(self.host_leaves) - 1)
        for ahead in range(stage + 1, last + 1):
            self.fetch(ahead, "forward")

    def prefetch_before(self, stage: int) -> None:
        first = max(stage - self.stages.prefetch, 0)
        for behind in range(stage - 1, first - 1, -1):
            # A stage outside the graph gets no backward call, so its copy would never be freed.
            if behind in self.in_graph:
                self.fetch(behind, "backward")

    # -- the two halves of one stage

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        on_device = self.acquire(stage, "forward")
        self.prefetch_after(stage)  # issued before this stage's kernels, so it overlaps them
        self.rng_states[stage] = self._rng_state()
        self._record("forward", "compute", stage)
        y = self._run(stage, on_device, x)
        del on_device
        self.release(stage, "forward")
        return y

    def backward(
        self,
        stage: int,
        x: torch.Tensor,
        host_leaves: Sequence[torch.Tensor],
        grad_y: torch.Tensor,
        needs: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        if torch.is_grad_enabled():
            return self._backward_differentiable(stage, x, host_leaves, grad_y, needs)
        on_device = self.acquire(stage, "backward")
        self.prefetch_before(stage)
        self._record("backward", "compute", stage)
        with torch.enable_grad(), self._replayed_rng(stage):
            live_x = x.detach().requires_grad_(needs[0])
            live = [t.detach().requires_grad_(need) for t, need in zip(on_device, needs[1:])]
            y = self._run(stage, live, live_x)
            wanted = [t for t in [live_x, *live] if t.requires_grad]
            grads = (
                torch.autograd.grad(y, wanted, grad_y, allow_unused=True)
                if y.requires_grad and wanted
                else [None] * len(wanted)
            )
        del y, live, on_device
        self.release(stage, "backward")
        found = iter(grads)
        grad_x = next(found) if needs[0] else None
        param_grads = [next(found) if need else None for need in needs[1:]]
        return grad_x, self._grads_to_host(param_grads, host_leaves)

    def _backward_differentiable(
        self,
        stage: int,
        x: torch.Tensor,
        host_leaves: Sequence[torch.Tensor],
        grad_y: torch.Tensor,
        needs: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Backward under a higher-order or torch.func transform: stay differentiable.

        The params come up through differentiable copies, so the gradient reaching the host
        leaves is itself differentiable; no prefetch (the copies must be made inside the graph).
        """
        self.in_flight.pop(stage, None)
        if stage not in self.resident:
            self.resident.add(stage)  # the copy is made inside `objective` below
            self._record("backward", "fetch", stage)
        self._record("backward", "compute", stage)
        device = self.stages.device
        treedef = self.stages.treedefs[stage]
        fn = self.stages.fns[stage]

        def objective(x_in: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
            params = tree.unflatten(treedef, [leaf.to(device) for leaf in leaves])
            y = _checked_output(stage, fn(params, x_in))
            return (y * grad_y).sum()

        with self._replayed_rng(stage):
            grad_x, grad_leaves = torch.func.grad(objective, argnums=(0, 1))(x, list(host_leaves))
        self.release(stage, "backward")
        return (
            grad_x if needs[0] else None,
            [g if need else None for g, need in zip(grad_leaves, needs[1:])],
        )

    def _run(self, stage: int, leaves: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        params = tree.unflatten(self.stages.treedefs[stage], leaves)
        return _checked_output(stage, self.stages.fns[stage](params, x))

    def _grads_to_host(
        self, grads: list[torch.Tensor | None], host_leaves: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        present = [i for i, g in enumerate(grads) if g is not None]
        moved = self.stages.transfer.download([grads[i] for i in present]) if present else []
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(present, moved):
            out[i] = g.to(host_leaves[i].device)
        return out

    # Dropout and other random ops must draw the same numbers when the stage is recomputed.
    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.stages.device
        accel = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return torch.get_rng_state(), accel

    def _replayed_rng(self, stage: int) -> _ReplayedRng:
        cpu_state, accel_state = self.rng_states[stage]
        return _ReplayedRng(cpu_state, accel_state, self.stages.device)


class _ReplayedRng:
    """Context: the RNG states of a stage's forward, restored afterwards to the current ones."""

    def __init__(
        self, cpu_state: torch.Tensor, accel_state: torch.Tensor | None, device: torch.device
    ) -> None:
        # fork_rng restores the caller's states on exit; an empty device list forks the CPU only.
        self.fork = torch.random.fork_rng(devices=[device] if accel_state is not None else [])
        self.cpu_state = cpu_state
        self.accel_state = accel_state
        self.device = device

    def __enter__(self) -> None:
        self.fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        if self.accel_state is not None:
            torch.cuda.set_rng_state(self.accel_state, self.device)

    def __exit__(self, *exc: Any) -> Any:
        return self.fork.__exit__(*exc)


def _checked_output(stage: int, y: Any) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(
            f"offload_params: stage {stage} returned a {type(y).__name__}; a stage function "
            "must return one tensor (the activation passed to the next stage)"
        )
    return y


class _OffloadedStage(torch.autograd.Function):
    """One stage as a rematerialised autograd node: saves its input, recomputes in backward."""

    @staticmethod
    def forward(x: torch.Tensor, schedule: _Schedule, stage: int, *host_leaves: torch.Tensor):
        y = schedule.forward(stage, x)
        # An output that *is* an input would make autograd treat the node as a view; a stage
        # that passes its input through gets a fresh tensor instead.
        return y.clone() if y is x else y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, schedule, stage, *host_leaves = inputs
        ctx.schedule = schedule
        ctx.stage = stage
        # Only the input and the (host) params: the stage's activations are recomputed.
        ctx.save_for_backward(x, *host_leaves)
        if any(ctx.needs_input_grad):
            schedule.in_graph.add(stage)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor):
        x, *host_leaves = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[3:])
        grad_x, grad_leaves = ctx.schedule.backward(ctx.stage, x, host_leaves, grad_y, needs)
        return (grad_x, None, None, *grad_leaves)


class OffloadedStages:
    """A sequence of stages whose params live in host memory; call it like the composed stages.

    Built by `offload_params`. ``run(x)`` runs the stages on `run.params`; ``run(x, params)`` on
    params of the same structure (e.g. the live leaves a train step differentiates).

    Attributes:
        params: one params pytree per stage, in host memory (pinned when `device` is CUDA).
        device: where stages compute.
        prefetch: how many stages ahead (behind, in backward) are copied to the device early.
        residency_log: the `ResidencyEvent`s of the latest call and the backward through it.
    """

    def __init__(
        self,
        fns: list[Callable[[PyTree, torch.Tensor], torch.Tensor]],
        params: tuple[PyTree, ...],
        device: torch.device,
        prefetch: int,
    ) -> None:
        self.fns = fns
        self.params = params
        self.treedefs = [tree.structure(p) for p in params]
        self.device = device
        self.prefetch = prefetch
        # Pinned staging for gradient downloads only pays off (and only exists) with CUDA.
        self.transfer = _Transfer(device, pin_memory=device.type == "cuda")
        self._last: _Schedule | None = None

    @property
    def residency_log(self) -> list[ResidencyEvent]:
        return list(self._last.log) if self._last is not None else []

    def __len__(self) -> int:
        return len(self.fns)

    def __call__(self, x: torch.Tensor, params: Sequence[PyTree] | None = None) -> torch.Tensor:
        """The composition of the stages applied to `x` (moved to `device` if elsewhere).

        Args:
            x: the first stage's input.
            params: one params pytree per stage with the structure of `self.params`, in host
                memory; default `self.params`. Gradients w.r.t. these leaves land on the host.

        Returns:
            The last stage's output, on `device`.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"offload_params: the input must be a tensor, got {type(x).__name__}")
        host_leaves = self._host_leaves(self.params if params is None else params)
        schedule = _Schedule(self, host_leaves)
        self._last = schedule
        x = x.to(self.device)
        for stage, leaves in enumerate(host_leaves):
            x = _OffloadedStage.apply(x, schedule, stage, *leaves)
        return x

    def _host_leaves(self, params: Sequence[PyTree]) -> list[list[torch.Tensor]]:
        if not isinstance(params, Sequence) or len(params) != len(self.fns):
            raise ValueError(
                f"offload_params: `params` must be a sequence of {len(self.fns)} params "
                f"pytrees, one per stage, got {type(params).__name__}"
            )
        out = []
        for stage, (stage_params, treedef) in enumerate(zip(params, self.treedefs)):
            leaves, found = tree.flatten(stage_params)
            if found != treedef:
                raise ValueError(
                    f"offload_params: params of stage {stage} have structure {found}, expected "
                    f"{treedef} (the structure given to offload_params)"
                )
            _check_host_leaves(stage, stage_params)
            out.append(leaves)
        return out

    def __repr__(self) -> str:
        return (
            f"OffloadedStages({len(self.fns)} stages, device={str(self.device)!r}, "
            f"prefetch={self.prefetch})"
        )


def _check_host_leaves(stage: int, stage_params: PyTree) -> None:
    paths, leaves, _ = tree.flatten_with_paths(stage_params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"offload_params: stage {stage} params leaf {path!r} is a "
                f"{type(leaf).__name__}, not a tensor"
            )
        if leaf.device != _HOST:
            raise ValueError(
                f"offload_params: stage {stage} params leaf {path!r} is on {leaf.device}; the "
                "params of offloaded stages live in host memory ('cpu'): move them there first"
            )


def offload_params(
    stages: Sequence[tuple[Callable[[PyTree, torch.Tensor], torch.Tensor], PyTree]],
    device: str | torch.device,
    *,
    prefetch: int = 1,
) -> OffloadedStages:
    """Keep the params of a sequence of stages in host memory; copy each up only while it runs.

    FairScale's OffloadModel as a function transform. Each stage is ``(stage_fn, stage_params)``
    with ``stage_fn(params, x) -> x`` pure in its params pytree and activation. The returned
    ``run(x)`` equals ``stage_fn_n(params_n, ... stage_fn_1(params_1, x))`` (bit for bit), and:

    - forward: before stage i runs, its params are copied to `device` (unless a prefetch already
      did) and the copies of stages i+1 .. i+`prefetch` are issued, so they overlap stage i;
      stage i's device params are released as soon as it returns. Only its input is kept.
    - backward: stages are visited in reverse; stage i's params come up again (stages
      i-1 .. i-`prefetch` are prefetched), its forward is recomputed from the saved input with
      the forward's RNG state (so dropout matches), the gradients are taken, the parameter
      gradients go down to the host and the device params are released.

    What lives where: host memory holds every stage's params and receives their gradients;
    the device holds at most ``prefetch + 1`` stages' params at any moment, plus one input
    activation per stage and one stage's recomputed activations during its backward.

    Traffic per training step (Ψ parameters in all): 2Ψ up (forward and backward) and Ψ down
    (gradients). Every stage is computed twice (the price of keeping no activations), and on
    CUDA the copies overlap compute only as far as one stage's compute hides the next stage's
    upload; the gain is a device memory bound independent of the model's depth. Pair it with
    an optimizer on the host params: the gradients already live there.

    Gradients flow to the host params: run ``run(x, params)`` under ``torch.autograd.grad`` with
    host leaves that require grad (or ``torch.func.grad``, which takes a slower differentiable
    path with no prefetch). On CUDA the host params are copied once into pinned memory: use
    `run.params`, not the originals, as the trained params.

    Args:
        stages: a sequence of ``(stage_fn, stage_params)`` pairs; the params' leaves must be
            host ("cpu") tensors.
        device: where the stages compute ("cuda", "cuda:1", or "cpu" to run the same schedule
            with the host as its own device).
        prefetch: how many stages ahead of the running one are copied early (0 disables
            prefetching; more hides more latency and holds more device memory).

    Returns:
        An `OffloadedStages` ``run``: ``run(x, params=None)``, with `run.params` (the host
        params) and `run.residency_log` (what was resident on the device at each event).

    Raises:
        TypeError: if `stages` is not a sequence of (callable, params) pairs, a params leaf is
            not a tensor, or `prefetch` is not an int.
        ValueError: if `stages` is empty, a leaf is not in host memory, `device` is unknown or
            unavailable, or `prefetch` < 0.

    Example:
        >>> import torch, fscale as fs
        >>> double = lambda p, x: x * p["w"]
        >>> run = fs.offload_params([(double, {"w": torch.tensor(2.0)})] * 3, "cpu")
        >>> run(torch.ones(2))
        tensor([8., 8.])
    """
    name = "offload_params"
    target = _checked_device(name, "device", device)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"{name}: `prefetch` must be an int, got {type(prefetch).__name__}")
    if prefetch < 0:
        raise ValueError(
            f"{name}: `prefetch` must be >= 0 (stages copied ahead of the running one), "
            f"got prefetch={prefetch}"
        )
    if not isinstance(stages, Sequence) or isinstance(stages, (str, bytes)):
        raise TypeError(
            f"{name}: `stages` must be a sequence of (stage_fn, stage_params) pairs, "
            f"got {type(stages).__name__}"
        )
    if not stages:
        raise ValueError(f"{name}: `stages` is empty; give at least one (stage_fn, params) pair")
    fns, params = [], []
    for i, pair in enumerate(stages):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not callable(pair[0]):
            raise TypeError(
                f"{name}: `stages[{i}]` must be a pair (stage_fn, stage_params) with "
                f"stage_fn(params, x) -> x, got {pair!r:.80}"
            )
        _check_host_leaves(i, pair[1])
        fns.append(pair[0])
        params.append(pair[1])
    if target.type == "cuda":
        params = [_pinned_params(p) for p in params]
    return OffloadedStages(fns, tuple(params), target, prefetch)


def _pinned_params(params: PyTree) -> PyTree:
    """`params` copied into page-locked memory (asynchronous uploads need it), grad flags kept."""
    leaves, treedef = tree.flatten(params)
    pinned = _pinned_packed_copy([t.detach() for t in leaves])
    return tree.unflatten(
        treedef, [p.detach().requires_grad_(t.requires_grad) for p, t in zip(pinned, leaves)]
    )
