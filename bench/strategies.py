"""Benchmark: the step time of every fscale strategy beside its peers, one run per model and ranks.

Usage: ``python bench/strategies.py [--quick] [--ranks N ...] [--models gpt cnn] [--rounds N]
[--warmup N] [--keep-heap] [--isolated [--over-gloo]] [--strategies DDP ZeRO-2 ZeRO-3 remat]``

For each model (the GPT language model of `_util.gpt_config`, 8 sequences per rank, and the
ResNet of ``bench/oss.py``, 32 images per rank) and each number of gloo ranks (default 2 and 4,
one thread each), one `fscale.launch` builds every variant of `_variants` listed below in the
same processes and times them round by round (`_util.interleave`: the order rotates, a barrier
precedes every step, and a round's time is the slowest rank's). All train the same model
(seed 0) on the same batches with AdamW (fused kernels for torch, fscale's own flat fused
update):

* ``torch DDP`` and ``fscale DDP`` (``fscale.data_parallel``, donated);
* ``fscale ZeRO-2`` (``fscale.shard_optimizer``) beside ``FairScale OSS + ShardedDDP`` and
  ``DeepSpeed ZeRO-2`` (each when its library imports; the run says why one is skipped);
* ``fscale ZeRO-3`` (``fscale.fully_shard``, its default ``"except_last"``) beside ``torch
  FSDP2`` (its default: every unit resharded after forward), the same units (GPT blocks,
  ResNet stages) and root, and beside ``torch FSDP2 last kept`` (torchtitan's policy,
  the same one as fscale's default);
* with ``--isolated --over-gloo`` also ``fscale DDP over gloo`` and ``fscale ZeRO-2 over
  gloo``: the same steps with their bucket collectives on gloo's TCP loopback instead of the
  shared memory fscale's ranks of one host use by default (`fscale.distributed.shared_memory`),
  shown beside the goal's peer so the transport's share of the difference can be read off;
* GPT only: ``fscale DDP + checkpoint`` beside ``torch DDP + checkpoint``
  (``torch.utils.checkpoint``), every block checkpointed: torch recomputes every block, fscale
  every block but the forward's last, whose saved tensors its step keeps for the backward that
  begins with it (``fscale.remat.keep_last``). The ResNet's BatchNorm statistics would be
  updated twice by torch's recompute, so it has no checkpoint pair.

Reported per variant: median step time with its IQR and the global mean loss after the last
step; per strategy: the ratio of its median to the median of the peer issue 11 names (ZeRO-2
and DDP against torch DDP, ZeRO-3 against FSDP2, remat against torch's checkpoint), the median
of the round-by-round ratios with a distribution-free 95% interval for it
(`_util.median_interval`), and the verdict on the goal (<= 1.00x; ZeRO-3 <= 0.95x): met or
missed when the whole interval lies on one side of it, undecided when the rounds cannot tell
(the JSON keeps ``goal_met``, the ratio of medians against the goal, too). ``--quick``: the
small models, 4 timed rounds after 2. ``--keep-heap``: every rank first makes glibc keep the
memory it frees for reuse (`_util.keep_heap`), so no variant's time depends on how its frees
order the heap (with glibc's defaults a step that frees its activations takes fresh zero-filled
pages for them in the next one). ``--isolated``: each variant in rank processes of its own
(`_isolated`: all alive at once, one variant's step at a time in the same rotating order), so
no variant runs on a heap another variant's step left behind; the page faults per step
(reported in both modes) show what that changes. ``--strategies``
times only those strategies' variants and their peers (fewer variants share the machine's
caches differently, so such figures are read beside each other, not beside a full run's).
Writes ``bench/results/strategies.json`` (``strategies_keep_heap.json``, then ``_isolated``
with ``--isolated``; with ``--strategies``, ``_<names>`` after that).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import _isolated
import _util
import _variants
import torch
import torch.distributed as dist

import fscale as fs

COMPARISONS = (
    # (strategy, fscale variant, the peer the goal is set against, goal, other peers shown)
    ("DDP", "fscale DDP", "torch DDP", 1.00, ("fscale DDP over gloo",)),
    (
        "ZeRO-2",
        "fscale ZeRO-2",
        "torch DDP",
        1.00,
        ("FairScale OSS + ShardedDDP", "DeepSpeed ZeRO-2", "fscale ZeRO-2 over gloo"),
    ),
    (
        "ZeRO-3",
        "fscale ZeRO-3",
        "torch FSDP2",
        0.95,
        ("torch FSDP2 last kept", "fscale ZeRO-3 over gloo"),
    ),
    ("remat", "fscale DDP + checkpoint", "torch DDP + checkpoint", 1.00, ()),
)
VARIANTS = (
    "torch DDP",
    "fscale DDP",
    "fscale ZeRO-2",
    "FairScale OSS + ShardedDDP",
    "DeepSpeed ZeRO-2",
    "fscale ZeRO-3",
    "torch FSDP2",
    "torch FSDP2 last kept",
    "fscale DDP + checkpoint",
    "torch DDP + checkpoint",
    "fscale DDP over gloo",
    "fscale ZeRO-2 over gloo",
    "fscale ZeRO-3 over gloo",
)


def variants_for(
    model: str,
    with_fairscale: bool,
    strategies: list[str] | None = None,
    over_gloo: bool = False,
    with_deepspeed: bool = False,
) -> list[str]:
    """The variants timed on `model`: no checkpoint pair on the CNN, FairScale and DeepSpeed
    when they import, the variants over gloo only when asked (`over_gloo`; they need processes
    of their own); with `strategies`, only their fscale variants and peers."""
    wanted = None
    if strategies is not None:
        wanted = {
            name
            for strategy, ours, peer, _, others in COMPARISONS
            if strategy in strategies
            for name in (ours, peer, *others)
        }
    return [
        name
        for name in VARIANTS
        if (model == "gpt" or "checkpoint" not in name)
        and (with_fairscale or name not in _variants.FAIRSCALE)
        and (with_deepspeed or name not in _variants.DEEPSPEED)
        and (over_gloo or name not in _variants.OVER_GLOO)
        and (wanted is None or name in wanted)
    ]


def _prepare_rank(model: str, options: dict[str, Any]) -> _variants.Workload:
    if options["keep_heap"] and not _util.keep_heap():
        raise RuntimeError("--keep-heap: glibc's mallopt refused the thresholds")
    torch.set_num_threads(1)
    fs.distributed.set_debug(False)  # the cross-rank metadata check is a test aid, not timed
    count = options["warmup"] + options["rounds"]
    return _variants.Workload(
        model, options["quick"], count, dist.get_rank(), dist.get_world_size()
    )


def rank_main(model: str, names: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """One rank: build the variants, time them interleaved, then reduce their last losses."""
    workload = _prepare_rank(model, options)
    rounds, warmup = options["rounds"], options["warmup"]
    variants = {name: _variants.build(name, workload) for name in names}
    faults: dict[str, list[float]] = {name: [] for name in names}
    counted = {name: _counting_faults(variant, faults[name]) for name, variant in variants.items()}
    times = _util.interleave(counted, rounds, warmup, before_each=dist.barrier)
    losses = {name: variant.global_loss() for name, variant in variants.items()}
    faults = {name: values[warmup:] for name, values in faults.items()}
    return {"rank": dist.get_rank(), "times": times, "faults": faults, "final_loss": losses}


def _counting_faults(variant: Any, into: list[float]) -> Any:
    def call() -> None:
        before = _util.minor_faults()
        variant()
        into.append(_util.minor_faults() - before)

    return call


def build_isolated(name: str, payload: tuple[str, dict[str, Any]]) -> _variants.Variant:
    """`_isolated.Build`: one variant on a rank of its own process group."""
    model, options = payload
    return _variants.build(name, _prepare_rank(model, options))


def final_loss(variant: Any) -> float:
    return variant.global_loss()


def run_isolated(model: str, names: list[str], world: int, options: dict[str, Any]) -> list[dict]:
    """`rank_main`'s results, each variant timed in rank processes of its own (`_isolated`)."""
    measured = _isolated.run(
        build_isolated,
        final_loss,
        names,
        world,
        options["rounds"],
        options["warmup"],
        (model, options),
    )
    return [
        {
            "rank": rank,
            "times": {name: measured[name]["wall"][rank] for name in names},
            "faults": {name: measured[name]["faults"][rank] for name in names},
            "final_loss": {name: measured[name]["finish"][rank] for name in names},
        }
        for rank in range(world)
    ]


def slowest_rank(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per variant and round, the slowest rank's time (a synchronous step ends with its last)."""
    return {
        name: [max(samples) for samples in zip(*(times[name] for times in per_rank))]
        for name in per_rank[0]
    }


def compare(per_round: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One row per strategy whose fscale variant and goal peer were both timed."""
    rows = []
    for strategy, ours, peer, goal, others in COMPARISONS:
        if ours not in per_round or peer not in per_round:
            continue
        median = _util.summarize(per_round[ours]).median
        row: dict[str, Any] = {
            "strategy": strategy,
            "fscale": ours,
            "peer": peer,
            "goal": goal,
            "fscale_median_s": median,
            "peer_median_s": _util.summarize(per_round[peer]).median,
        }
        row["ratio"] = median / row["peer_median_s"]
        paired = _util.paired_ratios(per_round[ours], per_round[peer])
        row["paired_ratio"] = _util.summarize(paired).as_dict()
        interval = _util.median_interval(paired)
        row["paired_interval"] = dataclasses.asdict(interval)
        row["goal_met"] = row["ratio"] <= goal
        row["verdict"] = interval.verdict(goal)
        row["other_peers"] = {
            other: median / _util.summarize(per_round[other]).median
            for other in others
            if other in per_round
        }
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, 4 rounds after 2")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="gloo ranks")
    parser.add_argument("--models", nargs="+", default=["gpt", "cnn"], choices=["gpt", "cnn"])
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first")
    parser.add_argument(
        "--keep-heap",
        action="store_true",
        help="every rank keeps its freed memory for reuse (glibc thresholds; see _util.keep_heap)",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        choices=[c[0] for c in COMPARISONS],
        help="time only these strategies and their peers",
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="each variant in rank processes of its own, so no variant runs on a heap another "
        "left behind (see bench/_isolated.py)",
    )
    parser.add_argument(
        "--over-gloo",
        action="store_true",
        help="with --isolated: also fscale's DDP and ZeRO-2 with their buckets over gloo instead "
        "of shared memory",
    )
    args = parser.parse_args(argv)
    if args.over_gloo and not args.isolated:
        parser.error("--over-gloo needs --isolated: a group's transport is decided once")
    rounds = args.rounds if args.rounds is not None else (4 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if rounds < 1 or warmup < 0 or any(n < 1 for n in args.ranks):
        parser.error("--rounds and every --ranks must be >= 1, --warmup >= 0")
    options = {"quick": args.quick, "rounds": rounds, "warmup": warmup, "keep_heap": args.keep_heap}
    fairscale = _variants.fairscale_status()
    deepspeed = _variants.deepspeed_status()
    for reason in (fairscale, deepspeed):
        if reason:
            print(reason)

    runs, table, verdicts = [], [], []
    for model in args.models:
        names = variants_for(
            model, fairscale is None, args.strategies, args.over_gloo, deepspeed is None
        )
        if not names:
            continue
        for world in args.ranks:
            with _util.MachineLoad() as load:
                if args.isolated:
                    per_rank = run_isolated(model, names, world, options)
                else:
                    per_rank = fs.launch(
                        rank_main, world, model, names, options, backend="gloo", timeout=3600
                    )
            per_round = slowest_rank([r["times"] for r in per_rank])
            comparisons = compare(per_round)
            variants = [
                {
                    "variant": name,
                    "step_s": _util.summarize(samples).as_dict(),
                    "round_s": samples,
                    "final_loss": per_rank[0]["final_loss"][name],
                    "page_faults_per_step": [
                        statistics.median(r["faults"][name]) for r in per_rank
                    ],
                }
                for name, samples in per_round.items()
            ]
            runs.append(
                {
                    "model": model,
                    "ranks": world,
                    "variants": variants,
                    "comparisons": comparisons,
                    "machine_load": load.as_dict(),
                }
            )
            print(f"{model}, {world} ranks: {load.describe()}", flush=True)
            for row in variants:
                step = row["step_s"]
                table.append(
                    [
                        model,
                        world,
                        row["variant"],
                        step["median"] * 1e3,
                        step["iqr"] * 1e3,
                        max(row["page_faults_per_step"]),
                        f"{row['final_loss']:.6f}",
                    ]
                )
            for row in comparisons:
                paired, interval = row["paired_ratio"], row["paired_interval"]
                verdicts.append(
                    [
                        model,
                        world,
                        row["strategy"],
                        row["peer"],
                        row["fscale_median_s"] * 1e3,
                        row["peer_median_s"] * 1e3,
                        f"{row['ratio']:.3f}x",
                        f"{paired['median']:.3f} ({interval['low']:.3f}-{interval['high']:.3f})",
                        f"<= {row['goal']:.2f}x",
                        row["verdict"],
                        ", ".join(f"{v:.3f}x {k}" for k, v in row["other_peers"].items()) or "-",
                    ]
                )
    print(
        _util.format_table(
            ["model", "ranks", "variant", "median ms", "IQR ms", "page faults", "final loss"],
            table,
        )
    )
    print()
    print(
        _util.format_table(
            [
                "model",
                "ranks",
                "strategy",
                "peer",
                "fscale ms",
                "peer ms",
                "ratio",
                "paired (95% CI)",
                "goal",
                "verdict",
                "fscale also vs",
            ],
            verdicts,
            float_format="{:.2f}",
        )
    )
    print(
        f"{rounds} interleaved rounds after {warmup}; a round's time is its slowest rank's; "
        "ratio = fscale median / peer median; paired = the median of the round-by-round ratios, "
        "with a distribution-free 95% interval for it; verdict: met / missed when the whole "
        "interval is on one side of the goal, else undecided"
        + ("; freed memory kept for reuse (--keep-heap)" if args.keep_heap else "")
        + ("; each variant in rank processes of its own (--isolated)" if args.isolated else "")
        + "; page faults: the median per step of the rank with most"
    )
    payload = {
        "options": {
            **options,
            "ranks": args.ranks,
            "models": args.models,
            "strategies": args.strategies,
            "isolated": args.isolated,
        },
        "fairscale": fairscale or "imported",
        "deepspeed": deepspeed or "imported",
        "runs": runs,
    }
    name = "strategies_keep_heap" if args.keep_heap else "strategies"
    if args.isolated:
        name += "_isolated"
    if args.strategies:
        name += "_" + "_".join(s.lower().replace("-", "") for s in args.strategies)
    path = _util.write_results(name, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
