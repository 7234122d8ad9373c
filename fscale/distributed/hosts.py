"""Whether the ranks of a mesh axis share one host.

A CPU rank's collectives run on the cores that also compute its step, unless they wait on a
network: `fscale.data_parallel` reduces after backward where every rank of its axis is on one
host, during backward where the axis crosses hosts (`fscale.parallel.reduce.GradReducer`).

A host is named by its kernel's boot id (containers of one machine share it, two machines never
do), or by its hostname where that file is missing. The answer is gathered once per process
group and kept: the first call is a collective over the axis, which every rank of it must make
at the same point of its program (a step's first backward does).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from fscale.distributed import setup_traffic
from fscale.distributed.comm import resolve_comm
from fscale.distributed.mesh import Mesh

__all__ = ["host_id", "on_one_host"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

# Process group -> whether all its ranks share this host (groups live as long as the job).
_ONE_HOST: dict[Any, bool] = {}


def host_id() -> str:
    """This machine's name for `on_one_host`: the boot id, else the hostname."""
    try:
        return "boot:" + _BOOT_ID.read_text().strip()
    except OSError:
        return "host:" + socket.gethostname()


def on_one_host(mesh: Mesh, axis: str) -> bool:
    """Whether every rank along `axis` of `mesh` runs on this rank's host (a collective the
    first time per process group; see the module docstring)."""
    group = mesh.group(axis)
    if group is None:
        return True
    known = _ONE_HOST.get(group)
    if known is None:
        comm = resolve_comm(axis, mesh, "on_one_host")
        names = setup_traffic.all_gather_objects(host_id(), comm)
        known = _ONE_HOST[group] = len(set(names)) == 1
    return known
