"""Turn an ``nn.Module`` into a pure function of explicit parameters and buffers.

``functionalize(module)`` returns ``(apply, params, buffers)``: two flat dicts keyed by the
module's own names, and ``apply(params, buffers, *args, key=None, train=None, **kwargs) ->
(output, new_buffers)``, a call of the module through ``torch.func.functional_call`` whose
result depends only on its arguments:

- **Parameters are leaves.** ``params`` holds every trainable parameter once. A parameter
  registered under several names (tied weights, such as a GPT's token embedding and output
  layer) is one leaf under its first name; ``apply`` hands it to every alias, so the gradients
  of all its uses sum into that one leaf, exactly as in eager training.
- **Everything not trained is a buffer.** ``buffers`` holds the module's buffers *and* its
  frozen parameters (``requires_grad=False``). Both are state that is read, never given a
  gradient; keeping frozen parameters out of ``params`` means an optimizer, a gradient
  all-reduce or a sharding plan never sees them.
- **Inputs are never mutated.** Modules such as BatchNorm update their buffers in place in
  training mode, so in training mode ``apply`` runs the module on clones of the buffers and
  returns the updated state in ``new_buffers`` (a new dict). Evaluation mode copies nothing:
  ``new_buffers`` then holds the very tensors that were passed in (or a buffer the forward
  rebound to a new tensor).
- **The mode is an argument.** ``train`` (default: the value given to ``functionalize``) sets
  ``module.train(mode)`` for the call; every submodule's own ``.training`` flag is restored
  afterwards, so the user's module is left as it was.
- **Randomness is an argument.** With ``key`` (an ``fscale.random`` key) the call runs under a
  forked RNG seeded with ``fscale.random.seed(key)``: dropout draws the same masks as the eager
  module run right after ``torch.manual_seed(fscale.random.seed(key))``, and the ambient RNG is
  untouched. ``key=None`` draws from the ambient torch RNG (and advances it), as eager code does.

- **Checked at the boundary.** A param of another shape (or kind of dtype) than the module's
  is refused naming the leaf, and a module flagged for ``torch.utils.checkpoint`` recompute
  (transformers' ``gradient_checkpointing_enable()``) is refused (`fscale.functional.checks`).

``params`` and ``buffers`` share memory with the module (they are detached views, not copies).
``apply`` works under ``torch.autograd.grad`` (give the ``params`` leaves ``requires_grad``),
``torch.func.grad`` and ``torch.func.vjp``.

Parameters materialized at their point of use
---------------------------------------------
``params`` may also be a `UnitParams`: parameters held in units that exist only while they are
needed (fully sharded training). A unit whose name is a submodule's path is materialized inside
that submodule's call; ``fscale.functional.unit_calls`` states how.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fscale import random as fsrandom
from fscale import tree
from fscale.functional import buffers as buffers_lib
from fscale.functional import checks, rng, unit_calls
from fscale.functional import slots as slots_lib
from fscale.functional.units import ParamUnit, UnitParams

__all__ = ["FunctionalModule", "functionalize"]

Tensors = dict[str, torch.Tensor]


def functionalize(
    module: nn.Module, *, train: bool = True
) -> tuple[FunctionalModule, Tensors, Tensors]:
    """Split `module` into a pure function and the state it reads.

    Args:
        module: the model. It is not modified, neither here nor by ``apply``.
        train: the mode ``apply`` runs in when its own ``train`` argument is not given.

    Returns:
        ``(apply, params, buffers)``. ``params`` maps the name of every trainable parameter to
        the parameter's tensor, detached (same memory, no autograd history); tied parameters
        appear once, under their first name in ``module.named_parameters()``. ``buffers`` maps
        the name of every buffer and every frozen parameter (``requires_grad=False``) to its
        tensor, detached. ``apply`` is a `FunctionalModule`.

    Raises:
        TypeError: `module` is not an ``nn.Module`` or `train` is not a bool.
        ValueError: a submodule has gradient checkpointing enabled
            (``model.gradient_checkpointing_enable()``), whose recompute cannot see the params
            given to ``apply``; use `fscale.checkpoint` instead.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"functionalize: `module` must be a torch.nn.Module, got {type(module).__name__}"
        )
    _check_bool("functionalize", "train", train)
    checks.refuse_torch_checkpointing("functionalize", list(module.named_modules()))
    params: Tensors = {}
    buffers: Tensors = {}
    for name, parameter in module.named_parameters():
        (params if parameter.requires_grad else buffers)[name] = parameter.detach()
    frozen_names = tuple(buffers)
    for name, buffer in module.named_buffers():
        buffers[name] = buffer.detach()
    apply = FunctionalModule(
        module,
        train=train,
        param_names=tuple(params),
        frozen_names=frozen_names,
        buffer_names=tuple(name for name in buffers if name not in frozen_names),
        aliases=_aliases(module),
    )
    return apply, params, buffers


class FunctionalModule:
    """``apply(params, buffers, *args, key=None, train=None, **kwargs) -> (output, new_buffers)``.

    Made by `functionalize`; see the module docstring for the contract. ``args`` and ``kwargs``
    go to the module's ``forward`` (so a ``forward`` argument named ``key`` or ``train`` cannot
    be passed through).

    Attributes:
        module: the wrapped module.
        train: the default mode.
        param_names: names of the trainable leaves, in ``module.named_parameters()`` order.
        buffer_names: names of the module's buffers.
        frozen_names: names of the frozen parameters (held in ``buffers``).
        aliases: for each tied tensor, its leaf name mapped to all the names it is registered
            under (the leaf name first).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        train: bool,
        param_names: tuple[str, ...],
        frozen_names: tuple[str, ...],
        buffer_names: tuple[str, ...],
        aliases: dict[str, tuple[str, ...]],
    ) -> None:
        self.module = module
        self.train = train
        self.param_names = param_names
        self.frozen_names = frozen_names
        self.buffer_names = buffer_names
        self.aliases = aliases
        # The module tree as of functionalize (its parameter names are fixed then too).
        self._named_submodules = list(module.named_modules())
        self._submodules = [submodule for _, submodule in self._named_submodules]
        self._param_check = checks.ParamCheck((n, module.get_parameter(n)) for n in param_names)
        self._state_dict_names = tuple(module.state_dict(keep_vars=True))

    def __repr__(self) -> str:
        return (
            f"FunctionalModule({type(self.module).__name__}, train={self.train}, "
            f"params={len(self.param_names)}, buffers={len(self.buffer_names)}, "
            f"frozen={len(self.frozen_names)}, tied={len(self.aliases)})"
        )

    def __call__(
        self,
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        *args: Any,
        key: torch.Tensor | None = None,
        train: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Any, Tensors]:
        """Run the module on `params` and `buffers`.

        Args:
            params: one tensor per name in `param_names` (the ``params`` of `functionalize`,
                or any tensors of the same names: updated, sharded-and-gathered, tracked by a
                torch.func transform).
            buffers: one tensor per name in `buffer_names` and `frozen_names`.
            *args: positional arguments of the module's ``forward``.
            key: an ``fscale.random`` key that seeds the call's randomness (dropout), or None
                to draw from the ambient torch RNG.
            train: the mode of this call; None means the default given to `functionalize`.
            **kwargs: keyword arguments of the module's ``forward``.

        Returns:
            ``(output, new_buffers)``: the module's output and a new dict with the same names as
            `buffers` holding the state after the call (running statistics updated in training
            mode). In evaluation mode, entries the call did not rebind are the tensors that
            were passed in; frozen parameters always are.

        Raises:
            TypeError: `params` or `buffers` is not a mapping of tensors, `key` is not a key,
                or `train` is not a bool.
            ValueError: a name is missing from `params` or `buffers`, or is not one of the
                module's (all offending names are listed); a param has another shape than the
                module's parameter, or another kind of dtype (`fscale.functional.checks`); in
                training mode, a submodule is flagged for torch.utils gradient checkpointing.
            RuntimeError: in evaluation mode the module modified a buffer in place (the
                caller's tensor has then changed; such a module needs ``train=True``).
        """
        mode = self.train if train is None else train
        _check_bool("apply", "train", mode)
        if key is not None and not fsrandom.is_key(key):
            raise TypeError(
                "apply: `key` must be an fscale.random key (an int64 tensor of shape (2,) made "
                f"by `fscale.random.key(seed)`) or None, got {_describe(key)}"
            )
        module_units: dict[str, ParamUnit] = {}
        if isinstance(params, UnitParams):
            module_units = unit_calls.module_units(
                self.module,
                params,
                param_names=self.param_names,
                aliases=self.aliases,
                hint=self._hint,
            )
            self._param_check.check(params.eager)
            params = unit_calls.unit_tensors(self.module, params, module_units, self.param_names)
        else:
            self._check_names("params", params, self.param_names)
            self._param_check.check(params)
        if mode and torch.is_grad_enabled():
            checks.refuse_torch_checkpointing("apply", self._named_submodules)
        self._check_names("buffers", buffers, self.buffer_names + self.frozen_names)

        # Mutable state is passed as clones in training mode, so in-place updates (BatchNorm's
        # running statistics) land in tensors this call owns rather than in the caller's.
        passed_buffers = {
            name: buffers[name].clone() if mode else buffers[name] for name in self.buffer_names
        }
        # Evaluation mode passes the caller's own tensors, so it checks afterwards that they
        # were not updated in place.
        versions_before = {} if mode else buffers_lib.versions(passed_buffers)
        tensors = self._with_aliases(params)
        tensors.update(self._with_aliases({name: buffers[name] for name in self.frozen_names}))
        tensors.update(self._with_aliases(passed_buffers))

        with (
            slots_lib.mode(self.module, mode, self._submodules),
            rng.seeded_by(key, lambda: [*tensors.values(), *tree.leaves((args, kwargs))]),
            unit_calls.forwards(self.module, module_units),
        ):
            # The aliases are mapped above, so tying by the call itself is not needed; every
            # name must be given, so a name this wrapper failed to map is an error.
            try:
                output, captured = buffers_lib.call(
                    self.module, tensors, args, kwargs, self.buffer_names
                )
            except Exception as error:
                note = self._param_check.dtype_note(params)
                add_note = getattr(error, "add_note", None)  # Python 3.11+
                if note is not None and add_note is not None:
                    add_note(note)
                raise

        new_buffers = self._new_buffers(buffers, passed_buffers, versions_before, captured, mode)
        return output, new_buffers

    def state_dict(
        self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]
    ) -> Tensors:
        """`params` and `buffers` under the names of ``module.state_dict()``, in its order.

        Every name the module's own state dict has is filled: a tied tensor under each of its
        names (a GPT-2's ``lm_head.weight`` beside ``transformer.wte.weight``), non-persistent
        buffers left out. So ``module.load_state_dict(apply.state_dict(params, buffers),
        strict=True)`` loads trained (e.g. `fscale.consolidate`-d) state into the module.

        Raises:
            TypeError, ValueError: `params` or `buffers` do not hold exactly the module's
                names, as for a call; ValueError also if the module's state dict holds an
                entry that is neither a parameter nor a buffer (extra state).
        """
        self._check_names("params", params, self.param_names, caller="state_dict")
        names = self.buffer_names + self.frozen_names
        self._check_names("buffers", buffers, names, caller="state_dict")
        tensors = self._with_aliases(params)
        tensors.update(self._with_aliases(buffers))
        other = [name for name in self._state_dict_names if name not in tensors]
        if other:
            raise ValueError(
                f"state_dict: the state dict of {type(self.module).__name__} holds entries that "
                f"are neither parameters nor buffers (extra state): {other}"
            )
        return {name: tensors[name] for name in self._state_dict_names}

    def _new_buffers(
        self,
        buffers: Mapping[str, torch.Tensor],
        passed_buffers: Tensors,
        versions_before: dict[str, int],
        captured: Tensors,
        mode: bool,
    ) -> Tensors:
        if not mode:
            buffers_lib.check_not_modified(passed_buffers, versions_before)
        # `captured` also holds buffers the forward rebound (``self.b = self.b + 1``), which
        # functional_call would otherwise drop when it restores the module.
        return {
            name: buffers[name]
            if name in self.frozen_names
            else captured.get(name, passed_buffers[name])
            for name in buffers
        }

    def _with_aliases(self, leaves: Mapping[str, torch.Tensor]) -> Tensors:
        named: Tensors = {}
        for name, tensor in leaves.items():
            for alias in self.aliases.get(name, (name,)):
                named[alias] = tensor
        return named

    def _check_names(
        self, argument: str, given: object, expected: tuple[str, ...], caller: str = "apply"
    ) -> None:
        if not isinstance(given, Mapping):
            raise TypeError(
                f"{caller}: `{argument}` must be a dict of name -> tensor (the `{argument}` "
                f"returned by functionalize), got {type(given).__name__}"
            )
        expected_set = set(expected)
        missing = [name for name in expected if name not in given]
        unknown = [name for name in given if name not in expected_set]
        if missing or unknown:
            module_name = type(self.module).__name__
            lines = [f"{caller}: `{argument}` does not match the module {module_name}:"]
            if missing:
                lines.append(f"  - missing: {missing}")
            lines.extend(f"  - unknown: {name!r}{self._hint(name)}" for name in unknown)
            lines.append(
                f"  Pass exactly the names of the `{argument}` dict returned by functionalize."
            )
            raise ValueError("\n".join(lines))
        for name in expected:
            if not isinstance(given[name], torch.Tensor):
                raise TypeError(
                    f"{caller}: `{argument}[{name!r}]` must be a tensor, got "
                    f"{type(given[name]).__name__}"
                )

    def _hint(self, name: object) -> str:
        for leaf, names in self.aliases.items():
            if name in names[1:]:
                return f" (tied to {leaf!r}; tied tensors are one entry, under {leaf!r})"
        if name in self.param_names:
            return " (a trainable parameter: it belongs in `params`)"
        if name in self.frozen_names:
            return " (a frozen parameter: it belongs in `buffers`)"
        if name in self.buffer_names:
            return " (a buffer: it belongs in `buffers`)"
        return ""


def _aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """For each tensor registered under several names: first name -> all names, in order."""
    names_by_tensor: dict[int, list[str]] = {}
    registered = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in registered:
        names_by_tensor.setdefault(id(tensor), []).append(name)
    return {names[0]: tuple(names) for names in names_by_tensor.values() if len(names) > 1}


def _check_bool(function: str, argument: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{function}: `{argument}` must be a bool, got {_describe(value)}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
