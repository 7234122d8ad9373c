"""Benchmark: what each collective costs on this backend, through c10d and through fscale.

Usage: ``python bench/collectives.py [--world 2 4] [--sizes-kib 64 1024 4096 16384]
[--rounds N] [--backend gloo]``

For every world size one `fscale.launch` starts the ranks (one thread each); for every buffer
size (float32, the size of the full buffer) they time, round by round (`_util.interleave`, a
barrier before each call):

* ``all_reduce`` of the buffer (what DDP moves per gradient bucket),
* ``reduce_scatter`` of the buffer into 1/N (ZeRO-2/3's gradient reduction),
* ``all_gather`` of 1/N into the buffer (ZeRO's parameter gather),

each once through ``torch.distributed`` (``all_reduce``, ``reduce_scatter_single`` /
``reduce_scatter_tensor``, ``all_gather_single`` / ``all_gather_into_tensor``), once through
`fscale.distributed.collectives` on a mesh axis (the differentiable path: the ledger, the
watchdog's signature check, the autograd Function), and once through the in-place bucket
collectives of `fscale.parallel.bucket_collectives` (what `data_parallel` and
`shard_optimizer` run on their gradient and parameter buckets). The bucket collectives and the
differentiable ones run twice, in two launches: with ``FSCALE_SHARED_MEMORY=0``, through gloo
(from 1 MiB the reduce-scatter and the all-gather are exchanges between every pair of ranks,
`fscale.distributed.exchange`), and with the default, through shared memory between the ranks
of this host (`fscale.distributed.shared_memory`: the bucket collectives and the
differentiable all-gather and reduce-scatter; the differentiable all-reduce keeps gloo); each
launch times c10d beside them, and each ratio is over its own launch's c10d. A round's time is
its slowest rank's.

Reported per (N, size, collective): the median milliseconds of each path, fscale's over c10d,
the algorithm bandwidth (buffer bytes / time) and the bus bandwidth, the bytes each rank's
link carries in a ring algorithm per second (nccl-tests' convention: algorithm bandwidth
times 2(N-1)/N for all_reduce, (N-1)/N for the other two), so the three are comparable. Below
the table, per size: ``(reduce_scatter + all_gather) / all_reduce``, over c10d and over the
bucket collectives on each transport, what ZeRO's two collectives cost against DDP's one for
the same bytes. A ring moves the same bytes for both, so the ratio is 1 where the collectives
are equally good. The c10d columns' bandwidths are gloo's.
Writes ``bench/results/collectives.json``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import _util
import torch
import torch.distributed as dist

import fscale as fs
from fscale.distributed import collectives
from fscale.distributed.comm import all_gather_flat, reduce_scatter_flat
from fscale.parallel.bucket_collectives import (
    all_gather_bucket_start,
    all_reduce_bucket_start,
    reduce_scatter_bucket_start,
)

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
BUS_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


def _calls(size: int, world: int, mesh: fs.Mesh) -> dict[str, Any]:
    """name -> a callable running one collective on buffers made once here."""
    full = torch.randn(size)
    out_full = torch.empty(size)
    shard = torch.randn(size // world)
    out_shard = torch.empty(size // world)
    return {
        "c10d all_reduce": lambda: dist.all_reduce(full),
        "c10d reduce_scatter": lambda: reduce_scatter_flat(out_shard, full),
        "c10d all_gather": lambda: all_gather_flat(out_full, shard),
        "fscale all_reduce": lambda: collectives.all_reduce(full, "x", mesh=mesh),
        "fscale reduce_scatter": lambda: collectives.reduce_scatter(full, "x", mesh=mesh),
        "fscale all_gather": lambda: collectives.all_gather(shard, "x", mesh=mesh),
        # In place: the mean keeps the values where they were; the reduce-scatter's input is
        # consumed (its values do not change what the call costs).
        "bucket all_reduce": lambda: all_reduce_bucket_start(full, "x", mesh).wait(),
        "bucket reduce_scatter": lambda: reduce_scatter_bucket_start(full, "x", mesh).wait(),
        "bucket all_gather": lambda: all_gather_bucket_start(out_full, "x", mesh).wait(),
    }


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = fs.Mesh(x=world)
    results: dict[str, Any] = {}
    for kib in options["sizes_kib"]:
        size = kib * 1024 // 4 // world * world  # float32 elements, a multiple of N
        results[str(kib)] = _util.interleave(
            _calls(size, world, mesh),
            rounds=options["rounds"],
            warmup=options["warmup"],
            before_each=dist.barrier,
        )
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "collectives").splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with _util.MachineLoad() as load:
        for world in args.world:
            options = {"sizes_kib": args.sizes_kib, "rounds": args.rounds, "warmup": args.warmup}
            launches = [
                fs.launch(
                    rank_main,
                    world,
                    options,
                    backend=args.backend,
                    env={"FSCALE_DEBUG": "0", "FSCALE_SHARED_MEMORY": shared},
                )
                for shared in ("0", "1")
            ]
            rows += _rows(world, args.sizes_kib, *launches)
    print(_format(rows))
    print(_zero_over_ddp(rows))
    print(load.describe())
    _util.write_results("collectives", {"rows": rows, "load": load.describe()})
    return {"rows": rows}


def _rows(
    world: int, sizes_kib: list[int], gloo: list[dict[str, Any]], shared: list[dict[str, Any]]
) -> list[dict]:
    """One row per (size, collective); `gloo` and `shared` are the two launches' rank results."""
    rows = []
    for kib in sizes_kib:

        def median(per_rank: list[dict[str, Any]], name: str, kib: int = kib) -> float:
            rounds = zip(*(r[str(kib)][name] for r in per_rank))
            return statistics.median(max(values) for values in rounds)

        for kind in KINDS:
            c10d, ours = median(gloo, f"c10d {kind}"), median(gloo, f"fscale {kind}")
            bucket = median(gloo, f"bucket {kind}")
            shared_c10d, shared_ours, shared_bucket = (
                median(shared, f"c10d {kind}"),
                median(shared, f"fscale {kind}"),
                median(shared, f"bucket {kind}"),
            )
            size_bytes = kib * 1024 // 4 // world * world * 4
            algorithm = size_bytes / c10d
            rows.append(
                {
                    "world": world,
                    "size_kib": kib,
                    "collective": kind,
                    "c10d_s": c10d,
                    "fscale_s": ours,
                    "fscale_over_c10d": ours / c10d,
                    "bucket_s": bucket,
                    "bucket_over_c10d": bucket / c10d,
                    "fscale_shared_s": shared_ours,
                    "fscale_shared_over_c10d": shared_ours / shared_c10d,
                    "shared_s": shared_bucket,
                    "shared_over_c10d": shared_bucket / shared_c10d,
                    "algorithm_gb_s": algorithm / 1e9,
                    "bus_gb_s": algorithm * BUS_FACTOR[kind] * (world - 1) / world / 1e9,
                }
            )
    return rows


def _format(rows: list[dict[str, Any]]) -> str:
    header = [
        "N",
        "KiB",
        "collective",
        "c10d ms",
        "fscale ms",
        "fscale/c10d",
        "fscale shm ms",
        "/c10d",
        "bucket gloo ms",
        "/c10d",
        "bucket shm ms",
        "/c10d",
        "c10d alg GB/s",
        "c10d bus GB/s",
    ]
    body = [
        [
            r["world"],
            r["size_kib"],
            r["collective"],
            r["c10d_s"] * 1e3,
            r["fscale_s"] * 1e3,
            r["fscale_over_c10d"],
            r["fscale_shared_s"] * 1e3,
            r["fscale_shared_over_c10d"],
            r["bucket_s"] * 1e3,
            r["bucket_over_c10d"],
            r["shared_s"] * 1e3,
            r["shared_over_c10d"],
            r["algorithm_gb_s"],
            r["bus_gb_s"],
        ]
        for r in rows
    ]
    return _util.format_table(header, body)


def _zero_over_ddp(rows: list[dict[str, Any]]) -> str:
    """Per (N, size): ZeRO's reduce_scatter + all_gather over DDP's all_reduce, c10d times and
    bucket-collective times."""
    lines = []
    for world, kib in sorted({(r["world"], r["size_kib"]) for r in rows}):
        ratios = []
        for path in ("c10d", "bucket", "shared"):
            by_kind = {
                r["collective"]: r[f"{path}_s"]
                for r in rows
                if (r["world"], r["size_kib"]) == (world, kib)
            }
            zero = by_kind["reduce_scatter"] + by_kind["all_gather"]
            ratios.append(f"{path} {zero / by_kind['all_reduce']:.2f}")
        lines.append(
            f"N={world} {kib} KiB: (reduce_scatter + all_gather) / all_reduce = "
            + ", ".join(ratios)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
