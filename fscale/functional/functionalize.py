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

The module after step.init
--------------------------
Once a training state has taken the tensors (`fscale.Step.init` keeps, copies or shards them),
the module's slots hold meta tensors (`FunctionalModule.release`, `fscale.functional.ownership`),
so no rank keeps a second copy of the model; ``apply`` is given every tensor and runs as before.
While the caller still holds the tensors (its ``params``), functionalizing or calling the
module puts them back (no copy); `FunctionalModule.load` gives it trained ones.

Modules on the meta device
--------------------------
A module built under ``with torch.device("meta"):`` is functionalized with ``init=``; its meta
``params`` and ``buffers`` get values from `fscale.fully_shard`'s init (this rank's shards only)
or `FunctionalModule.materialize` (the whole model), see `fscale.functional.materialize`.

Parameters materialized at their point of use
---------------------------------------------
``params`` may also be a `UnitParams`: parameters held in units that exist only while they are
needed (fully sharded training). A unit whose name is a submodule's path is materialized inside
that submodule's call; ``fscale.functional.unit_calls`` states how.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fscale import random as fsrandom
from fscale import tree
from fscale.functional import buffers as buffers_lib
from fscale.functional import checks, ownership, rng, unit_calls
from fscale.functional import materialize as materialize_lib
from fscale.functional import slots as slots_lib
from fscale.functional.units import ParamUnit, UnitParams

__all__ = ["FunctionalModule", "functionalize"]

Tensors = dict[str, torch.Tensor]


def functionalize(
    module: nn.Module,
    *,
    train: bool = True,
    init: str | materialize_lib.InitFn | None = None,
    init_device: str | torch.device = "cpu",
) -> tuple[FunctionalModule, Tensors, Tensors]:
    """Split `module` into a pure function and the state it reads.

    Args:
        module: the model. It is not modified here nor by ``apply``; `fscale.Step.init`
            releases the tensors its state takes (see "The module after step.init").
        train: the mode ``apply`` runs in when its own ``train`` argument is not given.
        init: how to give values to a module built on the meta device (see "Modules on the meta
            device"): ``"reset_parameters"``, or ``init(path, submodule)`` that sets the
            submodule's own parameters and buffers. None: the module must have values.
        init_device: where `init` creates the tensors.

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
    init_fn = materialize_lib.check_init(init, "functionalize")
    checks.refuse_torch_checkpointing("functionalize", list(module.named_modules()))
    ownership.restore_lent(module)  # a released module whose tensors the caller still holds
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
        aliases=ownership.tied_names(module),
        init=init_fn,
        init_device=torch.device(init_device),
    )
    for name, tensor in [*params.items(), *buffers.items()]:
        if ownership.is_released(ownership.tensor_at(module, name)):
            ownership.mark_released(tensor)  # so that an error can say where its values went
    ownership.record(apply, {**params, **buffers})
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
        init: ``init(path, submodule)`` for a module on the meta device, or None.
        init_device: where `init` creates tensors.
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
        init: materialize_lib.InitFn | None = None,
        init_device: torch.device | None = None,
    ) -> None:
        self.module = module
        self.init = init
        self.init_device = torch.device("cpu") if init_device is None else init_device
        self.train = train
        self.param_names = param_names
        self.frozen_names = frozen_names
        self.buffer_names = buffer_names
        self.aliases = aliases
        # The module tree as of functionalize (its parameter names are fixed then too).
        self._named_submodules = list(module.named_modules())
        self._submodules = [submodule for _, submodule in self._named_submodules]
        self._checkpointable = checks.checkpointable(self._named_submodules)
        self._name_sets = {n: frozenset(n) for n in (param_names, buffer_names + frozen_names)}
        self._param_check = checks.ParamCheck((n, module.get_parameter(n)) for n in param_names)
        self._state_dict_names = tuple(module.state_dict(keep_vars=True))
        self._slots = slots_lib.named_slots(  # resolved once; None: the general path
            module, param_names + frozen_names + buffer_names, aliases
        )
        self._guard: Any = None  # the hook refusing eager calls of a released module

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
            checks.refuse_torch_checkpointing("apply", self._checkpointable)
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

        def call_tensors() -> list[Any]:
            return [*tensors.values(), *tree.leaves((args, kwargs))]

        # Under torch.compile the generators are seeded by a call outside the graph, not by a
        # with block: Dynamo cannot resume a graph inside one, and would run this call eagerly.
        saved = None
        if key is not None and torch.compiler.is_compiling():
            saved, key = rng.seed_generators(key, call_tensors), None
        try:
            with (
                slots_lib.mode(self.module, mode, self._submodules),
                rng.seeded_by(key, call_tensors),
                unit_calls.forwards(self.module, module_units),
            ):
                # Aliases are mapped above (the call ties nothing); every name must be given.
                try:
                    output, captured = buffers_lib.call(
                        self.module, tensors, args, kwargs, self.buffer_names, self._slots
                    )
                except Exception as error:
                    note = self._param_check.dtype_note(params)
                    add_note = getattr(error, "add_note", None)  # Python 3.11+
                    if note is not None and add_note is not None:
                        add_note(note)
                    raise
        finally:
            if saved is not None:
                rng.restore_generators(saved)

        new_buffers = self._new_buffers(buffers, passed_buffers, versions_before, captured, mode)
        return output, new_buffers

    def release(self, names: Iterable[str] | None = None) -> None:
        """Put meta tensors in the module's slots of `names` (default: all), freeing its copy.

        `fscale.Step.init` calls it for the tensors its state took. Calls of ``self`` are not
        affected (they are given every tensor). The module runs eagerly again when `load`
        gives it tensors, or when the tensors `functionalize` handed out are still alive
        (they are put back; see the module docstring).

        Raises:
            ValueError: a name is not one of the module's params or buffers.
        """
        known = self.param_names + self.buffer_names + self.frozen_names
        names = list(known if names is None else names)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"release: `names` {unknown} are not params or buffers of the module")
        ownership.release_slots(self.module, names, self.aliases, ownership.handed_out(self))
        if names and self._guard is None:
            self._guard = ownership.guard_eager_calls(self.module, names[0])

    def load(
        self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]
    ) -> nn.Module:
        """Put `params` and `buffers` (e.g. a `fscale.consolidate`-d state's) into the module.

        The module then holds these very tensors (as parameters where it has parameters, one
        object for all names of a tied tensor) and runs eagerly, e.g. to ``save_pretrained``.
        It works on a released module, where ``module.load_state_dict`` would copy into meta
        tensors (a no-op). Returns the module.

        Raises:
            TypeError, ValueError: the names, shapes or dtypes do not match, as for a call.
        """
        self._check_names("params", params, self.param_names, caller="load")
        self._check_names("buffers", buffers, self.buffer_names + self.frozen_names, caller="load")
        self._param_check.check(params)
        ownership.load_into(self.module, {**params, **buffers}, self.param_names, self.aliases)
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        return self.module

    def materialize(self, key: torch.Tensor | int = 0) -> tuple[Tensors, Tensors]:
        """Full ``(params, buffers)`` of a module built on the meta device, made by `init`.

        `fscale.fully_shard` makes only each rank's shards of these values, from the key given
        to ``step.init``: both are seeded with ``fscale.random.seed(key)`` (an int `key` is a
        seed for ``fscale.random.key``). The module keeps meta tensors.

        Raises:
            ValueError: `functionalize` was given no `init`, a tensor is not on the meta device,
                or `init` left one unset.
        """
        tensors = materialize_lib.materialize(
            self.module,
            self.param_names + self.frozen_names + self.buffer_names,
            init=materialize_lib.require_init(self.init, self.module, "materialize"),
            device=self.init_device,
            seed=fsrandom.seed(fsrandom.key(key) if isinstance(key, int) else key),
            aliases=self.aliases,
            keep=lambda name, tensor: tensor,
        )
        params = {name: tensors[name] for name in self.param_names}
        return params, {name: tensors[name] for name in self.frozen_names + self.buffer_names}

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
        if not self.aliases:  # nothing tied: every name is its own
            return dict(leaves)
        named: Tensors = {}
        for name, tensor in leaves.items():
            for alias in self.aliases.get(name, (name,)):
                named[alias] = tensor
        return named

    def _check_names(
        self, argument: str, given: object, expected: tuple[str, ...], caller: str = "apply"
    ) -> None:
        names = self._name_sets.get(expected)
        if names is not None and checks.exactly(given, names):
            return
        module_name = type(self.module).__name__
        checks.check_names(caller, argument, given, expected, module_name, self._hint)

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


def _check_bool(function: str, argument: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{function}: `{argument}` must be a bool, got {_describe(value)}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
