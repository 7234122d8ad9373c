"""DCP planners for `Piece`s: each full leaf a 1-D global tensor, each rank's piece a chunk.

torch.distributed.checkpoint describes a sharded tensor by its global size and the chunks
(offset and size per dimension) each rank writes; its default planners find the chunks in
DTensors or ShardedTensors. fscale's pieces are neither: ZeRO and FSDP fragments are 1-D slices
of uneven length. So a full leaf is stored as its row-major flattening, a 1-D global tensor of
``numel`` elements, and a piece is the chunk ``[start, start + len)`` of it; the shape is kept
in fscale's manifest. Everything else is DCP's: replicated pieces (the same key and offset on
several ranks) are written once (`DefaultSavePlanner`'s deduplication), the global metadata
is checked for gaps and overlaps, and a load reads, for every local chunk, the overlapping
parts of the saved chunks (`create_read_items_for_chunk_list`), whatever world size and
layout wrote them. Non-tensor leaves are stored as bytes.
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

from fscale.ckpt.pieces import Piece

__all__ = ["PieceLoadPlanner", "PieceSavePlanner", "numel_of"]


def numel_of(shape: Sequence[int]) -> int:
    """Elements of a leaf of `shape` (a scalar has one)."""
    return int(torch.Size(shape).numel())


class PieceSavePlanner(DefaultSavePlanner):
    """Writes this rank's `pieces`; DCP is given ``{key: values}`` (the values, or copies)."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        # A rank with no elements of a leaf (a small FSDP unit's padding) writes nothing of it.
        self.by_index = {(p.key, p.start): p for p in pieces if p.values.numel()}

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, start), piece in self.by_index.items():
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([start]), sizes=torch.Size([piece.values.numel()])
            )
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size([start])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties(dtype=piece.dtype),
                        size=torch.Size([numel_of(piece.shape)]),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        # The values DCP was given (for an async save, its staged copies), by leaf key: a
        # rank holds one piece of each leaf.
        return self.state_dict[index.fqn]


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads what this rank's pieces need, from whatever chunks the checkpoint holds.

    DCP is given ``{key: piece.values}``; after the load, the pieces' tensors hold the values.
    """

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = [p for p in pieces if p.values.numel()]
        self.by_index = {(p.key, p.start): p for p in self.pieces}

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
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([piece.start]), sizes=torch.Size([piece.values.numel()])
            )
            items.extend(create_read_items_for_chunk_list(piece.key, stored, [chunk]))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = read_item.dest_index
        start = 0 if dest.offset is None else dest.offset[0]
        values = self.by_index[(dest.fqn, start)].values
        return values.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
