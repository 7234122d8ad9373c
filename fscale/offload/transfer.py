"""Host transfer: copies between host memory and an accelerator, overlapped where possible.

Everything fscale moves to host memory and back goes through this module: the optimizer state
and master params of `offload_optimizer`, the stage params of `offload_params`, and the values
an offloading checkpoint (`fscale.remat.checkpoint(offload=True)`) parks until backward.

On CUDA a `Transfer` runs uploads (host -> device) on one side stream and downloads
(device -> host) on another, from and into page-locked ("pinned") host memory, so both
directions proceed beside the compute stream. Every copy is ordered by events: a copy starts
after the kernels queued on the compute stream so far (its source is ready), and a consumer
waits for the copy's event before reading the result; `record_stream` keeps the caching
allocator from reusing memory a side stream still reads. On any other device the same calls
are plain synchronous ``.to`` copies with the same results, which is what makes the schedules
built on them testable on a CPU.

`park` starts an asynchronous download and returns a `Parked` value; `unpark` brings it back to
its device (waiting on the compute stream only, never blocking the host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from fscale.flat import FlatBuffer

__all__ = [
    "HOST",
    "Parked",
    "Transfer",
    "checked_device",
    "on_host",
    "park",
    "park_unless_on_host",
    "pinned_packed_copy",
    "unpark",
]

# Host memory is where offloaded tensors live; this is the one place "cpu" is meant literally.
HOST = torch.device("cpu")


def checked_device(name: str, arg: str, device: Any) -> torch.device:
    """`device` as a torch.device that can hold tensors here.

    Args:
        name: the public function validating its argument (used in messages).
        arg: the argument's name (used in messages).
        device: a device string or torch.device.

    Raises:
        TypeError: if `device` is neither a string nor a torch.device.
        ValueError: if torch does not know the device or it is not available on this machine.
    """
    if isinstance(device, torch.device):
        resolved = device
    elif isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError as error:
            raise ValueError(
                f"{name}: `{arg}`={device!r} is not a device torch knows "
                "(expected e.g. 'cpu', 'cuda', 'cuda:1')"
            ) from error
    else:
        raise TypeError(
            f"{name}: `{arg}` must be a device string or torch.device, got {type(device).__name__}"
        )
    try:  # a probe allocation is the one check that covers every backend and index
        torch.empty(0, device=resolved)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(
            f"{name}: `{arg}`={str(resolved)!r} is not available on this machine ({error})"
        ) from error
    return resolved


def pinned_packed_copy(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `leaves` in page-locked host memory, packed in one buffer per dtype.

    Packing keeps the leaves consecutive in one allocation, which is what the optimizers expect
    of their state (one copy per step instead of one per leaf). Empty dtype groups are plain
    host copies. Needs CUDA (page-locking is a CUDA facility).
    """
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in FlatBuffer.group_by_dtype(leaves).values():
        group = [leaves[i] for i in indices]
        total = sum(t.numel() for t in group)
        if not total:
            views = [t.to(HOST, copy=True) for t in group]
        else:
            data = torch.empty(total, dtype=group[0].dtype, device=HOST, pin_memory=True)
            torch.cat([t.reshape(-1).to(HOST) for t in group], out=data)
            # The layout comes from the host buffer alone: leaves of one dtype may come from
            # several devices (host and accelerator), which a FlatBuffer of them would refuse.
            chunks = data.split_with_sizes([t.numel() for t in group])
            views = [chunk.view(t.shape) for chunk, t in zip(chunks, group)]
        for i, view in zip(indices, views):
            out[i] = view
    return out  # type: ignore[return-value]


@dataclasses.dataclass
class Parked:
    """A device tensor's value in host memory, on its way there or arrived.

    Attributes:
        host: the host copy (complete once `ready` has fired).
        device: where the value came from and `restore` puts it back.
        ready: a CUDA event recorded after the device-to-host copy, or None for a finished copy.
    """

    host: torch.Tensor
    device: torch.device
    ready: Any

    def restore(self) -> torch.Tensor:
        """The value back on `device`, usable on the current stream."""
        if self.ready is not None:
            # The compute stream waits for the side-stream copy; the host stays untouched.
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            return self.host.to(self.device, non_blocking=True)
        return self.host.to(self.device)


class Transfer:
    """Copies between host memory and one accelerator, asynchronous where the backend allows.

    Args:
        device: the accelerator (any device; only CUDA copies are asynchronous).
        pin_memory: whether host buffers made by `download` and `park` are page-locked.
    """

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self._streams: tuple[Any, Any] | None = None
        self._last_upload_into: Any = None

    @property
    def is_async(self) -> bool:
        """Whether copies run on side streams (CUDA) rather than synchronously."""
        return self.device.type == "cuda"

    def _upload_download_streams(self) -> tuple[Any, Any]:
        if self._streams is None:  # created lazily: building an offload needs no CUDA context
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def start_upload(self, host: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Begin copying `host` tensors to the device; returns ``(device_tensors, event)``.

        The device tensors must not be read before `finish_upload`.
        """
        if not self.is_async:
            return [t.detach().to(self.device) for t in host], None
        upload, _ = self._upload_download_streams()
        # Allocating inside the upload stream ties the memory to that stream, so a copy that is
        # dropped unused (and freed) can never be overwritten while the copy is still running.
        with torch.cuda.stream(upload):
            on_device = [t.detach().to(self.device, non_blocking=True) for t in host]
            event = torch.cuda.Event()
            event.record(upload)
        return on_device, event

    def finish_upload(self, on_device: list[torch.Tensor], event: Any) -> list[torch.Tensor]:
        """Make the compute stream wait for an upload; the tensors are then safe to use."""
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in on_device:
                # Freed later from the compute stream: the allocator must wait for its kernels.
                t.record_stream(compute)
        return on_device

    def upload_into(
        self, host: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Copy `host` tensors into `targets` (device tensors of the same shape and dtype).

        Returns the targets, usable on the compute stream as soon as this returns.
        """
        if not self.is_async:
            with torch.no_grad():
                for dst, src in zip(targets, host):
                    dst.copy_(src)
            return list(targets)
        upload, _ = self._upload_download_streams()
        compute = torch.cuda.current_stream(self.device)
        # The targets may still be read by queued kernels (donated params) or sit in memory the
        # compute stream just released: write only after everything queued so far.
        upload.wait_stream(compute)
        with torch.no_grad(), torch.cuda.stream(upload):
            for dst, src in zip(targets, host):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(upload)
        compute.wait_event(event)
        self._last_upload_into = event
        return list(targets)

    def wait_for_sources(self) -> None:
        """Block until the host sources of `upload_into` have been read (before mutating them)."""
        if self._last_upload_into is not None:
            self._last_upload_into.synchronize()
            self._last_upload_into = None

    def download(self, on_device: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `on_device`, complete when this returns (the host reads them next)."""
        if not self.is_async:
            return [t.detach().to(HOST) for t in on_device]
        _, download = self._upload_download_streams()
        compute = torch.cuda.current_stream(self.device)
        download.wait_stream(compute)  # the tensors are produced by kernels queued on compute
        with torch.no_grad(), torch.cuda.stream(download):
            host = []
            for t in on_device:
                buffer = torch.empty(
                    t.shape, dtype=t.dtype, device=HOST, pin_memory=self.pin_memory
                )
                buffer.copy_(t, non_blocking=True)
                t.record_stream(download)
                host.append(buffer)
            event = torch.cuda.Event()
            event.record(download)
        event.synchronize()
        return host

    def park(self, t: torch.Tensor) -> Parked:
        """Start copying `t` (a tensor on this transfer's device) to host memory."""
        if not self.is_async:
            return Parked(t.to(HOST, copy=True), t.device, None)
        _, download = self._upload_download_streams()
        host = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=self.pin_memory)
        download.wait_stream(torch.cuda.current_stream(self.device))  # t's producer has finished
        with torch.cuda.stream(download):
            host.copy_(t, non_blocking=True)
        # The allocator must not hand t's memory out again before the side stream has read it.
        t.record_stream(download)
        return Parked(host, t.device, download.record_event())


# One transfer per device for `park`: its download stream is shared by every parked value.
_PARKING: dict[torch.device, Transfer] = {}


def on_host(t: torch.Tensor) -> bool:
    """Whether `t` already lives in host memory (offloading it moves nothing)."""
    return t.device.type == "cpu"


def park(t: torch.Tensor) -> Parked:
    """Start copying `t` to (pinned, on CUDA) host memory; `unpark` brings it back."""
    transfer = _PARKING.get(t.device)
    if transfer is None:
        transfer = _PARKING.setdefault(t.device, Transfer(t.device, pin_memory=True))
    return transfer.park(t)


def park_unless_on_host(t: torch.Tensor) -> torch.Tensor | Parked:
    """`park(t)`, or `t` itself when it already lives in host memory."""
    return t if on_host(t) else park(t)


def unpark(value: torch.Tensor | Parked) -> torch.Tensor:
    """A parked value back on its device; a tensor as it is."""
    return value.restore() if isinstance(value, Parked) else value
