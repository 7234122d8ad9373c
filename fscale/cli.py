"""The `fscale` command: `fscale demo` trains a small GPT-style model on local processes.

The demo is the library end to end: the bundled text corpus, byte-level tokens, the GPT-style
model, `functionalize`, `train_step`, a parallel strategy, `launch` on local gloo ranks, and
the exact accounting — per-rank bytes of parameters, gradients and optimizer state, and the
comm ledger of one step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    world_size: int = 2
    strategy: str = "ddp"
    seconds: float = 30.0
    max_steps: int = 0
    seq_len: int = 64
    batch_size: int = 16
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    progress: bool = True


def _strategies() -> dict[str, Callable[..., Any]]:
    """Strategy name -> ``(step, mesh) -> step`` for the strategies this build has."""
    import fscale as fs

    table: dict[str, Callable[..., Any]] = {
        "local": lambda step, mesh: step,
        "ddp": lambda step, mesh: fs.data_parallel(step, mesh),
    }
    if hasattr(fs, "shard_optimizer"):
        table["zero1"] = lambda step, mesh: fs.shard_optimizer(step, mesh, shard_grads=False)
        table["zero2"] = lambda step, mesh: fs.shard_optimizer(step, mesh)
    if hasattr(fs, "fully_shard"):
        table["fsdp"] = lambda step, mesh: fs.fully_shard(step, mesh)
    return table


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def peak_grad_bytes(metrics: dict[str, Any]) -> int:
    """The gradient bytes a rank held at once in a step: what a strategy must fit in memory.

    ``grad_bytes`` counts the gradients the update received (under ZeRO the reduced shards);
    ``grad_peak_bytes``, where a plan reports it, counts the most held during backward (under
    ZeRO-1 the full, unreduced gradient). The larger of the two is the peak.
    """
    return max(int(metrics.get("grad_bytes", 0)), int(metrics.get("grad_peak_bytes", 0)))


def _demo_rank(cfg: DemoConfig) -> dict[str, Any]:
    """What every rank runs: build, train for the time budget, account."""
    import torch

    import fscale as fs
    from fscale import models

    rank, world = fs.distributed.rank(), fs.distributed.world_size()
    mesh = fs.Mesh(dp=world) if cfg.strategy != "local" else fs.Mesh()
    tokens = fs.data.ByteTokenizer().encode(fs.data.bundled_corpus())
    streams = fs.data.batchify(tokens, cfg.batch_size)
    batches = fs.data.LMBatches(streams, cfg.seq_len, rank=rank, world_size=world, batch_major=True)
    model = models.GPT(
        models.GPTConfig(
            vocab_size=256,
            seq_len=cfg.seq_len,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_layers=cfg.n_layers,
        ),
        seed=cfg.seed,
    )
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        logits, buffers = apply(params, buffers, batch.inputs, key=key)
        return models.lm_loss(logits, batch.targets), buffers

    step = fs.train_step(loss_fn, fs.optim.adamw(cfg.lr, weight_decay=0.01))
    step = _strategies()[cfg.strategy](step, mesh)
    state = step.init(params, buffers, key=cfg.seed)

    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(desc=f"{cfg.strategy} x{world}", unit="step", dynamic_ncols=True)
    losses: list[float] = []
    start = time.perf_counter()
    ledger_text = ""
    ledger_bytes = 0.0
    grad_bytes = 0
    step_index = 0
    while True:
        batch = batches[step_index % len(batches)]
        if step_index == 1:  # a steady-state step, after any first-step set-up
            with fs.distributed.comm_ledger() as ledger:
                state, metrics = step(state, batch)
            ledger_text, ledger_bytes = ledger.summary(), ledger.total_bytes()
        else:
            state, metrics = step(state, batch)
        step_index += 1
        losses.append(float(metrics["loss"]))
        grad_bytes = max(grad_bytes, peak_grad_bytes(metrics))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        elapsed = time.perf_counter() - start
        # Every rank must take the same number of steps: rank 0 decides, the others follow.
        done = torch.tensor(
            [float(elapsed >= cfg.seconds or (cfg.max_steps and step_index >= cfg.max_steps))]
        )
        if world > 1:
            torch.distributed.broadcast(done, src=0)
        if done.item() and step_index >= 2:
            break
    if bar is not None:
        bar.close()
    state_bytes = fs.memory.state_bytes(state)
    return {
        "rank": rank,
        "steps": step_index,
        "seconds": time.perf_counter() - start,
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "params_bytes": state_bytes["params"],
        "grad_bytes": grad_bytes,
        "opt_state_bytes": state_bytes["opt_state"],
        "ledger": ledger_text,
        "ledger_bytes": ledger_bytes,
        "num_params": sum(p.numel() for p in params.values()),
    }


def run_demo(cfg: DemoConfig) -> list[dict[str, Any]]:
    """Run the demo on `cfg.world_size` local processes and print the report."""
    import fscale as fs

    strategies = _strategies()
    if cfg.strategy not in strategies:
        raise SystemExit(
            f"fscale demo: unknown strategy {cfg.strategy!r}; available: {', '.join(strategies)}"
        )
    world = 1 if cfg.strategy == "local" else cfg.world_size
    print(
        f"fscale demo: GPT-style model (d_model {cfg.d_model}, {cfg.n_layers} layers, seq "
        f"{cfg.seq_len}) on the bundled corpus, strategy {cfg.strategy}, {world} process(es), "
        f"~{cfg.seconds:g} s"
    )
    results = fs.launch(_demo_rank, world, cfg, timeout=cfg.seconds * 4 + 120)
    first = results[0]
    print(
        f"\n{first['steps']} steps in {first['seconds']:.1f} s; {first['num_params']:,} "
        f"parameters; loss {first['first_loss']:.3f} -> {first['last_loss']:.3f} "
        "(mean of the last 10 steps)"
    )
    print("\nper-rank model state (exact bytes of storage held; grads at their peak):")
    header = f"{'rank':>4}  {'params':>12}  {'grads':>12}  {'optimizer':>12}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['rank']:>4}  {_human(r['params_bytes']):>12}  {_human(r['grad_bytes']):>12}  "
            f"{_human(r['opt_state_bytes']):>12}"
        )
    if first["ledger"]:
        print("\ncommunication of one step on rank 0 (ring model):")
        print(first["ledger"])
    return results


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fscale", description=__doc__.splitlines()[0] if __doc__ else None
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small GPT-style model on local processes")
    defaults = DemoConfig()
    demo.add_argument("--world-size", type=int, default=defaults.world_size)
    demo.add_argument(
        "--strategy",
        default=defaults.strategy,
        help="local, ddp (default), and where available zero1, zero2, fsdp",
    )
    demo.add_argument("--seconds", type=float, default=defaults.seconds, help="time budget")
    demo.add_argument("--steps", type=int, default=0, help="stop after this many steps")
    demo.add_argument("--seq-len", type=int, default=defaults.seq_len)
    demo.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global")
    demo.add_argument("--d-model", type=int, default=defaults.d_model)
    demo.add_argument("--layers", type=int, default=defaults.n_layers)
    demo.add_argument("--lr", type=float, default=defaults.lr)
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    from fscale.ckpt.cli import add_commands as add_checkpoint_commands

    add_checkpoint_commands(commands)
    from fscale.parallel.pipeline.chart import chart_arguments, chart_command

    chart = commands.add_parser(
        "pipeline-chart", help="print a pipeline schedule as a table and draw it as a PNG"
    )
    chart_arguments(chart)
    chart.set_defaults(run=chart_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fscale` console script."""
    args = _build_parser().parse_args(argv)
    if hasattr(args, "run"):
        return args.run(args)
    if args.command == "demo":
        if args.world_size < 1:
            raise SystemExit("fscale demo: --world-size must be at least 1")
        if args.batch_size % max(args.world_size, 1):
            raise SystemExit(
                f"fscale demo: --batch-size {args.batch_size} must be divisible by "
                f"--world-size {args.world_size} (each rank reads its own streams)"
            )
        cfg = DemoConfig(
            world_size=args.world_size,
            strategy=args.strategy,
            seconds=args.seconds,
            max_steps=args.steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            d_model=args.d_model,
            n_layers=args.layers,
            lr=args.lr,
            seed=args.seed,
            progress=not args.no_progress,
        )
        run_demo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
