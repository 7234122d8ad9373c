"""Where the pieces a layer's inner plan holds lie in the layer's full state: pipeline stages,
expert slices and tensor-parallel shards.

The sharding layers (`fscale.ckpt.pieces`) describe a rank's pieces of the full state *of the
model the rank trains*. Three kinds of layer make that model a part of a bigger one, and each
maps the pieces into the bigger model's leaves, as its ``consolidate`` would gather them, but
without gathering anything:

- **pipeline** (`PipelinePlan`): the rank's state holds its stages, a tuple of the stages'
  pytrees; the leaf ``<position>.<path>`` of stage ``local[position]`` is ``<path>`` of the
  full model (a Sequential's names) or ``<stage>.<path>`` (a list of stage pytrees). An
  optimizer leaf that mirrors a parameter moves with it; the others (a step count) are the
  same on every stage's rank and written once.
- **expert_parallel** (`ExpertParallelPlan`): an expert leaf, and the optimizer state of it,
  is slice ``index`` of ``size`` along dim 0 of the full leaf (the rule of its ``consolidate``,
  `fscale.parallel.moe.plan.is_expert_state`).
- **tensor_parallel** (a module made by `fscale.tensor_parallel`): the state holds this rank's
  shard under the dense name; the module's `Split` of that name says which chunk of which
  dimension it is, within each of its blocks (a fused q/k/v projection has three). A
  parameter's optimizer moments share its split; replicated leaves stay whole.

Each is a function ``pieces -> pieces``; `describe` names them for the manifest.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fscale.ckpt.boxes import Piece, split_pieces
from fscale.functional import FunctionalModule
from fscale.parallel.moe.plan import ExpertParallelPlan, is_expert_state
from fscale.parallel.pipeline.layer import PipelinePlan
from fscale.parallel.tensor.apply import AXIS_ATTR, SPLITS_ATTR
from fscale.parallel.tensor.layers import TensorAxis

__all__ = [
    "PLACING_LAYERS",
    "describe",
    "place_experts",
    "place_layer",
    "place_stages",
    "place_tensor_parallel",
    "tensor_parallel_of",
]

PLACING_LAYERS = ("pipeline", "expert_parallel")


def place_layer(layer: Any, pieces: list[Piece]) -> list[Piece]:
    """`pieces` of `layer`'s inner plan's full state, as pieces of `layer`'s full state."""
    if isinstance(layer, PipelinePlan):
        return place_stages(layer, pieces)
    if isinstance(layer, ExpertParallelPlan):
        return place_experts(layer, pieces)
    raise TypeError(f"no placement for the layer {layer.name!r}")


def describe(layer: Any) -> str:
    """One line for the manifest: how `layer` places this rank's pieces."""
    if isinstance(layer, PipelinePlan):
        return (
            f"pipeline over {layer.axis!r}: {layer.schedule.num_stages} stages on "
            f"{layer.schedule.num_ranks} ranks"
        )
    if isinstance(layer, ExpertParallelPlan):
        return f"expert_parallel over {layer.axis!r}: {layer.mesh.size(layer.axis)} expert slices"
    if isinstance(layer, TensorAxis):
        return f"tensor_parallel over {layer.axis!r}: {layer.size} shards"
    raise TypeError(f"no placement for {layer!r}")


# ---- pipeline -----------------------------------------------------------------------------


def place_stages(plan: PipelinePlan, pieces: list[Piece]) -> list[Piece]:
    """Pieces of this rank's stages as pieces of the whole model (see the module docstring)."""
    by_name = plan.stages.param_names is not None
    local = plan.local

    def full_path(path: str) -> str:
        position, _, rest = path.partition(".")
        stage = local[int(position)]
        if by_name:
            return rest
        return f"{stage}.{rest}" if rest else str(stage)

    out = []
    for piece in pieces:
        group, _, path = piece.key.partition("/")
        mirrors = piece.mirrors
        if group in ("params", "buffers"):
            key = f"{group}/{full_path(path)}"
            mirrors = key if mirrors is not None else None
        elif group == "opt_state" and mirrors is not None:
            param_path = mirrors.removeprefix("params/")
            outer = path[: len(path) - len(param_path)]
            key = f"opt_state/{outer}{full_path(param_path)}"
            mirrors = f"params/{full_path(param_path)}"
        else:
            key = piece.key  # the same on every stage's rank
        out.append(piece._replace(key=key, mirrors=mirrors))
    return out


# ---- expert parallel ----------------------------------------------------------------------


def place_experts(plan: ExpertParallelPlan, pieces: list[Piece]) -> list[Piece]:
    """Pieces of this rank's expert slices as pieces of the full expert leaves."""
    size, index = plan.mesh.size(plan.axis), plan.mesh.rank(plan.axis)
    names, shapes = [], []
    for piece in pieces:
        group, _, path = piece.key.partition("/")
        if group == "params" and plan.experts(path) and path not in names:
            names.append(path)
            shapes.append(piece.shape)
    out = []
    for piece in pieces:
        group, _, path = piece.key.partition("/")
        if group in ("params", "opt_state") and is_expert_state(path, piece.shape, names, shapes):
            out.extend(split_pieces(piece, 0, 1, size, index))
        else:
            out.append(piece)
    return out


# ---- tensor parallel ----------------------------------------------------------------------


def tensor_parallel_of(model: Any) -> tuple[dict[str, Any], TensorAxis] | None:
    """``(splits by parameter name, axis)`` of a `tensor_parallel` module (or the
    FunctionalModule of one); None for any other model, or None."""
    module = model.module if isinstance(model, FunctionalModule) else model
    if not isinstance(module, nn.Module):
        return None
    splits = getattr(module, SPLITS_ATTR, None)
    tp = getattr(module, AXIS_ATTR, None)
    if not isinstance(splits, dict) or not isinstance(tp, TensorAxis):
        return None
    return splits, tp


def place_tensor_parallel(
    splits: dict[str, Any], tp: TensorAxis, pieces: list[Piece]
) -> list[Piece]:
    """Pieces of this rank's shards (under the dense names) as pieces of the dense leaves."""
    out = []
    for piece in pieces:
        name = piece.mirrors.removeprefix("params/") if piece.mirrors else None
        split = splits.get(name) if name is not None else None
        if split is None or tp.size == 1:
            out.append(piece)
        else:
            out.extend(split_pieces(piece, split.dim, split.parts, tp.size, tp.index))
    return out
