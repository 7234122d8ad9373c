"""Benchmark: `fscale.pipeline` against `torch.distributed.pipelining` on gloo ranks.

Usage: ``python bench/pipeline.py [--quick] [--steps N] [--warmup N] [--ranks 2 4]
[--micro-batches 4 8] [--balance time|even] [--keep-heap] [--isolated] [--launches K]``

For every (ranks P, micro-batches M, schedule) one `fscale.launch` starts P gloo ranks (one
thread each) that train the same GPT-style ``nn.Sequential`` — token and position embeddings,
the blocks, and a head (final LayerNorm and an untied output layer) — cut by the same balance
(``--balance time``, the default: `fscale.balance_by_time` of the layers with the head and the
loss counted, measured once in the parent process for each stage count; ``--balance even``:
the same number of layers per stage, which leaves the head's stage the slowest), with AdamW,
round by round alternating (`_util.interleave`, a barrier before every step):

* ``torch``: ``PipelineStage`` per local stage and ``ScheduleGPipe`` / ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``,
  ``torch.optim.AdamW(fused=True)`` (the kernel fscale's AdamW calls; the default on CPU is a
  slower per-tensor loop);
* ``fscale``: ``fscale.pipeline(..., schedule=..., donate=True)`` over the same modules (the
  update in place, as torch's optimizer does it); for ``zero_bubble`` the table ordered on this
  model's measured costs (`fscale.parallel.pipeline.zero_bubble` with ``costs=``: each stage's
  F, B and W seconds, medians over `COST_STEPS` steps of the unit-clock table, gathered from
  every rank).

Reported per configuration: median step time of each (the slowest rank's per round), the
throughput ratio fscale / torch (samples per second) with a distribution-free 95% interval for
its round-by-round median (`_util.median_interval`) and the verdict on the goal of 1.1x (met or
missed when the whole interval is on one side of it, else undecided), the CPU ratio torch /
fscale (the CPU seconds all ranks spend per step, median over rounds: the work done, which the
load other processes put on a shared machine does not stretch as it stretches step times), the
peak RSS growth of each rank during its steps (what the step allocates above the model: mostly
activations), the bubble fraction of fscale's schedule table, and for GPipe and 1F1B the
analytical (P−1)/(M+P−1). ``--keep-heap``: every rank first makes glibc keep the memory it
frees (`_util.keep_heap`); with glibc's defaults the two runtimes share each rank's heap, and
how often it is given back and faulted in again depends on their largest blocks (see the
README's pipeline section). ``--isolated``: each runtime in rank processes of its own
(`_isolated`: both alive at once, one runtime's step at a time, alternating), so neither runs
on a heap the other left. Writes ``bench/results/pipeline.json`` (``pipeline_keep_heap.json``,
then ``_isolated`` with ``--isolated``).

``--launches K``: every configuration is launched K times (new rank processes each time, the
configurations taken in turn in each of the K passes), and its verdict is decided over the
launches: the interval is the distribution-free one for the median of the K launches' own
medians of the paired ratios (`_over_launches`; K >= 6 for 95%). On this kind of shared host
the launches of one comparison differ more than one launch's rounds do (six launches of 1F1B at
P = 2, M = 8, 60 rounds each: medians 1.016-1.084, the third launch's interval 1.00-1.06 clear of
the first's 1.065-1.11), so one launch's interval speaks for that launch only. The ratio shown is
then the median of the launches' medians of the paired ratios (one launch: the ratio of the two
median step times); the step times, bounds and bubble shown are medians over the launches, and
each launch's own row is in the row's ``launches``.

Measured, from extra fscale steps run under `fscale.parallel.pipeline.record_timeline` after
the timed rounds (so the recording costs the timed steps nothing), each after one of torch's
steps as in the rounds (without it fscale's actions ran faster than in the rounds, and the
bounds below read low; not with ``--isolated``, where torch runs in other processes): the
bubble over the whole step, as the table's bubble and (P−1)/(M+P−1) count it
(`fscale.parallel.pipeline.measured_bubble`: ``1 - sum of busy / (P * span)``, busy being a
rank's actions' time less their waits on receives and the span from the first action on any
rank to the last end on any; median over the steps), timed without counting
activations (the count slows every forward); then, in as many steps again, each rank's peak of
the activation bytes autograd saves for backward (parameters excluded). The *floor* is fscale's
table run on a clock where every action takes its measured cost (`fscale.parallel.pipeline.
simulate`): the critical path of those actions in that order, with no time for messages, the
update or anything else between them; a backward that sent its input's gradient before its
linear layers' weight gradients hands it on at that point (`StepTimeline.sends`), not at its
end. ``fscale/floor`` and ``torch/floor`` say how far each
step is above it; for ``zero_bubble`` torch runs another table (two stages per rank), so its
figure compares schedules, not runtimes. For GPipe and 1F1B the *chain* is a bound that needs no
simulation: the first stage's first forward, all of the last stage's actions (one rank runs them
in turn) up to its last backward's send and the first stage's last backward run one after the
other in any runtime of the table, so no step is shorter (median over the measured steps;
``fscale/chain``, ``torch/chain``). The floor assumes a core per rank: with more ranks
than cores the ranks share them, an action's measured time includes the time it waited for a
core, and the floor is no bound. Below the table, per (P, M): 1F1B's
activation peak over GPipe's (the goal: at most P/M) and zero-bubble's measured bubble against
fscale's 1F1B's (the goal: below it), the two steps alternating for `BUBBLE_PAIRS` rounds in the
zero-bubble launch, after its timed rounds, and the goal decided on the median of the round by
round differences as the throughput's is on the ratios (over launches with ``--launches``),
with the median ratio of the two steps' times;
and, where each rank has a core of its own, the cells whose 1.1x
throughput goal no runtime with fscale's action costs could reach: ``torch/chain`` (GPipe,
1F1B) or ``torch/floor`` (interleaved) below 1.1 means that even a step with nothing outside
fscale's actions would be less than 1.1x torch's.
Writes ``bench/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from typing import Any

import _isolated
import _util
import torch
import torch.distributed as dist
from torch import nn

import fscale as fs
from fscale.models import GPT, GPTConfig
from fscale.parallel.pipeline import (
    Timeline,
    measured_bubble,
    measured_costs,
    record_timeline,
    simulate,
    zero_bubble,
)

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
LEARNING_RATE = 1e-3
THROUGHPUT_GOAL = 1.1  # issue 12: fscale >= 1.1x torch pipelining's throughput, same schedule
LAUNCH_CONFIDENCE = 0.95  # of a verdict over launches (`_over_launches`)
SEQUENCES_PER_MICRO_BATCH = 2
COST_STEPS = 3  # steps of the unit-clock zero-bubble table timed for its stages' costs
BUBBLE_PAIRS = 20  # rounds of zero-bubble and 1F1B alternating, for the bubble goal


def _config(quick: bool) -> GPTConfig:
    if quick:
        return GPTConfig(
            vocab_size=1024, seq_len=32, d_model=64, n_heads=4, n_layers=6, tie_embeddings=False
        )
    return GPTConfig(
        vocab_size=4096, seq_len=64, d_model=128, n_heads=4, n_layers=6, tie_embeddings=False
    )


class Head(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.norm, self.out = gpt.final_norm, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _layers(cfg: GPTConfig) -> nn.Sequential:
    gpt = GPT(cfg, seed=0)
    return nn.Sequential(gpt.embed, *gpt.blocks, Head(gpt))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _balance(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def _stage_balance(options: dict[str, Any], cfg: GPTConfig, num_stages: int) -> list[int]:
    """The layers per stage: measured in the parent process (the same on every rank and for
    both variants), or even."""
    measured = options.get("balances", {})
    return measured.get(num_stages) or _balance(cfg.n_layers + 2, num_stages)


def _measured_balances(quick: bool, stage_counts: set[int]) -> dict[int, list[int]]:
    """`fscale.balance_by_time` of the model for each stage count, the head and loss counted,
    on one micro-batch."""
    torch.set_num_threads(1)
    cfg = _config(quick)
    batch = _util.lm_batch(cfg, SEQUENCES_PER_MICRO_BATCH, 0)
    return {
        count: fs.balance_by_time(
            _layers(cfg), batch.inputs, count, loss_fn=_loss, targets=batch.targets, repeats=5
        )
        for count in sorted(stage_counts)
    }


def _torch_variant(cfg, balance, num_stages, schedule, micro_batches):
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _layers(cfg)
    bounds = [0]
    for size in balance:
        bounds.append(bounds[-1] + size)
    local = [s for s in range(num_stages) if s % world == rank]
    stages, params = [], []
    for s in local:
        module = nn.Sequential(*list(model.children())[bounds[s] : bounds[s + 1]])
        params += list(module.parameters())
        stages.append(pipelining.PipelineStage(module, s, num_stages, torch.device("cpu")))
    schedule_class = getattr(pipelining, SCHEDULES[schedule])
    if schedule in ("interleaved", "zero_bubble"):
        runner = schedule_class(stages, n_microbatches=micro_batches, loss_fn=_loss)
    else:
        runner = schedule_class(stages[0], n_microbatches=micro_batches, loss_fn=_loss)
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    first, last = 0 in local, num_stages - 1 in local

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        args = (tokens,) if first else ()
        kwargs = {"target": targets, "losses": []} if last else {}
        runner.step(*args, **kwargs)
        optimizer.step()

    return step


def _fscale_variant(cfg, balance, num_stages, schedule, micro_batches, batch):
    def build(table: Any) -> Any:
        model = _layers(cfg)
        _, params, buffers = fs.functionalize(model)
        step = fs.pipeline(
            model,
            _loss,
            fs.optim.adamw(LEARNING_RATE),
            fs.Mesh(pp=dist.get_world_size()),
            micro_batches=micro_batches,
            schedule=table,
            balance=balance,
            checkpoint="never",
            donate=True,  # torch's optimizer updates its parameters in place too
        )
        return step, step.init(params, buffers)

    step, state = build(schedule)
    if schedule == "zero_bubble":  # ZB-H1 ordered on this model's measured costs
        costs = _stage_costs(step, state, batch)
        step, state = build(functools.partial(zero_bubble, costs=costs))
    holder = {"state": state}

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        holder["state"], _ = step(holder["state"], (tokens, targets))

    return run, step.plan.schedule  # type: ignore[attr-defined]


def _stage_costs(step: Any, state: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """Each stage's F, B and W seconds over `COST_STEPS` recorded steps of `step`, the same on
    every rank (`fscale.parallel.pipeline.measured_costs`)."""
    state, _ = step(state, batch)  # warm-up
    with record_timeline(activations=False) as timeline:
        for _ in range(COST_STEPS):
            dist.barrier()
            state, _ = step(state, batch)
    return measured_costs(timeline, _pp_mesh())


def _measure(
    run: Any, tokens: torch.Tensor, targets: torch.Tensor, steps: int, between: Any = None
) -> dict[str, Any]:
    """This rank's measured bubble and action costs (medians over `steps` steps, timed without
    counting activations, which slows every forward), then its activation peak (max over as
    many steps again, counted). `between`, if given, runs before each timed step (torch's step,
    so that fscale's actions are timed in the conditions of the rounds, where the two
    alternate). Per step, also this rank's busy seconds and its first and last actions' (the
    parts of `_chain`)."""
    with record_timeline(activations=False) as timeline:
        for _ in range(steps):
            if between is not None:
                dist.barrier()
                between()
            dist.barrier()
            run(tokens, targets)
    with record_timeline() as counted:
        for _ in range(steps):
            dist.barrier()
            run(tokens, targets)
    runs = [s.costs() for s in timeline.steps]
    # Actions that sent their result before they ended (a backward's early send): the median
    # busy seconds until then, for the floor (`simulate`'s `sends`).
    sent = [s.sends() for s in timeline.steps]
    return {
        "step_busy_s": [s.busy for s in timeline.steps],
        "step_first_s": [s.actions[0].busy for s in timeline.steps],
        "step_last_s": [s.actions[-1].busy for s in timeline.steps],
        "step_after_send_s": [_after_send(s.actions[-1]) for s in timeline.steps],
        "bubble": statistics.median(measured_bubble(timeline, _pp_mesh())),
        "activation_peak": max(s.activation_peak or 0 for s in counted.steps),
        "busy_s": statistics.median(s.busy for s in timeline.steps),
        "wall_s": statistics.median(s.wall for s in timeline.steps),
        "costs": {key: statistics.median(r[key] for r in runs) for key in runs[0]},
        "sends": {key: statistics.median(r[key] for r in sent) for key in sent[0]},
    }


def _pp_mesh() -> fs.Mesh:
    return fs.Mesh(pp=dist.get_world_size())


def _paired_bubbles(zero: Any, one: Any, tokens: torch.Tensor, targets: torch.Tensor):
    """`BUBBLE_PAIRS` rounds of fscale's zero-bubble step then its 1F1B step on the same batch,
    each step recorded on its own: per round, the two bubbles (`measured_bubble`, gathered
    once after the rounds), measured under the same load, and this rank's time for each step
    (``"<schedule> s"``)."""
    recorded = {"zero_bubble": Timeline(activations=False), "1f1b": Timeline(activations=False)}
    paired: dict[str, list[float]] = {"zero_bubble s": [], "1f1b s": []}
    for _ in range(BUBBLE_PAIRS):
        for name, run in (("zero_bubble", zero), ("1f1b", one)):
            with record_timeline(activations=False) as timeline:
                dist.barrier()
                start = time.perf_counter()
                run(tokens, targets)
                paired[f"{name} s"].append(time.perf_counter() - start)
            recorded[name].steps += timeline.steps
    for name, timeline in recorded.items():
        paired[name] = measured_bubble(timeline, _pp_mesh())
    return paired


def _after_send(action: Any) -> float:
    """The busy seconds `action` spent after it sent its result on (0 if it sent none early)."""
    return 0.0 if action.sent is None else action.busy - action.sent


class _Setup:
    """What both runtimes train on this rank: the model's config, the balances, the batch."""

    def __init__(self, options: dict[str, Any]) -> None:
        if options.get("keep_heap") and not _util.keep_heap():
            raise RuntimeError("--keep-heap: glibc's mallopt refused the thresholds")
        torch.set_num_threads(1)
        fs.distributed.set_debug(False)  # the cross-rank metadata check is a test aid
        self.options = options
        self.cfg = cfg = _config(options["quick"])
        self.schedule, self.micro_batches = options["schedule"], options["micro_batches"]
        world = dist.get_world_size()
        split = self.schedule in ("interleaved", "zero_bubble")
        # fscale's ZB-H1 is one stage per rank; torch's zero-bubble schedule needs v stages.
        self.num_stages = world * (2 if self.schedule == "interleaved" else 1)
        self.balance = _stage_balance(options, cfg, self.num_stages)
        batch = _util.lm_batch(cfg, SEQUENCES_PER_MICRO_BATCH * self.micro_batches, 0)
        self.tokens, self.targets = batch.inputs, batch.targets
        self.torch_stages = world * 2 if split else world
        self.torch_balance = _stage_balance(options, cfg, self.torch_stages)

    def build(self, name: str) -> tuple[Any, Any]:
        """``(run, table)`` of the runtime `name` (the table is fscale's; None for torch)."""
        if name == "torch":
            run = _torch_variant(
                self.cfg, self.torch_balance, self.torch_stages, self.schedule, self.micro_batches
            )
            return run, None
        return _fscale_variant(
            self.cfg,
            self.balance,
            self.num_stages,
            self.schedule,
            self.micro_batches,
            (self.tokens, self.targets),
        )

    def fscale_facts(self, run: Any, table: Any, between: Any = None) -> dict[str, Any]:
        """The measured bubble and costs of fscale's steps (`_measure`) and its table's facts."""
        measure = self.options["measure"]
        facts = {
            "measured": _measure(run, self.tokens, self.targets, measure, between),
            "bubble": table.bubble_fraction(),
            "table": table,
            "activation_bound": list(table.activation_bound),
            "balance": self.balance,
            "paired_bubbles": None,
        }
        if self.schedule == "zero_bubble":  # the goal compares it with fscale's own 1F1B
            one, _ = _fscale_variant(
                self.cfg, self.balance, self.num_stages, "1f1b", self.micro_batches, None
            )
            one(self.tokens, self.targets)  # its first step checks the stage contracts
            facts["paired_bubbles"] = _paired_bubbles(run, one, self.tokens, self.targets)
        return facts


class _Timed:
    """One runtime's step with its CPU seconds and its peak RSS growth recorded."""

    def __init__(self, setup: _Setup, run: Any) -> None:
        self.setup, self.run = setup, run
        self.cpu: list[float] = []
        self.peak = 0

    def __call__(self) -> None:
        _util.reset_peak_rss()
        before = _util.rss_bytes()
        cpu_start = time.process_time()
        self.run(self.setup.tokens, self.setup.targets)
        self.cpu.append(time.process_time() - cpu_start)
        self.peak = max(self.peak, _util.peak_rss_bytes() - before)


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    """Both runtimes in this rank's process, timed round by round (`_util.interleave`)."""
    setup = _Setup(options)
    variants: dict[str, _Timed] = {}
    try:
        variants["torch"] = _Timed(setup, setup.build("torch")[0])
    except Exception as error:  # a schedule that torch does not run on gloo is reported
        variants_error = f"{type(error).__name__}: {error}"
    else:
        variants_error = None
    fscale_run, table = setup.build("fscale")
    variants["fscale"] = _Timed(setup, fscale_run)

    def timed(name: str):
        def call() -> None:
            dist.barrier()
            variants[name]()

        return call

    start = time.perf_counter()
    times = _util.interleave(
        {name: timed(name) for name in variants},
        rounds=options["steps"],
        warmup=options["warmup"],
    )
    return {
        "times": times,
        "cpu": {name: v.cpu[options["warmup"] :] for name, v in variants.items()},
        "peak_rss_growth": {name: v.peak for name, v in variants.items()},
        "torch_error": variants_error,
        **setup.fscale_facts(fscale_run, table, _between(setup, variants.get("torch"))),
        "seconds": time.perf_counter() - start,
    }


def _between(setup: _Setup, torch_step: _Timed | None) -> Any:
    """torch's step on the batch, to run between fscale's measured steps (None without one)."""
    if torch_step is None:
        return None
    return lambda: torch_step.run(setup.tokens, setup.targets)


def build_isolated(name: str, options: dict[str, Any]) -> _Timed:
    """`_isolated.Build`: one runtime on a rank of its own process group. A torch schedule that
    does not run on gloo becomes a step that does nothing, its error kept for the report."""
    setup = _Setup(options)
    try:
        run, table = setup.build(name)
    except Exception as error:
        if name != "torch":
            raise
        timed = _Timed(setup, lambda tokens, targets: None)
        timed.error = f"{type(error).__name__}: {error}"  # type: ignore[attr-defined]
        return timed
    timed = _Timed(setup, run)
    timed.table = table  # type: ignore[attr-defined]
    return timed


def finish_isolated(timed: _Timed) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": timed.cpu, "peak": timed.peak}
    out["error"] = getattr(timed, "error", None)
    table = getattr(timed, "table", None)
    if table is not None:
        out.update(timed.setup.fscale_facts(timed.run, table))
    return out


def run_isolated(ranks: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """`rank_main`'s results, each runtime in rank processes of its own (`_isolated`)."""
    start = time.perf_counter()
    steps, warmup = options["steps"], options["warmup"]
    measured = _isolated.run(
        build_isolated, finish_isolated, ["torch", "fscale"], ranks, steps, warmup, options
    )
    error = measured["torch"]["finish"][0]["error"]
    names = ["fscale"] if error else ["torch", "fscale"]
    results = []
    for rank in range(ranks):
        ours = measured["fscale"]["finish"][rank]
        kept = ("measured", "bubble", "table", "activation_bound", "balance", "paired_bubbles")
        facts = {k: ours[k] for k in kept}
        results.append(
            {
                "times": {name: measured[name]["wall"][rank] for name in names},
                "cpu": {n: measured[n]["finish"][rank]["cpu"][warmup:] for n in names},
                "peak_rss_growth": {n: measured[n]["finish"][rank]["peak"] for n in names},
                "torch_error": error,
                **facts,
                "seconds": time.perf_counter() - start,
            }
        )
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "pipeline").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--measure", type=int, default=None, help="steps under record_timeline")
    parser.add_argument(
        "--balance",
        choices=["time", "even"],
        default="time",
        help="layers per stage: fscale.balance_by_time (default) or an even count",
    )
    parser.add_argument(
        "--keep-heap",
        action="store_true",
        help="every rank keeps its freed memory for reuse (glibc thresholds; see _util.keep_heap)",
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="each runtime in rank processes of its own (see bench/_isolated.py)",
    )
    parser.add_argument(
        "--launches",
        type=int,
        default=1,
        help="launch every configuration K times and decide its verdict over the launches",
    )
    args = parser.parse_args(argv)
    if args.launches < 1:
        parser.error(f"--launches must be at least 1, got {args.launches}")
    steps = args.steps if args.steps is not None else (5 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.measure = args.measure if args.measure is not None else (3 if args.quick else 5)
    rows = []
    with _util.MachineLoad() as load:
        args.balances = {}
        if args.balance == "time":
            counts = {
                p * (2 if s in ("interleaved", "zero_bubble") else 1)
                for p in args.ranks
                for s in args.schedules
            } | set(args.ranks)
            args.balances = _measured_balances(args.quick, counts)
            print(f"balance_by_time: {args.balances}", flush=True)
        _run_all(args, steps, warmup, rows)
    print(_format(rows))
    if args.launches > 1:
        print(f"thr and its interval: over {args.launches} launches (`_over_launches`)")
    print(_goals(rows))
    print(load.describe())
    _util.write_results(
        ("pipeline_keep_heap" if args.keep_heap else "pipeline")
        + ("_isolated" if args.isolated else ""),
        {
            "rows": rows,
            "steps": steps,
            "warmup": warmup,
            "balances": {str(k): v for k, v in args.balances.items()},
            "launches": args.launches,
            "load": load.describe(),
        },
    )
    return {"rows": rows}


def _run_all(args: Any, steps: int, warmup: int, rows: list[dict[str, Any]]) -> None:
    configurations = [
        (ranks, micro_batches, schedule)
        for ranks in args.ranks
        for micro_batches in args.micro_batches
        for schedule in args.schedules
    ]
    launched: dict[tuple[int, int, str], list[dict[str, Any]]] = {c: [] for c in configurations}
    # Each pass launches every configuration once: a configuration's launches are spread over
    # the whole run, as the load of a shared host drifts.
    for launch in range(args.launches):
        for ranks, micro_batches, schedule in configurations:
            options = {
                "quick": args.quick,
                "steps": steps,
                "warmup": warmup,
                "schedule": schedule,
                "micro_batches": micro_batches,
                "measure": args.measure,
                "balances": args.balances,
                "keep_heap": args.keep_heap,
            }
            if args.isolated:
                results = run_isolated(ranks, options)
            else:
                results = fs.launch(
                    rank_main,
                    ranks,
                    options,
                    backend="gloo",
                    env={"FSCALE_DEBUG": "0"},
                    timeout=1800,
                )
            row = _row(ranks, micro_batches, schedule, results)
            launched[(ranks, micro_batches, schedule)].append(row)
            prefix = f"launch {launch + 1} of {args.launches}\n" if args.launches > 1 else ""
            print(prefix + _format([row]), flush=True)
    rows.extend(_over_launches(launched[configuration]) for configuration in configurations)


def _over_launches(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row from its launches' rows (one launch: that row).

    The throughput ratio is the median of the launches' medians of the paired ratios, its
    interval the distribution-free one for that median over the launches (`_util.
    median_interval`: the launches are independent draws, the rounds of one launch are not),
    and the verdict is decided on it when it holds the median with `LAUNCH_CONFIDENCE` (at
    least 6 launches), else undecided. The step times, CPU ratio, bounds and measured bubble
    are medians over the launches (`_MEDIAN_OVER_LAUNCHES`); the per-rank lists are those of the
    median launch (the lower middle one for an even count); ``launches`` holds each launch's
    own row.
    """
    if len(launches) == 1:
        return launches[0]
    with_torch = [r for r in launches if r["throughput_interval"] is not None]
    paired_bubble = _paired_bubble_over_launches(launches)
    if not with_torch:  # torch did not run this schedule: nothing to decide
        return {**launches[0], "paired_bubble": paired_bubble, "launches": launches}
    by_ratio = sorted(with_torch, key=lambda r: r["paired_median"])
    median_row = by_ratio[(len(by_ratio) - 1) // 2]
    medians = [r["paired_median"] for r in with_torch]
    interval = _util.median_interval(medians, LAUNCH_CONFIDENCE)
    # Fewer launches than the confidence needs give the whole range at a lower coverage,
    # which decides nothing.
    enough = interval.coverage >= LAUNCH_CONFIDENCE
    return {
        **median_row,
        **{key: _median_of(launches, key) for key in _MEDIAN_OVER_LAUNCHES},
        "throughput_ratio": statistics.median(medians),
        "paired_median": statistics.median(medians),
        "throughput_interval": dataclasses.asdict(interval),
        "throughput_verdict": interval.verdict_at_least(THROUGHPUT_GOAL) if enough else "undecided",
        "paired_bubble": paired_bubble,
        "launches": launches,
    }


_MEDIAN_OVER_LAUNCHES = (
    "fscale_s",
    "torch_s",
    "cpu_ratio",
    "floor_s",
    "fscale_over_floor",
    "torch_over_floor",
    "chain_s",
    "fscale_over_chain",
    "torch_over_chain",
    "measured_bubble",
)


def _median_of(launches: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in launches if r.get(key) is not None]
    return statistics.median(values) if values else None


def _row(ranks: int, micro_batches: int, schedule: str, results: list[dict[str, Any]]):
    names = list(results[0]["times"])
    per_round = {
        name: [max(values) for values in zip(*(r["times"][name] for r in results))]
        for name in names
    }
    medians = {name: _util.summarize(values).median for name, values in per_round.items()}
    # Round by round, torch's step time over fscale's (its throughput over torch's): the pair
    # ran under the same load, and the interval says whether the rounds decide the 1.1x goal.
    interval = verdict = paired_median = None
    if "torch" in per_round:
        ratios = _util.paired_ratios(per_round["torch"], per_round["fscale"])
        paired = _util.median_interval(ratios)
        interval, verdict = dataclasses.asdict(paired), paired.verdict_at_least(THROUGHPUT_GOAL)
        paired_median = statistics.median(ratios)
    analytic = (ranks - 1) / (micro_batches + ranks - 1) if schedule in ("gpipe", "1f1b") else None
    # The critical path of fscale's table with each action at its measured cost: the least
    # time any runtime takes for these actions in this order (`simulate`).
    costs = {key: c for r in results for key, c in r["measured"]["costs"].items()}
    sends = {key: c for r in results for key, c in r["measured"]["sends"].items()}
    floor = simulate(results[0]["table"], costs, sends=sends).makespan
    chain = _chain(schedule, results)
    # CPU seconds of all ranks per round: the work each variant does, which other processes'
    # load on the machine does not stretch as it stretches wall time.
    cpu = {
        name: _util.summarize([sum(v) for v in zip(*(r["cpu"][name] for r in results))]).median
        for name in names
    }
    return {
        "ranks": ranks,
        "micro_batches": micro_batches,
        "schedule": schedule,
        "fscale_s": medians["fscale"],
        "torch_s": medians.get("torch"),
        "throughput_ratio": medians["torch"] / medians["fscale"] if "torch" in medians else None,
        "cpu_ratio": cpu["torch"] / cpu["fscale"] if "torch" in cpu else None,
        "paired_median": paired_median,
        "throughput_interval": interval,
        "throughput_verdict": verdict,
        "floor_s": floor,
        "fscale_over_floor": medians["fscale"] / floor,
        "torch_over_floor": medians["torch"] / floor if "torch" in medians else None,
        "chain_s": chain,
        "fscale_over_chain": None if chain is None else medians["fscale"] / chain,
        "torch_over_chain": None
        if chain is None or "torch" not in medians
        else medians["torch"] / chain,
        "fscale_peak_mib": [r["peak_rss_growth"].get("fscale", 0) / 2**20 for r in results],
        "torch_peak_mib": [r["peak_rss_growth"].get("torch", 0) / 2**20 for r in results],
        "table_bubble": results[0]["bubble"],
        "analytic_bubble": analytic,
        "measured_bubble": results[0]["measured"]["bubble"],  # the same on every rank
        "paired_bubble": _paired_bubble([r["paired_bubbles"] for r in results]),
        "activation_peak_mib": [r["measured"]["activation_peak"] / 2**20 for r in results],
        "torch_error": results[0]["torch_error"],
    }


def _paired_bubble(ranks: list[dict[str, list[float]] | None]) -> dict[str, Any] | None:
    """Zero-bubble's measured bubble against fscale's 1F1B's, round by round in one launch
    (`_paired_bubbles`, one entry per rank; the bubbles are the same on every rank): the
    medians, the median of the differences with its interval, the verdict on the goal (below
    1F1B's: met when the whole interval is at or below 0, `MedianInterval.verdict`), and the
    median of the round by round ratios of the two steps' times (the slowest rank's),
    zero-bubble's over 1F1B's."""
    if ranks[0] is None:
        return None
    bubbles = ranks[0]
    differences = [z - o for z, o in zip(bubbles["zero_bubble"], bubbles["1f1b"])]
    interval = _util.median_interval(differences)
    slowest = {
        name: [max(times) for times in zip(*(r[f"{name} s"] for r in ranks if r))]
        for name in ("zero_bubble", "1f1b")
    }
    return {
        "zero_bubble": statistics.median(bubbles["zero_bubble"]),
        "1f1b": statistics.median(bubbles["1f1b"]),
        "difference": statistics.median(differences),
        "interval": dataclasses.asdict(interval),
        "verdict": interval.verdict(0.0),
        "step_ratio": statistics.median(
            _util.paired_ratios(slowest["zero_bubble"], slowest["1f1b"])
        ),
    }


def _paired_bubble_over_launches(launches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """`_paired_bubble` over launches: the medians of the launches' medians, the interval for
    the median of their differences (`LAUNCH_CONFIDENCE`; fewer launches decide nothing)."""
    paired = [r["paired_bubble"] for r in launches if r.get("paired_bubble")]
    if not paired:
        return None
    differences = [p["difference"] for p in paired]
    interval = _util.median_interval(differences, LAUNCH_CONFIDENCE)
    enough = interval.coverage >= LAUNCH_CONFIDENCE
    return {
        "zero_bubble": statistics.median(p["zero_bubble"] for p in paired),
        "1f1b": statistics.median(p["1f1b"] for p in paired),
        "difference": statistics.median(differences),
        "interval": dataclasses.asdict(interval),
        "verdict": interval.verdict(0.0) if enough else "undecided",
        "step_ratio": statistics.median(p["step_ratio"] for p in paired),
    }


def _chain(schedule: str, results: list[dict[str, Any]]) -> float | None:
    """The median over the measured steps of the chain of actions that any runtime of a
    one-stage-per-rank GPipe or 1F1B table runs one after the other: the first stage's first
    forward (every other action needs it), all of the last stage's actions (one rank runs them
    in turn) up to its last backward's send of the input's gradient (what fscale computes
    after that send, the weight gradients of its linear layers, is off the chain), then the
    first stage's last backward (it needs that gradient).
    None for the other schedules, where the last stage's rank holds other stages too
    (interleaved) or the first stage's last action does not wait for all of the last stage's
    (zero-bubble's deferred W)."""
    if schedule not in ("gpipe", "1f1b"):
        return None
    first, last = results[0]["measured"], results[-1]["measured"]
    chains = [
        head + busy - after + tail
        for head, busy, after, tail in zip(
            first["step_first_s"],
            last["step_busy_s"],
            last["step_after_send_s"],
            first["step_last_s"],
        )
    ]
    return statistics.median(chains)


def _format(rows: list[dict[str, Any]]) -> str:
    header = [
        "P",
        "M",
        "schedule",
        "fscale ms",
        "torch ms",
        "floor ms",
        "fscale/floor",
        "torch/floor",
        "chain ms",
        "fscale/chain",
        "torch/chain",
        "fscale/torch thr",
        "thr 95% CI",
        "torch/fscale cpu",
        "fscale peak MiB",
        "torch peak MiB",
        "table bubble",
        "(P-1)/(M+P-1)",
        "measured bubble",
        "act peak MiB",
    ]
    body = [
        [
            r["ranks"],
            r["micro_batches"],
            r["schedule"],
            r["fscale_s"] * 1e3,
            (r["torch_s"] or float("nan")) * 1e3,
            r["floor_s"] * 1e3,
            r["fscale_over_floor"],
            r["torch_over_floor"] if r["torch_over_floor"] is not None else "n/a",
            r["chain_s"] * 1e3 if r["chain_s"] is not None else "-",
            r["fscale_over_chain"] if r["fscale_over_chain"] is not None else "-",
            r["torch_over_chain"] if r["torch_over_chain"] is not None else "-",
            r["throughput_ratio"] if r["throughput_ratio"] is not None else "n/a",
            _interval_cell(r["throughput_interval"], r["throughput_verdict"]),
            r["cpu_ratio"] if r["cpu_ratio"] is not None else "n/a",
            "/".join(f"{v:.1f}" for v in r["fscale_peak_mib"]),
            "/".join(f"{v:.1f}" for v in r["torch_peak_mib"]),
            r["table_bubble"],
            r["analytic_bubble"] if r["analytic_bubble"] is not None else "-",
            r["measured_bubble"],
            "/".join(f"{v:.2f}" for v in r["activation_peak_mib"]),
        ]
        for r in rows
    ]
    return _util.format_table(header, body)


def _interval_cell(interval: dict[str, float] | None, verdict: str | None) -> str:
    if interval is None:
        return "n/a"
    return f"{interval['low']:.3f}-{interval['high']:.3f} {verdict}"


def _goals(rows: list[dict[str, Any]]) -> str:
    """Per (P, M): 1F1B's activation peak over GPipe's against P/M, and zero-bubble's measured
    bubble against 1F1B's."""
    by_key = {(r["ranks"], r["micro_batches"], r["schedule"]): r for r in rows}
    lines = []
    for ranks, micro_batches in sorted({(r["ranks"], r["micro_batches"]) for r in rows}):
        gpipe = by_key.get((ranks, micro_batches, "gpipe"))
        one = by_key.get((ranks, micro_batches, "1f1b"))
        zero = by_key.get((ranks, micro_batches, "zero_bubble"))
        parts = [f"P={ranks} M={micro_batches}:"]
        if gpipe and one:
            ratio = max(one["activation_peak_mib"]) / max(gpipe["activation_peak_mib"])
            bound = ranks / micro_batches
            parts.append(
                f"1F1B/GPipe activation peak {ratio:.4f} (P/M {bound:.4f}, "
                f"{'met' if ratio <= bound else 'missed'})"
            )
        paired = zero.get("paired_bubble") if zero else None
        if paired:
            interval = paired["interval"]
            parts.append(
                f"zero-bubble measured bubble {paired['zero_bubble']:.3f} vs 1F1B "
                f"{paired['1f1b']:.3f}, alternating in the same launches: difference "
                f"{paired['difference']:+.3f} ({interval['low']:+.3f} to {interval['high']:+.3f}, "
                f"{interval['coverage']:.1%}) {paired['verdict']}; its step "
                f"{paired['step_ratio']:.3f}x 1F1B's"
            )
        elif zero and one:
            met = zero["measured_bubble"] < one["measured_bubble"]
            parts.append(
                f"zero-bubble measured bubble {zero['measured_bubble']:.3f} vs 1F1B "
                f"{one['measured_bubble']:.3f} ({'met' if met else 'missed'})"
            )
        lines.append(" ".join(parts))
    cores = os.cpu_count() or 1
    for r in rows:
        # The chain where the table has one (GPipe, 1F1B), else the floor.
        chained = r["torch_over_chain"] is not None
        ceiling = r["torch_over_chain"] if chained else r["torch_over_floor"]
        if r["schedule"] == "zero_bubble" or ceiling is None or r["ranks"] > cores:
            continue  # torch runs another table; or the ranks share cores and neither bounds
        if ceiling < THROUGHPUT_GOAL:
            bound = (
                "the chain of fscale's actions that runs in turn" if chained else "fscale's floor"
            )
            lines.append(
                f"P={r['ranks']} M={r['micro_batches']} {r['schedule']}: torch took "
                f"{ceiling:.3f}x {bound}, so no runtime with fscale's action costs reaches "
                f"{THROUGHPUT_GOAL}x torch here"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
