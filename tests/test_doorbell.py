"""The doorbell: a raise is never missed, a sleeper wakes at a ring, an unrung wait ends at
its timeout, and a ring from another thread or process is seen."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

from fscale.distributed.doorbell import SPIN_SECONDS, Doorbell, spin_for


def _region() -> mmap.mmap:
    return mmap.mmap(-1, 4096)  # anonymous and shared: a futex word like a /dev/shm region's


def test_a_ring_raises_the_counter_and_a_wait_on_an_old_value_returns_at_once():
    region = _region()
    bell = Doorbell(region, 64)
    seen = bell.read()
    bell.ring()
    bell.ring()
    assert bell.read() == seen + 2
    start = time.monotonic()
    bell.wait(seen, 5.0)
    assert time.monotonic() - start < 1.0
    assert Doorbell(region, 64).read() == seen + 2  # another view of the same word
    assert Doorbell(region, 0).read() == 0  # a word of its own
    with pytest.raises(ValueError, match="multiple of 4"):
        Doorbell(region, 2)


def test_an_unrung_wait_ends_near_its_timeout():
    bell = Doorbell(_region())
    start = time.monotonic()
    bell.wait(bell.read(), 0.2)
    assert 0.15 <= time.monotonic() - start < 2.0
    start = time.monotonic()
    bell.wait(bell.read(), SPIN_SECONDS / 2)  # shorter than the watch: no sleep at all
    assert time.monotonic() - start < 0.1


def test_a_sleeper_wakes_when_another_thread_rings():
    region = _region()
    bell = Doorbell(region)
    seen = bell.read()
    ringer = threading.Timer(0.2, Doorbell(region).ring)
    ringer.start()
    start = time.monotonic()
    bell.wait(seen, 30.0)
    waited = time.monotonic() - start
    ringer.join()
    assert 0.15 <= waited < 5.0 and bell.read() == seen + 1
    bell.release()
    with pytest.raises(AssertionError, match="released"):
        bell.read()


def test_a_waiter_watches_only_where_every_rank_has_a_core():
    cores = len(os.sched_getaffinity(0))
    assert spin_for(1) == SPIN_SECONDS and spin_for(cores) == SPIN_SECONDS
    assert spin_for(cores + 1) == 0.0
    bell = Doorbell(_region())
    start = time.monotonic()
    bell.wait(bell.read(), 0.001, spin=0.0)  # straight to the kernel's timed sleep
    assert time.monotonic() - start < 0.5
