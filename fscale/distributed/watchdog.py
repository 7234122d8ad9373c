"""Ranks that disagree on a collective fail on every rank in bounded time, saying who is where.

Without it, a rank that takes one step more, or a collective whose shapes differ across the
ranks, hangs until the process-group timeout and ends in the backend's "Timed out waiting ...
for recv", and a size mismatch makes gloo abort the process. On the default path (debug check
off) every collective goes through three cheap steps:

1. **Count.** Each collective is numbered per process group (and per send/recv channel); its
   signature (operation, dtype, shape, argument) and the step (`note_step`) are kept as this
   rank's last collective. A few attribute updates, no communication.
2. **Agree once per transition.** The first time a signature follows the group's previous
   one (a pair never seen on this group), each rank posts it to the job's store under (group,
   number) and reads its peers' before anything is sent. In a correct program every rank
   issues the same signatures in the same order, so a transition is new at the same number
   on every rank. Where the ranks first differ they share the previous signature, so at
   least one of them sees a new transition: it refuses to issue and either finds the peers'
   different signature (`CollectiveMismatchError` on every rank) or stops its peers' waits
   (step 3), before the backend sees tensors of different sizes (gloo aborts the process on
   those). A training step repeats a fixed cycle of transitions, so after the first step this
   costs nothing; the one case left to the backend is ranks whose differing signatures both
   follow the same previous one somewhere earlier in the run.
3. **Bounded waits.** Every wait on a collective is bounded by `collective_timeout()` seconds
   (``FSCALE_COLLECTIVE_TIMEOUT``, default 30). When it expires, or the backend fails (a peer
   left), the rank publishes where it is to the store and waits up to that long again for its
   peers' records. If the collective completes meanwhile (a late peer), or every peer waits
   in the same collective (slow, not stuck), the wait goes on; otherwise
   `CollectiveTimeoutError` names each rank and the collective it waits in (number,
   operation, axis, shape, dtype, step), or that it returned from its function
   (`mark_finished`) or is in no collective of the group.

Every message points to ``FSCALE_DEBUG=1``, the full metadata check before every collective
(`fscale.distributed.debug`), which names the first collective that differs. The store is the
one the default process group was built on; without one (a group made some other way) steps 2
and 3 still run, with only this rank's own record in the message. With NCCL a wait returns once
the work is queued on the stream, so only steps 1 and 2 apply there.

The state is per process and registered with `fscale.tracking`: `fscale.tracking.reset` forgets
the counters and signatures (every rank of a pool resets before each call, so they stay in step)
and starts a new namespace of store keys.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fscale import tracking

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Ticket",
    "admit",
    "admit_pair",
    "collective_timeout",
    "describe",
    "mark_finished",
    "note_step",
    "set_collective_timeout",
    "timeout_from_env",
    "wait",
]

Tensor = torch.Tensor

DEBUG_HINT = (
    "Run with FSCALE_DEBUG=1 (or fscale.distributed.set_debug(True) on every rank) to check "
    "every collective's operation, shape and dtype across the ranks before it is sent; the "
    "error then names the first collective that differs."
)


class CollectiveMismatchError(ValueError):
    """The ranks of an axis called a collective with different operations, shapes or dtypes."""


class CollectiveTimeoutError(CollectiveMismatchError):
    """A collective waited past `collective_timeout()` and its peers are not all in it."""


def timeout_from_env(environ: Any = os.environ) -> float:
    """The patience ``FSCALE_COLLECTIVE_TIMEOUT`` asks for (seconds; default 30)."""
    text = str(environ.get("FSCALE_COLLECTIVE_TIMEOUT", "")).strip()
    try:
        value = float(text) if text else 30.0
    except ValueError:
        raise ValueError(
            f"FSCALE_COLLECTIVE_TIMEOUT={text!r} must be a positive number of seconds"
        ) from None
    if not 0 < value < float("inf"):
        raise ValueError(f"FSCALE_COLLECTIVE_TIMEOUT={text!r} must be a positive number of seconds")
    return value


class _State:
    """This process's counters, last collective and patience."""

    def __init__(self) -> None:
        self.channels: dict[Any, _Channel] = {}
        self.last: Ticket | None = None
        self.step: int | None = None
        self.generation = 0
        self.patience = timeout_from_env()
        self.patience_delta = datetime.timedelta(seconds=self.patience)


class _Channel:
    """One process group (or one send/recv direction): its ranks, count and known signatures."""

    __slots__ = ("key", "previous", "ranks", "seen", "seq")

    def __init__(self, key: str, ranks: tuple[int, ...]) -> None:
        self.key = key
        self.ranks = ranks
        self.seq = 0
        self.previous: tuple[Any, ...] | None = None
        self.seen: set[tuple[Any, ...]] = set()


class Ticket(NamedTuple):
    """One collective as this rank issued it: what a bounded wait reports about."""

    channel: _Channel
    seq: int
    op: str
    axis: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    step: int | None


_STATE = _State()


def _reset() -> None:
    generation = _STATE.generation + 1
    _STATE.__init__()
    _STATE.generation = generation


tracking.register(__name__, _reset)


def set_collective_timeout(seconds: float) -> None:
    """Set how long a collective waits for its peers before the ranks compare where they are.

    Also set by ``FSCALE_COLLECTIVE_TIMEOUT`` at import (default 30 s). A rank whose peers are
    not all in the same collective raises after at most twice this long. Set it below the
    process-group timeout, on every rank.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"set_collective_timeout: `seconds` must be a number, got {seconds!r}")
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"set_collective_timeout: `seconds` must be positive and finite, got {seconds!r}"
        )
    _STATE.patience = float(seconds)
    _STATE.patience_delta = datetime.timedelta(seconds=float(seconds))


def collective_timeout() -> float:
    """Seconds a collective waits for its peers before the ranks compare where they are."""
    return _STATE.patience


def note_step(step: int) -> None:
    """Record that this rank is in training step `step` (named in timeout messages)."""
    _STATE.step = int(step)


def admit(group: Any, ranks: Any, axis: str, op: str, x: Tensor, extra: int, agree: bool) -> Ticket:
    """Count a collective on `group` before it is issued; agree on a new signature if `agree`.

    Args:
        group: the process group (the key of its counter).
        ranks: a callable returning the group's global ranks, called the first time only.
        axis: the mesh axis, for messages.
        op: the operation's name.
        x: the tensor the collective is issued on.
        extra: the operation's argument as an int (reduction, source, permutation digest).
        agree: whether to agree on a signature this group has not seen (the default path).

    Raises:
        CollectiveMismatchError: the ranks' signatures differ (every rank raises).
        CollectiveTimeoutError: a peer did not reach this collective in time.
    """
    channel = _STATE.channels.get(group)
    if channel is None:
        name = getattr(group, "group_name", "") or "-".join(map(str, ranks()))
        channel = _STATE.channels[group] = _Channel(f"g{name}", tuple(ranks()))
    return _admit(channel, axis, op, (op, x.dtype, x.shape, extra), x, agree)


def admit_pair(src: int, dst: int, axis: str, op: str, x: Tensor, agree: bool) -> Ticket:
    """Count a send (or recv) of `x` from global rank `src` to `dst`; as `admit` otherwise."""
    key = ("pair", src, dst)
    channel = _STATE.channels.get(key)
    if channel is None:
        channel = _STATE.channels[key] = _Channel(f"p{src}-{dst}", (src, dst))
    # Both ends must agree on the tensor; the operation names differ by design.
    return _admit(channel, axis, op, ("pair", x.dtype, x.shape, 0), x, agree)


def _admit(
    channel: _Channel, axis: str, op: str, signature: tuple[Any, ...], x: Tensor, agree: bool
) -> Ticket:
    channel.seq += 1
    ticket = Ticket(channel, channel.seq, op, axis, x.dtype, x.shape, _STATE.step)
    _STATE.last = ticket
    transition = (channel.previous, signature)
    channel.previous = signature
    if agree and transition not in channel.seen:
        _agree(ticket)
        channel.seen.add(transition)
    return ticket


def wait(work: Any, ticket: Ticket | None) -> None:
    """Wait for c10d `work`, at most `collective_timeout()` before the ranks compare records.

    Raises:
        CollectiveTimeoutError: the peers are not all in this collective, or the backend
            failed (the backend's message is included).
    """
    if ticket is None:
        work.wait()
        return
    try:
        work.wait(_STATE.patience_delta)
        return
    except RuntimeError as error:
        failure = None if "timed out" in str(error).lower() else error
    # A late peer that arrives while the records are compared completes the collective.
    _diagnose(ticket, "waiting", failure, None if failure else work.is_completed)
    work.wait()  # done, or every peer is in this collective: slow, not stuck


def mark_finished() -> None:
    """Publish that this rank returned from its function, for peers still waiting on it."""
    store = _store()
    if store is None or not _STATE.channels:
        return
    counts = {channel.key: channel.seq for channel in _STATE.channels.values()}
    record = {"state": "finished", "last": _describe_ticket(_STATE.last), "counts": counts}
    store.set(_key("where", dist.get_rank()), json.dumps(record))


def describe(op: str, shape: Any, dtype: torch.dtype) -> str:
    """``"all_reduce of shape (4,) float32"``: one collective in a message."""
    return f"{op} of shape {tuple(shape)} {str(dtype).replace('torch.', '')}"


# --------------------------------------------------------------------------------------------
# Agreement and diagnosis through the store


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _key(kind: str, *parts: object) -> str:
    return "/".join(("fscale-watch", str(_STATE.generation), kind, *map(str, parts)))


def _describe_ticket(ticket: Ticket | None) -> str:
    if ticket is None:
        return "no collective yet"
    where = f"#{ticket.seq} {describe(ticket.op, ticket.shape, ticket.dtype)} over axis "
    where += repr(ticket.axis)
    return where + (f" at step {ticket.step}" if ticket.step is not None else "")


def _agree(ticket: Ticket) -> None:
    store = _store()
    if store is None:
        return
    me, channel = dist.get_rank(), ticket.channel
    mine = describe(ticket.op if channel.key[0] == "g" else "send/recv", ticket.shape, ticket.dtype)
    keys = {rank: _key("sig", channel.key, ticket.seq, rank) for rank in channel.ranks}
    store.set(keys[me], mine)
    peers = [rank for rank in channel.ranks if rank != me]
    if not _poll(store, [keys[rank] for rank in peers], _STATE.patience):
        _diagnose(ticket, "agreeing", None, lambda: bool(store.check([keys[r] for r in peers])))
    theirs = dict(zip(peers, (v.decode() for v in store.multi_get([keys[r] for r in peers]))))
    theirs[me] = mine
    if len(set(theirs.values())) == 1:
        return
    lines = [f"  rank {rank}: {theirs[rank]}" for rank in channel.ranks]
    step = f" at step {ticket.step}" if ticket.step is not None else ""
    raise CollectiveMismatchError(
        f"{ticket.op} over axis {ticket.axis!r} (collective #{ticket.seq} of the group{step}): "
        f"the ranks disagree:\n" + "\n".join(lines) + "\nEvery rank of the axis must issue the "
        "same collective, in the same order, with tensors of the same shape and dtype. "
        + DEBUG_HINT
    )


def _poll(store: Any, keys: list[str], seconds: float) -> bool:
    """Whether every key appears in the store within `seconds`."""
    if not keys:
        return True
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
        return True
    except (RuntimeError, dist.DistError):
        return False


def _present(
    store: Any, keys: dict[int, str], seconds: float, escape: Callable[[], bool] | None
) -> dict[int, str] | None:
    """The values of those `keys` that appear within `seconds` (polled; partial on expiry), or
    None as soon as `escape()` is true."""
    found: dict[int, str] = {}
    deadline = time.monotonic() + seconds
    pause = 0.005
    while True:
        if escape is not None and escape():
            return None
        for rank, key in keys.items():
            if rank not in found and store.check([key]):
                found[rank] = store.get(key).decode()
        if len(found) == len(keys) or time.monotonic() >= deadline:
            return found
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _diagnose(
    ticket: Ticket,
    state: str,
    failure: BaseException | None,
    escape: Callable[[], bool] | None = None,
) -> None:
    """Compare where the ranks are; return only when the wait may go on.

    That is when `escape()` turns true while the peers' records are awaited (the collective
    completed, the peers' signatures arrived), or when every peer waits in this collective.
    """
    me, channel = dist.get_rank(), ticket.channel
    here = {
        "state": state,
        "group": channel.key,
        "seq": ticket.seq,
        "what": _describe_ticket(ticket),
        "last": _describe_ticket(_STATE.last),
    }
    store = _store()
    records: dict[int, dict[str, Any]] = {}
    if store is not None:
        store.set(_key("where", me), json.dumps(here))
        peers = {rank: _key("where", rank) for rank in channel.ranks if rank != me}
        found = _present(store, peers, _STATE.patience, escape)
        if found is None:
            store.delete_key(_key("where", me))
            return
        records = {rank: json.loads(value) for rank, value in found.items()}
    records[me] = here
    same = all(
        r.get("state") == "waiting" and r.get("group") == channel.key and r.get("seq") == ticket.seq
        for r in records.values()
    )
    if failure is None and state == "waiting" and same and len(records) == len(channel.ranks):
        if store is not None:
            store.delete_key(_key("where", me))
        return
    lines = [f"  rank {rank}: {_status(records.get(rank), channel)}" for rank in channel.ranks]
    waited = f"{_STATE.patience:g} s" if failure is None else "until the backend failed"
    cause = f"\nThe backend reported: {failure}" if failure is not None else ""
    raise CollectiveTimeoutError(
        f"rank {me} waited {waited} in {_describe_ticket(ticket)} and its peers are not all "
        f"in it:\n" + "\n".join(lines) + "\nEvery rank must issue the same collectives in the "
        "same order (the same number of steps, the same buffers and shapes). " + DEBUG_HINT + cause
    ) from failure


def _status(record: dict[str, Any] | None, channel: _Channel) -> str:
    if record is None:
        return "in no collective of this group (still computing, blocked elsewhere, or gone)"
    state = record.get("state")
    if state == "finished":
        count = record.get("counts", {}).get(channel.key, 0)
        return (
            f"returned from its function after collective #{count} of this group (its last: "
            f"{record.get('last')})"
        )
    verb = "waits in" if state == "waiting" else "checks the signature of"
    other = "" if record.get("group") == channel.key else " (another group)"
    return f"{verb} {record.get('what')}{other}"
