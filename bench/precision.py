"""Benchmark: bf16 mixed precision against fp32 on the GPT model, one process and 2-rank ZeRO-3.

Usage: ``python bench/precision.py [--quick] [--rounds N] [--warmup N]``

Variants (same model: `_util.gpt_config`, seed 0, dropout 0; same batches: `_util.lm_batch`,
8 sequences per rank; `fscale.optim.adamw`):

* ``local fp32`` / ``local bf16``: ``train_step`` and ``mixed_precision(train_step(...))``
  (bf16 compute on fp32 master weights, fp32 gradients);
* ``zero3 fp32`` / ``zero3 bf16``: ``fully_shard(..., Mesh(dp=2))`` on 2 gloo ranks, and the
  same under ``mixed_precision``: shards cast to bf16 before each all-gather, gradients
  reduce-scattered in fp32.

Each setting (local, ZeRO-3) times its two variants interleaved round by round (`_util.interleave`,
a barrier before every distributed step; a round's time is the slower rank's). Reported per
variant: median step time and IQR, the ratio to fp32 (median of the round-by-round ratios), the
peak RSS of a process (each rank's, the largest) that builds and trains only that variant for three
steps (``VmHWM``: interpreter and torch included, which is the same for every variant; the
allocator keeps freed memory resident, so a peak measured beside another variant would not tell
them apart), the state's bytes (params + optimizer state, per rank), the peak bytes of gathered
units (`track_gathers`), and the bytes one step's all-gathers and reduce-scatters move per rank
with their dtypes (the comm ledger, ring model). On a CPU without bf16 matrix units bf16 is slower
than fp32 (the kernels convert); the memory and traffic columns are what the policy changes on any
machine.
Writes ``bench/results/precision.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

import _util
import torch
import torch.distributed as dist

import fscale as fs
from fscale.memory import tree_bytes
from fscale.models import GPT, lm_loss
from fscale.parallel.fsdp import track_gathers

BATCH_PER_RANK = 8
WORLD = 2


def _loss_fn(apply: Any):
    def loss_fn(params, buffers, batch, key):
        logits, buffers = apply(params, buffers, batch.inputs, key=key)
        return lm_loss(logits, batch.targets), buffers

    return loss_fn


def _step(cfg: Any, mesh: fs.Mesh | None, dtype: str) -> tuple[fs.Step, Any]:
    """(step, initial state) in `dtype` ("fp32" or "bf16"), under ZeRO-3 when `mesh` is given."""
    apply, params, buffers = fs.functionalize(GPT(cfg, seed=0))
    step = fs.train_step(_loss_fn(apply), fs.optim.adamw(1e-3), donate=True)
    if mesh is not None:
        step = fs.fully_shard(step, mesh)
    if dtype == "bf16":
        step = fs.mixed_precision(step, param_dtype=torch.bfloat16)
    return step, step.init(params, buffers)


def _batches(cfg: Any, count: int, mesh: fs.Mesh | None) -> list[Any]:
    rank, world = (0, 1) if mesh is None else (dist.get_rank(), dist.get_world_size())
    return [
        fs.data.split_batch(_util.lm_batch(cfg, BATCH_PER_RANK * world, i), rank, world)
        for i in range(count)
    ]


def _steps(cfg: Any, mesh: fs.Mesh | None) -> dict[str, tuple[fs.Step, Any]]:
    """name -> (step, initial state) for fp32 and bf16."""
    setting = "local" if mesh is None else "zero3"
    return {f"{setting} {dtype}": _step(cfg, mesh, dtype) for dtype in ("fp32", "bf16")}


def _peak_rss(cfg: Any, distributed: bool, dtype: str) -> int:
    """VmHWM of this process (a rank of its own launch) after three steps of one variant."""
    torch.set_num_threads(1)
    mesh = fs.Mesh(dp=dist.get_world_size()) if distributed else None
    step, state = _step(cfg, mesh, dtype)
    for batch in _batches(cfg, 3, mesh):
        state, _ = step(state, batch)
    return _util.peak_rss_bytes()


def _measure(cfg: Any, mesh: fs.Mesh | None, rounds: int, warmup: int) -> dict[str, Any]:
    batches = _batches(cfg, rounds + warmup + 2, mesh)
    steps = _steps(cfg, mesh)
    states = {name: state for name, (_, state) in steps.items()}
    counters = dict.fromkeys(steps, 0)

    def runner(name: str):
        step = steps[name][0]

        def run() -> None:
            states[name], _ = step(states[name], batches[counters[name] % len(batches)])
            counters[name] += 1

        return run

    barrier = None if mesh is None else dist.barrier
    times = _util.interleave(
        {name: runner(name) for name in steps}, rounds, warmup, before_each=barrier
    )
    rows: dict[str, Any] = {}
    for name, (step, _) in steps.items():
        with fs.distributed.comm_ledger() as ledger, track_gathers() as gathers:
            runner(name)()
        state = states[name]
        traffic: dict[str, float] = {}
        for record in ledger.records:
            if record.op in ("all_gather", "reduce_scatter"):
                key = f"{record.op} {str(record.dtype).removeprefix('torch.')}"
                traffic[key] = traffic.get(key, 0.0) + record.bytes
        rows[name] = {
            "times": times[name],
            "state_bytes": tree_bytes(state.params) + tree_bytes(state.opt_state),
            "gathered_peak_bytes": gathers.peak_bytes,
            "traffic": traffic,
            "plan": repr(step.plan),
        }
    return rows


def _rank_main(cfg: Any, rounds: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return _measure(cfg, fs.Mesh(dp=dist.get_world_size()), rounds, warmup)


def _summary(
    name: str, per_rank: list[dict[str, Any]], fp32: str, peak_rss: list[int]
) -> dict[str, Any]:
    times = [max(ts) for ts in zip(*(r[name]["times"] for r in per_rank))]
    reference = [max(ts) for ts in zip(*(r[fp32]["times"] for r in per_rank))]
    stats = _util.summarize(times)
    first = per_rank[0][name]
    return {
        "variant": name,
        "median_s": stats.median,
        "iqr_s": stats.iqr,
        "vs_fp32": _util.summarize(_util.paired_ratios(times, reference)).median,
        "peak_rss": max(peak_rss),
        "state_bytes": max(r[name]["state_bytes"] for r in per_rank),
        "gathered_peak_bytes": first["gathered_peak_bytes"],
        "traffic": first["traffic"],
        "plan": first["plan"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    cfg = _util.gpt_config(args.quick)
    rounds = args.rounds or (4 if args.quick else 15)
    with _util.MachineLoad() as load:
        torch.set_num_threads(1)
        local = [_measure(cfg, None, rounds, args.warmup)]
        zero3 = fs.launch(_rank_main, WORLD, cfg, rounds, args.warmup, timeout=1800)
        peaks = {
            f"{setting} {dtype}": fs.launch(_peak_rss, world, cfg, world > 1, dtype, timeout=900)
            for setting, world in (("local", 1), ("zero3", WORLD))
            for dtype in ("fp32", "bf16")
        }
    rows = [_summary(n, local, "local fp32", peaks[n]) for n in ("local fp32", "local bf16")]
    rows += [_summary(n, zero3, "zero3 fp32", peaks[n]) for n in ("zero3 fp32", "zero3 bf16")]
    mib = 2**20
    print(
        f"GPT d_model={cfg.d_model} layers={cfg.n_layers} vocab={cfg.vocab_size} "
        f"seq={cfg.seq_len}, {BATCH_PER_RANK} sequences per rank, {rounds} rounds, 1 thread/rank"
    )
    print(
        _util.format_table(
            [
                "variant",
                "median ms",
                "IQR ms",
                "x fp32",
                "peak RSS MiB",
                "state MiB",
                "gathered peak MiB",
                "all_gather MiB",
                "reduce_scatter MiB",
            ],
            [
                [
                    row["variant"],
                    row["median_s"] * 1e3,
                    row["iqr_s"] * 1e3,
                    row["vs_fp32"],
                    row["peak_rss"] / mib,
                    row["state_bytes"] / mib,
                    row["gathered_peak_bytes"] / mib,
                    " + ".join(
                        f"{v / mib:.2f} {k.split()[1]}"
                        for k, v in row["traffic"].items()
                        if k.startswith("all_gather")
                    )
                    or "-",
                    " + ".join(
                        f"{v / mib:.2f} {k.split()[1]}"
                        for k, v in row["traffic"].items()
                        if k.startswith("reduce_scatter")
                    )
                    or "-",
                ]
                for row in rows
            ],
            float_format="{:.2f}",
        )
    )
    result = {
        "config": {
            "quick": args.quick,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "vocab_size": cfg.vocab_size,
            "seq_len": cfg.seq_len,
            "batch_per_rank": BATCH_PER_RANK,
            "rounds": rounds,
            "warmup": args.warmup,
            "world": WORLD,
        },
        "rows": rows,
        "load": load.as_dict(),
    }
    path = _util.write_results("precision", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
