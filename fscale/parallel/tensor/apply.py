"""`tensor_parallel`: apply a plan of styles to any module by name, giving this rank's module.

The plan maps module-name patterns to styles (`fscale.parallel.tensor.styles`). A pattern is
matched against a module's dotted name one segment at a time, with shell wildcards inside a
segment (``"blocks.*.attn.qkv"``), as torch's ``parallelize_module`` does. The result is a copy
of the module in which every matched module is replaced or prepared by its style and every
split parameter is this rank's contiguous shard under the dense name; the input module is left
as it is (it stays the dense reference). The copy is an ordinary ``nn.Module``: functionalize
it, remat its blocks, and hand its parameters to any plan.

Before anything is built the plan is checked against the whole module: every pattern must match
a module, no module may be matched twice, every split must divide, and a weight registered
under several names (tied) must be split the same way under all of them.

How the data-parallel plans see the result: its parameters are the tensors this rank owns,
replicated ones (norms, a row-parallel bias) whole and identical on every rank of the axis, so a
plan over another axis (``data_parallel``, ``shard_optimizer``, ``fully_shard`` over "dp")
treats them as any parameters: it checks, broadcasts and reduces them over "dp" only, where the
ranks hold the same shard. The tensor-parallel collectives are inside the model's forward and
backward, so every gradient leaving the model is complete: a replicated parameter's is the
dense gradient on every rank of the axis, a split one's is this rank's slice of it.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fscale.distributed.mesh import Mesh
from fscale.functional import FunctionalModule
from fscale.parallel.tensor.layers import TensorAxis
from fscale.parallel.tensor.styles import Input, Split, Style, style_of
from fscale.split_params import mark_spread

__all__ = [
    "AXIS_ATTR",
    "SPLITS_ATTR",
    "shard_like",
    "shard_tensor",
    "splits_of",
    "tensor_parallel",
]

SPLITS_ATTR = "tensor_parallel_splits"
"""The attribute of a `tensor_parallel` result mapping each parameter name to its `Split` (None:
whole), under every name a tied parameter has."""

AXIS_ATTR = "tensor_parallel_axis"
"""The attribute of a `tensor_parallel` result holding its `TensorAxis`."""

Plan = Mapping[str, Any]


def tensor_parallel(
    module: nn.Module,
    mesh: Mesh,
    axis: str = "tp",
    plan: Plan | None = None,
    *,
    sequence_dim: int = 1,
) -> nn.Module:
    """This rank's tensor-parallel copy of `module` under `plan`.

    Args:
        module: the dense model; not modified.
        mesh: the mesh holding `axis`.
        axis: the tensor-parallel axis name.
        plan: module-name pattern -> style name ("colwise", "rowwise", "vocab", "sequence",
            "replicate"), a `Style`, or a tuple of them.
        sequence_dim: the sequence dimension of the activations, for sequence parallelism.

    Returns:
        A new ``nn.Module`` with the dense parameter names, holding this rank's shards.

    Raises:
        TypeError: `module` is not an ``nn.Module``, `mesh` not a Mesh, or a style applied to a
            module of the wrong kind.
        ValueError: unknown axis, an empty plan, a pattern matching no module, a module
            matched twice, a split that does not divide, or a tied weight split two ways.

    Example::

        tp_model = tensor_parallel(model, mesh, "tp", gpt_plan())
        apply, params, buffers = fscale.functionalize(tp_model)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"tensor_parallel: `module` must be a torch.nn.Module, got {type(module).__name__}"
        )
    if not isinstance(mesh, Mesh):
        raise TypeError(f"tensor_parallel: `mesh` must be a fscale Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"tensor_parallel: `axis`={axis!r} is not an axis of the mesh {mesh.axis_names}"
        )
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            "tensor_parallel: `plan` must be a non-empty mapping of module-name patterns to "
            f"styles, got {plan!r}"
        )
    tp = TensorAxis(mesh, axis, sequence_dim)
    module_styles = _match(module, {pattern: style_of(v, pattern) for pattern, v in plan.items()})
    for name, styles in module_styles.items():
        for style in styles:
            style.check(module.get_submodule(name), name, tp)
    _check_tied_splits(module, module_styles)

    result = copy.deepcopy(module)
    _keep_parameter_attributes(module, result)
    shards: dict[tuple[int, Split], nn.Parameter] = {}

    def shard(param: torch.Tensor, split: Split) -> nn.Parameter:
        cache_key = (id(param), split)
        if cache_key not in shards:
            data = shard_tensor(param.detach(), split, tp.size, tp.index)
            shards[cache_key] = nn.Parameter(data, requires_grad=param.requires_grad)
        return shards[cache_key]

    entering = [n for n, s in module_styles.items() if any(_enters(x) for x in s)]
    for name, styles in module_styles.items():
        inside = any(name.startswith(f"{outer}.") for outer in entering)
        target = result.get_submodule(name)
        for style in styles:
            target = style.apply(target, tp, shard, inside_region=inside)
        if target is not result.get_submodule(name):
            _replace(result, name, target)
    setattr(result, SPLITS_ATTR, _param_splits(module, module_styles))
    setattr(result, AXIS_ATTR, tp)
    if tp.size > 1:  # a step refuses to take a non-pointwise optimizer's statistics per rank
        for parameter in result.parameters():
            mark_spread(parameter, axis)
    return result


def splits_of(model: Any, caller: str) -> tuple[dict[str, Split | None], TensorAxis]:
    """``(split of each parameter name, axis)`` of a `tensor_parallel` module or of the
    `FunctionalModule` made of one; a TypeError naming `caller` for anything else."""
    module = model.module if isinstance(model, FunctionalModule) else model
    splits = getattr(module, SPLITS_ATTR, None) if isinstance(module, nn.Module) else None
    axis = getattr(module, AXIS_ATTR, None) if isinstance(module, nn.Module) else None
    if not isinstance(splits, dict) or not isinstance(axis, TensorAxis):
        raise TypeError(
            f"{caller}: `model` must be the module fscale.parallel.tensor.tensor_parallel "
            f"returned, or the FunctionalModule of it, got {type(model).__name__}"
        )
    return splits, axis


def shard_like(values: Mapping[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of each dense tensor in `values`, split as `module` holds its parameter.

    For a dense state (parameters, gradients, optimizer moments keyed by parameter name) and a
    `tensor_parallel` result: the tensors this rank's model holds or computes.

    Args:
        values: parameter name -> dense tensor (names that are not parameters are kept whole).
        module: a module returned by `tensor_parallel`.

    Raises:
        TypeError: `module` was not made by `tensor_parallel`.
    """
    splits = getattr(module, SPLITS_ATTR, None)
    tp = getattr(module, AXIS_ATTR, None)
    if not isinstance(splits, dict) or not isinstance(tp, TensorAxis):
        raise TypeError("shard_like: `module` must be a module returned by tensor_parallel")
    out = {}
    for name, value in values.items():
        split = splits.get(name)
        out[name] = value if split is None else shard_tensor(value, split, tp.size, tp.index)
    return out


def _keep_parameter_attributes(original: nn.Module, copied: nn.Module) -> None:
    """Give each copied parameter the Python attributes of the original (`copy.deepcopy` of a
    Parameter keeps only its data): an expert leaf's local shape for `apply`'s check, say."""
    pairs = zip(
        original.named_parameters(remove_duplicate=False),
        copied.named_parameters(remove_duplicate=False),
    )
    for (_, before), (_, after) in pairs:
        for key, value in vars(before).items():
            if not hasattr(after, key):
                setattr(after, key, value)


def shard_tensor(dense: torch.Tensor, split: Split, size: int, index: int) -> torch.Tensor:
    """Chunk `index` of `size` of `dense` along ``split.dim``, within each of its ``parts``
    blocks (concatenated), as a new contiguous tensor."""
    blocks = dense.unflatten(split.dim, (split.parts, -1))
    chunk = blocks.shape[split.dim + 1] // size
    return (
        blocks.narrow(split.dim + 1, index * chunk, chunk).flatten(split.dim, split.dim + 1).clone()
    )


def _enters(style: Style) -> bool:
    return isinstance(style, Input) and style.enters_region


def _segments_match(pattern: str, name: str) -> bool:
    pattern_parts, name_parts = pattern.split("."), name.split(".")
    return len(pattern_parts) == len(name_parts) and all(
        fnmatch.fnmatchcase(part, glob) for part, glob in zip(name_parts, pattern_parts)
    )


def _match(module: nn.Module, plan: dict[str, tuple[Style, ...]]) -> dict[str, tuple[Style, ...]]:
    names = [name for name, _ in module.named_modules() if name]
    matched: dict[str, tuple[Style, ...]] = {}
    by: dict[str, str] = {}
    for pattern, styles in plan.items():
        hits = [name for name in names if _segments_match(pattern, name)]
        if not hits:
            examples = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(
                f"tensor_parallel: plan pattern {pattern!r} matches no module; the module's "
                f"names are {examples}"
            )
        for name in hits:
            if name in matched:
                raise ValueError(
                    f"tensor_parallel: module `{name}` is matched by both {by[name]!r} and "
                    f"{pattern!r}; give one entry a tuple of styles instead"
                )
            matched[name], by[name] = styles, pattern
    return matched


def _uses(
    module: nn.Module, module_styles: dict[str, tuple[Style, ...]]
) -> dict[int, list[tuple[str, Split | None]]]:
    """Each parameter (by id) -> every name it has, with the split the plan gives it there."""
    uses: dict[int, list[tuple[str, Split | None]]] = {}
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        splits: dict[str, Split | None] = {}
        for style in module_styles.get(module_name, ()):
            splits.update(style.splits(submodule))
        for param_name, param in submodule.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            uses.setdefault(id(param), []).append((full_name, splits.get(param_name)))
    return uses


def _param_splits(
    module: nn.Module, module_styles: dict[str, tuple[Style, ...]]
) -> dict[str, Split | None]:
    return {name: split for named in _uses(module, module_styles).values() for name, split in named}


def _check_tied_splits(module: nn.Module, module_styles: dict[str, tuple[Style, ...]]) -> None:
    for named in _uses(module, module_styles).values():
        if len({split for _, split in named}) > 1:
            described = "; ".join(
                f"`{name}` {'whole' if split is None else f'split along dim {split.dim}'}"
                + ("" if split is None or split.parts == 1 else f" in {split.parts} parts")
                for name, split in named
            )
            raise ValueError(
                "tensor_parallel: a tied weight is split in incompatible ways by the plan: "
                f"{described}. Give its modules styles that split it alike (e.g. 'vocab' on "
                "the embedding with 'colwise' on the output layer) or untie it"
            )


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, new)
