"""One registry for fscale's per-process accounting state and the one `reset` that clears it.

Accounting in fscale is opt-in and scoped: a ``with`` block opens a recorder (a comm ledger,
remat statistics, gather statistics), the code inside reports its events to every recorder open
at the time, and the block closes it. Each kind of recorder lives on a named `Stack` made by
`stack`, innermost last, so nested blocks each see every event. State that is not a stack of
recorders (the current mesh's debug flag, say) registers a reset function with `register`.

`reset` puts every registered piece of state back to its start-up value. A process that runs
many unrelated programs in turn (the ranks of `fscale.testing.RankPool`) calls it between
them, so a block one program left open (an exception that skipped its ``with`` exit, a
``__enter__`` without ``__exit__``) does not record the next program's events.

A module registers its state once, at import, under a name of its own (its dotted module
path, or that path plus a suffix). Registering a name again (a reloaded module) replaces the
earlier entry, so a reload never leaves a stale entry behind.

Reporting costs one truth test of the stack when nothing is open::

    _LEDGERS: tracking.Stack[CommLedger] = tracking.stack("fscale.distributed.ledger")

    def record(...):
        if not _LEDGERS:
            return
        for ledger in _LEDGERS.active():
            ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Stack", "active", "register", "registered", "reset", "stack"]

T = TypeVar("T")


class Stack(Generic[T]):
    """The open recorders of one kind, innermost last.

    Attributes:
        name: the name the stack is registered under.
    """

    __slots__ = ("_cleared", "_items", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: list[T] = []
        # What the last `clear` closed: a block still open across a reset may exit normally.
        self._cleared: list[T] = []

    def push(self, item: T) -> T:
        """Open `item`: it sees every event reported from now until it is popped."""
        self._items.append(item)
        return item

    def pop(self, item: T) -> None:
        """Close `item` (the innermost occurrence of that very object).

        An item that the last `clear` (or `reset`) closed may be popped again, so a ``with``
        block that spans a reset exits without error.

        Raises:
            ValueError: `item` is not open on this stack.
        """
        for items in (self._items, self._cleared):
            for index in range(len(items) - 1, -1, -1):
                if items[index] is item:
                    del items[index]
                    return
        raise ValueError(f"tracking stack {self.name!r}: {item!r} is not open")

    @contextlib.contextmanager
    def open(self, item: T) -> Iterator[T]:
        """Push `item` for the duration of the block and pop it however the block ends."""
        self.push(item)
        try:
            yield item
        finally:
            self.pop(item)

    def active(self) -> tuple[T, ...]:
        """The open items, outermost first: a snapshot that later pushes and pops leave alone."""
        return tuple(self._items)

    def top(self) -> T | None:
        """The innermost open item, or None when none is open."""
        return self._items[-1] if self._items else None

    def clear(self) -> None:
        """Close every open item."""
        self._cleared, self._items = self._items, []

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Stack({self.name!r}, {len(self._items)} open)"


_RESETS: dict[str, Callable[[], None]] = {}
_STACKS: dict[str, Stack[Any]] = {}


def stack(name: str) -> Stack[Any]:
    """A new, empty `Stack` registered under `name`; `reset` clears it.

    Raises:
        TypeError: `name` is not a non-empty string.
    """
    _check_name(name, "stack")
    new: Stack[Any] = Stack(name)
    _STACKS[name] = new
    _RESETS[name] = new.clear
    return new


def register(name: str, reset_fn: Callable[[], None]) -> None:
    """Have `reset` call `reset_fn` (no arguments) to restore state kept under `name`.

    Raises:
        TypeError: `name` is not a non-empty string, or `reset_fn` is not callable.
    """
    _check_name(name, "register")
    if not callable(reset_fn):
        raise TypeError(f"tracking.register: `reset_fn` must be callable, got {reset_fn!r}")
    _STACKS.pop(name, None)
    _RESETS[name] = reset_fn


def registered() -> tuple[str, ...]:
    """The names of the registered state, in registration order."""
    return tuple(_RESETS)


def active(name: str) -> tuple[Any, ...]:
    """The open items of the stack registered as `name` (see `Stack.active`).

    Raises:
        KeyError: no stack is registered as `name`; the message lists those that are.
    """
    found = _STACKS.get(name)
    if found is None:
        raise KeyError(
            f"tracking.active: no stack named {name!r}; registered stacks: {sorted(_STACKS)}"
        )
    return found.active()


def reset() -> None:
    """Restore every registered piece of state: close all stacks, run every reset function."""
    for reset_fn in list(_RESETS.values()):
        reset_fn()


def _check_name(name: object, caller: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tracking.{caller}: `name` must be a non-empty string, got {name!r}")
