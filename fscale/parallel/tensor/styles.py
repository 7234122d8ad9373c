"""The styles a tensor-parallel plan assigns to modules, and what each does to its module.

A plan maps module-name patterns to styles; a string names a style with its defaults:

===============  ==========================================================================
style            effect on the matched module (``N`` ranks on the axis, this rank r)
===============  ==========================================================================
"colwise"        `Colwise`: an ``nn.Linear`` becomes a `ColumnParallelLinear` (weight rows r,
                 bias entries r)
"rowwise"        `Rowwise`: an ``nn.Linear`` becomes a `RowParallelLinear` (weight columns r,
                 the whole bias added after the reduction)
"vocab"          `Vocab`: an ``nn.Embedding`` becomes a `VocabParallelEmbedding` (rows r)
"sequence"       `Sequence`: the module runs on this rank's shard of the sequence; its
                 parameters stay whole and are used through ``replicate`` (their gradients,
                 partial per shard, are summed over the axis), an ``nn.Dropout`` becomes a
                 `TensorParallelDropout` (a mask per rank)
"replicate"      `Replicate`: the module keeps its full parameters (the default for every
                 module no pattern matches; naming it checks tied weights)
===============  ==========================================================================

Three more styles prepare a module that is not itself split: `Heads` divides a head-count
attribute (an attention whose column-parallel projection holds 1/N of the heads), `Input`
transforms a module's input as it enters a region (``f`` once for all the column-parallel
layers that read it, or the all-gather of sequence shards) and `Output` its output (the split
of a replicated activation into sequence shards, or their gather for a replicated consumer).
A column-parallel layer whose ``input`` is left None reads its input as it is when an
ancestor's `Input` has entered the region, and through ``f`` otherwise.

Each style states how it splits each of its module's parameters (`Split`), so that a weight tied
between two modules is checked to be split the same way by both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from fscale.distributed import replicate
from fscale.parallel.tensor.dropout import TensorParallelDropout
from fscale.parallel.tensor.layers import (
    INPUTS,
    OUTPUTS,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorAxis,
    VocabParallelEmbedding,
    enter_region,
)
from fscale.parallel.tensor.regions import gather_replicated

__all__ = [
    "STYLE_NAMES",
    "Colwise",
    "Heads",
    "Input",
    "Output",
    "Replicate",
    "Rowwise",
    "Sequence",
    "Split",
    "Style",
    "Vocab",
    "style_of",
]


class Split(NamedTuple):
    """How a parameter is split: along `dim` into N contiguous chunks within each of `parts`
    blocks; ``None`` in place of a Split means whole (replicated)."""

    dim: int
    parts: int = 1


Shard = Callable[[torch.Tensor, Split], nn.Parameter]
"""``shard(dense_param, split) -> this rank's Parameter`` (the same object for tied weights)."""


class Style:
    """A module's tensor-parallel treatment (subclasses below)."""

    def splits(self, module: nn.Module) -> dict[str, Split | None]:
        """The split of each of `module`'s own parameters (all whole by default)."""
        return {}

    def check(self, module: nn.Module, name: str, tp: TensorAxis) -> None:
        """Raise a ValueError or TypeError naming `name` if the style does not fit `module`."""

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        """The module that replaces `module` (possibly `module` itself, changed)."""
        return module


def _require(module: nn.Module, kind: type, style: str, name: str) -> None:
    if not isinstance(module, kind):
        raise TypeError(
            f"tensor_parallel: style {style!r} applies to an {kind.__name__}, but module "
            f"`{name}` is a {type(module).__name__}"
        )


def _divides(size: int, what: str, name: str, tp: TensorAxis) -> None:
    if size % tp.size:
        raise ValueError(
            f"tensor_parallel: {what}={size} of module `{name}` does not divide over the "
            f"{tp.size} ranks of axis {tp.axis!r}"
        )


def _choice(value: Any, allowed: tuple[Any, ...], field: str, style: str) -> None:
    if value not in allowed:
        raise ValueError(f"{style}: `{field}` must be one of {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Colwise(Style):
    """Split an ``nn.Linear``'s output features (see `ColumnParallelLinear`).

    Attributes:
        input: "replicated", "sequence", "local", or None (see the module docstring).
        gather_output: return the full output instead of this rank's slice.
        parts: blocks of the dense output split one by one (3 for a fused q/k/v).
    """

    input: str | None = None
    gather_output: bool = False
    parts: int = 1

    def __post_init__(self) -> None:
        _choice(self.input, (None, *INPUTS), "input", "Colwise")
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"Colwise: `parts` must be a positive int, got {self.parts!r}")

    def splits(self, module: nn.Module) -> dict[str, Split | None]:
        return {"weight": Split(0, self.parts), "bias": Split(0, self.parts)}

    def check(self, module: nn.Module, name: str, tp: TensorAxis) -> None:
        _require(module, nn.Linear, "colwise", name)
        assert isinstance(module, nn.Linear)
        if module.out_features % (self.parts * tp.size):
            raise ValueError(
                f"tensor_parallel: out_features={module.out_features} of module `{name}` "
                f"does not split into {self.parts} block(s) of {tp.size} equal chunks "
                f"(the size of axis {tp.axis!r})"
            )

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        assert isinstance(module, nn.Linear)
        split = Split(0, self.parts)
        how = self.input or ("local" if inside_region else "replicated")
        return ColumnParallelLinear(
            shard(module.weight, split),
            None if module.bias is None else shard(module.bias, split),
            tp,
            input=how,
            gather_output=self.gather_output,
            parts=self.parts,
        )


@dataclasses.dataclass(frozen=True)
class Rowwise(Style):
    """Split an ``nn.Linear``'s input features (see `RowParallelLinear`).

    Attributes:
        input: "local" (from a column-parallel layer) or "replicated" (sliced here).
        output: "replicated" (all-reduce) or "sequence" (reduce-scatter along the sequence).
    """

    input: str = "local"
    output: str = "replicated"

    def __post_init__(self) -> None:
        _choice(self.input, ("local", "replicated"), "input", "Rowwise")
        _choice(self.output, OUTPUTS, "output", "Rowwise")

    def splits(self, module: nn.Module) -> dict[str, Split | None]:
        return {"weight": Split(1), "bias": None}

    def check(self, module: nn.Module, name: str, tp: TensorAxis) -> None:
        _require(module, nn.Linear, "rowwise", name)
        assert isinstance(module, nn.Linear)
        _divides(module.in_features, "in_features", name, tp)

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        assert isinstance(module, nn.Linear)
        return RowParallelLinear(
            shard(module.weight, Split(1)),
            module.bias,
            tp,
            input=self.input,
            output=self.output,
        )


@dataclasses.dataclass(frozen=True)
class Vocab(Style):
    """Split an ``nn.Embedding``'s rows (see `VocabParallelEmbedding`).

    Attributes:
        output: "replicated" (all-reduce) or "sequence" (reduce-scatter along the sequence).
    """

    output: str = "replicated"

    def __post_init__(self) -> None:
        _choice(self.output, OUTPUTS, "output", "Vocab")

    def splits(self, module: nn.Module) -> dict[str, Split | None]:
        return {"weight": Split(0)}

    def check(self, module: nn.Module, name: str, tp: TensorAxis) -> None:
        _require(module, nn.Embedding, "vocab", name)
        assert isinstance(module, nn.Embedding)
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(
                f"tensor_parallel: module `{name}` uses max_norm, scale_grad_by_freq or sparse "
                "gradients, which a vocab-parallel embedding does not support"
            )
        _divides(module.num_embeddings, "num_embeddings", name, tp)

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        assert isinstance(module, nn.Embedding)
        return VocabParallelEmbedding(
            shard(module.weight, Split(0)),
            tp,
            padding_idx=module.padding_idx,
            output=self.output,
        )


@dataclasses.dataclass(frozen=True)
class Sequence(Style):
    """Run the module on this rank's sequence shard (see the module docstring)."""

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        if isinstance(module, nn.Dropout):
            return TensorParallelDropout(module.p, tp)
        if any(True for _ in module.parameters(recurse=False)):
            _use_params_replicated(module, tp)
        return module


@dataclasses.dataclass(frozen=True)
class Replicate(Style):
    """Keep the module's full parameters."""


@dataclasses.dataclass(frozen=True)
class Heads(Style):
    """An attention whose column-parallel projections hold 1/N of its heads.

    Checks that the heads divide over the axis, and divides the module's head-count attribute
    `attr` (when given) by the axis size.

    Attributes:
        attr: the integer head-count attribute (``"n_heads"`` for `fscale.models.GPT`), or None
            for an attention that infers the count from its input.
        head_dim: the attribute holding the width of one head, with `projections`: each of
            these child Linears' out_features must be a whole number of heads per rank.
        projections: the column-parallel children checked with `head_dim`.
    """

    attr: str | None = None
    head_dim: str | None = None
    projections: tuple[str, ...] = ()

    def check(self, module: nn.Module, name: str, tp: TensorAxis) -> None:
        if self.attr is not None:
            _check_heads(getattr(module, self.attr, None), self.attr, name, tp)
        if self.head_dim is not None:
            width = getattr(module, self.head_dim, None)
            for child in self.projections:
                projection = module.get_submodule(child)
                _require(projection, nn.Linear, "Heads projection", f"{name}.{child}")
                assert isinstance(width, int) and isinstance(projection, nn.Linear)
                _check_heads(projection.out_features // width, f"{child} heads", name, tp)

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        if self.attr is not None:
            setattr(module, self.attr, getattr(module, self.attr) // tp.size)
        return module


def _check_heads(heads: Any, what: str, name: str, tp: TensorAxis) -> None:
    if isinstance(heads, bool) or not isinstance(heads, int):
        raise TypeError(
            f"tensor_parallel: module `{name}` has no integer attribute {what!r} (the head "
            f"count `Heads` divides), got {heads!r}"
        )
    if heads % tp.size:
        raise ValueError(
            f"tensor_parallel: the {heads} attention heads ({what}) of module `{name}` do not "
            f"divide over the {tp.size} ranks of axis {tp.axis!r}"
        )


@dataclasses.dataclass(frozen=True)
class Input(Style):
    """Transform the module's input as it enters: "replicated" (``f``), "sequence" (all-gather
    of sequence shards) or "split" (a replicated value to this rank's sequence shard).

    Attributes:
        how: the transformation.
        name: the keyword of the input; None for the first positional argument (or, when the
            call has none, the first keyword argument).
    """

    how: str = "replicated"
    name: str | None = None

    def __post_init__(self) -> None:
        _choice(self.how, ("replicated", "sequence", "split"), "how", "Input")

    @property
    def enters_region(self) -> bool:
        return self.how in ("replicated", "sequence")

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        how, keyword = self.how, self.name

        def prepare(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if keyword is None and args:
                return (enter_region(args[0], how, tp), *args[1:]), kwargs
            name = keyword if keyword is not None else next(iter(kwargs), None)
            if name is None or name not in kwargs:
                raise TypeError(
                    f"tensor_parallel: Input(name={keyword!r}) found no such input in the call"
                )
            return args, {**kwargs, name: enter_region(kwargs[name], how, tp)}

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module


@dataclasses.dataclass(frozen=True)
class Output(Style):
    """Transform the module's (tensor) output: "split" a replicated activation into this rank's
    sequence shard, or "gather" sequence shards into the full activation for a replicated
    consumer (`gather_replicated`: the backward keeps this rank's slice)."""

    how: str = "split"

    def __post_init__(self) -> None:
        _choice(self.how, ("split", "gather"), "how", "Output")

    def apply(
        self, module: nn.Module, tp: TensorAxis, shard: Shard, *, inside_region: bool
    ) -> nn.Module:
        how = self.how

        def finish(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            if how == "gather":
                return gather_replicated(output, tp.axis, tp.sequence_dim, mesh=tp.mesh)
            return enter_region(output, "split", tp)

        module.register_forward_hook(finish)
        return module


STYLE_NAMES: dict[str, Style] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "vocab": Vocab(),
    "sequence": Sequence(),
    "replicate": Replicate(),
}


def style_of(value: Any, pattern: str) -> tuple[Style, ...]:
    """The styles a plan entry names: a style name, a `Style`, or a tuple of them."""
    items = value if isinstance(value, tuple) else (value,)
    styles = []
    for item in items:
        if isinstance(item, str) and item in STYLE_NAMES:
            styles.append(STYLE_NAMES[item])
        elif isinstance(item, Style):
            styles.append(item)
        else:
            raise ValueError(
                f"tensor_parallel: plan entry {pattern!r} must be one of {tuple(STYLE_NAMES)}, "
                f"a Style, or a tuple of them; got {item!r}"
            )
    if not styles:
        raise ValueError(f"tensor_parallel: plan entry {pattern!r} names no style")
    return tuple(styles)


def _use_params_replicated(module: nn.Module, tp: TensorAxis) -> None:
    """For the duration of each call, `module`'s own parameters are read through ``replicate``.

    The parameters are swapped in the module's parameter table (where ``functional_call`` puts
    the call's tensors too) and put back after the call, also when it raises. Those of one
    dtype go through one ``replicate`` of their concatenation, so their gradients are summed
    by one all-reduce (a norm's weight and bias together).
    """
    originals: list[dict[str, Any]] = []

    def wrap(mod: nn.Module, args: tuple[Any, ...]) -> None:
        table = mod._parameters
        originals.append(dict(table))
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, value in table.items():
            if value is not None:
                by_dtype.setdefault(value.dtype, []).append(name)
        for names in by_dtype.values():
            values = [table[name] for name in names]
            flat = torch.cat([value.reshape(-1) for value in values])  # pyright: ignore[reportOptionalMemberAccess]
            pieces = replicate(flat, tp.axis, "sum", mesh=tp.mesh).split(
                [value.numel() for value in values]  # pyright: ignore[reportOptionalMemberAccess]
            )
            for name, value, piece in zip(names, values, pieces):
                table[name] = piece.view_as(value)  # pyright: ignore[reportArgumentType]

    def restore(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if originals:
            mod._parameters.update(originals.pop())

    module.register_forward_pre_hook(wrap)
    module.register_forward_hook(restore, always_call=True)
