"""Run a block under RNGs seeded from an ``fscale.random`` key; the ambient RNGs stay untouched.

A functional call with a key must draw the same numbers as the eager module run right after
``torch.manual_seed(fscale.random.seed(key))``, without advancing the caller's generators. So the
block runs under ``torch.random.fork_rng`` for the CPU generator and for every generator of each
accelerator type the call's tensors live on (the generators ``torch.manual_seed`` would seed that
the call can draw from, and no others), each seeded with ``fscale.random.seed(key)``.

Under ``torch.compile`` the generators are saved, seeded and restored by two functions run
outside the graph: Dynamo refuses every operation on generator state, so this is a graph break
torch requires (the random ops inside the graph then draw from the seeded generators).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fscale import random as fsrandom
from fscale.outside_graph import outside_graph

__all__ = ["Saved", "reseeding", "restore_generators", "seed_generators", "seeded_by"]


def _accelerator_types(call_tensors: Callable[[], list[Any]]) -> list[str]:
    """The device types other than the CPU (and meta) that the call's tensors live on, sorted.

    Where no accelerator is available no tensor can live on one: the scan of every tensor of
    the call (a sizeable part of a small step's fixed cost) is then skipped. (`is_available`,
    not `current_accelerator`: in torch 2.6 the latter raises when there is none.)
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and not accelerator.is_available():
        return []
    types = {t.device.type for t in call_tensors() if isinstance(t, torch.Tensor)}
    return sorted(types - {"cpu", "meta"})


@contextlib.contextmanager
def seeded_by(key: torch.Tensor | None, call_tensors: Callable[[], list[Any]]) -> Iterator[None]:
    """The block's RNGs seeded with `key`; ambient RNGs restored on exit. ``None``: no change.

    Args:
        key: an ``fscale.random`` key, or None to draw from (and advance) the ambient RNGs.
        call_tensors: returns the call's parameters, buffers and inputs (non-tensors are
            ignored); called only when `key` is given, to find the accelerator types in use.
    """
    if key is None:
        yield
        return
    if torch.compiler.is_compiling():
        saved = seed_generators(key, call_tensors)
        try:
            yield
        finally:
            restore_generators(saved)
        return
    seed = fsrandom.seed(key)
    device_types = _accelerator_types(call_tensors)
    if not device_types:
        # What fork_rng(devices=[]) does for the CPU generator, without its context-manager
        # machinery: a sizeable part of a small call's fixed cost.
        generator = torch.default_generator
        ambient = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(ambient)
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for device_type in device_types:
            device_module = torch.get_device_module(device_type)
            stack.enter_context(
                torch.random.fork_rng(
                    devices=list(range(device_module.device_count())), device_type=device_type
                )
            )
        torch.default_generator.manual_seed(seed)
        for device_type in device_types:
            device_module = torch.get_device_module(device_type)
            getattr(device_module, "manual_seed_all", device_module.manual_seed)(seed)
        yield


# What `seed_generators` saved: (the CPU generator or a device module, device index, state).
Saved = list[tuple[Any, int | None, torch.Tensor]]


@outside_graph
def seed_generators(key: torch.Tensor, call_tensors: Callable[[], list[Any]]) -> Saved:
    """The generators `seeded_by` seeds, saved and then seeded with `key`; run outside any
    torch.compile graph. `restore_generators` puts the saved states back.

    Code that calls a module under a key inside a compiled function calls these two around the
    forward (``try``/``finally``) rather than entering `seeded_by`: Dynamo cannot resume a graph
    inside a ``with`` block, so a break there runs the whole enclosing function eagerly.

    Dynamo refuses every operation on torch's generator state (``manual_seed``, ``get_state``,
    ``set_rng_state``, ``fork_rng``), and the seed is the key's value on the host, so no graph
    can hold this; gathering the call's devices here too keeps the break in one place.
    """
    seed = fsrandom.seed(key)
    device_types = _accelerator_types(call_tensors)
    saved: Saved = [(torch.default_generator, None, torch.default_generator.get_state())]
    for device_type in device_types:
        device_module = torch.get_device_module(device_type)
        for index in range(device_module.device_count()):
            saved.append((device_module, index, device_module.get_rng_state(index)))
    torch.default_generator.manual_seed(seed)
    for device_type in device_types:
        device_module = torch.get_device_module(device_type)
        getattr(device_module, "manual_seed_all", device_module.manual_seed)(seed)
    return saved


@outside_graph
def restore_generators(saved: Saved) -> None:
    """Put back the generator states `seed_generators` saved."""
    for owner, index, state in saved:
        if index is None:
            owner.set_state(state)
        else:
            owner.set_rng_state(state, index)


@contextlib.contextmanager
def reseeding(call_tensors: Callable[[], list[Any]]) -> Iterator[Callable[[int], None]]:
    """A block that seeds the RNGs several times (``reseed(seed)``, e.g. before each layer of a
    pipeline stage); the ambient RNGs are saved once on entry and restored once on exit.

    Equal to one `seeded_by` block per seed, for the cost of one: a stage of many layers pays
    the save and restore of the generators once per micro-batch instead of once per layer.
    `call_tensors` is as for `seeded_by`.
    """
    device_types = _accelerator_types(call_tensors)
    generator = torch.default_generator
    if not device_types and not torch.compiler.is_compiling():
        ambient = generator.get_state()
        try:
            yield generator.manual_seed  # type: ignore[misc]
        finally:
            generator.set_state(ambient)
        return
    device_modules = [torch.get_device_module(t) for t in device_types]

    def reseed(seed: int) -> None:
        generator.manual_seed(seed)
        for device_module in device_modules:
            getattr(device_module, "manual_seed_all", device_module.manual_seed)(seed)

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for device_type, device_module in zip(device_types, device_modules):
            stack.enter_context(
                torch.random.fork_rng(
                    devices=list(range(device_module.device_count())), device_type=device_type
                )
            )
        yield reseed
