"""`FlatBuffer`: many same-dtype tensors in one buffer, and the per-rank `Fragment`s of it.

`FlatBuffer` is the unit of bucketing, sharding and fused optimizer updates, the one flat layout
that ZeRO's buckets (`fscale.parallel.bucket_layout`) and FSDP's units
(`fscale.parallel.fsdp.units`) are made of: it packs a list of tensors of one dtype and device
into one contiguous 1-D buffer, padded with zeros to a multiple of `num_shards` so it splits
into equal shards, and hands back zero-copy views with the original shapes. Rank ``r`` of ``n``
owns ``shard(r)``; `fragments(r)` says which element range of which tensor that shard holds,
which is what sharded optimizers need to complete per-tensor statistics (norms, row/column
means) with a collective. With ``align=`` every leaf and every shard boundary starts on a
64-byte boundary (`ALIGN_BYTES`), which keeps torch's fused kernels exact under sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch._utils import _flatten_dense_tensors

__all__ = [
    "ALIGN_BYTES",
    "FlatBuffer",
    "Fragment",
    "TensorSlice",
    "aligned_elements",
    "flat_copy",
]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (as ``torch.empty(shape).stride()``)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


Placement = tuple[torch.Size, tuple[int, ...], int]
"""Where a tensor lies in a flat buffer: its shape, contiguous strides and offset."""


class TensorSlice(NamedTuple):
    """A tensor-parallel shard of a tensor: along `dim`, which is cut into `parts` equal blocks
    (a fused weight's q, k and v), chunk `index` of `size` of every block, the chunks
    concatenated (`fscale.parallel.tensor.shard_tensor`)."""

    dim: int
    parts: int
    size: int
    index: int

    def shape_of(self, full: torch.Size) -> torch.Size:
        """The shard's shape within a full tensor of shape `full`."""
        return torch.Size((*full[: self.dim], full[self.dim] // self.size, *full[self.dim + 1 :]))


class Fragment(NamedTuple):
    """The piece of one tensor that a rank holds.

    Elements ``[start, stop)`` of the row-major flattening of the tensor, or, with `block`, of
    the tensor-parallel shard `block` of it; ``start == stop`` when the rank holds none of it.
    `shape` is the whole tensor's shape. `counted` is False for a copy of a tensor that another
    rank's copy already stands for (a tensor-parallel rank's replica of a norm's weight): sums
    across ranks leave it out, so each element counts once.
    """

    shape: torch.Size
    start: int
    stop: int
    block: TensorSlice | None = None
    counted: bool = True

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def is_whole(self) -> bool:
        return self.block is None and self.start == 0 and self.stop == self.shape.numel()

    def element_indices(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The index, in the whole tensor's row-major flattening, of each element held."""
        index = torch.arange(self.start, self.stop, device=device)
        if self.block is None:
            return index
        dim, parts = self.block.dim, self.block.parts
        full = self.shape[dim]
        held = full // self.block.size  # along `dim`, in the shard
        chunk = held // parts  # one block's chunk
        inner = self.shape[dim + 1 :].numel()
        outer, rest = index // (inner * held), index % inner
        along = (index // inner) % held
        along = (along // chunk) * (full // parts) + self.block.index * chunk + along % chunk
        return (outer * full + along) * inner + rest


class FlatBuffer:
    """Same-dtype tensors packed back to back in one contiguous, zero-padded 1-D buffer.

    Args:
        tensors: the tensors to pack, all of one dtype and device, at least one.
        num_shards: the buffer length is padded to a multiple of this, so `shard(i)` for
            ``i < num_shards`` are equal slices.
        data: an existing 1-D buffer of the right length, dtype and device to use as storage
            instead of copying `tensors` in (the tensors then only give shapes).
        align: every tensor starts, and every shard boundary falls, on a multiple of this many
            elements (the gaps are zero). Sharded optimizers need it: torch's fused CPU kernels
            compute a tensor's last ``numel % vector width`` elements with scalar code that
            rounds differently, so a shard cut inside a vector would not update exactly as the
            whole tensor does. `aligned_elements(dtype)` gives the usual value.

    The round trip is exact: ``FlatBuffer(ts).views()[i]`` equals ``ts[i]`` bit for bit and has
    its shape; the views share memory with `data`.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        num_shards: int = 1,
        *,
        data: torch.Tensor | None = None,
        align: int = 1,
    ) -> None:
        tensors = list(tensors)
        _check_num_shards(num_shards)
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"FlatBuffer: `align` must be a positive int, got {align!r}")
        if not tensors:
            raise ValueError(
                "FlatBuffer: `tensors` is empty; pass at least one tensor "
                "(an empty parameter group needs no buffer)"
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"FlatBuffer: `tensors[{i}]` is a {type(t).__name__}, not a tensor")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(
                f"FlatBuffer: `tensors` mix dtypes {sorted(str(d) for d in dtypes)}; "
                "pack each dtype into its own buffer (see `FlatBuffer.group_by_dtype`)"
            )
        if len(devices) > 1:
            raise ValueError(
                f"FlatBuffer: `tensors` lie on several devices {sorted(str(d) for d in devices)}; "
                "move them to one device first"
            )
        self.dtype: torch.dtype = tensors[0].dtype
        self.device: torch.device = tensors[0].device
        self.num_shards = num_shards
        self.shapes: list[torch.Size] = [t.shape for t in tensors]
        self.numels: list[int] = [t.numel() for t in tensors]
        self.align = align
        self.offsets: list[int] = []
        end = 0
        for n in self.numels:
            offset = -(-end // align) * align
            self.offsets.append(offset)
            end = offset + n
        self.numel_unpadded = end
        self.shard_size = -(-max(end, 1) // (num_shards * align)) * align
        self.numel = self.shard_size * num_shards
        if data is None:
            data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            # The values are copied, not differentiated: parameters that require grad pack
            # as any tensor does.
            with torch.no_grad():
                if align == 1 and end:
                    torch.cat([t.reshape(-1) for t in tensors], out=data[:end])
                else:
                    for view, t in zip(self.views(data), tensors):
                        view.copy_(t)
        else:
            self._check_data(data)
        self.data: torch.Tensor = data

    def _check_data(self, data: torch.Tensor) -> None:
        if data.dim() != 1 or data.numel() != self.numel:
            raise ValueError(
                f"FlatBuffer: `data` must be 1-D with {self.numel} elements, got shape "
                f"{tuple(data.shape)}"
            )
        if data.dtype != self.dtype:
            raise ValueError(f"FlatBuffer: `data` has dtype {data.dtype}, expected {self.dtype}")

    def with_data(self, data: torch.Tensor) -> FlatBuffer:
        """A FlatBuffer with this one's layout over another storage (e.g. the gradients)."""
        other = object.__new__(FlatBuffer)
        other.__dict__.update(self.__dict__)
        other._check_data(data)
        other.data = data
        return other

    def empty_like(self) -> FlatBuffer:
        """Same layout, fresh zeroed storage."""
        return self.with_data(torch.zeros_like(self.data))

    def views(self, data: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Zero-copy views of `data` (default: this buffer) with the packed tensors' shapes.

        When `data` requires grad (a gathered unit), the views come from one
        ``split_with_sizes``, whose backward writes every view's gradient into one new buffer
        once. Slices would each give back a zero-filled buffer of the full size with its
        gradient in it, summed by autograd: k fills and k - 1 additions for k tensors.
        """
        data = self.data if data is None else data
        if data.requires_grad and len(self.shapes) > 1:
            pieces = data.split_with_sizes(self._pieces()[0])
            return [pieces[i].view(shape) for i, shape in zip(self._pieces()[1], self.shapes)]
        if not data.requires_grad and data.stride() == (1,) and not torch.compiler.is_compiling():
            # One as_strided per tensor: a third of the time of a slice and a view (a step
            # takes these views of every bucket, every step). Not in a graph: Dynamo cannot
            # trace `storage_offset`, and traced slices cost nothing at run time.
            base = data.storage_offset()
            return [
                data.as_strided(shape, strides, base + offset)
                for shape, strides, offset in self.placements
            ]
        return [
            data[o : o + n].view(shape)
            for o, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    @property
    def placements(self) -> list[Placement]:
        """Per tensor, ``(shape, contiguous strides, offset)``: one ``as_strided`` call on a
        contiguous buffer of this layout makes its view. Computed once per layout, in plain
        Python, which torch.compile traces."""
        cached = self.__dict__.get("_placements_cache")
        if cached is None:
            cached = self.__dict__["_placements_cache"] = [
                (shape, contiguous_strides(shape), offset)
                for shape, offset in zip(self.shapes, self.offsets)
            ]
        return cached

    def _pieces(self) -> tuple[list[int], list[int]]:
        """The buffer cut into the tensors and the gaps around them: the sizes of the pieces,
        and the position of each tensor's piece."""
        cached = self.__dict__.get("_pieces_cache")
        if cached is None:
            sizes: list[int] = []
            positions: list[int] = []
            end = 0
            for offset, n in zip(self.offsets, self.numels):
                if offset > end:
                    sizes.append(offset - end)
                positions.append(len(sizes))
                sizes.append(n)
                end = offset + n
            if self.numel > end:
                sizes.append(self.numel - end)
            cached = self.__dict__["_pieces_cache"] = (sizes, positions)
        return cached

    def shard(self, index: int, data: torch.Tensor | None = None) -> torch.Tensor:
        """The `index`-th of `num_shards` equal slices of `data` (default: this buffer)."""
        if not 0 <= index < self.num_shards:
            raise IndexError(f"FlatBuffer.shard: `index`={index} is outside [0, {self.num_shards})")
        data = self.data if data is None else data
        return data[index * self.shard_size : (index + 1) * self.shard_size]

    def fragments(self, index: int) -> list[Fragment]:
        """For each packed tensor, the element range of it that `shard(index)` holds."""
        return list(self._fragment_layout(index)[0])

    def _fragment_layout(self, index: int) -> tuple[list[Fragment], list[tuple[int, int]]]:
        """`fragments(index)`, and where each lies in the shard: (begin, numel). Computed once
        per shard index: a ZeRO step takes these views of every bucket, every step."""
        cache = self.__dict__.get("_fragments_cache")  # not setdefault: Dynamo < 2.13
        if cache is None:
            cache = self.__dict__["_fragments_cache"] = {}
        cached = cache.get(index)
        if cached is None:
            lo = index * self.shard_size
            hi = lo + self.shard_size
            fragments, spans = [], []
            for offset, n, shape in zip(self.offsets, self.numels, self.shapes):
                start = min(max(lo - offset, 0), n)
                stop = max(start, min(max(hi - offset, 0), n))
                fragments.append(Fragment(shape, start, stop))
                spans.append((max(offset + start - lo, 0), stop - start))
            cached = cache[index] = (fragments, spans)
        return cached

    def fragment_views(self, index: int, shard_data: torch.Tensor) -> list[torch.Tensor]:
        """1-D views into `shard_data` (a shard-sized tensor) for each tensor's fragment."""
        spans = self._fragment_layout(index)[1]
        if (
            not shard_data.requires_grad
            and shard_data.stride() == (1,)
            and not torch.compiler.is_compiling()  # as in `views`
        ):
            base = shard_data.storage_offset()
            return [shard_data.as_strided((n,), (1,), base + begin) for begin, n in spans]
        return [shard_data[begin : begin + n] for begin, n in spans]

    def __repr__(self) -> str:
        return (
            f"FlatBuffer({len(self.shapes)} tensors, {self.numel_unpadded} elements of "
            f"{self.dtype} padded to {self.numel} = {self.num_shards} x {self.shard_size})"
        )

    @staticmethod
    def group_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
        """Indices of `tensors` grouped by dtype, in first-seen order (for one buffer each)."""
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        return groups


ALIGN_BYTES = 64
"""The widest CPU vector (AVX-512) and a cache line: the alignment sharded buffers use."""


def aligned_elements(dtype: torch.dtype) -> int:
    """Elements of `dtype` in `ALIGN_BYTES` (the `align` argument of a sharded FlatBuffer)."""
    return max(1, ALIGN_BYTES // dtype.itemsize)


def flat_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new 1-D buffer holding `tensors` (one dtype and device) back to back, in one kernel,
    outside autograd: a buffer that a collective may then write into.

    torch's dense flatten returns a view of a lone tensor rather than a copy, so one tensor is
    cloned instead; either way nothing of the result aliases the given tensors.
    """
    with torch.no_grad():
        if len(tensors) == 1:
            return tensors[0].reshape(-1).clone()
        return _flatten_dense_tensors(list(tensors))


def _check_num_shards(num_shards: int) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(
            f"FlatBuffer: `num_shards` must be a positive int (the number of ranks sharing the "
            f"buffer), got {num_shards!r}"
        )
