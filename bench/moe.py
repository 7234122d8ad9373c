"""Benchmark: fscale's MoE layer against FairScale's MOELayer + Top2Gate, 2 gloo ranks.

Usage: ``python bench/moe.py [--quick] [--rounds N] [--warmup N] [--tokens S]``

One MoE layer, expert parallel over every rank (``ep`` = world size), top-2 gating with Gumbel
noise on the second choice (FairScale always adds it), E = 2 experts per rank, each an MLP
``d_model -> 4 d_model -> d_model`` with GELU; S tokens per rank. A unit of work is forward +
backward of ``sum(y * w)`` with respect to the input, the gate and every expert.

Rows (interleaved round by round, a barrier before each, `_util.interleave`):

* ``FairScale``: ``fairscale.nn.MOELayer(Top2Gate(d, E), experts)``; capacity ``2S/E``;
* ``fscale fixed c=1.0``: `fscale.moe_dispatch`, ``capacity_factor=1.0`` (= ``2S/E`` for
  k = 2: equal capacity, the throughput comparison);
* ``fscale fixed c=1.25``: the usual training factor;
* ``fscale dropless``: ``capacity="dropless"`` (variable-size all-to-all, no padding).

Columns: median time per unit of work (rank 0) and its IQR; throughput ratio against FairScale
(ratio of medians); the time of the experts alone (each local expert's forward + backward on
the rows it receives, measured separately on the same shapes) and the rest of the layer
(gating, dispatch, combine, all-to-all): ``dispatch = total - experts``; the all-to-all bytes
rank 0 sent per unit of work from fscale's comm ledger against the analytical count (fixed:
4 all-to-alls of ``E * C * d`` float32 elements, ``(N-1)/N`` of which leave the rank; FairScale
moves the same tensors); and the tokens dropped. Writes ``bench/results/moe.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

import _util
import torch
import torch.distributed as dist
from torch import nn

import fscale as fs
from fscale.parallel.moe import expert_mlp

EXPERTS_PER_RANK = 2
FAIRSCALE = "FairScale"


def _params(d_model: int, num_experts: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    hidden = 4 * d_model
    return {
        "gate": {"weight": torch.randn(d_model, num_experts, generator=g) * 0.02},
        "experts": {
            "w_in": torch.randn(num_experts, d_model, hidden, generator=g) * 0.02,
            "b_in": torch.zeros(num_experts, hidden),
            "w_out": torch.randn(num_experts, hidden, d_model, generator=g) * 0.02,
            "b_out": torch.zeros(num_experts, d_model),
        },
    }


def _local(params: dict[str, Any], rank: int, local: int) -> dict[str, Any]:
    experts = {
        n: leaf[rank * local : (rank + 1) * local].clone() for n, leaf in params["experts"].items()
    }
    tree = {"gate": {"weight": params["gate"]["weight"].clone()}, "experts": experts}
    return fs.tree.map(lambda leaf: leaf.requires_grad_(), tree)


class FscaleRow:
    """fscale's layer: one forward + backward per call."""

    def __init__(self, mesh, params, x, weight, **options: Any) -> None:
        world = mesh.size("ep")
        self.moe = fs.moe_dispatch(
            expert_mlp, mesh, num_experts=EXPERTS_PER_RANK * world, k=2, noisy=True, **options
        )
        self.params, self.x, self.weight = params, x, weight
        self.leaves = fs.tree.leaves(params)
        self.calls = 0
        self.dropped = 0

    def __call__(self) -> None:
        key = fs.random.fold_in(fs.random.key(dist.get_rank()), self.calls)
        self.calls += 1
        y, aux = self.moe(self.params, self.x, key)
        torch.autograd.grad((y * self.weight).sum(), [self.x, *self.leaves])
        self.dropped = int(aux["dropped_assignments"])


class FairScaleRow:
    """FairScale's MOELayer + Top2Gate with the same gate and experts."""

    def __init__(self, params, x, weight) -> None:
        from fairscale.nn import MOELayer, Top2Gate

        d_model = x.shape[1]
        world = dist.get_world_size()
        gate = Top2Gate(d_model, EXPERTS_PER_RANK * world)
        with torch.no_grad():
            gate.wg.weight.copy_(params["gate"]["weight"].t())
        experts = nn.ModuleList()
        for e in range(EXPERTS_PER_RANK):
            mlp = nn.Sequential(
                nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
            )
            with torch.no_grad():
                mlp[0].weight.copy_(params["experts"]["w_in"][e].t())
                mlp[0].bias.copy_(params["experts"]["b_in"][e])
                mlp[2].weight.copy_(params["experts"]["w_out"][e].t())
                mlp[2].bias.copy_(params["experts"]["b_out"][e])
            experts.append(mlp)
        self.layer = MOELayer(gate, experts)
        self.x, self.weight = x.view(EXPERTS_PER_RANK, -1, x.shape[1]), weight
        self.leaves = list(self.layer.parameters())

    def __call__(self) -> None:
        y = self.layer(self.x)
        torch.autograd.grad((y.view_as(self.weight) * self.weight).sum(), [self.x, *self.leaves])


def _experts_alone(params: dict[str, Any], rows: list[int], d_model: int) -> Any:
    """Forward + backward of each local expert on `rows[e]` rows: the expert compute alone."""
    inputs = [torch.randn(n, d_model, requires_grad=True) for n in rows]
    leaves = fs.tree.leaves(params["experts"])

    def run() -> None:
        outputs = []
        for e, x in enumerate(inputs):
            one = {n: leaf[e] for n, leaf in params["experts"].items()}
            outputs.append(expert_mlp(one, x).sum())
        torch.autograd.grad(sum(outputs), [*inputs, *leaves])

    return run


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    fs.distributed.set_debug(False)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.Mesh(ep=world)
    tokens, d_model = options["tokens"], options["d_model"]
    num_experts = EXPERTS_PER_RANK * world
    full = _params(d_model, num_experts, seed=0)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, d_model, generator=g).requires_grad_()
    weight = torch.randn(tokens, d_model, generator=g)
    rows: dict[str, Any] = {}
    try:
        rows[FAIRSCALE] = FairScaleRow(full, x, weight)
    except ImportError as error:
        fairscale_error = f"fairscale unavailable: {error}"
    else:
        fairscale_error = None
    for name, opts in {
        "fscale fixed c=1.0": {"capacity_factor": 1.0},
        "fscale fixed c=1.25": {"capacity_factor": 1.25},
        "fscale dropless": {"capacity": "dropless"},
    }.items():
        rows[name] = FscaleRow(mesh, _local(full, rank, EXPERTS_PER_RANK), x, weight, **opts)

    times = _util.interleave(
        rows, rounds=options["rounds"], warmup=options["warmup"], before_each=dist.barrier
    )

    # The expert compute alone: fixed capacity C per source rank, N sources per local expert.
    local_params = _local(full, rank, EXPERTS_PER_RANK)
    expert_work = {}
    for name, factor in (("c=1.0", 1.0), ("c=1.25", 1.25)):
        capacity = fs.parallel.moe.capacity.capacity_for(tokens, num_experts, 2, factor)
        expert_work[name] = _experts_alone(
            local_params, [world * capacity] * EXPERTS_PER_RANK, d_model
        )
    # Dropless: the rows each local expert really receives (its share of all ranks' tokens).
    with fs.distributed.comm_ledger() as ledger:
        rows["fscale dropless"]()
    dropless_rows = [int(tokens * 2 * world / num_experts)] * EXPERTS_PER_RANK
    expert_work["dropless"] = _experts_alone(local_params, dropless_rows, d_model)
    expert_times = _util.interleave(expert_work, rounds=options["rounds"], warmup=1)

    traffic = {}
    for name, row in rows.items():
        if name == FAIRSCALE:
            continue
        with fs.distributed.comm_ledger() as ledger:
            row()
        traffic[name] = {
            "all_to_all_bytes": ledger.total_bytes("all_to_all"),
            "size_exchange_bytes": ledger.total_bytes("all_gather"),
            "calls": ledger.count(),
            "dropped_assignments": row.dropped,
        }
    return {
        "times": times,
        "expert_times": expert_times,
        "traffic": traffic,
        "fairscale_error": fairscale_error,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    options = {
        "rounds": args.rounds or (5 if args.quick else 20),
        "warmup": args.warmup if args.warmup is not None else 2,
        "tokens": args.tokens or (256 if args.quick else 1024),
        "d_model": args.d_model or (64 if args.quick else 128),
    }
    world = args.world
    num_experts = EXPERTS_PER_RANK * world
    print(
        f"MoE top-2, {num_experts} experts over {world} gloo ranks x 1 thread, "
        f"{options['tokens']} tokens/rank, d_model={options['d_model']}, hidden 4x, "
        f"{options['rounds']} rounds after {options['warmup']} warm-up"
    )
    with _util.MachineLoad() as load:
        results = fs.launch(
            rank_main, world, options, backend="gloo", env={"FSCALE_DEBUG": "0"}, timeout=1800
        )
    print(load.describe())
    rank0 = results[0]
    if rank0["fairscale_error"]:
        print(rank0["fairscale_error"])
    summaries = {name: _util.summarize(t) for name, t in rank0["times"].items()}
    experts = {name: _util.summarize(t).median for name, t in rank0["expert_times"].items()}
    expert_of = {
        FAIRSCALE: "c=1.0",
        "fscale fixed c=1.0": "c=1.0",
        "fscale fixed c=1.25": "c=1.25",
        "fscale dropless": "dropless",
    }
    reference = summaries[FAIRSCALE].median if FAIRSCALE in summaries else None
    tokens, d_model = options["tokens"], options["d_model"]
    table, stored = [], []
    for name, summary in summaries.items():
        expert_s = experts[expert_of[name]]
        traffic = rank0["traffic"].get(name)
        if name == FAIRSCALE or name.startswith("fscale fixed"):
            factor = 1.25 if name.endswith("1.25") else 1.0
            capacity = fs.parallel.moe.capacity.capacity_for(tokens, num_experts, 2, factor)
            analytical = 4 * num_experts * capacity * d_model * 4 * (world - 1) / world
        else:  # dropless under uniform routing: k S rows, (N-1)/N of them leave the rank
            analytical = 4 * 2 * tokens * d_model * 4 * (world - 1) / world
        measured = traffic["all_to_all_bytes"] if traffic else analytical  # FairScale: same tensors
        row = {
            "variant": name,
            "step_s": summary.as_dict(),
            "throughput_x_fairscale": (reference / summary.median) if reference else None,
            "experts_s": expert_s,
            "dispatch_s": summary.median - expert_s,
            "all_to_all_bytes": measured,
            "analytical_bytes": analytical,
            "dropped_assignments": traffic["dropped_assignments"] if traffic else None,
        }
        stored.append(row)
        table.append(
            [
                name,
                summary.median * 1e3,
                summary.iqr * 1e3,
                row["throughput_x_fairscale"] if reference else None,
                expert_s * 1e3,
                row["dispatch_s"] * 1e3,
                measured / 2**20,
                analytical / 2**20,
                row["dropped_assignments"],
            ]
        )
    print(
        _util.format_table(
            [
                "variant",
                "median ms",
                "IQR ms",
                "throughput x FairScale",
                "experts ms",
                "dispatch ms",
                "a2a MiB",
                "analytical MiB",
                "dropped",
            ],
            table,
        )
    )
    fixed = summaries["fscale fixed c=1.25"].median
    print(f"dropless / fixed c=1.25 time: {summaries['fscale dropless'].median / fixed:.3f}")
    path = _util.write_results("moe", {"options": options, "world": world, "rows": stored})
    print(f"wrote {path}")
    return {"rows": stored}


if __name__ == "__main__":
    main()
