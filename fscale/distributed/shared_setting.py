"""Whether process groups decided from now on use shared memory between ranks of one host.

The setting of `fscale.distributed.shared_memory`: ``FSCALE_SHARED_MEMORY=0`` in the environment
(read at import and at `fscale.tracking.reset`) or `set_shared_memory(False)` keeps gloo for
the groups whose first collective comes afterwards.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "enabled_from_env", "set_shared_memory", "shared_memory_enabled"]

ENV = "FSCALE_SHARED_MEMORY"


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
