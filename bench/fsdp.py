"""Benchmark: fscale.fully_shard against torch FSDP2 and torch DDP, 2 ranks on gloo.

Models: a GPT-style LM (units: one per block plus the root) and a wide MLP (one unit per
linear layer). Variants, each trained with Adam for a few steps on 2 ranks started by
`fscale.launch` (one process group per variant, so each variant's peak RSS is its own):

* ``fscale``: ``fully_shard(step, mesh)`` (reshard after forward: freed after each unit's
  forward, gathered again for its backward, no recompute, except the last unit, kept for the
  backward that begins with it; prefetch 1);
* ``fscale reshard all``: ``reshard_after_forward=True``, the last unit resharded too;
* ``fscale prefetch=0``: the same without prefetch;
* ``fscale remat``: ``reshard_after_forward="remat"`` (each unit recomputed in backward);
* ``fscale no-reshard``: ``reshard_after_forward=False``;
* ``torch FSDP2``: ``torch.distributed.fsdp.fully_shard`` on every block (every linear layer
  of the MLP) and on the root module;
* ``torch DDP``: ``DistributedDataParallel``.

Columns: median step time over the timed steps with its spread (min-max), the ratio to FSDP2,
model-state bytes per rank (parameters + gradients + optimizer state actually held: fscale's
shards and ``grad_bytes`` metric; the local shards of FSDP2's DTensors and their ``.grad``
and Adam state; DDP's parameters, ``.grad`` and Adam state, its bucket copies not counted),
peak RSS per rank (max over the two ranks, ``ru_maxrss``), and bytes sent per step per rank
under the ring model: measured by fscale's comm ledger for fscale, analytical for the torch
peers (labelled): FSDP2 3·Ψ_blocks + 2·Ψ_root (its root is not resharded after forward), DDP
2·Ψ, times (N−1)/N and 4 bytes.

Usage: ``python bench/fsdp.py [--quick] [--steps N]``. Writes ``bench/results/fsdp.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fscale as fs
from fscale.parallel.fsdp import fully_shard

RESULTS = Path(__file__).parent / "results" / "fsdp.json"
WORLD = 2
VARIANTS = (
    "fscale",
    "fscale reshard all",
    "fscale prefetch=0",
    "fscale remat",
    "fscale no-reshard",
    "torch FSDP2",
    "torch DDP",
)


# ---------------------------------------------------------------------------------------------
# Models and batches (built identically on every rank)


def _model(kind: str, quick: bool) -> nn.Module:
    if kind == "gpt":
        cfg = fs.models.GPTConfig(
            vocab_size=4096 if quick else 8192,
            seq_len=64 if quick else 128,
            d_model=192 if quick else 256,
            n_heads=4,
            n_layers=4,
        )
        return fs.models.GPT(cfg, seed=0)
    width = 768 if quick else 1024
    return fs.models.mlp([width] * 7, seed=0)


def _batch(
    kind: str, model: nn.Module, quick: bool, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    if kind == "gpt":
        cfg = model.cfg
        tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    width = model[0].in_features
    rows = 64 if quick else 128
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _loss(kind: str, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return fs.models.lm_loss(output, targets)
    return nn.functional.mse_loss(output, targets)


def _units(kind: str, model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 wraps (fscale's default units are the same ones)."""
    if kind == "gpt":
        return list(model.blocks)
    return [m for m in model if isinstance(m, nn.Linear)]


def _psi(kind: str, model: nn.Module) -> tuple[int, int]:
    """(Ψ of the units, Ψ of the root) in elements."""
    units = sum(p.numel() for u in _units(kind, model) for p in u.parameters())
    total = sum(p.numel() for p in model.parameters())
    return units, total - units


# ---------------------------------------------------------------------------------------------
# One variant on one rank


def _run_variant(kind: str, variant: str, quick: bool, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    model = _model(kind, quick)
    if variant.startswith("fscale"):
        measure = _fscale(kind, variant, model, quick, warmup, steps)
    elif variant == "torch FSDP2":
        measure = _torch_fsdp2(kind, model, quick, warmup, steps)
    else:
        measure = _torch_ddp(kind, model, quick, warmup, steps)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**measure, "peak_rss": peak_rss}


def _timed(run_step, warmup: int, steps: int) -> list[float]:
    for i in range(warmup):
        run_step(i)
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        run_step(warmup + i)
        times.append(time.perf_counter() - start)
    return times


def _fscale(kind, variant, model, quick, warmup, steps):  # type: ignore[no-untyped-def]
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, batch, key):  # type: ignore[no-untyped-def]
        inputs, targets = batch
        output, b = apply(p, b, inputs, key=key)
        return _loss(kind, output, targets), b

    options = {
        "fscale": {},
        "fscale reshard all": {"reshard_after_forward": True},
        "fscale prefetch=0": {"prefetch": 0},
        "fscale remat": {"reshard_after_forward": "remat"},
        "fscale no-reshard": {"reshard_after_forward": False},
    }[variant]
    step = fully_shard(
        fs.train_step(loss_fn, fs.optim.adam(1e-3), donate=True),
        fs.Mesh(dp=dist.get_world_size()),
        **options,
    )
    state = step.init(params, buffers)
    metrics: dict = {}

    def run_step(i: int) -> None:
        nonlocal state, metrics
        state, metrics = step(state, _batch(kind, model, quick, i))

    times = _timed(run_step, warmup, steps)
    with fs.distributed.comm_ledger() as ledger:
        run_step(warmup + steps)
    state_bytes = (
        fs.memory.tree_bytes(state.params)
        + fs.memory.tree_bytes(state.opt_state)
        + int(metrics["grad_bytes"])
    )
    return {
        "times": times,
        "state_bytes": state_bytes,
        "bytes_per_step": ledger.total_bytes(),
        "bytes_source": "fscale ledger",
    }


def _torch_fsdp2(kind, model, quick, warmup, steps):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in _units(kind, model):
        torch_fully_shard(unit, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)

    def run_step(i: int) -> None:
        inputs, targets = _batch(kind, model, quick, i)
        optimizer.zero_grad(set_to_none=True)
        _loss(kind, model(inputs), targets).backward()
        optimizer.step()

    times = _timed(run_step, warmup, steps)
    run_step(warmup + steps)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    held = [local(p) for p in model.parameters()]
    held += [local(p.grad) for p in model.parameters() if p.grad is not None]
    held += [
        local(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    units, root = _psi(kind, model)
    n = dist.get_world_size()
    return {
        "times": times,
        "state_bytes": fs.memory.tree_bytes(held),
        "bytes_per_step": (3 * units + 2 * root) * (n - 1) / n * 4,
        "bytes_source": "analytical",
    }


def _torch_ddp(kind, model, quick, warmup, steps):  # type: ignore[no-untyped-def]
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=True)

    def run_step(i: int) -> None:
        inputs, targets = _batch(kind, model, quick, i)
        optimizer.zero_grad(set_to_none=True)
        _loss(kind, ddp(inputs), targets).backward()
        optimizer.step()

    times = _timed(run_step, warmup, steps)
    run_step(warmup + steps)
    held = [p.detach() for p in model.parameters()]
    held += [p.grad for p in model.parameters() if p.grad is not None]
    held += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    psi = sum(p.numel() for p in model.parameters())
    n = dist.get_world_size()
    return {
        "times": times,
        "state_bytes": fs.memory.tree_bytes(held),
        "bytes_per_step": 2 * psi * (n - 1) / n * 4,
        "bytes_source": "analytical",
    }


# ---------------------------------------------------------------------------------------------
# Driver


def _summarise(kind: str, variant: str, per_rank: list[dict]) -> dict:
    # A step ends when the slower rank ends: per step, the max over ranks.
    times = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    return {
        "model": kind,
        "variant": variant,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "state_bytes": max(r["state_bytes"] for r in per_rank),
        "peak_rss": max(r["peak_rss"] for r in per_rank),
        "bytes_per_step": per_rank[0]["bytes_per_step"],
        "bytes_source": per_rank[0]["bytes_source"],
    }


def _table(rows: list[dict]) -> str:
    header = (
        "model",
        "variant",
        "step ms (min-max)",
        "vs FSDP2",
        "state MiB/rank",
        "peak RSS MiB",
        "MiB sent/step",
    )
    lines = [header]
    for row in rows:
        reference = next(
            r for r in rows if r["model"] == row["model"] and r["variant"] == "torch FSDP2"
        )
        lines.append(
            (
                row["model"],
                row["variant"],
                f"{row['median_s'] * 1e3:.1f} ({row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f})",
                f"{row['median_s'] / reference['median_s']:.2f}x",
                f"{row['state_bytes'] / 2**20:.2f}",
                f"{row['peak_rss'] / 2**20:.0f}",
                f"{row['bytes_per_step'] / 2**20:.2f}"
                + (" (analytical)" if row["bytes_source"] == "analytical" else ""),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps = args.steps or (6 if args.quick else 20)
    warmup = 2
    rows = []
    for kind in ("gpt", "mlp"):
        for variant in VARIANTS:
            per_rank = fs.launch(
                _run_variant, WORLD, kind, variant, args.quick, warmup, steps, timeout=600
            )
            rows.append(_summarise(kind, variant, per_rank))
            print(f"  {kind:4s} {variant:18s} {rows[-1]['median_s'] * 1e3:8.1f} ms", flush=True)
    print(_table(rows))
    meta = {
        "world_size": WORLD,
        "backend": "gloo",
        "threads_per_rank": 1,
        "steps": steps,
        "warmup": warmup,
        "quick": args.quick,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": __import__("os").cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
