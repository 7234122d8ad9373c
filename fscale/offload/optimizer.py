"""ZeRO-Offload: the optimizer's state and a master copy of the params live in host memory.

`offload_optimizer(optimizer)` (Ren et al., 2021) keeps the wrapped optimizer's state *and a
master copy of the parameters* on the host and runs the update there. Per step, the gradients
go down (device -> host) and the new parameters come up (host -> device); the optimizer state
never crosses the bus. The copies go through `fscale.offload.transfer`: on CUDA asynchronous,
on side streams, from pinned memory; elsewhere synchronous with identical results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from fscale import optim as optim_lib
from fscale import tree
from fscale.offload.transfer import HOST, Transfer, checked_device, pinned_packed_copy
from fscale.optim.base import described

__all__ = ["OffloadState", "offload_optimizer"]

PyTree = Any


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


@described
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

    The wrapper composes: `sharding` passes through unchanged, so a sharded optimizer wrapper
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
    host = checked_device(name, "device", device)
    pin = _checked_pin_memory(name, host, pin_memory)
    transfers: dict[torch.device, Transfer] = {}

    def transfer_for(accelerator: torch.device) -> Transfer:
        if accelerator not in transfers:
            transfers[accelerator] = Transfer(accelerator, pin)
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
            elif source.type == "cuda" and host == HOST:
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
                    cast = torch.empty(src.shape, dtype=likes[i].dtype, device=host, pin_memory=pin)
                    src = cast.copy_(src)
                sources.append(src)
            if into:
                targets = [likes[i] for i in indices]
            else:
                # Fresh tensors even when `target` is the host: the result must never alias the
                # master, which the next donated step updates in place.
                targets = [torch.empty_like(likes[i]) for i in indices]
            if target.type == "cuda" and host == HOST:
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
        return pinned_packed_copy(master)

    def init(params: PyTree, *, sharding: Any = None) -> OffloadState:
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
            master = pinned_packed_copy(master)
        master_tree = tree.unflatten(treedef, master)
        return OffloadState(optimizer.init(master_tree, sharding=sharding), master_tree)

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
        grads: PyTree, state: OffloadState, params: PyTree = None, *, sharding: Any = None
    ) -> tuple[PyTree, OffloadState]:
        grad_leaves, master, treedef = unpack(grads, state)
        host_grads = to_host(grad_leaves, [m.dtype for m in master])
        wait_for_uploads()
        master_tree = tree.unflatten(treedef, master)
        host_updates, inner_state = optimizer.update(
            tree.unflatten(treedef, host_grads), state.inner, master_tree, sharding=sharding
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
        sharding: Any = None,
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
            sharding=sharding,
            donate=donate,
        )
        new_master_leaves = keep_pinned(tree.leaves(new_master))
        new_params = to_devices(new_master_leaves, param_leaves, into=donate)
        return (
            tree.unflatten(treedef, new_params),
            OffloadState(inner_state, tree.unflatten(treedef, new_master_leaves)),
        )

    return tree.with_fields(optimizer, init=init, update=update, apply=apply)
