"""`checkpoint`: rematerialise a function or an `nn.Module` (the user-facing remat transform).

A checkpointed function or module keeps only its inputs for backward and runs again there
(`fscale.remat.engine.checkpoint_call`). Applied per block of a deep network, the activations
kept between forward and backward shrink from "everything every layer saved" to "one input per
block". A module is wrapped as a copy of itself whose class (``Checkpointed<Class>``) puts a
checkpointed `forward` before its own; its parameters and buffers are read at call time and
enter the recompute as its `state`, so under `functional_call` the swapped-in tensors get
gradients and buffers updated in place are updated once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from fscale.functional import slots as slots_lib
from fscale.remat.engine import checkpoint_call
from fscale.remat.policy import SavePolicy

__all__ = ["checkpoint"]


class _Options(NamedTuple):
    """A checkpointed module's `checkpoint_call` options."""

    offload: bool
    policy: SavePolicy | None


class _CheckpointedModule(nn.Module):
    """Mixin placed before a module's own class: its forward is checkpointed."""

    _checkpoint_options: _Options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        base_forward = super().forward
        if not torch.is_grad_enabled():
            return base_forward(*args, **kwargs)
        # Collected at call time: under functional_call these are the swapped-in tensors, which
        # must enter the Function as inputs for their gradients to flow.
        owners = list(self.modules())
        state, slots, num_parameters = slots_lib.state_slots(self, owners)
        # The recompute runs in backward, after the caller (e.g. functionalize's apply with an
        # explicit train flag) may have put the modules back in another mode: replay the mode
        # of this forward, or dropout and BatchNorm would compute another function.
        modes = [(m, m.training) for m in owners]

        def run(state_values: list[torch.Tensor], *call_args: Any, **call_kwargs: Any) -> Any:
            with slots_lib.holding(slots, state_values), slots_lib.training_modes(modes):
                return base_forward(*call_args, **call_kwargs)

        return checkpoint_call(
            run,
            args,
            kwargs,
            state=state,
            # Listed from the positions, not as a range: under torch.compile the count can be
            # symbolic (next to BatchNorm's 0-d integer buffer), and a range of it fails to trace.
            mutable=[i for i in range(len(state)) if i >= num_parameters],
            offload=self._checkpoint_options.offload,
            policy=self._checkpoint_options.policy,
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The class is made at run time, so pickle (and deepcopy) rebuild it from the base class.
        base = type(self).__mro__[2]
        return (_new_checkpointed, (base,), self.__getstate__())


@functools.cache
def _checkpointed_class(base: type[nn.Module]) -> type[nn.Module]:
    return type(
        f"Checkpointed{base.__name__}", (_CheckpointedModule, base), {"__module__": base.__module__}
    )


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
    fn: Callable[..., Any] | nn.Module | None = None,
    *,
    offload: bool = False,
    policy: SavePolicy | None = None,
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
        MutatedArgumentError: (a ValueError) at a forward that records gradients, if it
            changed a non-tensor argument (a key/value cache: call a transformers model with
            ``use_cache=False``), which the recompute would change a second time.

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
    options = _Options(offload, policy)
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
        return checkpoint_call(
            lambda _state, *a, **k: fn(*a, **k), args, kwargs, offload=offload, policy=policy
        )

    return checkpointed
