"""Bucket collectives as pairwise exchanges on gloo: gloo's all-reduce's bits, the wire once.

Inputs are heavy-tailed (magnitudes over many binades), so summing four terms in another order
shows in the last bits of most elements; equality is checked on the raw bits. The sizes cover
gloo's two regimes: at most 2N segments of under 1 MiB, and buffers cut into 1 MiB segments.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from summation import SIZES, bits, heavy_tailed

import fscale as fs
from fscale import distributed as fd
from fscale.distributed import collectives as C
from fscale.distributed import exchange as exchange_module
from fscale.distributed.comm import resolve_comm
from fscale.distributed.exchange import (
    EXCHANGE_MIN_BYTES,
    RING_RULES,
    PairWork,
    exchange_all_gather,
    exchange_reduce_scatter,
    exchanges,
    exchanges_reduce_scatter,
    ring_chunk,
    ring_rule,
)
from fscale.distributed.shared_memory import set_shared_memory
from fscale.parallel.bucket_collectives import (
    all_gather_bucket_start,
    reduce_scatter_bucket_start,
)
from fscale.testing import run_spmd


def _ring_sum(terms: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """Every element summed as `ring_chunk` says gloo sums it, written out term by term."""
    size, numel = len(terms), terms[0].numel()
    out = torch.empty(numel)
    for c in range(size):
        lo, hi = min(c * chunk, numel), min((c + 1) * chunk, numel)
        if lo < hi:
            acc = terms[(c - 1) % size][lo:hi].clone()
            for k in range(2, size + 1):
                acc = terms[(c - k) % size][lo:hi] + acc
            out[lo:hi] = acc
    return out


def _model_case() -> tuple[str | None, list[bool]]:
    world = dist.get_world_size()
    rule = ring_rule(resolve_comm("dp", fd.Mesh(dp=world), "test"))
    out = []
    for numel in SIZES:
        numel = numel // world * world
        terms = [heavy_tailed(r, numel) for r in range(world)]
        reduced = terms[dist.get_rank()].clone()
        dist.all_reduce(reduced)
        expected = _ring_sum(terms, ring_chunk(numel, world, 4, rule or "count_first"))
        out.append(torch.equal(bits(reduced), bits(expected)))
    return rule, out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_chunk_is_the_order_gloo_sums_in(world):
    # The probe finds one of the two rules, the same on every rank, and that rule predicts
    # gloo's sums of whole buffers in both regimes.
    results = run_spmd(_model_case, world, timeout=120)
    assert len({rule for rule, _ in results}) == 1 and results[0][0] in RING_RULES
    for _, per_size in results:
        assert all(per_size), per_size


def _probe_in_either_order() -> list[str | None]:
    comm = resolve_comm("dp", fd.Mesh(dp=dist.get_world_size()), "test")
    saved = exchange_module.RING_RULES
    found = []
    try:
        for rules in (saved, saved[::-1]):
            exchange_module.RING_RULES = rules
            found.append(exchange_module._probe_rule(comm))
    finally:
        exchange_module.RING_RULES = saved
    return found


def test_the_probe_tells_the_rules_apart():
    # Tried in either order, the probe names the same rule: the other one's order fails it.
    for first, second in run_spmd(_probe_in_either_order, 4):
        assert first == second and first in RING_RULES


def test_the_two_ring_rules_differ_only_past_2n_mib():
    for size in (2, 3, 4, 8):
        small = 2 * size * (1 << 18) // 3  # float32, under 2N MiB
        assert ring_chunk(small, size, 4, "count_first") == ring_chunk(small, size, 4, "size_first")
    # 4 ranks, 8 MiB and 80 bytes: 12 segments either way (3 per rank), of 1 MiB (size first)
    # or of a twelfth of the buffer, 8,388,688 / 12 = 699,057.3 bytes rounded up to whole
    # elements, 699,060 (count first).
    numel = 2 * 4 * (1 << 18) + 20
    assert ring_chunk(numel, 4, 4, "size_first") == 3 * (1 << 18)
    assert ring_chunk(numel, 4, 4, "count_first") == 3 * 699_060 // 4
    with pytest.raises(ValueError, match="`rule` must be one of"):
        ring_chunk(numel, 4, 4, "ring")


def _unknown_rule_case() -> list[bool]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    comm = resolve_comm("dp", mesh, "test")
    saved = dict(exchange_module._probed_rule)
    exchange_module._probed_rule["rule"] = None  # a gloo that sums in an unknown order
    try:
        numel = EXCHANGE_MIN_BYTES // 4
        x = heavy_tailed(rank, numel)
        expected = x.clone()
        dist.all_reduce(expected)
        shard = reduce_scatter_bucket_start(x * world, "dp", mesh).wait()
        part = slice(rank * (numel // world), (rank + 1) * (numel // world))
        return [
            exchanges_reduce_scatter(comm, x) == (world == 2),
            exchanges(comm, x),  # all-gathers do no arithmetic: still exchanged
            torch.equal(shard, expected[part]),
        ]
    finally:
        exchange_module._probed_rule.clear()
        exchange_module._probed_rule.update(saved)


@pytest.mark.parametrize("world", [2, 4])
def test_an_unknown_ring_order_keeps_gloo_for_reduce_scatters_over_more_ranks(world):
    for checks in run_spmd(_unknown_rule_case, world):
        assert all(checks), checks


def test_ring_chunk_covers_the_buffer_in_n_chunks():
    for numel in (1, 7, 4100, 2_097_157, 6_292_692, 50_000_000):
        for size in (2, 3, 4, 8):
            for element_size in (2, 4, 8):
                chunk = ring_chunk(numel, size, element_size)
                assert chunk * size >= numel  # every element in one of the N chunks
                # Nearly an N-th part: one element per segment over it at most (rounding).
                assert chunk - numel / size <= max(2, -(-numel * element_size // (1 << 20)))


def _exchange_case(trailing: int) -> list[dict[str, bool]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    comm = resolve_comm("dp", mesh, "test")
    out = []
    for size in SIZES:
        numel = size // world * world
        whole = numel + trailing
        terms = [heavy_tailed(r, whole) for r in range(world)]
        reduced = terms[rank].clone()
        dist.all_reduce(reduced)  # the reference: gloo's all-reduce of the same buffer
        part = slice(rank * (numel // world), (rank + 1) * (numel // world))
        flat = terms[rank].clone()
        work, total = exchange_reduce_scatter(flat, comm, None, trailing)
        work.wait()
        target = torch.full((numel,), float("nan"))
        target[part] = reduced[part]
        exchange_all_gather(target, comm, None).wait()
        out.append(
            {
                "part": torch.equal(bits(total), bits(reduced[part])),
                "trailing": torch.equal(bits(flat[numel:]), bits(reduced[numel:])),
                "gathered": torch.equal(bits(target), bits(reduced[:numel])),
                "own part untouched": torch.equal(flat[part], terms[rank][part]),
                "exchanges": exchanges(comm, flat) == (whole * 4 >= EXCHANGE_MIN_BYTES),
            }
        )
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("trailing", [0, 3])
def test_exchanges_give_gloo_all_reducebits(world, trailing):
    for per_rank in run_spmd(_exchange_case, world, trailing, timeout=120):
        for checks in per_rank:
            assert all(checks.values()), checks


def _in_flight_case() -> list[bool]:
    # Two buckets' collectives in flight at once, a point-to-point message of the same shape
    # between them, waited for in the other order: each takes its own messages.
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    numel = EXCHANGE_MIN_BYTES // 4  # large enough to be exchanged
    first, second = heavy_tailed(rank, numel), heavy_tailed(rank + 10, numel)
    expected = [x.clone() for x in (first, second)]
    for x in expected:
        dist.all_reduce(x)
    a = reduce_scatter_bucket_start(first * world, "dp", mesh)
    b = reduce_scatter_bucket_start(second * world, "dp", mesh)
    shifted = C.ppermute(
        torch.full((numel // world,), float(rank)),
        "dp",
        [(r, (r + 1) % world) for r in range(world)],
        mesh=mesh,
    )
    shard_b, shard_a = b.wait(), a.wait()
    part = slice(rank * (numel // world), (rank + 1) * (numel // world))
    gathered = torch.zeros(numel)
    gathered[part] = shard_a
    gathered = all_gather_bucket_start(gathered, "dp", mesh).wait()
    return [
        torch.equal(shard_a, expected[0][part]),
        torch.equal(shard_b, expected[1][part]),
        torch.equal(shifted, torch.full_like(shifted, float((rank - 1) % world))),
        torch.equal(gathered, expected[0]),
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_exchanges_in_flight_take_their_own_messages(world):
    for checks in run_spmd(_in_flight_case, world):
        assert all(checks), checks


def test_a_pair_work_whose_wait_timed_out_says_the_connection_is_gone():
    class TimesOut:
        def wait(self, timeout=None):
            raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

        def is_completed(self):
            return False

    pending = PairWork([TimesOut()])
    with pytest.raises(RuntimeError, match="Timed out"):
        pending.wait(datetime.timedelta(seconds=1))  # what the watchdog sees and diagnoses
    with pytest.raises(RuntimeError, match=r"gloo then closed the connection .*Timed out"):
        pending.wait()  # gloo would answer "Application timeout caused pair closure"


def _late_exchange(late):
    # The watchdog's patience is 1 s; gloo would close the connection of a wait that timed
    # out, so an exchange waits twice the patience before it reports (PairWork).
    C.set_debug(False)
    C.set_collective_timeout(1.0)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    numel = EXCHANGE_MIN_BYTES // 4
    x = heavy_tailed(rank, numel)
    expected = x.clone()
    dist.all_reduce(expected)
    for _ in range(2):  # the signature and its repetition agreed: the next wait is the bound's
        reduce_scatter_bucket_start(x.clone(), "dp", mesh).wait()
    dist.barrier()
    if rank == 0:
        time.sleep(late)
    shard = reduce_scatter_bucket_start(x * world, "dp", mesh).wait()
    part = slice(rank * (numel // world), (rank + 1) * (numel // world))
    return torch.equal(shard, expected[part])


def test_a_peer_late_by_less_than_twice_the_patience_is_no_error_in_an_exchange():
    assert run_spmd(_late_exchange, 2, 1.4) == [True, True]


def _zero_grad_peak(transport: str) -> tuple[int, int]:
    world, rank = dist.get_world_size(), dist.get_rank()
    saved = exchange_module.EXCHANGE_MIN_BYTES
    exchange_module.EXCHANGE_MIN_BYTES = saved if transport == "exchange" else 1 << 62
    set_shared_memory(transport == "shared memory")
    try:
        params = {"w": torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))}

        def loss_fn(p, buffers, batch, key):
            return (batch @ p["w"].T).square().mean()

        step = fs.shard_optimizer(fs.train_step(loss_fn, fs.optim.sgd(0.1)), fd.Mesh(dp=world))
        state = step.init(params)
        _, metrics = step(
            state, torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank))
        )
    finally:
        exchange_module.EXCHANGE_MIN_BYTES = saved
    return int(metrics["grad_peak_bytes"]), 512 * 1024 * 4


@pytest.mark.parametrize("world", [2, 4])
def test_the_gradient_peak_counts_what_an_exchange_receives(world):
    runs = [run_spmd(_zero_grad_peak, world, t) for t in ("exchange", "gloo", "shared memory")]
    for (exchanged, bucket), (all_reduced, _), (shared, _) in zip(*runs):
        # The bucket, and beside it the other ranks' parts of this rank's shard it receives (one
        # of which becomes the shard); the loss rides in the bucket too (4 bytes in it, 4 received
        # from each other rank). An all-reduce in the bucket holds less. Through shared memory
        # the bucket and the shard it sums into (the windows are the transport's own).
        riding = 4 * world
        assert exchanged == bucket + bucket * (world - 1) // world + riding
        assert all_reduced < exchanged
        assert shared == bucket + 4 + bucket // world


def test_pair_work_waits_for_every_message_then_runs_its_completion_once():
    calls = []

    class Done:
        def __init__(self):
            self.waited = 0

        def wait(self, timeout=None):
            self.waited += 1
            return True

        def is_completed(self):
            return self.waited > 0

    works = [Done(), Done()]
    pending = PairWork(list(works), lambda: calls.append(1))
    assert not pending.is_completed()
    pending.wait()
    pending.wait()
    assert [w.waited for w in works] == [1, 1] and calls == [1] and pending.is_completed()
