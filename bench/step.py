"""Benchmark: one fscale training step against the eager PyTorch step, in one process.

Usage: ``python bench/step.py [--quick] [--steps N] [--warmup N] [--threads N] [--profile]``

The model is `fscale.models.GPT` (shape from `_util.gpt_config`: vocabulary 8192, d_model 256,
4 layers, 128 positions, batch 8; ``--quick``: a smaller one), dropout 0, every variant built
from seed 0 and fed the same stream of batches. Variants:

* ``eager``: the ``nn.Module`` with ``torch.optim.AdamW(fused=True)``:
  ``zero_grad(set_to_none=True)``, ``loss.backward()``, ``opt.step()``;
* ``fscale donate=False``: ``fscale.train_step(loss_fn, fscale.optim.adamw(lr))`` over
  ``fscale.functionalize(GPT(cfg))`` (the pure step: the input state is never modified);
* ``fscale donate=True``: the same with ``donate=True`` (parameters and optimizer state updated
  in place, as the eager optimizer does).

Variants run interleaved round by round (`_util.interleave`); warm-up rounds are dropped. The
report gives each variant's median step time with its interquartile range, the ratio of medians
to eager and the median of the round-by-round ratios, the transient memory of one step (peak
RSS above the resident memory before it), the minor page faults per step (first touches of
memory the allocator had to get from the kernel), and whether the final losses and parameters equal
eager's bit for bit. When an fscale variant is more than ``GOAL`` times slower than eager (or
with ``--profile``), it is profiled against eager: per-op self CPU time from torch.profiler
(which ops fscale runs more of, e.g. copies) and per-function own time from cProfile (the
Python overhead outside the ops), each the median over steps profiled in alternation with eager.
Writes ``bench/results/step.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import _util
import torch

import fscale as fs
from fscale.data import LMBatch
from fscale.models import GPT, lm_loss

GOAL = 1.05
"""The slowdown against eager at or below which fscale's step counts as fast enough."""

LEARNING_RATE = 1e-3
BATCH_SIZE = 8


class Batches:
    """The shared stream of batches, made once (on `device`) so that creating them is never
    timed."""

    def __init__(
        self, cfg: Any, batch_size: int, count: int, device: torch.device | str = "cpu"
    ) -> None:
        self._batches = [
            LMBatch(b.inputs.to(device), b.targets.to(device))
            for b in (_util.lm_batch(cfg, batch_size, i) for i in range(count))
        ]

    def __getitem__(self, index: int) -> Any:
        # Extra steps (memory and profile passes) cycle through the stream again.
        return self._batches[index % len(self._batches)]


class EagerVariant:
    """The reference: an nn.Module trained with torch.optim.AdamW(fused=True) on `device`,
    under ``torch.autocast(bfloat16)`` when `bf16`."""

    def __init__(
        self, cfg: Any, batches: Batches, device: torch.device | str = "cpu", bf16: bool = False
    ) -> None:
        self.model = GPT(cfg, seed=0).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, fused=True)
        self.batches = batches
        self.device_type, self.bf16 = torch.device(device).type, bf16
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        batch = self.batches[len(self.losses)]
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, torch.bfloat16, enabled=self.bf16):
            loss = lm_loss(self.model(batch.inputs), batch.targets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.detach())

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}


class FscaleVariant:
    """fscale.train_step over the functionalized GPT with fscale.optim.adamw on `device`;
    `exact` is adamw's, and `bf16` wraps the step in ``fscale.mixed_precision``."""

    def __init__(
        self,
        cfg: Any,
        batches: Batches,
        *,
        donate: bool,
        device: torch.device | str = "cpu",
        exact: bool = True,
        bf16: bool = False,
    ) -> None:
        apply, params, buffers = fs.functionalize(GPT(cfg, seed=0).to(device))

        def loss_fn(params, buffers, batch, key):
            logits, new_buffers = apply(params, buffers, batch.inputs, key=key)
            return lm_loss(logits, batch.targets), new_buffers

        optimizer = fs.optim.adamw(LEARNING_RATE, exact=exact)
        self.step = fs.train_step(loss_fn, optimizer, donate=donate)
        if bf16:
            self.step = fs.mixed_precision(self.step)
        self.state = self.step.init(params, buffers)
        self.batches = batches
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        self.state, metrics = self.step(self.state, self.batches[len(self.losses)])
        self.losses.append(metrics["loss"])

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.state.params)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, and every pair of tensors equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def step_memory(variant: Callable[[], None]) -> int | None:
    """Bytes by which one step's peak RSS exceeds the resident memory before it."""
    if not _util.reset_peak_rss():
        return None
    before = _util.rss_bytes()
    variant()
    return max(0, _util.peak_rss_bytes() - before)


def page_faults(variant: Callable[[], None], steps: int = 3) -> float:
    """Median minor page faults per step: first touches of memory the allocator got fresh."""
    counts = []
    for _ in range(steps):
        before = _util.minor_faults()
        variant()
        counts.append(_util.minor_faults() - before)
    return _util.quantile(counts, 0.5)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (steps per variant)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", action="store_true", help="profile even if within the goal")
    parser.add_argument("--profile-steps", type=int, default=None, help="steps per profile")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.quick else 60)
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    profile_steps = args.profile_steps or (5 if args.quick else 10)
    if steps < 1 or warmup < 0 or profile_steps < 1:
        parser.error("--steps and --profile-steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(args.threads)

    cfg = _util.gpt_config(args.quick)
    batches = Batches(cfg, BATCH_SIZE, warmup + steps)
    variants: dict[str, Any] = {
        "eager": EagerVariant(cfg, batches),
        "fscale donate=False": FscaleVariant(cfg, batches, donate=False),
        "fscale donate=True": FscaleVariant(cfg, batches, donate=True),
    }
    numel = sum(p.numel() for p in variants["eager"].params().values())
    print(
        f"GPT vocab={cfg.vocab_size} d_model={cfg.d_model} layers={cfg.n_layers} "
        f"seq={cfg.seq_len} batch={BATCH_SIZE} ({numel / 1e6:.2f}M params), "
        f"{args.threads} thread(s), {steps} timed rounds after {warmup} warm-up"
    )
    with _util.MachineLoad() as load:
        times = _util.interleave(variants, rounds=steps, warmup=warmup)
    peak_rss = _util.peak_rss_bytes()
    print(load.describe())

    # The losses and parameters after the same number of steps on the same batches.
    eager = variants["eager"]
    final_loss = {name: float(v.losses[-1]) for name, v in variants.items()}
    losses_equal = {
        name: torch.equal(v.losses[-1], eager.losses[-1]) for name, v in variants.items()
    }
    params_equal = {name: bitwise_equal(v.params(), eager.params()) for name, v in variants.items()}
    memory = {name: step_memory(v) for name, v in variants.items()}
    faults = {name: page_faults(v) for name, v in variants.items()}

    summaries = {name: _util.summarize(samples) for name, samples in times.items()}
    eager_median = summaries["eager"].median
    rows = []
    for name, summary in summaries.items():
        paired = _util.summarize(_util.paired_ratios(times[name], times["eager"]))
        rows.append(
            {
                "variant": name,
                "step_s": summary.as_dict(),
                "ratio_of_medians": summary.median / eager_median,
                "paired_ratio": paired.as_dict(),
                "final_loss": final_loss[name],
                "loss_bitwise_equal_to_eager": losses_equal[name],
                "params_bitwise_equal_to_eager": params_equal[name],
                "step_peak_rss_above_resident_bytes": memory[name],
                "minor_page_faults_per_step": faults[name],
            }
        )
    print(
        _util.format_table(
            [
                "variant",
                "median ms",
                "IQR ms",
                "x eager",
                "paired x (IQR)",
                "final loss",
                "loss ==",
                "params ==",
                "step MiB",
                "faults",
            ],
            [
                [
                    row["variant"],
                    row["step_s"]["median"] * 1e3,
                    row["step_s"]["iqr"] * 1e3,
                    row["ratio_of_medians"],
                    f"{row['paired_ratio']['median']:.3f} ({row['paired_ratio']['iqr']:.3f})",
                    f"{row['final_loss']:.6f}",
                    row["loss_bitwise_equal_to_eager"],
                    row["params_bitwise_equal_to_eager"],
                    None
                    if row["step_peak_rss_above_resident_bytes"] is None
                    else row["step_peak_rss_above_resident_bytes"] / 2**20,
                    int(row["minor_page_faults_per_step"]),
                ]
                for row in rows
            ],
        )
    )
    print(f"process peak RSS over the timed rounds (all variants live): {peak_rss / 2**20:.0f} MiB")

    slow = [
        row["variant"]
        for row in rows
        if row["variant"] != "eager" and row["ratio_of_medians"] > GOAL
    ]
    verdict = "all fscale variants within" if not slow else f"slower than the goal: {slow}"
    print(f"goal: fscale step <= {GOAL}x eager; {verdict}")
    profile = None
    to_profile = [name for name in variants if name != "eager"] if args.profile else slow
    if to_profile:
        profile = _util.profile_against(variants, "eager", to_profile, profile_steps)
        print()
        print(_util.format_profile(profile))

    result = {
        "config": {**cfg.__dict__, "batch": BATCH_SIZE, "params": numel, "lr": LEARNING_RATE},
        "steps": steps,
        "warmup": warmup,
        "goal_ratio": GOAL,
        "machine_load": load.as_dict(),
        "peak_rss_bytes": peak_rss,
        "rows": rows,
        "profile": profile,
    }
    path = _util.write_results("step", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
