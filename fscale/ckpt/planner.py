"""DCP planners for `Piece`s: each full leaf a global tensor, each rank's box a chunk of it.

torch.distributed.checkpoint describes a sharded tensor by its global size and the chunks
(offset and size per dimension) each rank writes; its default planners find the chunks in
DTensors or ShardedTensors. fscale's pieces are neither, but they are boxes of the full leaves
(`fscale.ckpt.boxes`), which is what a chunk is: a leaf is stored under its key with its full
shape, and every piece is the chunk at its offsets. Everything else is DCP's: replicated pieces
(the same key and offsets on several ranks) are written once (`DefaultSavePlanner`'s
deduplication), the global metadata is checked for gaps and overlaps, and a load reads, for
every local box, the overlapping parts of the saved chunks (`create_read_items_for_chunk_list`),
whatever world size and layout wrote them. A plain ``dcp.load`` of full tensors reads such a
checkpoint too.

Format version 1 stored every leaf as its row-major flattening (a 1-D global tensor). A load
from such a checkpoint reads, for each box, the range of the flattening from its first element
to its last into a scratch tensor, and copies the box out of it (`PieceLoadPlanner.finish`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fscale.ckpt.boxes import Piece

__all__ = ["PieceLoadPlanner", "PieceSavePlanner", "numel_of", "piece_name"]


def numel_of(shape: Sequence[int]) -> int:
    """Elements of a leaf of `shape` (a scalar has one)."""
    return int(torch.Size(shape).numel())


def piece_name(piece: Piece) -> str:
    """The name of `piece`'s values in the dict given to DCP (a rank may hold several boxes
    of one leaf)."""
    return _name(piece.key, piece.offsets)


def _name(key: str, offsets: Sequence[int]) -> str:
    return f"{key}@{','.join(map(str, offsets))}"


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes))


class PieceSavePlanner(DefaultSavePlanner):
    """Writes this rank's `pieces`; DCP is given ``{piece_name: values}`` (or copies)."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        # A rank with no elements of a leaf (a small FSDP unit's padding) writes nothing of it.
        self.pieces = [p for p in pieces if p.values.numel()]

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(piece.key, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(piece),
                    properties=TensorProperties(dtype=piece.dtype),
                    size=torch.Size(piece.shape),
                ),
            )
            for piece in self.pieces
        ]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        # The values DCP was given (for an async save, its staged copies).
        return self.state_dict[_name(index.fqn, () if index.offset is None else index.offset)]


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads what this rank's pieces need, from whatever chunks the checkpoint holds.

    DCP is given ``{piece_name: values}``; after the load and `finish`, the pieces' tensors
    hold the values.
    """

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = [p for p in pieces if p.values.numel()]
        # Per local chunk: what DCP fills (the piece, or a scratch range of a version 1 leaf).
        self.targets: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.copies: list[tuple[Piece, torch.Tensor]] = []

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for piece in self.pieces:
            stored = saved.get(piece.key)
            if not isinstance(stored, TensorStorageMetadata):
                raise ValueError(
                    f"the checkpoint's DCP metadata has no tensor {piece.key!r} (damaged?)"
                )
            if tuple(stored.size) == tuple(piece.shape):
                chunk = _chunk(piece)
                self.targets[(piece.key, piece.offsets)] = piece.values
            elif len(stored.size) == 1 and stored.size[0] == numel_of(piece.shape):
                chunk = self._flat_range(piece)
            else:
                raise ValueError(
                    f"the checkpoint stores {piece.key!r} with shape {list(stored.size)}, "
                    f"not {list(piece.shape)} (damaged?)"
                )
            items.extend(create_read_items_for_chunk_list(piece.key, stored, [chunk]))
        return LoadPlan(items)

    def _flat_range(self, piece: Piece) -> ChunkStorageMetadata:
        """The version 1 chunk holding `piece`: its flattening's range, read into scratch."""
        strides = torch.empty(piece.shape, device="meta").stride()
        first = sum(o * s for o, s in zip(piece.offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(piece.offsets, piece.sizes, strides))
        scratch = torch.empty(last - first + 1, dtype=piece.dtype)
        self.targets[(piece.key, (first,))] = scratch
        self.copies.append((piece, scratch))
        return ChunkStorageMetadata(offsets=torch.Size([first]), sizes=scratch.shape)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = read_item.dest_index
        offsets = () if dest.offset is None else tuple(dest.offset)
        target = self.targets[(dest.fqn, offsets)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        """Copy the boxes out of the scratch ranges read from a version 1 checkpoint."""
        for piece, scratch in self.copies:
            strides = torch.empty(piece.shape, device="meta").stride()
            # The scratch range starts at the box's first element.
            piece.values.copy_(scratch.as_strided(piece.sizes, strides, 0))
