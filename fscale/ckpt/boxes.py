"""`Piece`: a box of one leaf of the full state, and the box arithmetic every layout needs.

A checkpoint stores each leaf of the full state (the one a single-process `train_step` holds)
as a tensor of its own shape; a rank writes the boxes of it that it holds, each an offset and a
size per dimension (DCP's chunks). The layouts describe what a rank holds in three ways, all
turned into boxes here:

- a whole leaf (a replicated parameter, a step count): one box, the leaf;
- elements ``[start, stop)`` of the row-major flattening (ZeRO and FSDP fragments): at most
  ``2·(ndim − 1) + 1`` boxes (`range_pieces`): the rest of the first partial row, the whole
  rows, the start of the last partial row, each found the same way one dimension down;
- chunk ``index`` of ``size`` along one dimension, taken within each of ``parts`` equal blocks
  (a tensor-parallel shard, a fused q/k/v projection's, an expert-parallel slice): a box of
  the local tensor maps to one box of the full tensor per block it meets (`split_pieces`).

Boxes of every layout tile the same full leaves, so a load under any layout reads, for each of
its boxes, the overlapping parts of whatever boxes were saved.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Piece", "range_boxes", "range_pieces", "split_pieces", "whole_piece"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""``(offsets, sizes, begin)``: a box and where its elements begin in the range it came from."""


class Piece(NamedTuple):
    """The box of the full leaf `key` at `offsets` that this rank holds, with its `values`.

    Attributes:
        key: the leaf (``params/<path>``, ``buffers/<path>``, ``opt_state/<path>``, ``step``,
            ``key``).
        shape: the full leaf's shape.
        dtype: its dtype.
        offsets: the box's first index in every dimension.
        values: the box (its shape is the box's size), a view of the state's tensor.
        mirrors: the ``params/`` key of the parameter this leaf is the per-element state of
            (a moment; a parameter names itself), whose split it shares; None otherwise.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]
    values: torch.Tensor
    mirrors: str | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def index(self) -> tuple[str, tuple[int, ...]]:
        """What identifies the box among all ranks' boxes (DCP's chunk index)."""
        return self.key, self.offsets


def whole_piece(key: str, leaf: torch.Tensor, mirrors: str | None = None) -> Piece:
    """The whole of `leaf` as one piece."""
    shape = tuple(leaf.shape)
    return Piece(key, shape, leaf.dtype, (0,) * len(shape), leaf.detach(), mirrors)


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes that elements ``[start, stop)`` of a row-major `shape` fill, in order."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = 1
    for size in shape[1:]:
        inner *= size
    rest = (0,) * (len(shape) - 1)
    boxes: list[Box] = []

    def row_part(row: int, lo: int, hi: int) -> None:
        for offsets, sizes, begin in range_boxes(shape[1:], lo, hi):
            boxes.append(((row, *offsets), (1, *sizes), row * inner + lo - start + begin))

    position = start
    if position % inner:  # the end of a row
        row = position // inner
        end = min(stop, (row + 1) * inner)
        row_part(row, position - row * inner, end - row * inner)
        position = end
    rows = (stop - position) // inner
    if rows:
        boxes.append(((position // inner, *rest), (rows, *shape[1:]), position - start))
        position += rows * inner
    if position < stop:  # the start of a row
        row_part(position // inner, 0, stop - position)
    return boxes


def range_pieces(
    key: str,
    shape: tuple[int, ...],
    start: int,
    values: torch.Tensor,
    mirrors: str | None = None,
) -> list[Piece]:
    """Elements ``[start, start + values.numel())`` of the full leaf as pieces.

    `values` is 1-D and contiguous; each piece's values are a view of it.
    """
    flat = values.detach().reshape(-1)
    stop = start + flat.numel()
    return [
        Piece(
            key,
            tuple(shape),
            flat.dtype,
            offsets,
            flat[begin : begin + _numel(sizes)].view(sizes),
            mirrors,
        )
        for offsets, sizes, begin in range_boxes(tuple(shape), start, stop)
    ]


def split_pieces(piece: Piece, dim: int, parts: int, size: int, index: int) -> list[Piece]:
    """`piece` of a local tensor that is chunk `index` of `size` along `dim`, taken within each
    of `parts` blocks, as pieces of the full tensor (``size`` times longer along `dim`)."""
    length = piece.shape[dim]
    chunk = length // parts
    if chunk * parts != length:
        raise ValueError(
            f"the leaf {piece.key!r} of shape {list(piece.shape)} does not split into {parts} "
            f"blocks along dim {dim}"
        )
    full_shape = list(piece.shape)
    full_shape[dim] = length * size
    lo = piece.offsets[dim]
    hi = lo + piece.values.shape[dim]
    out = []
    position = lo
    while position < hi:
        block = position // chunk
        end = min(hi, (block + 1) * chunk)
        offsets = list(piece.offsets)
        offsets[dim] = block * chunk * size + index * chunk + position - block * chunk
        values = piece.values.narrow(dim, position - lo, end - position)
        out.append(piece._replace(shape=tuple(full_shape), offsets=tuple(offsets), values=values))
        position = end
    return out


def _numel(sizes: tuple[int, ...]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count
