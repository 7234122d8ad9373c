"""Each rank's region of ``/dev/shm``, made and agreed on by the ranks of one group.

The shared-memory transports (`fscale.distributed.shared_memory`'s windows,
`fscale.distributed.shared_channels`' rings) start the same way: every rank makes a region of
its own, the ranks gather each other's names (a collective, at the same point on every rank),
and the group uses shared memory only if they all share a host, all want it (the setting of
`fscale.distributed.shared_setting`) and all could reserve their pages. A region's pages are
reserved when it is made (``posix_fallocate``): a page of a full tmpfs is otherwise a SIGBUS
at its first touch, deep inside a collective (``/dev/shm`` is 64 MiB in a default container,
and DataLoader workers share tensors through it too); a rank that cannot reserve them keeps
the group on gloo, with a warning.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import warnings
from typing import NamedTuple

from fscale.distributed import setup_traffic
from fscale.distributed.comm import Comm
from fscale.distributed.hosts import host_id
from fscale.distributed.shared_setting import (
    ENV,
    SHM_DIR,
    host_supports_shared_memory,
    shared_memory_enabled,
    unlink_region,
)

__all__ = ["Regions", "map_region", "open_regions"]


class Regions(NamedTuple):
    """This rank's region mapped, its name (to unlink once every peer has mapped it), and
    every rank's name and process id, by index along the axis."""

    own: mmap.mmap
    path: str
    paths: list[str]
    pids: list[int]


def open_regions(comm: Comm, size: int, prefix: str, purpose: str) -> Regions | None:
    """Make this rank's region of `size` bytes and learn every rank's: a collective over
    `comm`'s group. None where the group keeps gloo (ranks on several hosts, shared memory
    off, or a region whose pages could not be reserved: warned, naming `purpose`).

    Raises:
        ValueError: ranks of one host disagree on the setting.
    """
    setting = shared_memory_enabled()
    path, fd, failure, regions = None, -1, None, None
    if setting and host_supports_shared_memory():
        fd, path = tempfile.mkstemp(prefix=prefix, dir=SHM_DIR)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            failure = f"{SHM_DIR} could not hold {size} bytes ({error})"
    try:
        mine = (host_id(), setting, None if failure else path, failure, os.getpid())
        everyone = setup_traffic.all_gather_objects(mine, comm)
        if len({host for host, *_ in everyone}) > 1:
            return None
        if len({wants for _, wants, *_ in everyone}) > 1:
            on = [q for q, (_, wants, *_) in enumerate(everyone) if wants]
            raise ValueError(
                f"shared memory: the ranks of axis {comm.axis!r} share a host but not the "
                f"setting: ranks {on} of the axis would use shared memory and the others "
                f"would not. Set {ENV} (or set_shared_memory) alike on every rank"
            )
        if any(peer_path is None for _, _, peer_path, *_ in everyone):
            failures = [(q, why) for q, (_, _, _, why, _) in enumerate(everyone) if why]
            if failures and comm.index == 0:
                warnings.warn(
                    f"shared memory: {purpose} over axis {comm.axis!r} keeps gloo, rank "
                    f"{failures[0][0]}: {failures[0][1]}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        assert path is not None
        regions = Regions(
            mmap.mmap(fd, size), path, [e[2] for e in everyone], [e[4] for e in everyone]
        )
        return regions
    finally:
        if fd >= 0:
            os.close(fd)
        if path is not None and regions is None:  # not used: no name left behind
            unlink_region(path)


def map_region(path: str, size: int) -> mmap.mmap:
    """A peer's region (by the name `open_regions` gathered), mapped into this process."""
    with open(path, "r+b") as region:
        return mmap.mmap(region.fileno(), size)
