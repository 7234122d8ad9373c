"""Benchmark: per-rank peak resident memory of each strategy beside its torch peer, one run.

Usage: ``python bench/peak_memory.py [--quick] [--world N] [--steps N] [--fixed-mmap-threshold]
[--variants NAME ...]``

Every variant trains the GPT language model of the other benchmarks (`_util.gpt_config`, seed 0,
8 sequences per rank, AdamW) on ``--world`` gloo ranks, each variant in its own `fscale.launch`,
so that a rank's peak resident memory (``VmHWM``) is that variant's alone:

* ``torch DDP`` / ``torch DDP + checkpoint``: ``DistributedDataParallel`` with
  ``torch.optim.AdamW(fused=True)``, the second with ``torch.utils.checkpoint`` (non-reentrant)
  around every block;
* ``fscale DDP`` / ``fscale DDP donate=False``: ``fscale.data_parallel`` (donated and pure);
* ``fscale ZeRO-1`` / ``fscale ZeRO-2``: ``fscale.shard_optimizer(shard_grads=False / True)``;
* ``fscale DDP + checkpoint``: ``fscale.checkpoint`` around every block, under data_parallel.

Per rank: the resident memory after two warm-up steps (the state at rest, the module and the
batches included), the peak over the following steps, and the peak of the gradient phase and of
the update phase of one step (``step.gradients`` / ``step.apply_gradients``) above the memory
before it (fscale variants). With ``--fixed-mmap-threshold`` each rank first fixes glibc's mmap
threshold at 64 KiB (``mallopt``), so every tensor of that size gets its own mapping and is
returned to the kernel when freed: resident memory then follows the live tensors, without the
heap the allocator keeps after a phase's transient buffers are freed. Writes
``bench/results/peak_memory.json``.
"""

from __future__ import annotations

import argparse
import ctypes
from typing import Any

import _util
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.models import GPT, lm_loss

VARIANTS = (
    "torch DDP",
    "torch DDP + checkpoint",
    "fscale DDP",
    "fscale DDP donate=False",
    "fscale ZeRO-1",
    "fscale ZeRO-2",
    "fscale DDP + checkpoint",
)
SEQUENCES_PER_RANK = 8
LEARNING_RATE = 1e-3
MIB = 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _torch_step(model: nn.Module, batches: list) -> Any:
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE, fused=True)

    def run(index: int) -> None:
        batch = batches[index]
        optimizer.zero_grad(set_to_none=True)
        lm_loss(ddp(batch.inputs), batch.targets).backward()
        optimizer.step()

    return run, None


def _fscale_step(variant: str, model: nn.Module, batches: list, mesh: fs.Mesh) -> Any:
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        logits, new_buffers = apply(params, buffers, batch.inputs, key=key)
        return lm_loss(logits, batch.targets), new_buffers

    step = fs.train_step(
        loss_fn, fs.optim.adamw(LEARNING_RATE), donate=not variant.endswith("donate=False")
    )
    if "ZeRO" in variant:
        step = fs.shard_optimizer(step, mesh, shard_grads=variant.endswith("2"))
    else:
        step = fs.data_parallel(step, mesh)
    holder = {"state": step.init(params, buffers)}
    del params

    def run(index: int) -> None:
        holder["state"], _ = step(holder["state"], batches[index])

    def phases(index: int) -> dict[str, float]:
        """Peaks of the two phases of one step above the resident memory before each."""
        dist.barrier()
        start = _util.rss_bytes()
        _util.reset_peak_rss()
        grads, aux = step.gradients(holder["state"], batches[index])
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

    return run, phases


def rank_main(variant: str, options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    if options["fixed_mmap_threshold"]:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    fs.distributed.set_debug(False)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _util.gpt_config(options["quick"])
    steps = options["steps"]
    batches = [
        fs.data.split_batch(_util.lm_batch(cfg, SEQUENCES_PER_RANK * world, i), rank, world)
        for i in range(steps + 3)
    ]
    model = GPT(cfg, seed=0)
    if variant.endswith("checkpoint"):
        for i, block in enumerate(model.blocks):
            is_torch = variant.startswith("torch")
            model.blocks[i] = _TorchCheckpointed(block) if is_torch else fs.checkpoint(block)
    if variant.startswith("torch"):
        run, phases = _torch_step(model, batches)
    else:
        run, phases = _fscale_step(variant, model, batches, fs.Mesh(dp=world))
    run(0)
    run(1)
    dist.barrier()
    at_rest = _util.rss_bytes()
    _util.reset_peak_rss()
    for index in range(2, 2 + steps):
        run(index)
    result = {
        "rank": rank,
        "at_rest_mib": at_rest / MIB,
        "peak_mib": _util.peak_rss_bytes() / MIB,
        "peak_above_rest_mib": (_util.peak_rss_bytes() - at_rest) / MIB,
    }
    if phases is not None:
        result.update(phases(2 + steps))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small GPT")
    parser.add_argument("--world", type=int, default=2, help="number of gloo ranks")
    parser.add_argument("--steps", type=int, default=4, help="steps after the two warm-up steps")
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
        "steps": args.steps,
        "fixed_mmap_threshold": args.fixed_mmap_threshold,
    }
    cfg = _util.gpt_config(args.quick)
    print(
        f"GPT vocab={cfg.vocab_size} d_model={cfg.d_model} layers={cfg.n_layers} "
        f"seq={cfg.seq_len}, {SEQUENCES_PER_RANK} sequences per rank, {args.world} gloo ranks, "
        f"{args.steps} steps after 2; fixed mmap threshold: {args.fixed_mmap_threshold}"
    )
    rows = []
    with _util.MachineLoad() as load:
        for variant in args.variants:
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
            ["variant", "peak MiB", "at rest MiB", "peak - rest", "gradients +", "update +"],
            [
                [
                    row["variant"],
                    ranks(row, "peak_mib"),
                    ranks(row, "at_rest_mib"),
                    ranks(row, "peak_above_rest_mib"),
                    ranks(row, "gradient_phase_peak_mib"),
                    ranks(row, "update_phase_peak_mib"),
                ]
                for row in rows
            ],
        )
    )
    print("each cell: rank 0 / rank 1 / ...; MiB of resident memory (VmRSS / VmHWM)")
    payload = {
        "config": {**cfg.__dict__, "sequences_per_rank": SEQUENCES_PER_RANK, "world": args.world},
        "options": options,
        "machine_load": load.as_dict(),
        "rows": rows,
    }
    path = _util.write_results(
        "peak_memory_fixed_mmap" if args.fixed_mmap_threshold else "peak_memory", payload
    )
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
