"""Megatron's tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Each layer holds this rank's contiguous shard of the dense layer's parameters under the dense
names (``weight``, ``bias``), so a model keeps its parameter names after `tensor_parallel`, and
places the collectives of the region around its computation (``N`` ranks on the axis)::

    layer                  parameters (this rank r)          forward               backward
    ---------------------  --------------------------------  --------------------  ------------
    ColumnParallelLinear   weight rows r, bias entries r     f(x) @ W_r^T + b_r    f: all-reduce
    RowParallelLinear      weight columns r, the whole bias  g(x_r @ W_r^T) + b    g: identity
    VocabParallelEmbedding rows r (token ids r*V/N ...)      g(lookup, 0 outside)  g: identity

``f`` is `fscale.distributed.replicate` and ``g`` `fscale.distributed.all_reduce` (op "sum"),
so the activations entering and leaving the region are replicated and every rank's loss is the
dense loss. A column-parallel layer's output is this rank's slice of the last dimension, which
is what a row-parallel layer consumes; ``gather_output`` gathers it instead (for a replicated
consumer: `gather_replicated`). With ``parts`` > 1 the dense output is ``parts`` blocks (a fused
query/key/value projection) and each block is split on its own, so rank r holds block p's
chunk r for every p, and the gathered output is put back in the dense order.

Under sequence parallelism the activations outside the region are sequence shards: a column-
parallel layer's input is all-gathered along the sequence (``input="sequence"``; its dual
reduce-scatters the gradient), and a row-parallel layer or the embedding reduce-scatters its
output along the sequence (``output="sequence"``) instead of all-reducing it. The row-parallel
bias is then added to a shard, so it is used through ``replicate``: its gradient, partial on
each rank, is summed over the axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fscale.distributed import all_gather, all_reduce, reduce_scatter, replicate
from fscale.distributed.mesh import Mesh
from fscale.parallel.tensor.regions import gather_replicated, split_replicated

__all__ = [
    "INPUTS",
    "OUTPUTS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorAxis",
    "VocabParallelEmbedding",
    "enter_region",
]

Tensor = torch.Tensor

INPUTS = ("replicated", "sequence", "local")
"""How an input reaches a layer: replicated (enter with ``f``), sequence shards (all-gather), or
already this rank's part of the region (nothing to do)."""

OUTPUTS = ("replicated", "sequence")
"""How a reduced output leaves: all-reduced, or reduce-scattered along the sequence."""


class TensorAxis:
    """The mesh axis a tensor-parallel layer runs over, and the sequence dimension it splits.

    Shared by every layer of one model; copies of a module share it (a mesh is a handle on
    process groups, not state to copy).

    Attributes:
        mesh: the mesh.
        axis: the tensor-parallel axis name.
        size: ranks along the axis.
        index: this rank's index along it.
        sequence_dim: the sequence dimension of activations (1 for ``[batch, time, ...]``).
    """

    def __init__(self, mesh: Mesh, axis: str, sequence_dim: int = 1) -> None:
        self.mesh = mesh
        self.axis = axis
        self.size = mesh.size(axis)
        self.index = mesh.rank(axis)
        self.sequence_dim = sequence_dim

    def __deepcopy__(self, memo: dict[int, object]) -> TensorAxis:
        return self

    def __repr__(self) -> str:
        return f"TensorAxis({self.axis!r}, size={self.size}, index={self.index})"


def enter_region(x: Tensor, how: str, tp: TensorAxis) -> Tensor:
    """`x` as a region's input: ``f`` for a replicated value, the all-gather of sequence shards,
    the split of a replicated value into sequence shards ("split"), or `x` itself ("local")."""
    if how == "replicated":
        return replicate(x, tp.axis, "sum", mesh=tp.mesh)
    if how == "sequence":
        return all_gather(x, tp.axis, tp.sequence_dim, mesh=tp.mesh)
    if how == "split":
        return split_replicated(x, tp.axis, tp.sequence_dim, mesh=tp.mesh)
    return x


def _leave_region(y: Tensor, how: str, tp: TensorAxis) -> Tensor:
    if how == "sequence":
        return reduce_scatter(y, tp.axis, tp.sequence_dim, mesh=tp.mesh)
    return all_reduce(y, tp.axis, mesh=tp.mesh)


class ColumnParallelLinear(nn.Module):
    """A Linear whose output features are split over the axis (see the module docstring).

    Args:
        weight: this rank's rows of the dense weight, ``[out / N, in]``.
        bias: this rank's entries of the dense bias, or None.
        tp: the axis.
        input: one of `INPUTS`.
        gather_output: return the full output (replicated) instead of this rank's slice.
        parts: how many blocks the dense output is made of, each split on its own.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        tp: TensorAxis,
        *,
        input: str = "replicated",
        gather_output: bool = False,
        parts: int = 1,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp = tp
        self.input = input
        self.gather_output = gather_output
        self.parts = parts

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(enter_region(x, self.input, self.tp), self.weight, self.bias)
        if not self.gather_output:
            return y
        y = gather_replicated(y, self.tp.axis, -1, mesh=self.tp.mesh)
        if self.parts > 1 and self.tp.size > 1:
            # Gathered as (rank, part, chunk); the dense order is (part, rank, chunk).
            y = y.unflatten(-1, (self.tp.size, self.parts, -1)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (
            f"in_features={inp}, out_features={out} of {out * self.tp.size}, "
            f"input={self.input!r}, gather_output={self.gather_output}, parts={self.parts}"
        )


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the axis; the output is reduced.

    Args:
        weight: this rank's columns of the dense weight, ``[out, in / N]``.
        bias: the whole dense bias, or None; added once, after the reduction.
        tp: the axis.
        input: "local" (this rank's slice, from a column-parallel layer) or "replicated" (the
            full input, sliced here).
        output: one of `OUTPUTS`.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        tp: TensorAxis,
        *,
        input: str = "local",
        output: str = "replicated",
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp = tp
        self.input = input
        self.output = output

    def forward(self, x: Tensor) -> Tensor:
        if self.input == "replicated" and self.tp.size > 1:
            x = _split_last(x, self.tp)
        y = _leave_region(F.linear(x, self.weight), self.output, self.tp)
        if self.bias is None:
            return y
        bias = self.bias
        if self.output == "sequence":
            bias = replicate(bias, self.tp.axis, "sum", mesh=self.tp.mesh)
        return y + bias

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (
            f"in_features={inp} of {inp * self.tp.size}, out_features={out}, "
            f"input={self.input!r}, output={self.output!r}"
        )


def _split_last(x: Tensor, tp: TensorAxis) -> Tensor:
    return split_replicated(x.movedim(-1, 0), tp.axis, 0, mesh=tp.mesh).movedim(0, -1)


class VocabParallelEmbedding(nn.Module):
    """An Embedding whose rows (token ids) are split over the axis; lookups are summed.

    Each rank looks up the ids in its range ``[r * V/N, (r + 1) * V/N)`` and zeros the others,
    so the sum over the ranks is the dense lookup exactly (each position adds one row and
    zeros).

    Args:
        weight: this rank's rows of the dense weight, ``[V / N, dim]``.
        tp: the axis.
        padding_idx: the dense layer's padding index (its gradient row stays zero), or None.
        output: one of `OUTPUTS`.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        tp: TensorAxis,
        *,
        padding_idx: int | None = None,
        output: str = "replicated",
    ) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp
        self.output = output
        rows = weight.shape[0]
        self.vocab_start = tp.index * rows
        self.local_padding_idx = (
            padding_idx - self.vocab_start
            if padding_idx is not None and 0 <= padding_idx - self.vocab_start < rows
            else None
        )

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.weight.shape[0]
        local_ids = ids - self.vocab_start
        mine = (local_ids >= 0) & (local_ids < rows)
        looked_up = F.embedding(
            torch.where(mine, local_ids, 0), self.weight, padding_idx=self.local_padding_idx
        )
        looked_up = looked_up * mine.unsqueeze(-1).to(looked_up.dtype)
        if self.tp.size == 1:
            return looked_up
        return _leave_region(looked_up, self.output, self.tp)

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return (
            f"{rows} of {rows * self.tp.size} rows from {self.vocab_start}, {dim}, "
            f"output={self.output!r}"
        )
