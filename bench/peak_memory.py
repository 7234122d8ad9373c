"""Benchmark: per-rank peak resident memory of each fscale strategy beside its peers, one run.

Usage: ``python bench/peak_memory.py [--quick] [--world N] [--steps N] [--model gpt|cnn]
[--fixed-mmap-threshold] [--variants NAME ...]``

Every variant of `_variants` trains the same model (default the GPT language model of the
other benchmarks, `_util.gpt_config`, seed 0, 8 sequences per rank; ``--model cnn``: the
ResNet of ``bench/oss.py``, 32 images per rank, without the checkpoint pair) with AdamW on
``--world`` gloo ranks, each variant in its own `fscale.launch`, so that a rank's peak resident
memory (``VmHWM``) is that variant's alone. The strategies and their peers:

* DDP: ``fscale DDP`` / ``fscale DDP donate=False`` (``fscale.data_parallel``, donated and
  pure) beside ``torch DDP`` (``DistributedDataParallel`` + ``torch.optim.AdamW(fused=True)``);
* ZeRO-1: ``fscale ZeRO-1`` (``fscale.shard_optimizer(shard_grads=False)``) beside ``torch DDP
  + ZeRO-1`` (DDP + ``ZeroRedundancyOptimizer``, bucket view);
* ZeRO-2: ``fscale ZeRO-2`` (``fscale.shard_optimizer()``) beside ``FairScale OSS +
  ShardedDDP`` and ``DeepSpeed ZeRO-2`` (each when its library imports; the run says why one
  is skipped);
* ZeRO-3: ``fscale ZeRO-3`` (``fscale.fully_shard``) beside ``torch FSDP2`` (``fully_shard``
  per block, then the root) and ``torch FSDP2 last kept`` (the last block not resharded
  after forward, as fscale's default);
* remat: ``fscale DDP + checkpoint`` (``fscale.checkpoint`` around every block) beside ``torch
  DDP + checkpoint`` (``torch.utils.checkpoint``, non-reentrant).

Per rank: the resident memory after two warm-up steps (the state at rest, the module and the
batches included) and the bytes its live tensors hold then (`_util.live_tensor_bytes`: the
state, the module and the batches, without the memory the allocator keeps), the peak over
the following steps, and for the fscale variants the peak of
the gradient phase and of the update phase of one step (``step.gradients`` /
``step.apply_gradients``) above the memory before it. Then, per strategy, each fscale variant
beside its best peer (the one with the lowest peak; a peak is the highest over the ranks) and
whether fscale's peak is at or below it, the goal of issue 11. With ``--fixed-mmap-threshold``
each rank first fixes glibc's mmap threshold at 64 KiB (``mallopt``), so every tensor of that
size gets its own mapping and is returned to the kernel when freed: resident memory then
follows the live tensors, without the heap the allocator keeps after a phase's transient
buffers are freed. Writes ``bench/results/peak_memory.json`` (``peak_memory_fixed_mmap.json``).
"""

from __future__ import annotations

import argparse
import ctypes
from typing import Any

import _util
import _variants
import torch
import torch.distributed as dist

import fscale as fs

VARIANTS = _variants.FSCALE + _variants.PEERS
CLASSES = (
    # (strategy, fscale variants, peers)
    ("DDP", ("fscale DDP", "fscale DDP donate=False"), ("torch DDP",)),
    ("ZeRO-1", ("fscale ZeRO-1",), ("torch DDP + ZeRO-1",)),
    ("ZeRO-2", ("fscale ZeRO-2",), ("FairScale OSS + ShardedDDP", "DeepSpeed ZeRO-2")),
    ("ZeRO-3", ("fscale ZeRO-3",), ("torch FSDP2", "torch FSDP2 last kept")),
    ("remat", ("fscale DDP + checkpoint",), ("torch DDP + checkpoint",)),
)
MIB = 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def _phases(variant: _variants.Variant, batch: Any) -> dict[str, float]:
    """Peaks of the two phases of one fscale step above the resident memory before each."""
    step, holder = variant.fscale_step, variant.holder
    assert step is not None
    dist.barrier()
    start = _util.rss_bytes()
    _util.reset_peak_rss()
    grads, aux = step.gradients(holder["state"], batch)
    gradient_peak = _util.peak_rss_bytes() - start
    _util.reset_peak_rss()
    before_update = _util.rss_bytes()
    holder["state"], _ = step.apply_gradients(holder["state"], grads, aux)
    del grads, aux
    update_peak = _util.peak_rss_bytes() - before_update
    return {
        "gradient_phase_peak_mib": gradient_peak / MIB,
        "update_phase_peak_mib": update_peak / MIB,
    }


def rank_main(variant: str, options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    if options["fixed_mmap_threshold"]:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    fs.distributed.set_debug(False)
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = options["steps"]
    workload = _variants.Workload(options["model"], options["quick"], steps + 3, rank, world)
    run = _variants.build(variant, workload)
    run()
    run()
    dist.barrier()
    at_rest = _util.rss_bytes()
    live_at_rest = _util.live_tensor_bytes()
    _util.reset_peak_rss()
    for _ in range(steps):
        run()
    result = {
        "rank": rank,
        "at_rest_mib": at_rest / MIB,
        "live_at_rest_mib": live_at_rest / MIB,
        "peak_mib": _util.peak_rss_bytes() / MIB,
        "peak_above_rest_mib": (_util.peak_rss_bytes() - at_rest) / MIB,
    }
    if run.fscale_step is not None:
        result.update(_phases(run, workload.batch(2 + steps)))
    return result


def verdicts(rows: list[dict[str, Any]], absent: dict[str, str]) -> list[dict[str, Any]]:
    """Per strategy and fscale variant: its peak beside the best measured peer's.

    A variant's peak is the highest over its ranks. `absent` maps a peer that could not run to
    the reason, stored with the strategy's row.
    """
    peak = {row["variant"]: max(r["peak_mib"] for r in row["ranks"]) for row in rows}
    out = []
    for strategy, ours, peers in CLASSES:
        measured = [p for p in peers if p in peak]
        best = min(measured, key=peak.__getitem__) if measured else None
        missing = {p: absent[p] for p in peers if p in absent}
        for name in ours:
            if name not in peak:
                continue
            entry: dict[str, Any] = {
                "strategy": strategy,
                "fscale": name,
                "fscale_peak_mib": peak[name],
                "best_peer": best,
                "best_peer_peak_mib": None if best is None else peak[best],
                "peers_absent": missing,
            }
            entry["at_or_below_best_peer"] = None if best is None else peak[name] <= peak[best]
            out.append(entry)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small models")
    parser.add_argument("--world", type=int, default=2, help="number of gloo ranks")
    parser.add_argument("--steps", type=int, default=4, help="steps after the two warm-up steps")
    parser.add_argument("--model", default="gpt", choices=["gpt", "cnn"], help="the workload")
    parser.add_argument(
        "--fixed-mmap-threshold",
        action="store_true",
        help="fix glibc's mmap threshold in the ranks (resident memory follows live tensors)",
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    if args.world < 1 or args.steps < 1:
        parser.error("--world and --steps must be >= 1")
    options = {
        "quick": args.quick,
        "model": args.model,
        "steps": args.steps,
        "fixed_mmap_threshold": args.fixed_mmap_threshold,
    }
    absent: dict[str, str] = {}
    fairscale, deepspeed = _variants.fairscale_status(), _variants.deepspeed_status()
    if fairscale:
        absent.update(dict.fromkeys(_variants.FAIRSCALE, fairscale))
    if deepspeed:
        absent.update(dict.fromkeys(_variants.DEEPSPEED, deepspeed))
    for reason in sorted(set(absent.values())):
        print(reason)
    names = [
        name
        for name in args.variants
        if name not in absent and (args.model == "gpt" or "checkpoint" not in name)
    ]
    if args.model == "cnn" and any(name.endswith("checkpoint") for name in args.variants):
        print("the checkpoint pair trains the GPT only: skipped on the CNN")
    if args.model == "gpt":
        cfg = _util.gpt_config(args.quick)
        config: dict[str, Any] = {
            **cfg.__dict__,
            "sequences_per_rank": _variants.SEQUENCES_PER_RANK,
        }
        print(
            f"GPT vocab={cfg.vocab_size} d_model={cfg.d_model} layers={cfg.n_layers} "
            f"seq={cfg.seq_len}, {_variants.SEQUENCES_PER_RANK} sequences per rank, "
            f"{args.world} gloo ranks, {args.steps} steps after 2; fixed mmap threshold: "
            f"{args.fixed_mmap_threshold}"
        )
    else:
        config = {
            "model": "resnet",
            "quick": args.quick,
            "images_per_rank": _variants.IMAGES_PER_RANK,
        }
        print(
            f"ResNet ({'quick' if args.quick else 'full'}), {_variants.IMAGES_PER_RANK} images "
            f"per rank, {args.world} gloo ranks, {args.steps} steps after 2; fixed mmap "
            f"threshold: {args.fixed_mmap_threshold}"
        )
    rows = []
    with _util.MachineLoad() as load:
        for variant in names:
            per_rank = fs.launch(
                rank_main, args.world, variant, options, backend="gloo", timeout=3600
            )
            rows.append({"variant": variant, "ranks": per_rank})
    print(load.describe())

    def ranks(row: dict[str, Any], key: str) -> str:
        values = [r.get(key) for r in row["ranks"]]
        return " / ".join("-" if v is None else f"{v:.0f}" for v in values)

    print(
        _util.format_table(
            [
                "variant",
                "peak MiB",
                "at rest MiB",
                "tensors at rest",
                "peak - rest",
                "gradients +",
                "update +",
            ],
            [
                [
                    row["variant"],
                    ranks(row, "peak_mib"),
                    ranks(row, "at_rest_mib"),
                    ranks(row, "live_at_rest_mib"),
                    ranks(row, "peak_above_rest_mib"),
                    ranks(row, "gradient_phase_peak_mib"),
                    ranks(row, "update_phase_peak_mib"),
                ]
                for row in rows
            ],
        )
    )
    print(
        "each cell: rank 0 / rank 1 / ...; MiB of resident memory (VmRSS / VmHWM); tensors at "
        "rest: MiB of the storages live tensors view (_util.live_tensor_bytes)"
    )
    comparison = verdicts(rows, absent)
    print()
    print(
        _util.format_table(
            ["strategy", "fscale", "peak MiB", "best peer", "peak MiB", "fscale - peer", "goal"],
            [
                [
                    entry["strategy"],
                    entry["fscale"],
                    entry["fscale_peak_mib"],
                    entry["best_peer"] or "none measured",
                    entry["best_peer_peak_mib"],
                    None
                    if entry["best_peer"] is None
                    else entry["fscale_peak_mib"] - entry["best_peer_peak_mib"],
                    {True: "at or below", False: "above", None: "-"}[
                        entry["at_or_below_best_peer"]
                    ],
                ]
                for entry in comparison
            ],
            float_format="{:.0f}",
        )
    )
    print("peak: the highest per-rank peak RSS over the ranks; goal: fscale's peak <= best peer's")
    for reason in sorted(set(absent.values())):
        print(reason)
    payload = {
        "config": {**config, "world": args.world},
        "options": options,
        "machine_load": load.as_dict(),
        "rows": rows,
        "strategies": comparison,
        "absent": absent,
    }
    path = _util.write_results(
        "peak_memory_fixed_mmap" if args.fixed_mmap_threshold else "peak_memory", payload
    )
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
