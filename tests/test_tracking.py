"""The registry of per-process accounting state: stacks, reset functions, one reset."""

from __future__ import annotations

import pytest

import fscale as fs
from fscale import tracking
from fscale.distributed import debug, ledger, mesh
from fscale.remat import early_stop


def test_stack_push_pop_open_and_snapshots():
    stack = tracking.stack("tests.test_tracking.basic")
    assert not stack and len(stack) == 0 and stack.top() is None
    outer, inner = object(), object()
    assert stack.push(outer) is outer
    with stack.open(inner) as opened:
        assert opened is inner
        snapshot = stack.active()
        assert snapshot == (outer, inner) and stack.top() is inner and len(stack) == 2
    assert snapshot == (outer, inner)  # a snapshot, not a view
    assert stack.active() == (outer,)
    stack.pop(outer)
    assert not stack
    with pytest.raises(
        ValueError, match=r"tracking stack 'tests.test_tracking.basic': .* is not open"
    ):
        stack.pop(outer)


def test_open_pops_when_the_block_raises():
    stack = tracking.stack("tests.test_tracking.raises")
    with pytest.raises(RuntimeError), stack.open("item"):
        raise RuntimeError
    assert stack.active() == ()


def test_pop_closes_the_innermost_occurrence():
    stack = tracking.stack("tests.test_tracking.twice")
    item, other = object(), object()
    stack.push(item)
    stack.push(other)
    stack.push(item)
    stack.pop(item)
    assert stack.active() == (item, other)


def test_reset_clears_every_registered_stack_and_runs_reset_functions():
    first = tracking.stack("tests.test_tracking.first")
    second = tracking.stack("tests.test_tracking.second")
    calls = []
    tracking.register("tests.test_tracking.flag", lambda: calls.append("reset"))
    first.push(1)
    second.push(2)
    second.push(3)
    assert tracking.active("tests.test_tracking.second") == (2, 3)
    before = debug.debug_enabled()
    try:
        debug.set_debug(not debug.debug_from_env())
        with fs.Mesh(dp=1), fs.distributed.comm_ledger():
            tracking.reset()
            assert not first and not second and calls == ["reset"]
            assert fs.distributed.current_mesh() is None
            assert ledger.open_ledgers() == ()
            assert debug.debug_enabled() == debug.debug_from_env()
    except ValueError:
        pytest.fail("leaving a block after a reset must not fail")
    finally:
        debug.set_debug(before)


def test_fscale_state_is_registered():
    names = tracking.registered()
    for module in (ledger, mesh, debug, early_stop):
        assert module.__name__ in names


def test_registering_a_name_again_replaces_it():
    old = tracking.stack("tests.test_tracking.again")
    old.push("stale")
    new = tracking.stack("tests.test_tracking.again")
    assert tracking.active("tests.test_tracking.again") == ()
    new.push("fresh")
    tracking.reset()
    assert not new and old.active() == ("stale",)  # the replaced stack is no longer reset


def test_registry_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"tracking.stack: `name` must be a non-empty string"):
        tracking.stack("")
    with pytest.raises(TypeError, match=r"tracking.register: `name` must be a non-empty string"):
        tracking.register(3, lambda: None)
    with pytest.raises(TypeError, match=r"`reset_fn` must be callable, got 'x'"):
        tracking.register("tests.test_tracking.bad", "x")
    with pytest.raises(KeyError, match=r"no stack named 'nope'"):
        tracking.active("nope")
