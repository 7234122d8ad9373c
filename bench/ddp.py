"""Benchmark: `fscale.data_parallel` against torch DistributedDataParallel on 2 gloo ranks.

Usage: ``python bench/ddp.py [--quick] [--model gpt|hf-gpt2] [--steps N] [--warmup N] [--world N]
[--profile]``

One `fscale.launch` starts the ranks (gloo, ``torch.set_num_threads(1)`` each); inside the same
processes, round by round (`_util.interleave`, a barrier before every step), they train:

* ``torch DDP``: ``DistributedDataParallel(GPT(cfg))`` (default 25 MiB buckets) with
  ``torch.optim.AdamW(fused=True)``: ``zero_grad(set_to_none=True)``, ``backward()``,
  ``step()``;
* ``fscale donate=False`` / ``fscale donate=True``:
  ``fscale.data_parallel(fscale.train_step(loss_fn, fscale.optim.adamw(lr), donate=...), mesh)``
  over ``fscale.functionalize(GPT(cfg))`` (on these CPU ranks its all-reduces start after
  backward);
* ``fscale donate=True overlap=True``: the same with ``overlap=True``, each bucket's all-reduce
  started during backward as torch DDP's are;
* ``fscale ZeRO-2 donate=True``: ``fscale.shard_optimizer`` (gradients reduce-scattered during
  backward, optimizer state sharded) instead of ``data_parallel``.

Same model (`_util.gpt_config`, seed 0, dropout 0) and the same batches: global batch ``i`` of
`_util.lm_batch`, split evenly over the ranks (default 8 sequences per rank). ``--model hf-gpt2``
trains a Hugging Face ``transformers.GPT2LMHeadModel`` instead, random-initialised from a config
of the same shape (vocabulary, width, layers, heads, positions; dropout 0; nothing downloaded),
called with ``use_cache=False``; both libraries take ``fscale.models.lm_loss`` of its logits.
With ``--quick`` that is a small model whose step time the per-step Python (the HF model's and
the library's) takes a visible share of. A round's time is the slowest rank's. Reported: median
step time with its IQR, ratio of medians to DDP and the median round-by-round ratio with a
distribution-free 95% interval for it (`_util.median_interval`), each rank's
peak RSS, the final global mean loss of each variant (DDP's is the mean of the ranks' losses,
reduced as fscale reduces its metrics) and whether it and the parameters equal DDP's bit for bit,
and the traffic of one step: what fscale's comm ledger records (ring-model bytes) and the bytes
this rank actually wrote to its gloo sockets (``wchar`` of ``/proc/self/io`` across the step), for
fscale and DDP alike (fscale's ranks of one host move their buckets through shared memory,
`fscale.distributed.shared_memory`, so theirs is about zero: the ledger counts what moved).
When an fscale variant is slower than DDP (or with ``--profile``), rank 0 profiles it against
DDP (per-op and per-Python-function medians; see `_util.profile_against`).
Writes ``bench/results/ddp.json`` (``ddp_hf_gpt2.json`` with ``--model hf-gpt2``).
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from typing import Any

import _util
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.models import GPT, lm_loss
from fscale.spmd import all_gather_objects

GOAL = 1.00
"""The ratio to torch DDP's step time at or below which fscale counts as fast enough."""

LEARNING_RATE = 1e-3
BATCH_PER_RANK = 8
REFERENCE = "torch DDP"


class Batches:
    """This rank's slices of the shared stream of global batches, made before any timing."""

    def __init__(self, cfg: Any, batch_per_rank: int, count: int, rank: int, world: int) -> None:
        self._batches = [
            fs.data.split_batch(_util.lm_batch(cfg, batch_per_rank * world, i), rank, world)
            for i in range(count)
        ]

    def __getitem__(self, index: int) -> Any:
        # Steps after the timed ones (traffic, memory, profile) cycle through the stream again.
        return self._batches[index % len(self._batches)]


MODELS = ("gpt", "hf-gpt2")


def build_model(kind: str, cfg: Any) -> torch.nn.Module:
    """The model the variants train, from seed 0: fscale's GPT, or an HF GPT-2 of its shape."""
    if kind == "gpt":
        return GPT(cfg, seed=0)
    import transformers  # the `integration` extra; main() checks it first

    config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)


def logits_of(output: Any) -> torch.Tensor:
    """The logits a model's forward returned (an HF model returns a ModelOutput)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def forward_kwargs(kind: str) -> dict[str, Any]:
    """Keyword arguments of every forward call: HF's KV cache off (nothing reuses it)."""
    return {} if kind == "gpt" else {"use_cache": False}


class DDPVariant:
    """torch DDP with torch.optim.AdamW(fused=True)."""

    def __init__(self, cfg: Any, batches: Batches, kind: str = "gpt") -> None:
        self.module = build_model(kind, cfg)
        self.kwargs = forward_kwargs(kind)
        self.ddp = DistributedDataParallel(self.module)
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=LEARNING_RATE, fused=True)
        self.batches = batches
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        batch = self.batches[len(self.losses)]
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(logits_of(self.ddp(batch.inputs, **self.kwargs)), batch.targets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.detach())

    def global_loss(self, index: int) -> torch.Tensor:
        """The mean over ranks of step `index`'s loss, reduced as fscale reduces its metrics
        (each rank pre-divides by the world size, then the shares are summed)."""
        share = self.losses[index] / dist.get_world_size()
        dist.all_reduce(share)
        return share

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.module.named_parameters()}


class FscaleVariant:
    """fscale.data_parallel (or shard_optimizer) over fscale.train_step with fscale.optim.adamw."""

    def __init__(
        self,
        cfg: Any,
        batches: Batches,
        mesh: fs.Mesh,
        *,
        donate: bool,
        zero: bool = False,
        kind: str = "gpt",
        overlap: bool | None = None,
    ) -> None:
        apply, params, buffers = fs.functionalize(build_model(kind, cfg))
        kwargs = forward_kwargs(kind)

        def loss_fn(params, buffers, batch, key):
            output, new_buffers = apply(params, buffers, batch.inputs, key=key, **kwargs)
            return lm_loss(logits_of(output), batch.targets), new_buffers

        step = fs.train_step(loss_fn, fs.optim.adamw(LEARNING_RATE), donate=donate)
        self.step = (
            fs.shard_optimizer(step, mesh)
            if zero
            else fs.data_parallel(step, mesh, overlap=overlap)
        )
        self.state = self.step.init(params, buffers)
        self.batches = batches
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        self.state, metrics = self.step(self.state, self.batches[len(self.losses)])
        self.losses.append(metrics["loss"])

    def global_loss(self, index: int) -> torch.Tensor:
        return self.losses[index]  # already the mean over ranks

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.state.params)


def _written_bytes() -> int:
    """Bytes this process has passed to write()-family calls, sockets included."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def traffic(variants: dict[str, Any], steps: int) -> dict[str, dict[str, Any]]:
    """Per variant, median bytes written to sockets per step, and fscale's ledger for a step.

    The window is one step, opened after a barrier, so it holds the step's collectives only:
    gloo's transport writes with writev, which ``wchar`` counts, and nothing else in a step
    writes.
    """
    written: dict[str, list[int]] = {name: [] for name in variants}
    ledgers: dict[str, Any] = {}
    for _ in range(steps):
        for name, variant in variants.items():
            dist.barrier()
            before = _written_bytes()
            if isinstance(variant, FscaleVariant):
                with fs.distributed.comm_ledger() as ledger:
                    variant()
                ledgers[name] = ledger
            else:
                variant()
            written[name].append(_written_bytes() - before)
    report = {}
    for name in variants:
        entry: dict[str, Any] = {"wire_bytes": _util.quantile(written[name], 0.5)}
        if name in ledgers:
            ledger = ledgers[name]
            entry["ledger_bytes"] = ledger.total_bytes()
            entry["ledger_calls"] = {
                op: ledger.count(op) for op in {record.op for record in ledger.records}
            }
            entry["ledger_summary"] = ledger.summary()
        report[name] = entry
    return report


def step_memory(variants: dict[str, Any]) -> dict[str, int | None]:
    """Per variant, bytes by which one step's peak RSS exceeds the resident memory before it."""
    out: dict[str, int | None] = {}
    for name, variant in variants.items():
        dist.barrier()
        if not _util.reset_peak_rss():
            variant()
            out[name] = None
            continue
        before = _util.rss_bytes()
        variant()
        out[name] = max(0, _util.peak_rss_bytes() - before)
    return out


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    """One rank: build the variants, time them interleaved, then check and measure them."""
    torch.set_num_threads(1)
    fs.distributed.set_debug(False)  # the cross-rank metadata check is a test aid, not for timing
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _util.gpt_config(options["quick"])
    kind = options["model"]
    steps, warmup = options["steps"], options["warmup"]
    batches = Batches(cfg, options["batch_per_rank"], warmup + steps, rank, world)
    mesh = fs.Mesh(dp=world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's notes about the gloo backend
        variants: dict[str, Any] = {REFERENCE: DDPVariant(cfg, batches, kind)}
    variants["fscale donate=False"] = FscaleVariant(cfg, batches, mesh, donate=False, kind=kind)
    variants["fscale donate=True"] = FscaleVariant(cfg, batches, mesh, donate=True, kind=kind)
    variants["fscale donate=True overlap=True"] = FscaleVariant(
        cfg, batches, mesh, donate=True, kind=kind, overlap=True
    )
    variants["fscale ZeRO-2 donate=True"] = FscaleVariant(
        cfg, batches, mesh, donate=True, zero=True, kind=kind
    )

    times = _util.interleave(variants, rounds=steps, warmup=warmup, before_each=dist.barrier)
    peak_rss = _util.peak_rss_bytes()
    all_times = all_gather_objects(times, mesh, "dp")
    last = warmup + steps - 1
    final_loss = {name: v.global_loss(last) for name, v in variants.items()}
    reference = variants[REFERENCE]
    result: dict[str, Any] = {
        "rank": rank,
        "times": times,
        "final_loss": {name: float(loss) for name, loss in final_loss.items()},
        "loss_equal": {
            name: torch.equal(loss, final_loss[REFERENCE]) for name, loss in final_loss.items()
        },
        "params_equal": {
            name: bitwise_equal(v.params(), reference.params()) for name, v in variants.items()
        },
        "params": sum(p.numel() for p in reference.params().values()),
        "peak_rss_bytes": peak_rss,
    }
    result["traffic"] = traffic(variants, steps=3)
    result["step_memory"] = step_memory(variants)

    # Every rank decides from the same gathered timings, so all take part in the profile.
    slow = slow_variants(round_times(all_times))
    to_profile = [name for name in variants if name != REFERENCE] if options["profile"] else slow
    if to_profile:
        result["profile"] = _util.profile_against(
            variants,
            REFERENCE,
            to_profile,
            options["profile_steps"],
            record=rank == 0,
            before_each=dist.barrier,
        )
    return result


def slow_variants(per_round: dict[str, list[float]]) -> list[str]:
    """The fscale variants whose median round time exceeds GOAL times DDP's."""
    reference = _util.summarize(per_round[REFERENCE]).median
    return [
        name
        for name, samples in per_round.items()
        if name != REFERENCE and _util.summarize(samples).median / reference > GOAL
    ]


def round_times(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """A round's time is its slowest rank's: a synchronous step ends when all ranks finish."""
    return {
        name: [max(samples) for samples in zip(*(times[name] for times in per_rank))]
        for name in per_rank[0]
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="gpt",
        help="fscale's GPT, or a transformers GPT2LMHeadModel of the same shape",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (steps per variant)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first")
    parser.add_argument("--world", type=int, default=2, help="number of gloo ranks")
    parser.add_argument("--batch-per-rank", type=int, default=BATCH_PER_RANK)
    parser.add_argument("--profile", action="store_true", help="profile even if within the goal")
    parser.add_argument("--profile-steps", type=int, default=None, help="steps per profile")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (15 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    profile_steps = args.profile_steps or (3 if args.quick else 8)
    if steps < 1 or warmup < 0 or profile_steps < 1 or args.world < 1 or args.batch_per_rank < 1:
        parser.error("--steps, --profile-steps, --world, --batch-per-rank >= 1; --warmup >= 0")
    if args.model == "hf-gpt2" and importlib.util.find_spec("transformers") is None:
        parser.error("--model hf-gpt2 needs `transformers` (pip install -e '.[integration]')")

    options = {
        "quick": args.quick,
        "model": args.model,
        "steps": steps,
        "warmup": warmup,
        "batch_per_rank": args.batch_per_rank,
        "profile": args.profile,
        "profile_steps": profile_steps,
    }
    cfg = _util.gpt_config(args.quick)
    print(
        f"{'GPT' if args.model == 'gpt' else 'HF GPT-2'} vocab={cfg.vocab_size} "
        f"d_model={cfg.d_model} layers={cfg.n_layers} "
        f"seq={cfg.seq_len}, {args.batch_per_rank} sequences per rank, {args.world} gloo ranks "
        f"x 1 thread, {steps} timed rounds after {warmup} warm-up"
    )
    env = {"FSCALE_DEBUG": "0"}
    with _util.MachineLoad() as load:
        results = fs.launch(rank_main, args.world, options, backend="gloo", env=env, timeout=1800)
    print(load.describe())

    per_round = round_times([r["times"] for r in results])
    summaries = {name: _util.summarize(samples) for name, samples in per_round.items()}
    reference_median = summaries[REFERENCE].median
    rank0 = results[0]
    rows = []
    for name, summary in summaries.items():
        ratios = _util.paired_ratios(per_round[name], per_round[REFERENCE])
        paired, interval = _util.summarize(ratios), _util.median_interval(ratios)
        rows.append(
            {
                "variant": name,
                "step_s": summary.as_dict(),
                "ratio_of_medians": summary.median / reference_median,
                "paired_ratio": paired.as_dict(),
                "paired_interval": {"low": interval.low, "high": interval.high},
                "final_loss": rank0["final_loss"][name],
                "loss_bitwise_equal_to_ddp": all(r["loss_equal"][name] for r in results),
                "params_bitwise_equal_to_ddp": all(r["params_equal"][name] for r in results),
                "wire_bytes_per_step": [r["traffic"][name]["wire_bytes"] for r in results],
                "ledger_bytes_per_step": rank0["traffic"][name].get("ledger_bytes"),
                "ledger_calls_per_step": rank0["traffic"][name].get("ledger_calls"),
                "step_peak_rss_above_resident_bytes": [r["step_memory"][name] for r in results],
            }
        )
    params = rank0["params"]
    print(
        _util.format_table(
            [
                "variant",
                "median ms",
                "IQR ms",
                "x DDP",
                "paired x (95% CI)",
                "final loss",
                "loss ==",
                "params ==",
                "wire MiB",
                "ledger MiB",
            ],
            [
                [
                    row["variant"],
                    row["step_s"]["median"] * 1e3,
                    row["step_s"]["iqr"] * 1e3,
                    row["ratio_of_medians"],
                    (
                        f"{row['paired_ratio']['median']:.3f} "
                        f"({row['paired_interval']['low']:.3f}-{row['paired_interval']['high']:.3f})"
                    ),
                    f"{row['final_loss']:.6f}",
                    row["loss_bitwise_equal_to_ddp"],
                    row["params_bitwise_equal_to_ddp"],
                    row["wire_bytes_per_step"][0] / 2**20,
                    None
                    if row["ledger_bytes_per_step"] is None
                    else row["ledger_bytes_per_step"] / 2**20,
                ]
                for row in rows
            ],
        )
    )
    ring = 2 * (args.world - 1) / args.world * params * 4
    print(
        f"{params / 1e6:.2f}M float32 params: one ring all-reduce of the gradients sends "
        f"{ring / 2**20:.2f} MiB per rank; wire = bytes rank 0 wrote to its sockets per step "
        "(none where fscale's ranks of one host share memory: fscale.distributed.shared_memory), "
        "ledger = fscale's ring-model count (all collectives of the step)"
    )
    for name, entry in rank0["traffic"].items():
        if "ledger_summary" in entry:
            print(f"comm ledger of one {name!r} step on rank 0:\n{entry['ledger_summary']}")
    print(
        "peak RSS per rank over the timed rounds (all variants live in each rank): "
        + ", ".join(f"rank {r['rank']} {r['peak_rss_bytes'] / 2**20:.0f} MiB" for r in results)
    )

    slow = slow_variants(per_round)
    verdict = "all fscale variants within" if not slow else f"slower than the goal: {slow}"
    print(f"goal: fscale step <= {GOAL:.2f}x torch DDP; {verdict}")
    profile = rank0.get("profile")
    if profile is not None:
        print()
        print(_util.format_profile(profile))

    result = {
        "config": {
            **cfg.__dict__,
            "model": args.model,
            "batch_per_rank": args.batch_per_rank,
            "world": args.world,
            "params": params,
            "lr": LEARNING_RATE,
            "ring_all_reduce_bytes": ring,
        },
        "steps": steps,
        "warmup": warmup,
        "goal_ratio": GOAL,
        "machine_load": load.as_dict(),
        "rows": rows,
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in results],
        "profile": profile,
    }
    path = _util.write_results("ddp" if args.model == "gpt" else "ddp_hf_gpt2", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
