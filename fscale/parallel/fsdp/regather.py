"""Re-gathering a `fully_shard` unit in backward instead of keeping or recomputing it.

With ``reshard_after_forward=True`` a unit's gathered parameters are freed when its forward call
returns, while autograd keeps the call's activations. Saved-tensor hooks record every tensor
autograd saves that views the gathered buffer as a *place* in it (offset, size, strides), so
nothing holds the buffer. In backward the first place unpacked gathers the unit's shard again
and reads the views out of the new buffer; the calls before it are prefetched; the buffer is
dropped when the gradient of the forward's buffer is complete. Which re-gathers are in flight
is the Gatherer's backward `PrefetchSchedule` (the engine of the forward gathers and of
`offload_params`' uploads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fscale import remat
from fscale.functional import UnitCall

if TYPE_CHECKING:
    from fscale.parallel.fsdp.gather import Gatherer, ShardedUnit

__all__ = ["Regather"]


class _Place(NamedTuple):
    """Where a tensor autograd saved lies in its unit's gathered buffer."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements from the start of the gathered buffer


class Regather:
    """One forward call of a unit whose gathered parameters are freed after it.

    During the call, saved-tensor hooks turn every tensor autograd saves that views the
    gathered buffer into a `_Place`; the call's other saved tensors (activations) are kept as
    they are. In backward, the first unpacked place gathers the shard again (`fetch`) and
    starts the re-gathers of the calls before it; the new buffer is dropped once the gradient
    of the forward's buffer is complete, just before the forward gather's dual reduce-scatters
    it.
    """

    def __init__(
        self, gatherer: Gatherer, unit: ShardedUnit, index: int, gathered: torch.Tensor
    ) -> None:
        self.gatherer = gatherer
        self.unit = unit
        self.index = index
        # The forward buffer is identified by address only while it is certainly alive (the
        # call): holding the tensor would keep it alive, which is what this class avoids.
        self._address: int | None = gathered.untyped_storage().data_ptr()
        self._start_offset = int(gathered.storage_offset())
        self._dtype = gathered.dtype  # the unit's, or a mixed-precision policy's param_dtype
        self.needed = False  # whether autograd saved a view of the buffer
        self.done = False  # whether the unit's gradient is complete (no re-gather needed)
        self._gathered: torch.Tensor | None = None
        gathered.register_hook(self._gradient_complete)

    def run(self, call: UnitCall, params: Mapping[str, torch.Tensor]) -> Any:
        """Run the unit's call with its saved parameter views turned into places."""
        try:
            # A checkpointed call inside keeps nothing (`fscale.remat.keep_last`): what it kept
            # would view the gathered buffer and hold it past the unit's forward.
            with (
                remat.keep_last(False),
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
            ):
                return call.run(params, call.state, call.args, call.kwargs)
        finally:
            self._address = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Place:
        if (
            self._address is None
            or type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or tensor.dtype != self._dtype
            or tensor.untyped_storage().data_ptr() != self._address
        ):
            return tensor
        self.needed = True
        offset = int(tensor.storage_offset()) - self._start_offset
        return _Place(tensor.size(), tensor.stride(), offset)

    def _unpack(self, packed: torch.Tensor | _Place) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        gathered = self.fetch()
        return gathered.as_strided(
            packed.size, packed.stride, gathered.storage_offset() + packed.offset
        )

    def fetch(self) -> torch.Tensor:
        """The gathered buffer for backward: waits for the re-gather, issuing it if needed."""
        if self._gathered is not None:
            return self._gathered
        self.done = False  # read after its gradient: a (rare) second re-gather
        schedule = self.gatherer.backward_schedule()
        schedule.fetch(self.index, "backward")
        # The calls before this one are gathered while this unit's backward computes.
        self.gatherer.prefetch_backward(self.index)
        pending, tie = schedule.acquire(self.index, "backward")
        gathered = pending.wait()
        tie(gathered)
        self._gathered = gathered
        return gathered

    def _gradient_complete(self, grad: torch.Tensor) -> None:
        self.release()
        self.done = True

    def release(self) -> None:
        """Drop the re-gathered buffer (waiting for a re-gather still in flight)."""
        schedule = self.gatherer.backward_schedule()
        if schedule.holds(self.index):
            handle = schedule.release(self.index, "backward")
            if handle is not None:
                pending, tie = handle
                tie(pending.wait())
        self._gathered = None
