"""A checkpoint read in one CPU process: full leaves, a safetensors export, a summary.

`read_leaves` joins every saved chunk of the leaves asked for into full tensors, whatever world
size and plan wrote them (DCP reads the chunks; no process group is needed). `export` writes
the model's ``state_dict`` from them as one safetensors file: every key of the module's
``state_dict``, tied weights under each of their names (as separate tensors, since
safetensors stores no aliases), in the dtype the state holds its parameters in (the full
precision master copy). Tensor-parallel shards, pipeline stages and expert slices are boxes of
those full leaves like any others, so the export gathers them too. `describe` is what
``fscale inspect`` prints, the boxes each leaf was saved in among it.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from fscale.ckpt import dcp_io
from fscale.ckpt import directory as dirs
from fscale.ckpt.boxes import whole_piece
from fscale.ckpt.manifest import CheckpointError, Manifest, dtype_of, read_manifest
from fscale.ckpt.planner import PieceLoadPlanner, numel_of, piece_name
from fscale.ckpt.save import FAILURES, single_process_quiet

__all__ = ["RankBytes", "bytes_per_rank", "chunk_grids", "describe", "export", "read_leaves"]

_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def read_leaves(
    path: str | os.PathLike[str], keys: Iterable[str] | None = None
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest of the checkpoint at `path` and its full leaves `keys` (default: all).

    Raises:
        CheckpointError / FileNotFoundError: as `fscale.ckpt.load`, or a key the checkpoint
            does not hold.
    """
    directory = dirs.resolve(path, "read_leaves")
    manifest = read_manifest(directory)
    wanted = list(manifest.leaves) if keys is None else list(keys)
    unknown = [key for key in wanted if key not in manifest.leaves]
    if unknown:
        raise CheckpointError(f"read_leaves: the checkpoint holds no leaves {unknown}")
    pieces = []
    for key in wanted:
        shape, dtype = manifest.leaves[key]
        pieces.append(whole_piece(key, torch.zeros(shape, dtype=dtype_of(dtype))))
    state_dict = {piece_name(p): p.values for p in pieces if p.values.numel()}
    planner = PieceLoadPlanner(pieces)
    with single_process_quiet():
        try:
            dcp_io.read(state_dict, FileSystemReader(directory), planner, None)
        except FAILURES as error:
            raise CheckpointError(
                f"the checkpoint {str(directory)!r} could not be read (truncated or damaged "
                f"files?): {error}"
            ) from None
    planner.finish()
    return manifest, {p.key: p.values for p in pieces}


def export(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Write the model's ``state_dict`` from the checkpoint at `path` to the safetensors `out`.

    ``module.load_state_dict(safetensors.torch.load_file(out), strict=True)`` accepts it on the
    module that was trained (the checkpoint must have been saved with ``model=``).

    Returns:
        The tensors written, by ``state_dict`` key.

    Raises:
        CheckpointError: the checkpoint has no model names (saved without ``model=``).
        ImportError: safetensors is not installed.
    """
    from safetensors.torch import save_file

    directory = dirs.resolve(path, "export")
    manifest = read_manifest(directory)
    if not manifest.model:
        raise CheckpointError(
            f"export: {str(directory)!r} was saved without `model=`, so the names of the "
            "module's state_dict are unknown; save with fscale.save(..., model=apply)"
        )
    mapping: dict[str, str] = manifest.model["state_dict"]
    _, leaves = read_leaves(directory, sorted(set(mapping.values())))
    tensors = {name: leaves[key].clone().contiguous() for name, key in mapping.items()}
    metadata = {"format": "pt", "step": str(manifest.step), "module": manifest.model["module"]}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return tensors


class RankBytes(NamedTuple):
    """What one rank wrote: its tensor data, the bytes of its files, and its chunks."""

    data: int
    written: int
    chunks: int


def bytes_per_rank(directory: Path) -> dict[int, RankBytes]:
    """What each rank wrote into its data files (from DCP's metadata)."""
    metadata = FileSystemReader(directory).read_metadata()
    storage = metadata.storage_data or {}
    data: collections.Counter[int] = collections.Counter()
    written: collections.Counter[int] = collections.Counter()
    chunks: collections.Counter[int] = collections.Counter()
    for key, stored in metadata.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        itemsize = stored.properties.dtype.itemsize
        for chunk in stored.chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            rank = _rank_of(info)
            if info is not None and rank is not None:
                data[rank] += numel_of(chunk.sizes) * itemsize
                written[rank] += int(info.length)
                chunks[rank] += 1
    return {rank: RankBytes(data[rank], written[rank], chunks[rank]) for rank in sorted(data)}


def _rank_of(info: Any) -> int | None:
    match = _DCP_FILE.fullmatch(Path(str(getattr(info, "relative_path", ""))).name)
    return int(match.group(1)) if match else None


def chunk_grids(directory: Path) -> dict[str, tuple[int, ...]]:
    """Per leaf, how many distinct boxes along each dimension its saved chunks form."""
    metadata = FileSystemReader(directory).read_metadata()
    grids = {}
    for key, stored in metadata.state_dict_metadata.items():
        if isinstance(stored, TensorStorageMetadata):
            grids[key] = tuple(
                len({chunk.offsets[dim] for chunk in stored.chunks})
                for dim in range(len(stored.size))
            )
    return grids


def describe(path: str | os.PathLike[str], *, leaves: bool = True) -> str:
    """What the checkpoint at `path` holds: plan, placements, world size, step, leaves (with
    the boxes they were saved in), and bytes per rank."""
    directory = dirs.resolve(path, "inspect")
    manifest = read_manifest(directory)
    total = sum(numel_of(s) * dtype_of(d).itemsize for s, d in manifest.leaves.values())
    lines = [
        f"checkpoint  {directory}",
        f"format      version {manifest.version}",
        f"step        {manifest.step}",
        f"plan        {manifest.plan}",
        f"world size  {manifest.world_size} (layout: {manifest.layout})",
        *[f"placement   {line}" for line in manifest.placements],
        f"leaves      {len(manifest.leaves)}, {_size(total)} in full",
        f"model       {manifest.model['module'] if manifest.model else '(names not saved)'}",
        "bytes per rank (tensor data; as written, with DCP's framing of each chunk):",
    ]
    lines += [
        f"  rank {rank}: {_size(n.data)} in {n.chunks} chunks ({_size(n.written)} written)"
        for rank, n in bytes_per_rank(directory).items()
    ]
    if leaves:
        grids = chunk_grids(directory)
        lines.append("leaves (boxes saved along each dimension):")
        for key, (shape, dtype) in manifest.leaves.items():
            grid = grids.get(key, ())
            split = " x ".join(map(str, grid)) if any(n > 1 for n in grid) else "whole"
            lines.append(f"  {key}  {list(shape)}  {dtype}  {split}")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"
