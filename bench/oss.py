"""Benchmark: FairScale's OSS benchmark on this machine: ZeRO-1/2 against DDP, 2 gloo ranks.

Usage: ``python bench/oss.py [--quick] [--rounds N] [--warmup N] [--bucket-mb MB]``

FairScale's ``benchmarks/oss.py`` trains a ResNet with RMSprop (lr 1e-4, momentum 0.9) under
DDP, OSS + DDP and OSS + ShardedDDP and compares throughput, memory and the final loss. This
script does the same with fscale's strategies and their peers, on one `fscale.launch` of 2 gloo
ranks (``torch.set_num_threads(1)`` each). Workloads (model x optimizer):

* models: a ResNet (`fscale.models.resnet`, widths 16-32-64, one block per stage; ``--quick``:
  8-16-32) on synthetic 3x32x32 images, 10 classes, 32 images per rank; and the GPT language
  model of the other benchmarks (`_util.gpt_config`), 8 sequences per rank;
* optimizers: RMSprop (lr 1e-4, momentum 0.9, as FairScale), SGD (lr 1e-2, momentum 0.9) and
  Adam (lr 1e-3); ``--quick`` runs RMSprop only.

Rows (each a training step on the same model, seed 0, and the same batches; fscale's buckets
are ``--bucket-mb`` MiB, default 4, so that even these small models have several buckets and
ZeRO-2's release of reduced buckets shows; torch DDP keeps its default 25 MiB):

* ``Vanilla DDP``: ``fscale.data_parallel``;
* ``OSS + DDP``: ``fscale.shard_optimizer(shard_grads=False)`` (ZeRO-1);
* ``OSS + ShardedDDP``: ``fscale.shard_optimizer()`` (ZeRO-2);
* ``torch DDP``: ``DistributedDataParallel`` + the torch.optim optimizer;
* ``torch DDP + ZeRO``: ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer``;
* ``FairScale OSS + DDP`` / ``FairScale OSS + ShardedDDP``: when ``import fairscale`` works
  (``fairscale.optim.OSS``, under torch DDP or ``fairscale.nn.ShardedDataParallel``, with
  ``model.zero_grad()`` as FairScale documents), else the reason is printed and stored.

All rows of a workload run interleaved round by round (`_util.interleave`, the order rotating,
a barrier before every step), so they see the same load. Columns: rank 0's median throughput
(global samples per second) with its interquartile range; the model-state bytes one rank holds
(parameters + gradients + optimizer state, each storage counted once: fscale's from its state
and the step's ``grad_bytes`` / ``grad_peak_bytes`` metrics, torch's from the parameters, their
``.grad`` after the step and the optimizer's state; DDP's internal bucket copy of the gradients
is not visible and not counted); the peak RSS of each rank during one step of the row, above
the RSS just before it (all rows live in the same processes, so the absolute peak is stored
too); and the global mean loss after the last step. Writes ``bench/results/oss.json``.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import _util
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.memory import tree_bytes
from fscale.models import GPT, ResNetConfig, classification_loss, lm_loss, resnet

WORLD = 2
IMAGES_PER_RANK = 32
SEQUENCES_PER_RANK = 8
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "RMSprop": ("rmsprop", {"lr": 1e-4, "momentum": 0.9}),
    "SGD": ("sgd", {"lr": 1e-2, "momentum": 0.9}),
    "Adam": ("adam", {"lr": 1e-3}),
}
_TORCH_NAMES = {"rmsprop": "RMSprop", "sgd": "SGD", "adam": "Adam"}


def fairscale_status() -> str | None:
    """None when FairScale's OSS and ShardedDDP import, else why they do not."""
    try:
        from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: F401
        from fairscale.optim.oss import OSS  # noqa: F401
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
        return f"FairScale rows skipped: `import fairscale` failed ({reason})"
    return None


# ----------------------------------------------------------------------------- workloads


class Workload:
    """A model family, its loss and this rank's slices of a fixed stream of global batches."""

    def __init__(self, name: str, quick: bool, count: int, rank: int) -> None:
        self.name = name
        if name == "ResNet":
            widths = (8, 16, 32) if quick else (16, 32, 64)
            self.build = lambda: resnet(ResNetConfig(num_classes=10, widths=widths), seed=0)
            self.per_rank = IMAGES_PER_RANK
            self.batches = [self._images(i, rank) for i in range(count)]
        else:
            cfg = _util.gpt_config(quick)
            self.build = lambda: GPT(cfg, seed=0)
            self.per_rank = SEQUENCES_PER_RANK
            self.batches = [
                fs.data.split_batch(_util.lm_batch(cfg, self.per_rank * WORLD, i), rank, WORLD)
                for i in range(count)
            ]

    def _images(self, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        images = torch.randn(self.per_rank * WORLD, 3, 32, 32, generator=g)
        labels = torch.randint(0, 10, (self.per_rank * WORLD,), generator=g)
        return fs.data.split_batch((images, labels), rank, WORLD)

    def inputs(self, batch: Any) -> torch.Tensor:
        return batch[0] if self.name == "ResNet" else batch.inputs

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        if self.name == "ResNet":
            return classification_loss(output, batch[1])
        return lm_loss(output, batch.targets)

    def batch(self, index: int) -> Any:
        return self.batches[index % len(self.batches)]


# ----------------------------------------------------------------------------- rows


class FscaleRow:
    """One fscale strategy: a Step over the functionalized model."""

    def __init__(
        self, workload: Workload, optimizer: tuple[str, dict], transform: Callable
    ) -> None:
        apply, params, buffers = fs.functionalize(workload.build())

        def loss_fn(params, buffers, batch, key):
            output, new_buffers = apply(params, buffers, workload.inputs(batch), key=key)
            return workload.loss(output, batch), new_buffers

        name, options = optimizer
        step = fs.train_step(loss_fn, getattr(fs.optim, name)(**options), donate=True)
        self.step = transform(step, fs.Mesh(dp=WORLD))
        self.state = self.step.init(params, buffers)
        self.workload = workload
        self.count = 0
        self.loss = float("nan")
        self.grad_bytes = 0

    def __call__(self) -> None:
        self.state, metrics = self.step(self.state, self.workload.batch(self.count))
        self.count += 1
        self.loss = float(metrics["loss"])
        self.grad_bytes = int(metrics.get("grad_peak_bytes", metrics["grad_bytes"]))

    def state_bytes(self) -> dict[str, int]:
        return {
            "params": tree_bytes(self.state.params),
            "grads": self.grad_bytes,
            "optimizer": tree_bytes(self.state.opt_state),
        }


class TorchRow:
    """torch DDP (or FairScale ShardedDDP) with a torch.optim, ZeRO or OSS optimizer."""

    def __init__(self, workload: Workload, optimizer: tuple[str, dict], kind: str) -> None:
        torch.manual_seed(0)
        self.model = workload.build()
        name, options = optimizer
        optimizer_class = getattr(torch.optim, _TORCH_NAMES[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "zero":
                self.optimizer = ZeroRedundancyOptimizer(
                    self.model.parameters(), optimizer_class=optimizer_class, **options
                )
            elif kind.startswith("fairscale"):
                from fairscale.optim.oss import OSS

                self.optimizer = OSS(self.model.parameters(), optim=optimizer_class, **options)
            else:
                self.optimizer = optimizer_class(self.model.parameters(), **options)
            if kind == "fairscale_sharded":
                from fairscale.nn.data_parallel import ShardedDataParallel

                self.wrapped = ShardedDataParallel(self.model, self.optimizer)
            else:
                self.wrapped = DistributedDataParallel(self.model)
        self.kind = kind
        self.workload = workload
        self.count = 0
        self.loss = float("nan")

    def __call__(self) -> None:
        batch = self.workload.batch(self.count)
        if self.kind == "fairscale_sharded":
            self.model.zero_grad()  # ShardedDDP's documented reset (its grads live in buckets)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        loss = self.workload.loss(self.wrapped(self.workload.inputs(batch)), batch)
        loss.backward()
        self.optimizer.step()
        self.count += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        self.loss = float(mean) / WORLD

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        # ZeroRedundancyOptimizer and OSS hold this rank's shard in an inner optimizer.
        local = getattr(self.optimizer, "optim", self.optimizer)
        return {
            "params": tree_bytes(params),
            "grads": tree_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": tree_bytes([dict(s) for s in local.state.values()]),
        }


def build_rows(
    workload: Workload, optimizer: tuple[str, dict], with_fairscale: bool, bucket_mb: float
) -> dict:
    def zero(shard_grads: bool) -> Callable:
        return lambda step, mesh: fs.parallel.shard_optimizer(
            step, mesh, shard_grads=shard_grads, bucket_mb=bucket_mb
        )

    rows: dict[str, Any] = {
        "Vanilla DDP": FscaleRow(
            workload, optimizer, lambda s, m: fs.data_parallel(s, m, bucket_mb=bucket_mb)
        ),
        "OSS + DDP": FscaleRow(workload, optimizer, zero(False)),
        "OSS + ShardedDDP": FscaleRow(workload, optimizer, zero(True)),
        "torch DDP": TorchRow(workload, optimizer, "ddp"),
        "torch DDP + ZeRO": TorchRow(workload, optimizer, "zero"),
    }
    if with_fairscale:
        rows["FairScale OSS + DDP"] = TorchRow(workload, optimizer, "fairscale_ddp")
        rows["FairScale OSS + ShardedDDP"] = TorchRow(workload, optimizer, "fairscale_sharded")
    return rows


def step_peak_rss(row: Any) -> tuple[int, int]:
    """(peak RSS during one step above the RSS before it, absolute peak), in bytes."""
    dist.barrier()
    _util.reset_peak_rss()
    before = _util.rss_bytes()
    row()
    peak = _util.peak_rss_bytes()
    return peak - before, peak


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    with_fairscale = options["fairscale_status"] is None
    results = []
    for model_name in ("ResNet", "GPT"):
        count = options["warmup"] + options["rounds"]
        workload = Workload(model_name, options["quick"], count, rank)
        for opt_label in options["optimizers"]:
            rows = build_rows(workload, OPTIMIZERS[opt_label], with_fairscale, options["bucket_mb"])
            times = _util.interleave(
                rows, options["rounds"], options["warmup"], before_each=dist.barrier
            )
            memory = {name: row.state_bytes() for name, row in rows.items()}
            losses = {name: row.loss for name, row in rows.items()}
            rss = {name: step_peak_rss(row) for name, row in rows.items()}
            results.append(
                {
                    "model": model_name,
                    "optimizer": opt_label,
                    "global_batch": workload.per_rank * WORLD,
                    "times": times,
                    "state_bytes": memory,
                    "final_loss": losses,
                    "step_rss": rss,
                }
            )
            del rows
    return {"rank": rank, "results": results}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, RMSprop only")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per workload")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="fscale bucket size, MiB")
    args = parser.parse_args(argv)
    status = fairscale_status()
    if status:
        print(status)
    options = {
        "quick": args.quick,
        "rounds": args.rounds or (4 if args.quick else 20),
        "warmup": args.warmup if not args.quick else min(args.warmup, 1),
        "optimizers": ["RMSprop"] if args.quick else list(OPTIMIZERS),
        "fairscale_status": status,
        "bucket_mb": args.bucket_mb,
    }
    with _util.MachineLoad() as load:
        per_rank = fs.launch(rank_main, WORLD, options, backend="gloo", timeout=3600)
    table, records = [], []
    for index, result in enumerate(per_rank[0]["results"]):
        for name, samples in result["times"].items():
            seconds = _util.summarize(samples)
            throughput = _util.summarize([result["global_batch"] / t for t in samples])
            state = result["state_bytes"][name]
            rss = [r["results"][index]["step_rss"][name] for r in per_rank]
            records.append(
                {
                    "model": result["model"],
                    "optimizer": result["optimizer"],
                    "row": name,
                    "throughput_samples_per_s": throughput,
                    "step_seconds": seconds,
                    "state_bytes": state,
                    "step_peak_rss_above_start_bytes": [r[0] for r in rss],
                    "absolute_peak_rss_bytes": [r[1] for r in rss],
                    "final_loss": result["final_loss"][name],
                }
            )
            table.append(
                [
                    result["model"],
                    result["optimizer"],
                    name,
                    throughput.median,
                    throughput.iqr,
                    sum(state.values()) / 2**20,
                    " / ".join(f"{r[0] / 2**20:.1f}" for r in rss),
                    result["final_loss"][name],
                ]
            )
    header = [
        "model",
        "optimizer",
        "row",
        "samples/s",
        "IQR",
        "state MiB/rank",
        "step RSS MiB (r0 / r1)",
        "final loss",
    ]
    print(_util.format_table(header, table, float_format="{:.4g}"))
    print(load.describe())
    payload = {
        "options": options,
        "rows": records,
        "machine_load": load.as_dict(),
        "notes": (
            "throughput: rank 0's global samples per second, median and IQR over interleaved "
            "rounds; state: params + grads + optimizer state of one rank (fscale: grads are "
            "the step's peak of gradient storage; torch: .grad after the step); step RSS: "
            "peak above the RSS before one step of the row."
        ),
    }
    path = _util.write_results("oss", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
