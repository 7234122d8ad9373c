"""A rank's doorbell: a 32-bit counter on a page of shared memory that its peers raise, and on
which it sleeps in the kernel (a futex) until one does.

`fscale.distributed.shared_channels` waits for what a neighbour writes, often for a whole
bubble of a pipeline. Polling for it costs a processor while the neighbour computes, which on a
host with as many ranks as cores is the neighbour's own; sleeping a fixed while delays the reply
by up to that while. A doorbell gives both: the waiter reads the counter, looks for what it
waits for, watches the counter for `SPIN_SECONDS` (a futex's wakeup took 50-100 us on a 2-core
host; not where ranks outnumber the cores, see `spin_for`), and then sleeps until a peer raises
it. A peer raises it after storing what it wrote, through the kernel's atomic
``FUTEX_WAKE_OP`` (two peers may raise one doorbell at once; a plain read and store would lose
one), which also wakes the sleeper. The waiter never misses a raise: it reads the counter
before it looks, and the kernel sleeps only while the counter still holds what it read. (The
bucket collectives' windows, `fscale.distributed.shared_memory`, keep polling: their waits are
short, and a raise per peer and window made a 30 MB all-reduce 14% slower.)

x86-64 Linux only (the futex's system call number; `host_supports_shared_memory`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

__all__ = ["SPIN_SECONDS", "Doorbell", "spin_for"]

SPIN_SECONDS = 50e-6
"""How long a waiter watches its doorbell before it sleeps in the kernel: a message's round
trip between two ranks took 150-220 us without the watch and 70 us with it (64 KiB)."""


def spin_for(ranks_on_host: int) -> float:
    """How long a waiter of a host running `ranks_on_host` ranks should watch before it
    sleeps: `SPIN_SECONDS` where every rank has a core of its own, else 0 (4 pipeline ranks on
    2 cores took 4.4% less time per 1F1B step without the watch, 2 ranks 0.9% more)."""
    return SPIN_SECONDS if ranks_on_host <= len(os.sched_getaffinity(0)) else 0.0


_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE_OP = 0, 5  # not the _PRIVATE forms: the word is shared by processes
# FUTEX_WAKE_OP's operation: add 1 to the word (its conditional second wake wakes no one).
_ADD_ONE = (1 << 28) | (1 << 12)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Doorbell:
    """The doorbell at byte `offset` of a mapped region (4-byte aligned), as this process
    maps it: its owner waits on it, its peers `ring` it."""

    def __init__(self, region: mmap.mmap, offset: int = 0) -> None:
        if offset % 4:
            raise ValueError(f"Doorbell: `offset` must be a multiple of 4, got {offset}")
        self._word: ctypes.c_int32 | None = ctypes.c_int32.from_buffer(region, offset)
        self._address = ctypes.c_void_p(ctypes.addressof(self._word))

    def read(self) -> int:
        """The counter now (pass it to `wait` after looking for what you wait for)."""
        assert self._word is not None, "released"
        return self._word.value

    def ring(self) -> None:
        """Raise the counter by one and wake its owner (call after storing what it reads)."""
        _LIBC.syscall(
            _SYS_FUTEX,
            self._address,
            _FUTEX_WAKE_OP,
            ctypes.c_int(1 << 30),
            None,
            self._address,
            ctypes.c_int(_ADD_ONE),
        )

    def wait(self, seen: int, seconds: float, spin: float = SPIN_SECONDS) -> None:
        """Return once the counter is no longer `seen` (at once if it moved already), or after
        about `seconds`, or earlier (a signal): the caller looks again either way. `spin`: the
        seconds to watch before sleeping (0 where the host has fewer cores than ranks: the
        watch would take the core from the rank being waited for)."""
        until = time.monotonic() + min(spin, seconds)
        while self.read() == seen and time.monotonic() < until:
            pass
        if self.read() != seen or seconds <= spin:
            return
        whole = int(seconds)
        timeout = _Timespec(whole, int((seconds - whole) * 1e9))
        _LIBC.syscall(
            _SYS_FUTEX, self._address, _FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(timeout)
        )

    def release(self) -> None:
        """Drop this process's view of the word (a mapping closes only once nothing exports
        it); the doorbell is unusable afterwards."""
        self._word = None
