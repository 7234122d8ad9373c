"""Whether process groups decided from now on use shared memory between ranks of one host.

The setting of `fscale.distributed.shared_memory`: ``FSCALE_SHARED_MEMORY=0`` in the environment
(read at import and at `fscale.tracking.reset`) or `set_shared_memory(False)` keeps gloo for
the groups whose first collective comes afterwards.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys

__all__ = [
    "ENV",
    "SHM_DIR",
    "enabled_from_env",
    "host_supports_shared_memory",
    "set_shared_memory",
    "shared_memory_enabled",
    "unlink_region",
]

ENV = "FSCALE_SHARED_MEMORY"
SHM_DIR = "/dev/shm"


def enabled_from_env() -> bool:
    """The setting `ENV` asks for (on unless it reads 0, false, no or off)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_SETTING = {"enabled": enabled_from_env()}


def set_shared_memory(enabled: bool) -> None:
    """Use shared memory (or not) for the groups whose first collective comes after this call.
    Every rank of a group must set the same."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_shared_memory: `enabled` must be a bool, got {enabled!r}")
    _SETTING["enabled"] = enabled


def shared_memory_enabled() -> bool:
    """Whether groups decided from now on use shared memory where their ranks share a host."""
    return _SETTING["enabled"]


def host_supports_shared_memory() -> bool:
    """Whether this host can run the shared-memory transports: Linux with a writable
    `SHM_DIR`, on x86-64, whose processors make one processor's stores visible to the others
    in the order it issued them (a peer that sees a counter stored after some data sees the
    data; elsewhere that needs fences Python cannot issue)."""
    return (
        sys.platform.startswith("linux")
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.access(SHM_DIR, os.W_OK)
    )


def unlink_region(path: str) -> None:
    """Remove a region's name from `SHM_DIR` (the mappings keep its pages); gone already is
    fine (a finalizer and an explicit close may both try)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
