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
``reduce_scatter_tensor``, ``all_gather_single`` / ``all_gather_into_tensor``) and once through
`fscale.distributed.collectives` on a mesh axis (the path fscale's plans take: the ledger, the
watchdog's signature check, the autograd Function). A round's time is its slowest rank's.

Reported per (N, size, collective): the median milliseconds of each path, fscale over c10d,
the algorithm bandwidth (buffer bytes / time) and the bus bandwidth, the bytes each rank's
link carries in a ring algorithm per second (nccl-tests' convention: algorithm bandwidth
times 2(N-1)/N for all_reduce, (N-1)/N for the other two), so the three are comparable. Below
the table, per size: ``(reduce_scatter + all_gather) / all_reduce`` over c10d, what ZeRO's
two collectives cost against DDP's one for the same bytes. A ring moves the same bytes for
both, so the ratio is 1 where the backend's collectives are equally good. Writes
``bench/results/collectives.json``.
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
            per_rank = fs.launch(
                rank_main, world, options, backend=args.backend, env={"FSCALE_DEBUG": "0"}
            )
            rows += _rows(world, args.sizes_kib, per_rank)
    print(_format(rows))
    print(_zero_over_ddp(rows))
    print(load.describe())
    _util.write_results("collectives", {"rows": rows, "load": load.describe()})
    return {"rows": rows}


def _rows(world: int, sizes_kib: list[int], per_rank: list[dict[str, Any]]) -> list[dict]:
    rows = []
    for kib in sizes_kib:

        def median(name: str, kib: int = kib) -> float:
            rounds = zip(*(r[str(kib)][name] for r in per_rank))
            return statistics.median(max(values) for values in rounds)

        for kind in KINDS:
            c10d, ours = median(f"c10d {kind}"), median(f"fscale {kind}")
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
        "alg GB/s",
        "bus GB/s",
    ]
    body = [
        [
            r["world"],
            r["size_kib"],
            r["collective"],
            r["c10d_s"] * 1e3,
            r["fscale_s"] * 1e3,
            r["fscale_over_c10d"],
            r["algorithm_gb_s"],
            r["bus_gb_s"],
        ]
        for r in rows
    ]
    return _util.format_table(header, body)


def _zero_over_ddp(rows: list[dict[str, Any]]) -> str:
    """Per (N, size): ZeRO's reduce_scatter + all_gather over DDP's all_reduce, c10d times."""
    by_key = {(r["world"], r["size_kib"], r["collective"]): r["c10d_s"] for r in rows}
    lines = []
    for world, kib in sorted({(r["world"], r["size_kib"]) for r in rows}):
        zero = by_key[(world, kib, "reduce_scatter")] + by_key[(world, kib, "all_gather")]
        lines.append(
            f"N={world} {kib} KiB: (reduce_scatter + all_gather) / all_reduce = "
            f"{zero / by_key[(world, kib, 'all_reduce')]:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
