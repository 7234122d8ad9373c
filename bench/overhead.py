"""Benchmark: the fixed cost of an fscale step, in microseconds, on a model too small to hide it.

Usage: ``python bench/overhead.py [--world N] [--steps N] [--warmup N] [--width N] [--profile]``

On a tiny MLP (default widths 32-32-32-8: about 2.4 thousand parameters, a batch of 16 rows per
rank) the arithmetic of a step takes a few tens of microseconds, so what remains is the fixed
per-step cost: Python, hooks, tree handling, checks and the latency of each collective. One
`fscale.launch` starts ``--world`` gloo ranks (``torch.set_num_threads(1)`` each); inside the
same processes, round by round (`_util.interleave`, a barrier before every step), they run:

* ``by hand``: the same arithmetic written out: ``nn.Module`` forward, ``loss.backward()``, the
  gradients packed into one flat buffer, divided by N and all-reduced in place, copied back,
  ``torch.optim.AdamW(fused=True).step()``; the loss is not reduced (nothing is reported);
* ``torch DDP``: ``DistributedDataParallel`` with the same optimizer, the loss not reduced;
* ``fscale data_parallel``: ``fscale.data_parallel(fscale.train_step(loss_fn, adamw,
  donate=True), mesh)``, which also returns the global mean loss;
* ``fscale data_parallel donate=False``: the pure step (new parameter and state buffers);
* ``fscale shard_optimizer``: ZeRO-2 over the same mesh;
* ``eager, no collectives`` / ``fscale train_step, no collectives``: the single-process step
  and fscale's local step on the same rank (no communication), whose difference is fscale's
  fixed cost outside the collectives.

A round's time is the slowest rank's. Reported per variant: the median step time in
microseconds with its interquartile range, and the fixed cost over ``by hand`` and over
``torch DDP`` (median of the round-by-round differences, which cancels most of the drift of a
shared machine). Writes ``bench/results/overhead.json``. ``--profile`` adds, from rank 0, where
fscale's data-parallel step spends the time ``by hand`` does not (`_util.profile_against`).
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from typing import Any

import _util
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.spmd import all_gather_objects

LEARNING_RATE = 1e-3
ROWS_PER_RANK = 16
BY_HAND = "by hand"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time, "main thread": time.thread_time}
"""Wall time, the CPU time of the rank's process (all its threads, gloo's included), and that of
its main thread alone (the Python that a step runs, without gloo's threads): on a machine shared
with other work the CPU times are the steadier measures of the cost itself."""
TORCH_DDP = "torch DDP"


def _batches(width: int, out: int, count: int, rank: int) -> list[tuple[torch.Tensor, ...]]:
    batches = []
    for index in range(count):
        g = torch.Generator().manual_seed(1000 * index + rank)
        batches.append(
            (
                torch.randn(ROWS_PER_RANK, width, generator=g),
                torch.randn(ROWS_PER_RANK, out, generator=g),
            )
        )
    return batches


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class EagerVariant:
    """An nn.Module with torch.optim.AdamW(fused=True): by hand, under torch DDP, or alone."""

    def __init__(self, sizes: list[int], batches: list, kind: str) -> None:
        self.model = fs.models.mlp(sizes, seed=0)
        self.kind = kind
        self.forward = self.model
        if kind == TORCH_DDP:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.forward = DistributedDataParallel(self.model)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LEARNING_RATE, fused=True)
        self.batches = batches
        self.count = 0

    def __call__(self) -> None:
        inputs, targets = self.batches[self.count % len(self.batches)]
        self.count += 1
        self.optimizer.zero_grad(set_to_none=True)
        _loss(self.forward(inputs), targets).backward()
        if self.kind == BY_HAND:
            grads = [p.grad for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
            flat.div_(dist.get_world_size())
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))  # type: ignore[union-attr]
                offset += g.numel()  # type: ignore[union-attr]
        self.optimizer.step()


class FscaleVariant:
    """An fscale Step over the functionalized MLP with fscale.optim.adamw."""

    def __init__(self, sizes: list[int], batches: list, strategy: str, donate: bool) -> None:
        apply, params, buffers = fs.functionalize(fs.models.mlp(sizes, seed=0))

        def loss_fn(params, buffers, batch, key):
            output, new_buffers = apply(params, buffers, batch[0], key=key)
            return _loss(output, batch[1]), new_buffers

        step = fs.train_step(loss_fn, fs.optim.adamw(LEARNING_RATE), donate=donate)
        mesh = fs.Mesh(dp=dist.get_world_size())
        if strategy == "data_parallel":
            step = fs.data_parallel(step, mesh)
        elif strategy == "shard_optimizer":
            step = fs.shard_optimizer(step, mesh)
        self.step = step
        self.state = step.init(params, buffers)
        self.batches = batches
        self.count = 0

    def __call__(self) -> None:
        self.state, _ = self.step(self.state, self.batches[self.count % len(self.batches)])
        self.count += 1


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    fs.distributed.set_debug(False)  # the cross-rank metadata check is a test aid, not for timing
    rank = dist.get_rank()
    sizes = options["sizes"]
    batches = _batches(sizes[0], sizes[-1], 8, rank)
    variants: dict[str, Any] = {
        BY_HAND: EagerVariant(sizes, batches, BY_HAND),
        TORCH_DDP: EagerVariant(sizes, batches, TORCH_DDP),
        "fscale data_parallel": FscaleVariant(sizes, batches, "data_parallel", True),
        "fscale data_parallel donate=False": FscaleVariant(sizes, batches, "data_parallel", False),
        "fscale shard_optimizer": FscaleVariant(sizes, batches, "shard_optimizer", True),
        "eager, no collectives": EagerVariant(sizes, batches, "eager"),
        "fscale train_step, no collectives": FscaleVariant(sizes, batches, "local", True),
    }
    mesh = fs.Mesh(dp=dist.get_world_size())
    result: dict[str, Any] = {"rank": rank}
    for clock_name, clock in CLOCKS.items():
        times = _util.interleave(
            variants,
            rounds=options["steps"],
            warmup=options["warmup"],
            before_each=dist.barrier,
            clock=clock,
        )
        result[clock_name] = all_gather_objects(times, mesh, "dp")
    if options["profile"]:
        result["profile"] = _util.profile_against(
            variants,
            BY_HAND,
            ["fscale data_parallel"],
            options["profile_steps"],
            record=rank == 0,
            before_each=dist.barrier,
        )
    return result


def round_times(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """A round's time is its slowest rank's: a synchronous step ends when all ranks finish."""
    return {
        name: [max(samples) for samples in zip(*(times[name] for times in per_rank))]
        for name in per_rank[0]
    }


def fixed_cost(samples: list[float], reference: list[float]) -> _util.Summary:
    """Round-by-round differences to the reference, in seconds."""
    return _util.summarize([a - b for a, b in zip(samples, reference)])


def _cell(entry: dict[str, float] | None) -> str:
    return "-" if entry is None else f"{entry['median']:.0f} ({entry['iqr']:.0f})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="number of gloo ranks")
    parser.add_argument("--steps", type=int, default=200, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    parser.add_argument("--width", type=int, default=32, help="hidden width of the MLP")
    parser.add_argument("--profile", action="store_true", help="profile fscale against by hand")
    parser.add_argument("--profile-steps", type=int, default=20, help="steps per profile")
    args = parser.parse_args(argv)
    if args.world < 2 or args.steps < 1 or args.warmup < 0 or args.width < 1:
        parser.error("--world >= 2, --steps >= 1, --warmup >= 0, --width >= 1")
    sizes = [args.width, args.width, args.width, 8]
    options = {
        "sizes": sizes,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile": args.profile,
        "profile_steps": args.profile_steps,
    }
    params = sum(a * b + b for a, b in itertools.pairwise(sizes))
    print(
        f"MLP {'-'.join(map(str, sizes))} ({params} params), {ROWS_PER_RANK} rows per rank, "
        f"{args.world} gloo ranks x 1 thread, {args.steps} timed rounds after {args.warmup}"
    )
    with _util.MachineLoad() as load:
        results = fs.launch(rank_main, args.world, options, backend="gloo", timeout=3600)
    print(load.describe())
    tables = {}
    for clock_name in CLOCKS:
        per_round = round_times(results[0][clock_name])
        rows = []
        for name, samples in per_round.items():
            over_hand = fixed_cost(samples, per_round[BY_HAND])
            over_ddp = fixed_cost(samples, per_round[TORCH_DDP])
            rows.append(
                {
                    "variant": name,
                    "step_us": _util.summarize(samples).scaled(1e6).as_dict(),
                    "over_by_hand_us": None if name == BY_HAND else over_hand.scaled(1e6).as_dict(),
                    "over_torch_ddp_us": None
                    if name == TORCH_DDP
                    else over_ddp.scaled(1e6).as_dict(),
                }
            )
        local = fixed_cost(
            per_round["fscale train_step, no collectives"], per_round["eager, no collectives"]
        )
        tables[clock_name] = {"rows": rows, "local_fixed_cost_us": local.scaled(1e6).as_dict()}
        print(f"\n{clock_name} time per step (a round's value is its slowest rank's):")
        print(
            _util.format_table(
                ["variant", "median us", "IQR us", "- by hand us (IQR)", "- torch DDP us (IQR)"],
                [
                    [
                        row["variant"],
                        row["step_us"]["median"],
                        row["step_us"]["iqr"],
                        _cell(row["over_by_hand_us"]),
                        _cell(row["over_torch_ddp_us"]),
                    ]
                    for row in rows
                ],
                float_format="{:.0f}",
            )
        )
        print(
            f"fscale's fixed cost without collectives (train_step - eager): "
            f"{local.median * 1e6:.0f} us per step (IQR {local.iqr * 1e6:.0f})"
        )
    profile = results[0].get("profile")
    if profile is not None:
        print()
        print(_util.format_profile(profile))
    payload = {
        "config": {
            "sizes": sizes,
            "params": params,
            "rows_per_rank": ROWS_PER_RANK,
            "world": args.world,
            "lr": LEARNING_RATE,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "machine_load": load.as_dict(),
        "clocks": tables,
        "profile": profile,
    }
    path = _util.write_results("overhead", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
