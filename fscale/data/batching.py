"""Language-model batches: B contiguous token streams cut into windows, and per-rank slices.

The layout is the one of the WikiText language-model benchmarks. `batchify` cuts a token
sequence into ``B`` contiguous streams, the columns of a time-major ``[T, B]`` tensor::

    ids = a b c d e f g h i j k l m   (13 tokens), batch_size = 3, remainder m dropped

          stream 0  stream 1  stream 2
    row 0    a         e         i
    row 1    b         f         j
    row 2    c         g         k
    row 3    d         h         l

`LMBatches` walks down the rows ``seq_len`` at a time. Batch ``i`` reads the ``seq_len + 1``
rows ``[i * seq_len, i * seq_len + seq_len + 1)``: the inputs are its first ``seq_len`` rows
and the targets the last ``seq_len`` (the next token of each input), so consecutive batches
overlap by one row and no token is a target twice (with ``drop_last=False``, every token but
a stream's first is a target exactly once). Tokens are never shuffled: stream ``b`` of batch
``i + 1`` continues stream ``b`` of batch ``i``, which is what lets a recurrent model carry its
state across batches.

Data parallelism splits the *streams* of every global batch: rank ``r`` of ``n`` reads streams
``[r * B / n, (r + 1) * B / n)``, so the ranks' batches are disjoint, together are exactly the
global batch, and each rank's streams stay contiguous from batch to batch. `split_batch` does
the same for any pytree of tensors (image batches, masks), along a chosen dimension.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from fscale import tree

__all__ = ["LMBatch", "LMBatches", "batchify", "shard_batch", "split_batch"]

PyTree = Any


class LMBatch(NamedTuple):
    """Inputs and next-token targets of a language-model batch, both of one shape.

    Time-major ``[T, B]`` as `LMBatches` yields by default (column ``b`` is stream ``b``), or
    batch-major ``[B, T]`` after `batch_major` (row ``b`` is stream ``b``), the layout of
    models that take ``[batch, time]``.
    """

    inputs: torch.Tensor
    targets: torch.Tensor

    def batch_major(self) -> LMBatch:
        """This time-major ``[T, B]`` batch as batch-major ``[B, T]`` (contiguous tensors).

        A batch does not record its layout: this is a transpose, so call it once, on a batch
        from `LMBatches` with the default ``batch_major=False``.
        """
        return LMBatch(self.inputs.t().contiguous(), self.targets.t().contiguous())


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _check_int(value: object, name: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: `{name}` must be an int >= {minimum}, got {value!r}")
    return value


def _check_rank(rank: object, world_size: object, where: str) -> tuple[int, int]:
    world_size = _check_int(world_size, "world_size", where, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"{where}: `rank` must be an int in [0, world_size={world_size}), got {rank!r}"
        )
    return rank, world_size


def batchify(ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Cut a token sequence into `batch_size` contiguous streams: a time-major ``[T, B]`` tensor.

    Args:
        ids: a 1-D integer tensor of token ids (the whole split, concatenated).
        batch_size: the number of streams ``B``.

    Returns:
        A contiguous ``[T, B]`` tensor, ``T = len(ids) // B``, whose column ``b`` is
        ``ids[b * T:(b + 1) * T]``; the last ``len(ids) % B`` tokens are dropped. Same dtype and
        device as `ids`.

    Raises:
        TypeError: `ids` is not a 1-D integer tensor.
        ValueError: `batch_size` < 1 or larger than the number of tokens.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(
            f"batchify: `ids` must be a 1-D integer tensor of token ids, got {_describe(ids)}; "
            "encode the text with a tokenizer and concatenate it first"
        )
    batch_size = _check_int(batch_size, "batch_size", "batchify", 1)
    num_rows = ids.numel() // batch_size
    if num_rows == 0:
        raise ValueError(
            f"batchify: `batch_size`={batch_size} streams need at least {batch_size} tokens, "
            f"but `ids` has {ids.numel()}; use a smaller batch_size or a longer corpus"
        )
    return ids[: num_rows * batch_size].view(batch_size, num_rows).t().contiguous()


class LMBatches:
    """The language-model batches of a ``[T, B]`` stream tensor, ``seq_len`` rows at a time.

    Batch ``i`` reads rows ``[i * seq_len, i * seq_len + seq_len + 1)`` of `data` (the
    ``seq_len + 1`` trick: inputs are the first ``seq_len`` rows, targets the last
    ``seq_len``). Batches come in order and streams are never shuffled, so stream ``b``
    continues across consecutive batches. Indexing (``batches[i]``) and ``len`` are supported;
    iterating again starts over.

    Args:
        data: a ``[T, B]`` integer tensor from `batchify`.
        seq_len: the number of positions per batch (time steps the model sees).
        rank: this data-parallel rank; each rank reads its own contiguous ``B / world_size``
            streams (see `shard_batch`).
        world_size: the number of data-parallel ranks; must divide ``B``.
        batch_major: yield ``[B_local, seq_len]`` batches instead of ``[seq_len, B_local]``.
        drop_last: leave out the final, shorter batch when ``T - 1`` is not a multiple of
            `seq_len` (the default keeps every batch the same shape); pass False to cover
            every token, e.g. to evaluate on a whole split.

    Yields:
        `LMBatch` of contiguous tensors on `data`'s device.

    Raises:
        TypeError: `data` is not a 2-D integer tensor.
        ValueError: ``seq_len + 1`` rows do not fit in `data`, or ``B`` does not divide by
            `world_size`, or a bad `rank`.
    """

    def __init__(
        self,
        data: torch.Tensor,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        batch_major: bool = False,
        drop_last: bool = True,
    ) -> None:
        where = "LMBatches"
        if (
            not isinstance(data, torch.Tensor)
            or data.dim() != 2
            or data.dtype not in _INTEGER_DTYPES
        ):
            raise TypeError(
                f"{where}: `data` must be a 2-D [T, B] integer tensor from batchify, got "
                f"{_describe(data)}"
            )
        seq_len = _check_int(seq_len, "seq_len", where, 1)
        rank, world_size = _check_rank(rank, world_size, where)
        num_rows, num_streams = data.shape
        if num_rows < seq_len + 1:
            raise ValueError(
                f"{where}: `seq_len`={seq_len} needs seq_len + 1 = {seq_len + 1} rows (inputs "
                f"plus the shifted targets) but `data` has only {num_rows} rows of "
                f"{num_streams} streams; use seq_len <= {num_rows - 1}, fewer streams in "
                "batchify (each stream gets more rows) or a longer corpus"
            )
        if num_streams % world_size:
            raise ValueError(
                f"{where}: the {num_streams} streams of `data` do not divide among "
                f"`world_size`={world_size} ranks; batchify with a batch_size that is a "
                f"multiple of {world_size}"
            )
        self.data = data
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.batch_major = bool(batch_major)
        self.drop_last = bool(drop_last)

    @property
    def streams_per_rank(self) -> int:
        """The number of streams ``B / world_size`` in each rank's batch."""
        return self.data.shape[1] // self.world_size

    def __len__(self) -> int:
        # Row 0 is never a target, so T - 1 target rows are cut into windows of seq_len.
        num_full, remainder = divmod(self.data.shape[0] - 1, self.seq_len)
        return num_full + (1 if remainder and not self.drop_last else 0)

    def __getitem__(self, index: int) -> LMBatch:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"LMBatches: index must be an int, got {type(index).__name__}")
        num_batches = len(self)
        if not -num_batches <= index < num_batches:
            raise IndexError(f"LMBatches: batch {index} out of range for {num_batches} batches")
        index %= num_batches
        start = index * self.seq_len
        length = min(self.seq_len, self.data.shape[0] - 1 - start)
        width = self.streams_per_rank
        window = self.data.narrow(0, start, length + 1).narrow(1, self.rank * width, width)
        batch = LMBatch(window[:-1].contiguous(), window[1:].contiguous())
        return batch.batch_major() if self.batch_major else batch

    def __iter__(self) -> Iterator[LMBatch]:
        for index in range(len(self)):
            yield self[index]

    def __repr__(self) -> str:
        num_rows, num_streams = self.data.shape
        return (
            f"LMBatches({len(self)} batches, seq_len={self.seq_len}, data=[{num_rows}, "
            f"{num_streams}], rank={self.rank}/{self.world_size}, "
            f"{'batch' if self.batch_major else 'time'}-major)"
        )


def split_batch(batch: PyTree, rank: int, world_size: int, dim: int = 0) -> PyTree:
    """Rank `rank`'s contiguous ``1 / world_size`` slice of every tensor of `batch` along `dim`.

    Args:
        batch: a pytree (dict, list, tuple, NamedTuple, ...) whose leaves are tensors, all of
            the same size along `dim` (e.g. images and labels of one batch).
        rank: the rank whose slice to take, in ``[0, world_size)``.
        world_size: the number of ranks; must divide the size of every leaf along `dim`.
        dim: the dimension to split (the batch dimension), negative counts from the end.

    Returns:
        A pytree of the same structure whose leaves are views of the input: leaf ``x`` becomes
        ``x.narrow(dim, rank * n, n)`` with ``n = x.shape[dim] // world_size``. Concatenating
        the results of all ranks along `dim` gives `batch` back exactly.

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: a bad `rank`, a leaf with too few dimensions, leaves of different sizes
            along `dim`, or a size not divisible by `world_size`; the message names the leaf.
    """
    rank, world_size = _check_rank(rank, world_size, "split_batch")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"split_batch: `dim` must be an int, got {type(dim).__name__}")
    paths, leaves, treedef = tree.flatten_with_paths(batch)
    sizes = {}
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"split_batch: every leaf of `batch` must be a tensor, but {path} is a "
                f"{type(leaf).__name__}; keep non-tensor values out of the batch pytree"
            )
        if not -leaf.dim() <= dim < leaf.dim():
            raise ValueError(
                f"split_batch: `dim`={dim} does not exist in {path} of shape {tuple(leaf.shape)}"
            )
        sizes[path] = leaf.shape[dim]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"split_batch: all leaves must have the same size along dim {dim} (the batch "
            f"size), got {sizes}"
        )
    size = next(iter(sizes.values()), 0)
    if size % world_size:
        raise ValueError(
            f"split_batch: the batch size {size} (dim {dim} of {', '.join(sizes)}) does not "
            f"divide among `world_size`={world_size} ranks; use a batch size that is a "
            f"multiple of {world_size}"
        )
    slices = []
    for leaf in leaves:
        share = leaf.shape[dim] // world_size
        slices.append(leaf.narrow(dim, rank * share, share))
    return tree.unflatten(treedef, slices)


def shard_batch(batch: LMBatch, rank: int, world_size: int, *, dim: int) -> LMBatch:
    """Rank `rank`'s contiguous share of the streams of a global `LMBatch`.

    Args:
        batch: the global batch, ``[T, B]`` or ``[B, T]``.
        rank: the data-parallel rank, in ``[0, world_size)``.
        world_size: the number of data-parallel ranks; must divide ``B``.
        dim: the stream dimension: 1 for a time-major ``[T, B]`` batch (what `LMBatches`
            yields by default), 0 for a batch-major ``[B, T]`` one. There is no default, as
            splitting the wrong dimension would silently cut the sequences instead.

    Returns:
        An `LMBatch` of streams ``[rank * B / n, (rank + 1) * B / n)``: the same streams, in
        the same order, as ``LMBatches(..., rank=rank, world_size=n)`` yields.

    Raises:
        TypeError: `batch` is not an `LMBatch` of tensors.
        ValueError: `dim` is not 0 or 1, inputs and targets differ in shape, or ``B`` does not
            divide by `world_size`.
    """
    if not isinstance(batch, LMBatch) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError(
            f"shard_batch: `batch` must be an LMBatch of tensors, got {type(batch).__name__}; "
            "use split_batch for other pytrees"
        )
    if dim not in (0, 1):
        raise ValueError(
            f"shard_batch: `dim` must be 1 (time-major [T, B]) or 0 (batch-major [B, T]), "
            f"got {dim!r}"
        )
    if batch.inputs.dim() != 2 or batch.inputs.shape != batch.targets.shape:
        raise ValueError(
            "shard_batch: inputs and targets must be 2-D and of one shape, got "
            f"{tuple(batch.inputs.shape)} and {tuple(batch.targets.shape)}"
        )
    rank, world_size = _check_rank(rank, world_size, "shard_batch")
    num_streams = batch.inputs.shape[dim]
    if num_streams % world_size:
        raise ValueError(
            f"shard_batch: the {num_streams} streams (dim {dim}) of `batch` do not divide "
            f"among `world_size`={world_size} ranks; batchify with a batch_size that is a "
            f"multiple of {world_size}"
        )
    return split_batch(batch, rank, world_size, dim=dim)
