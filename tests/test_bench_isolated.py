"""bench/_isolated.py: variants in rank processes of their own, interleaved round by round."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _isolated  # the ranks import it by this name, from the same path


def _step_builder(name, payload):
    """A variant whose step all-reduces a counter and records when it ran."""
    if name == "broken":
        raise RuntimeError("this variant cannot be built")
    calls = []
    touched = payload.get(name, 0)

    def step():
        start = time.monotonic()
        counter = torch.ones(1)
        dist.all_reduce(counter)
        if touched:
            torch.ones(touched // 4).add_(1.0)  # fresh pages: page faults in its own process
        time.sleep(0.01)
        calls.append((start, time.monotonic(), int(counter)))

    step.calls = calls  # type: ignore[attr-defined]
    return step


def _report(step):
    start = time.monotonic()
    time.sleep(0.05)  # a finish that takes a while (e.g. steps of its own)
    return os.getpid(), dist.get_world_size(), step.calls, (start, time.monotonic())


def test_each_variant_runs_alone_in_its_own_processes_in_rotating_order():
    names = ["a", "b", "c"]
    payload = {"c": 64 << 20}
    measured = _isolated.run(_step_builder, _report, names, 2, rounds=3, warmup=1, payload=payload)
    assert list(measured) == names
    pids, spans, finishes = set(), [], []
    for name in names:
        result = measured[name]
        for key in ("wall", "cpu", "faults"):
            assert len(result[key]) == 2 and all(len(v) == 3 for v in result[key])  # warmup off
        assert all(w >= 0.01 for per_rank in result["wall"] for w in per_rank)
        for pid, world, calls, finish in result["finish"]:
            pids.add(pid)
            finishes.append((*finish, name))
            assert world == 2 and [n for *_, n in calls] == [2] * 4  # both ranks, every step
            spans += [(start, end, name) for start, end, _ in calls]
    assert len(pids) == 2 * len(names)  # a process per rank and variant
    # One variant's step at a time, in the order a, b, c / b, c, a / c, a, b / a, b, c.
    spans.sort()
    for (_, end, name), (start, _, next_name) in itertools.pairwise(spans):
        assert name == next_name or end <= start
    order = [name for i, (_, _, name) in enumerate(spans) if i == 0 or spans[i - 1][2] != name]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # The variants finish one after the other, after their last steps.
    finishes.sort()
    assert all(start >= spans[-1][1] for start, _, _ in finishes)
    for (_, end, name), (start, _, next_name) in itertools.pairwise(finishes):
        assert name == next_name or end <= start
    # Page faults are each process's own: only c touches 64 MiB of fresh memory per step.
    assert min(min(f) for f in measured["c"]["faults"]) > 10_000
    assert max(max(f) for f in measured["a"]["faults"]) < 10_000


def test_a_variant_that_fails_is_named_and_the_others_stop():
    with pytest.raises(RuntimeError, match=r"(?s)variant 'broken' failed: .*cannot be built"):
        _isolated.run(_step_builder, None, ["a", "broken"], 2, rounds=2, warmup=0, payload={})


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="distinct and non-empty"):
        _isolated.run(_step_builder, None, ["a", "a"], 2, rounds=1, warmup=0)
    with pytest.raises(ValueError, match="rounds >= 1"):
        _isolated.run(_step_builder, None, ["a"], 2, rounds=0, warmup=0)
