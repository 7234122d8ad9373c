"""Benchmark: `fscale.tensor_parallel` against torch DTensor ``parallelize_module`` on gloo ranks.

Usage: ``python bench/tensor.py [--quick] [--steps N] [--warmup N] [--world N]``

One `fscale.launch` starts the ranks (gloo, ``torch.set_num_threads(1)`` each); every rank
trains the same GPT (`_util.gpt_config`, seed 0, dropout 0) on the same batches (the whole
batch on every rank: tensor parallelism splits the model, not the data), round by round
(`_util.interleave`, a barrier before every step):

* ``torch DTensor``: ``parallelize_module`` on every block with ``ColwiseParallel`` on
  ``attn.qkv`` and ``mlp.fc_in`` and ``RowwiseParallel`` on ``attn.proj`` and ``mlp.fc_out``;
  the fused q/k/v weight's rows are first put in (rank, q/k/v, head) order so that DTensor's
  contiguous split hands each rank whole heads, and each attention's ``n_heads`` is divided by
  the axis size. ``torch.optim.SGD`` (foreach) over the DTensor parameters.
* ``fscale tp``: `fscale.tensor_parallel` with the same four layers split (`Colwise(parts=3)`
  on ``qkv``) and `fscale.train_step` with `fscale.optim.sgd`.
* ``fscale tp+sp``: the same with sequence parallelism between the regions (the norms on
  sequence shards; the stream split after the embeddings and gathered before the output layer).

The embeddings and the output layer stay replicated in all three, so the traffic is the
blocks' alone. Per step: the median step time (the slowest rank's) and its ratio to DTensor's,
the bytes fscale's comm ledger records (ring model) against the analytical count, the bytes
each rank wrote to its sockets (``wchar``), the collectives DTensor issued (``CommDebugMode``),
and the final loss of each variant against a dense single-process model's.

Analytical traffic, ``S = batch * seq_len * d_model * 4`` bytes, ``N`` ranks, ``L`` blocks: 4
activation all-reduces per block (``g`` after each row-parallel layer in the forward, ``f``
before each column-parallel layer in the backward), ``4 L * 2 (N-1)/N * S``. With sequence
parallelism each all-reduce becomes a reduce-scatter plus an all-gather (the same bytes), plus
one all-gather of the final stream and its dual at the split after the embeddings, and the
gradients of the parameters used on sequence shards (partial on each rank, one all-reduce per
module): ``2 L + 1`` norms' weights and biases and ``2 L`` row-parallel biases, ``P = (4 L + 2 +
2 L) * d_model * 4`` bytes, so ``(4 L * 2 + 2) * (N-1)/N * S + 2 (N-1)/N * P``.
Writes ``bench/results/tensor.json``.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import _util
import torch
import torch.distributed as dist

import fscale as fs
from fscale.models import GPT, lm_loss
from fscale.parallel import tensor as tpl
from fscale.spmd import all_gather_objects

GOAL = 1.00
"""The ratio to DTensor's step time at or below which fscale counts as fast enough."""

LEARNING_RATE = 0.1
BATCH = 8
REFERENCE = "torch DTensor"


def _block_plan(sequence_parallel: bool) -> dict[str, Any]:
    how = "sequence" if sequence_parallel else "replicated"
    plan: dict[str, Any] = {
        "blocks.*.attn": (tpl.Heads("n_heads"), tpl.Input(how)),
        "blocks.*.attn.qkv": tpl.Colwise(parts=3),
        "blocks.*.attn.proj": tpl.Rowwise(output=how),
        "blocks.*.mlp": tpl.Input(how),
        "blocks.*.mlp.fc_in": "colwise",
        "blocks.*.mlp.fc_out": tpl.Rowwise(output=how),
    }
    if sequence_parallel:
        plan["embed"] = tpl.Output("split")
        plan["blocks.*.attn_norm"] = "sequence"
        plan["blocks.*.mlp_norm"] = "sequence"
        plan["final_norm"] = ("sequence", tpl.Output("gather"))
    return plan


class DTensorVariant:
    """torch's parallelize_module (ColwiseParallel / RowwiseParallel) with torch.optim.SGD."""

    def __init__(self, cfg: Any, batches: list[Any], mesh: fs.Mesh) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world = mesh.size("tp")
        self.module = GPT(cfg, seed=0)
        plan = {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc_in": ColwiseParallel(),
            "mlp.fc_out": RowwiseParallel(),
        }
        for block in self.module.blocks:
            with torch.no_grad():  # rows (q/k/v, rank, head) -> (rank, q/k/v, head)
                weight = block.attn.qkv.weight
                weight.copy_(
                    weight.unflatten(0, (3, world, -1)).transpose(0, 1).flatten(0, 2).clone()
                )
            block.attn.n_heads //= world
            parallelize_module(block, mesh.device_mesh, plan)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LEARNING_RATE)
        self.batches = batches
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        batch = self.batches[len(self.losses) % len(self.batches)]
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(self.module(batch.inputs), batch.targets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.detach())


class FscaleVariant:
    """fscale.tensor_parallel under fscale.train_step with fscale.optim.sgd."""

    def __init__(self, cfg: Any, batches: list[Any], mesh: fs.Mesh, sequence_parallel: bool):
        model = fs.tensor_parallel(GPT(cfg, seed=0), mesh, "tp", _block_plan(sequence_parallel))
        apply, params, buffers = fs.functionalize(model)

        def loss_fn(params, buffers, batch, key):
            logits, new_buffers = apply(params, buffers, batch.inputs, key=key)
            return lm_loss(logits, batch.targets), new_buffers

        self.step = fs.train_step(loss_fn, fs.optim.sgd(LEARNING_RATE))
        self.state = self.step.init(params, buffers)
        self.batches = batches
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        batch = self.batches[len(self.losses) % len(self.batches)]
        self.state, metrics = self.step(self.state, batch)
        self.losses.append(metrics["loss"])


def _dense_losses(cfg: Any, batches: list[Any], steps: int) -> list[float]:
    model = GPT(cfg, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for i in range(steps):
        batch = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(batch.inputs), batch.targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _written_bytes() -> int:
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def traffic(variants: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One step of each variant: socket bytes, fscale's ledger, DTensor's collective counts."""
    from torch.distributed.tensor.debug import CommDebugMode

    report: dict[str, dict[str, Any]] = {}
    for name, variant in variants.items():
        dist.barrier()
        before = _written_bytes()
        entry: dict[str, Any] = {}
        if isinstance(variant, FscaleVariant):
            with fs.distributed.comm_ledger() as ledger:
                variant()
            entry["ledger_bytes"] = ledger.total_bytes()
            entry["calls"] = {op: ledger.count(op) for op in {r.op for r in ledger.records}}
        else:
            with CommDebugMode() as comm_mode:
                variant()
            entry["calls"] = {
                str(op).split(".")[-1]: n for op, n in comm_mode.get_comm_counts().items()
            }
        entry["wire_bytes"] = _written_bytes() - before
        report[name] = entry
    return report


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    fs.distributed.set_debug(False)
    world = dist.get_world_size()
    cfg = _util.gpt_config(options["quick"])
    steps, warmup = options["steps"], options["warmup"]
    batches = [_util.lm_batch(cfg, options["batch"], i) for i in range(warmup + steps)]
    mesh = fs.Mesh(tp=world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants: dict[str, Any] = {REFERENCE: DTensorVariant(cfg, batches, mesh)}
    variants["fscale tp"] = FscaleVariant(cfg, batches, mesh, sequence_parallel=False)
    variants["fscale tp+sp"] = FscaleVariant(cfg, batches, mesh, sequence_parallel=True)
    times = _util.interleave(variants, rounds=steps, warmup=warmup, before_each=dist.barrier)
    all_times = all_gather_objects(times, mesh, "tp")
    last = warmup + steps - 1
    result = {
        "times": times,
        "all_times": all_times,
        "final_loss": {name: float(v.losses[last]) for name, v in variants.items()},
        "dense_final_loss": _dense_losses(cfg, batches, warmup + steps)[last],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result["traffic"] = traffic(variants)
    return result


def analytical_bytes(cfg: Any, batch: int, world: int, sequence_parallel: bool) -> float:
    activation = batch * cfg.seq_len * cfg.d_model * 4
    share = (world - 1) / world * activation
    if sequence_parallel:
        # The parameters used on this rank's sequence shard only get partial gradients, each
        # module's summed over the ranks by one all-reduce, as under Megatron's sequence
        # parallelism: the norms' weights and biases (two norms per block, one final) and the
        # row-parallel layers' biases, added after the reduce-scatter (two per block).
        partial = ((2 * cfg.n_layers + 1) * 2 + 2 * cfg.n_layers) * cfg.d_model * 4
        return (4 * cfg.n_layers * 2 + 2) * share + 2 * (world - 1) / world * partial
    return 4 * cfg.n_layers * 2 * share


def round_times(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    return {
        name: [max(samples) for samples in zip(*(times[name] for times in per_rank))]
        for name in per_rank[0]
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (10 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    cfg = _util.gpt_config(args.quick)
    options = {"quick": args.quick, "steps": steps, "warmup": warmup, "batch": args.batch}
    print(
        f"GPT vocab={cfg.vocab_size} d_model={cfg.d_model} layers={cfg.n_layers} "
        f"seq={cfg.seq_len}, batch {args.batch}, {args.world} gloo ranks x 1 thread, "
        f"{steps} timed rounds after {warmup} warm-up"
    )
    with _util.MachineLoad() as load:
        results = fs.launch(
            rank_main, args.world, options, backend="gloo", env={"FSCALE_DEBUG": "0"}, timeout=1800
        )
    print(load.describe())
    per_round = round_times(results[0]["all_times"])
    summaries = {name: _util.summarize(samples) for name, samples in per_round.items()}
    reference = summaries[REFERENCE].median
    rank0 = results[0]
    rows = []
    for name, summary in summaries.items():
        paired = _util.summarize(_util.paired_ratios(per_round[name], per_round[REFERENCE]))
        traffic_row = rank0["traffic"][name]
        expected = analytical_bytes(cfg, args.batch, args.world, name.endswith("sp"))
        rows.append(
            {
                "variant": name,
                "step_s": summary.as_dict(),
                "ratio_of_medians": summary.median / reference,
                "paired_ratio": paired.as_dict(),
                "final_loss": rank0["final_loss"][name],
                "dense_final_loss": rank0["dense_final_loss"],
                "ledger_bytes_per_step": traffic_row.get("ledger_bytes"),
                "analytical_bytes_per_step": expected,
                "wire_bytes_per_step": traffic_row["wire_bytes"],
                "collectives_per_step": traffic_row["calls"],
            }
        )
    mib = 1 / 2**20
    print(
        _util.format_table(
            [
                "variant",
                "median ms",
                "IQR ms",
                "x DTensor",
                "paired x",
                "final loss",
                "dense loss",
                "ledger MiB",
                "analytic MiB",
                "wire MiB",
                "collectives",
            ],
            [
                [
                    r["variant"],
                    r["step_s"]["median"] * 1e3,
                    r["step_s"]["iqr"] * 1e3,
                    r["ratio_of_medians"],
                    r["paired_ratio"]["median"],
                    r["final_loss"],
                    r["dense_final_loss"],
                    None
                    if r["ledger_bytes_per_step"] is None
                    else r["ledger_bytes_per_step"] * mib,
                    r["analytical_bytes_per_step"] * mib,
                    r["wire_bytes_per_step"] * mib,
                    " ".join(f"{k}={v}" for k, v in sorted(r["collectives_per_step"].items())),
                ]
                for r in rows
            ],
        )
    )
    fscale_ratio = max(r["ratio_of_medians"] for r in rows if r["variant"] != REFERENCE)
    verdict = "met" if fscale_ratio <= GOAL else "not met"
    print(f"goal: fscale <= {GOAL:.2f}x DTensor's step time: {verdict}")
    output = {"rows": rows, "load": load.as_dict() if hasattr(load, "as_dict") else load.describe()}
    _util.write_results("tensor", output)
    return output


if __name__ == "__main__":
    main()
