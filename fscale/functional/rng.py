"""Run a block under RNGs seeded from an ``fscale.random`` key; the ambient RNGs stay untouched.

A functional call with a key must draw the same numbers as the eager module run right after
``torch.manual_seed(fscale.random.seed(key))``, without advancing the caller's generators. So the
block runs under ``torch.random.fork_rng`` for the CPU generator and for every generator of each
accelerator type the call's tensors live on (the generators ``torch.manual_seed`` would seed that
the call can draw from, and no others), each seeded with ``fscale.random.seed(key)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fscale import random as fsrandom

__all__ = ["reseeding", "seeded_by"]


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
    seed = fsrandom.seed(key)
    device_types = sorted(
        {t.device.type for t in call_tensors() if isinstance(t, torch.Tensor)} - {"cpu", "meta"}
    )
    if not device_types and not torch.compiler.is_compiling():
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


@contextlib.contextmanager
def reseeding(call_tensors: Callable[[], list[Any]]) -> Iterator[Callable[[int], None]]:
    """A block that seeds the RNGs several times (``reseed(seed)``, e.g. before each layer of a
    pipeline stage); the ambient RNGs are saved once on entry and restored once on exit.

    Equal to one `seeded_by` block per seed, for the cost of one: a stage of many layers pays
    the save and restore of the generators once per micro-batch instead of once per layer.
    `call_tensors` is as for `seeded_by`.
    """
    device_types = sorted(
        {t.device.type for t in call_tensors() if isinstance(t, torch.Tensor)} - {"cpu", "meta"}
    )
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
