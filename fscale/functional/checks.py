"""What `apply` checks at its boundary: names, params that fit the module, no recompute outside.

**Names.** `params` and `buffers` must hold exactly the module's names (`check_names`): every
missing and unknown name is listed, an unknown one with where it belongs instead.

**Params that fit.** A tensor given for a parameter must have the parameter's shape, and be a
floating-point (or complex, or integer) tensor where the parameter is one: a wrong shape would
otherwise fail deep inside a matmul, or broadcast silently, with no word of which leaf is
wrong. The dtype itself may differ (a model cast to float64 for a gradient check, or to bf16
for mixed precision), so a dtype is never refused; when the call fails, the error gets a note
naming the leaves whose dtype differs from the module's. The check compares a list of shapes
and one of dtypes with the module's: about 0.6 µs per parameter on CPU (measured: 90 µs for a
GPT-2 of 148 parameters, whose forward takes milliseconds).

**No recompute outside apply.** `apply` swaps the given tensors into the module only while the
forward runs. A module that recomputes its forward later, in backward, through
``torch.utils.checkpoint`` then runs on the module's own parameters, not on the ones given: the
gradients are wrong. Hugging Face transformers does this for every layer that
``model.gradient_checkpointing_enable()`` flagged (``layer.gradient_checkpointing = True``), so
`functionalize` and a training-mode `apply` refuse a module with such a flag. A direct call of
``torch.utils.checkpoint`` inside a forward leaves no mark on the module and is not detected;
`fscale.checkpoint` is the remat that works with `apply`. The flag scan reads each submodule's
instance dict: about 0.3 µs per submodule (50 µs for 164).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "APPLY_SHAPE_ATTR",
    "ParamCheck",
    "check_name_set",
    "check_names",
    "checkpointable",
    "exactly",
    "refuse_torch_checkpointing",
]

APPLY_SHAPE_ATTR = "fscale_apply_shape"
"""A parameter attribute: the shape `apply` is given for it when that is not the module's own.

A layer whose parameter is handed to the forward as this rank's slice (an expert-parallel MoE
layer holds all E experts at construction, so every rank builds the same model, but its forward
runs on the E/ep of this rank) sets it, and the check expects that shape instead."""


class ParamCheck:
    """The shapes and dtypes of a module's trainable parameters, to check given params against.

    Args:
        expected: ``(name, parameter)`` for each trainable leaf, in the order apply lists them.
    """

    def __init__(self, expected: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = list(expected)
        self.names = tuple(name for name, _ in expected)
        self.shapes = [torch.Size(getattr(t, APPLY_SHAPE_ATTR, t.shape)) for _, t in expected]
        self.dtypes = [t.dtype for _, t in expected]
        # The dtypes of the last full set of params that passed: a mixed-precision step passes
        # the same bf16 casts every call, which the fast path below then accepts at once.
        self._accepted_dtypes = self.dtypes

    def check(self, params: Mapping[str, torch.Tensor]) -> None:
        """Raise if a tensor of `params` (any subset of the names) does not fit its parameter.

        Raises:
            ValueError: a tensor has another shape than its parameter, or is floating-point
                where the parameter is not (or the other way round); every such leaf is listed.
        """
        names = [name for name in self.names if name in params]
        dtypes = None
        if len(names) == len(self.names):
            tensors = [params[name] for name in names]
            shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
            if shapes == self.shapes and dtypes in (self._accepted_dtypes, self.dtypes):
                return  # the usual case: a few comparisons of lists
        problems = []
        for i, name in enumerate(self.names):
            if name not in params:
                continue
            given = params[name]
            if given.shape != self.shapes[i]:
                problems.append(
                    f"  - `params[{name!r}]` has shape {tuple(given.shape)}, the module's "
                    f"parameter {tuple(self.shapes[i])}"
                )
            elif _kind(given.dtype) != _kind(self.dtypes[i]):
                problems.append(
                    f"  - `params[{name!r}]` is {given.dtype}, the module's parameter "
                    f"{self.dtypes[i]} ({_kind(given.dtype)} for {_kind(self.dtypes[i])})"
                )
        if not problems and dtypes is not None:
            self._accepted_dtypes = dtypes
        if problems:
            raise ValueError(
                "apply: `params` does not fit the module's parameters:\n"
                + "\n".join(problems)
                + "\n  Pass the params functionalize returned (or a state built from them by "
                "step.init); a changed model needs a new state."
            )

    def dtype_note(self, params: Mapping[str, torch.Tensor]) -> str | None:
        """A note naming the leaves of `params` whose dtype is not the module's, if any."""
        differing = [
            f"`params[{name!r}]` is {params[name].dtype} (the module's: {dtype})"
            for name, dtype in zip(self.names, self.dtypes)
            if name in params and params[name].dtype != dtype
        ]
        if not differing:
            return None
        if len(differing) > 8:
            differing[8:] = [f"... and {len(differing) - 8} more"]
        return (
            "apply: the call failed with params whose dtype differs from the module's "
            "parameters: " + "; ".join(differing) + ". Cast every parameter alike, or pass the "
            "dtypes the module has."
        )


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def refuse_torch_checkpointing(caller: str, named_modules: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise if a submodule is flagged for Hugging Face (torch.utils) gradient checkpointing.

    Raises:
        ValueError: naming the first flagged submodule, with the fix.
    """
    for name, module in named_modules:
        # The flag is set on the instance (a class attribute False is the default); reading the
        # instance dict is 50x cheaper than getattr's failing lookup on most modules.
        if vars(module).get("gradient_checkpointing") is True:
            where = f"`{name}`" if name else "the root module"
            raise ValueError(
                f"{caller}: gradient checkpointing is enabled on {where} "
                f"({type(module).__name__}.gradient_checkpointing is True, as "
                "`model.gradient_checkpointing_enable()` or `activation_checkpointing_enable()` "
                "sets it). Its torch.utils.checkpoint recompute runs in backward, after apply "
                "has put the module's own parameters back, so it would differentiate those "
                "instead of the params given: wrong gradients. Call "
                "`model.gradient_checkpointing_disable()` and checkpoint with fscale instead: "
                "`blocks[i] = fs.checkpoint(blocks[i])` for each block before functionalize, "
                "or fully_shard(step, mesh, reshard_after_forward='remat')."
            )


def checkpointable(named_modules: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules of `named_modules` that can be flagged for gradient checkpointing: Hugging
    Face turns it on only in modules that have the flag (set False in their __init__), so
    `refuse_torch_checkpointing` need only look at these on each call."""
    return [(name, m) for name, m in named_modules if hasattr(m, "gradient_checkpointing")]


def exactly(given: object, names: frozenset[str]) -> bool:
    """Whether `given` is a dict of tensors under exactly `names`: the usual case of
    `check_names`, at the cost of one comparison of key sets."""
    return (
        isinstance(given, dict)
        and given.keys() == names
        and all(isinstance(t, torch.Tensor) for t in given.values())
    )


def check_names(
    caller: str,
    argument: str,
    given: object,
    expected: tuple[str, ...],
    module_name: str,
    hint: Callable[[object], str],
) -> None:
    """`given` (the `argument` of `caller`) is a dict of tensors under exactly the names
    `expected` of the module `module_name`; else a TypeError / ValueError listing every missing
    and unknown name, each unknown one with ``hint(name)`` (where it belongs instead)."""
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{caller}: `{argument}` must be a dict of name -> tensor (the `{argument}` "
            f"returned by functionalize), got {type(given).__name__}"
        )
    check_name_set(caller, argument, given, expected, module_name, hint)
    for name in expected:
        if not isinstance(given[name], torch.Tensor):
            raise TypeError(
                f"{caller}: `{argument}[{name!r}]` must be a tensor, got "
                f"{type(given[name]).__name__}"
            )


def check_name_set(
    caller: str,
    argument: str,
    given: Iterable[str],
    expected: Sequence[str],
    module_name: str,
    hint: Callable[[str], str],
    advice: str | None = None,
) -> None:
    """The names `given` are exactly `expected`; else a ValueError listing every missing and
    unknown name, each unknown one with ``hint(name)``, and `advice` (by default: pass the names
    functionalize returned)."""
    given = list(given)
    expected_set, given_set = set(expected), set(given)
    missing = [name for name in expected if name not in given_set]
    unknown = [name for name in given if name not in expected_set]
    if not (missing or unknown):
        return
    lines = [f"{caller}: `{argument}` does not match the module {module_name}:"]
    if missing:
        lines.append(f"  - missing: {missing}")
    lines.extend(f"  - unknown: {name!r}{hint(name)}" for name in unknown)
    lines.append(
        advice or f"  Pass exactly the names of the `{argument}` dict returned by functionalize."
    )
    raise ValueError("\n".join(lines))
