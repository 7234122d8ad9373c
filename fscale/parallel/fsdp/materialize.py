"""This rank's shards of a model built on the meta device, without ever holding the whole model.

`fully_shard`'s init calls `sharded_init` when the params (or buffers) it is given are meta
tensors that `fscale.functionalize` handed out for a module functionalized with ``init=``. The
module's own initialisation runs one submodule at a time (`fscale.functional.materialize`), and
as each parameter is complete this rank copies its fragment into its zero-filled unit shards
and the full tensor is dropped. Buffers (and frozen parameters) are replicated, so every rank
keeps them whole. Every rank runs the same walk from the same seed (``fscale.random.seed`` of
the step's key), so the shards equal, bit for bit, `ShardLayout.shard` of the full model that
``apply.materialize(key)`` makes on one process; each rank computes every tensor's values once
and keeps 1/N of the parameters.

Peak memory per rank: its shards, the full buffers, and the tensors of one submodule (plus a
tied tensor between its first and last holder).
"""

from __future__ import annotations

from typing import Any

import torch

from fscale import random as fsrandom
from fscale import tree
from fscale.functional import materialize as materialize_lib
from fscale.functional import ownership
from fscale.parallel.fsdp.units import ShardLayout

__all__ = ["has_meta", "sharded_init"]

Tensors = dict[str, torch.Tensor]


def has_meta(*values: Any) -> bool:
    """Whether a tensor leaf of `values` is on the meta device."""
    return any(
        isinstance(leaf, torch.Tensor) and leaf.device.type == "meta"
        for leaf in tree.leaves(values)
    )


def sharded_init(
    layout: ShardLayout, rank: int, params: Tensors, buffers: Any, key: torch.Tensor
) -> tuple[Tensors, Any]:
    """``(shards, buffers)`` for shard `rank` of `params` (full tensors or meta ones).

    Args:
        layout: the units of `params`.
        rank: this rank's index along the shard axis.
        params: ``{name: tensor}``; meta tensors must come from one `fscale.functionalize`
            given ``init=``, real ones are sharded as they are.
        buffers: the buffers pytree; its meta leaves are made whole by the same walk.
        key: the step's key: the walk is seeded with ``fscale.random.seed(key)``.

    Raises:
        ValueError: a meta tensor does not come from `fscale.functionalize`, they come from
            several modules, or the module was functionalized without ``init``; or the init
            left a tensor unset.
    """
    buffer_paths, buffer_leaves, buffer_def = tree.flatten_with_paths(buffers)
    pending = [(f"params[{name!r}]", name, t) for name, t in params.items()]
    pending += [
        (f"buffers{path}", i, t) for i, (path, t) in enumerate(zip(buffer_paths, buffer_leaves))
    ]
    owner, wanted = _owner(pending)
    init = materialize_lib.require_init(owner.init, owner.module, "fully_shard")
    devices = {t.device for t in params.values() if t.device.type != "meta"}
    device = owner.init_device if not devices else devices.pop()
    shards = {u.name: torch.zeros(u.shard_size, dtype=u.dtype, device=device) for u in layout.units}
    views = layout.fragment_views(shards, rank)
    fragments = layout.fragments(rank)

    def shard_into(name: str, tensor: torch.Tensor) -> None:
        fragment = fragments[name]
        with torch.no_grad():
            views[name].copy_(tensor.detach().reshape(-1)[fragment.start : fragment.stop])

    for name, tensor in params.items():
        if tensor.device.type != "meta":
            shard_into(name, tensor)
    new_buffers = list(buffer_leaves)

    def keep(owner_name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        place = wanted[owner_name]
        if isinstance(place, str):  # a parameter: keep this rank's fragment only
            shard_into(place, tensor)
            return None
        new_buffers[place] = tensor
        return None

    materialize_lib.materialize(
        owner.module,
        list(wanted),
        init=init,
        device=owner.init_device,
        seed=fsrandom.seed(key),
        aliases=owner.aliases,
        keep=keep,
    )
    return shards, tree.unflatten(buffer_def, new_buffers)


def _owner(pending: list[tuple[str, Any, Any]]) -> tuple[Any, dict[str, str | int]]:
    """The one module the meta tensors of `pending` came from, and ``{its name: where}``."""
    owners: dict[int, Any] = {}
    wanted: dict[str, str | int] = {}
    for label, place, tensor in pending:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            continue
        if ownership.is_released(tensor):
            raise ValueError(
                f"fully_shard: {label} is a placeholder: its values were taken by the state of an "
                "earlier step.init, which released the module. Continue from that state, or "
                "keep the params functionalize returned"
            )
        found = ownership.owner_of(tensor)
        if found is None:
            raise ValueError(
                f"fully_shard: {label} is a meta tensor that fscale.functionalize did not hand "
                "out, so there is no module to initialise it from; build the model under "
                "`with torch.device('meta'):` and pass the params and buffers of "
                "fscale.functionalize(model, init=...)"
            )
        owners[id(found[0])] = found[0]
        wanted[found[1]] = place
    if len(owners) > 1:
        raise ValueError(
            "fully_shard: the meta tensors come from several functionalized modules; "
            "functionalize one model and pass its params and buffers"
        )
    return next(iter(owners.values())), wanted
