"""Interleave variants that each run in rank processes of their own.

`_util.interleave` times variants built in the same processes: the machine's drift cancels
round by round, but the variants share each process's heap. glibc's malloc hands a freed
block back to the system or keeps it depending on the order of the frees, so one variant's
step can leave the heap such that the next variant's activations take fresh zero-filled pages.
On the ResNet of ``bench/strategies.py`` (2 ranks, 30 steps each, page faults counted with
``getrusage``): fscale's DDP step alone took 2,000 page faults per step and torch's 5,500; in
one process, interleaved, fscale's took 6,100 and torch's 2,000-2,600, whichever ran first.
What a variant pays there is what the other left behind, not its own work.

`run` gives each variant `world` rank processes of its own (its own process group and heap),
all alive at once; the parent runs one step of one variant at a time, every rank of it
together, in the rotating order of `_util.interleave`, so drift still cancels and no variant's
memory affects another's. At the end the variants are stopped one after the other, each
running its `finish` while the others wait. The ranks of the variants waiting for their turn
block on a queue. Costs: ``len(names) * world`` processes, each with its own copy of torch.

Each rank records, per step, the wall time, its process's CPU time and its minor page faults.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import _util
import torch.distributed as dist

import fscale as fs

Build = Callable[[str, Any], Callable[[], Any]]
"""``build(name, payload)``: on each rank of a variant's group, make the callable that runs one
step of variant `name`; a module-level function (ranks import it)."""

_POLL_S = 1.0


def run(
    build: Build,
    finish: Callable[[Callable[[], Any]], Any] | None,
    names: Sequence[str],
    world: int,
    rounds: int,
    warmup: int,
    payload: Any = None,
    *,
    timeout: float = 3600.0,
) -> dict[str, dict[str, Any]]:
    """Time `names`, each in its own `world` gloo ranks, interleaved round by round.

    Args:
        build: see `Build`.
        finish: ``finish(step_callable)`` on every rank of a variant after its last step (e.g.
            a collective that reduces the final loss), or None; a module-level function.
        names: the variants.
        world: ranks per variant.
        rounds: timed rounds, at least 1.
        warmup: rounds run first and not recorded.
        payload: passed to `build` (picklable).
        timeout: seconds the whole run may take.

    Returns:
        name -> ``{"wall", "cpu", "faults"}``, each a list per rank of its `rounds` values
        (seconds, seconds, page faults), and ``"finish"``: what `finish` returned on each rank.

    Raises:
        ValueError: no names, a repeated name, or bad `world`, `rounds` or `warmup`.
        RuntimeError: a variant's ranks failed (the error names the variant) or stopped
            answering for `timeout` seconds.
    """
    names = list(names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"_isolated.run: `names` must be distinct and non-empty, got {names}")
    if world < 1 or rounds < 1 or warmup < 0:
        raise ValueError(
            f"_isolated.run: world >= 1, rounds >= 1, warmup >= 0; got {world}, {rounds}, {warmup}"
        )
    deadline = time.monotonic() + timeout
    with multiprocessing.get_context("spawn").Manager() as manager:
        go = {name: [manager.Queue() for _ in range(world)] for name in names}
        done = manager.Queue()
        results: dict[str, list[Any]] = {}
        errors: dict[str, BaseException] = {}

        def launch(name: str) -> None:
            try:
                results[name] = fs.launch(
                    _rank_main,
                    world,
                    name,
                    build,
                    finish,
                    payload,
                    go[name],
                    done,
                    backend="gloo",
                    timeout=timeout,
                )
            except BaseException as error:  # reported by the waits of the main thread
                errors[name] = error

        threads = [threading.Thread(target=launch, args=(name,), daemon=True) for name in names]
        for thread in threads:
            thread.start()
        try:
            _wait_for(
                done, {("ready", n, r) for n in names for r in range(world)}, errors, deadline
            )
            for round_index in range(warmup + rounds):
                for name in _util.rotation(names, round_index):
                    for rank_queue in go[name]:
                        rank_queue.put(True)
                    _wait_for(done, {("step", name, r) for r in range(world)}, errors, deadline)
        finally:
            # One variant at a time, so that each `finish` (which may run steps of its own)
            # has the machine to itself while the other variants' ranks wait, idle.
            for name, thread in zip(names, threads):
                for rank_queue in go[name]:
                    rank_queue.put(None)
                thread.join(max(1.0, deadline - time.monotonic()))
        if errors:
            name, error = next(iter(errors.items()))
            raise RuntimeError(f"_isolated.run: variant {name!r} failed: {error}") from error
    return {
        name: {
            **{
                measure: [per_rank[measure][warmup:] for per_rank in results[name]]
                for measure in ("wall", "cpu", "faults")
            },
            "finish": [per_rank["finish"] for per_rank in results[name]],
        }
        for name in names
    }


def _wait_for(
    done: Any,
    expected: set[tuple[str, str, int]],
    errors: dict[str, BaseException],
    deadline: float,
) -> None:
    """Take messages from `done` until every one of `expected` has come."""
    while expected:
        if errors:
            name, error = next(iter(errors.items()))
            raise RuntimeError(f"_isolated.run: variant {name!r} failed: {error}") from error
        if time.monotonic() > deadline:
            raise RuntimeError(f"_isolated.run: timed out waiting for {sorted(expected)[:3]}")
        try:
            message = done.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if message not in expected:
            raise RuntimeError(
                f"_isolated.run: unexpected message {message} (waiting for {sorted(expected)[:3]})"
            )
        expected.discard(message)


def _rank_main(
    name: str,
    build: Build,
    finish: Callable[[Callable[[], Any]], Any] | None,
    payload: Any,
    go: list[Any],
    done: Any,
) -> dict[str, Any]:
    rank = dist.get_rank()
    step = build(name, payload)
    done.put(("ready", name, rank))
    measured: dict[str, list[float]] = {"wall": [], "cpu": [], "faults": []}
    while go[rank].get():
        dist.barrier()
        faults = _util.minor_faults()
        cpu, wall = time.process_time(), time.perf_counter()
        step()
        measured["wall"].append(time.perf_counter() - wall)
        measured["cpu"].append(time.process_time() - cpu)
        measured["faults"].append(_util.minor_faults() - faults)
        done.put(("step", name, rank))
    return {**measured, "finish": None if finish is None else finish(step)}
