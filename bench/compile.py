"""Benchmark: the fscale step under torch.compile against eager fscale and eager / compiled torch.

Usage: ``python bench/compile.py [--quick] [--steps N] [--warmup N] [--ranks 1 2]
[--models gpt cnn] [--plans data_parallel shard_optimizer]``

Models: `fscale.models.GPT` (shape from `_util.gpt_config`, batch 8) and `fscale.models.ResNet`
(widths 16-32-64, 32x32 images, batch 32), dropout 0, every variant built from seed 0 and fed
the same batches. Variants, each with AdamW (lr 1e-3):

* ``torch eager``: the ``nn.Module`` with ``torch.optim.AdamW(fused=True)`` (2 ranks: in torch
  DDP): ``zero_grad``, ``loss.backward()``, ``opt.step()``;
* ``torch compiled``: the same with ``torch.compile(module)`` (the optimizer step stays eager:
  torch's fused AdamW does not compile on CPU, see below);
* ``fscale eager``: ``fscale.train_step(loss_fn, fscale.optim.adamw(lr), donate=True)`` (2
  ranks: under ``fscale.data_parallel``);
* ``fscale compiled``: ``torch.compile`` of that step;
* ``fscale compiled loss_fn``: the eager step of ``torch.compile(loss_fn)``: the forward, the
  loss and their backward compiled, fscale's step around them eager (as ``torch compiled``
  compiles the module and runs the loop around it eagerly);
* on several ranks with ``--plans shard_optimizer``: ``fscale ZeRO-2 eager``,
  ``fscale ZeRO-2 compiled`` and ``fscale ZeRO-2 compiled loss_fn``, the same steps under
  ``fscale.shard_optimizer`` instead of ``data_parallel`` (gradients reduce-scattered during
  backward, optimizer state sharded).

Compile time is reported apart from the step time: it is the time to build the variant and
run its first step, minus the variant's steady-state median. Steady-state steps run interleaved
round by round (`_util.interleave`); the table gives medians with the interquartile range and
the ratio of medians to ``torch eager``; ``equal`` says whether the final parameters equal the
eager variant of the same library bit for bit (``max |diff|`` otherwise). Two ranks run on local
gloo processes (`fscale.launch`), each timing every variant. Writes
``bench/results/compile.json``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import _util
import torch
import torch.distributed as dist

import fscale as fs
from fscale.models import GPT, ResNet, ResNetConfig, classification_loss, lm_loss

LEARNING_RATE = 1e-3


def _gpt(quick: bool) -> tuple[Callable[[], torch.nn.Module], Callable[[int], Any], Any]:
    cfg = _util.gpt_config(quick)

    def batch(index: int) -> Any:
        b = _util.lm_batch(cfg, 8, index)
        return b.inputs, b.targets

    return (lambda: GPT(cfg, seed=0)), batch, lm_loss


def _cnn(quick: bool) -> tuple[Callable[[], torch.nn.Module], Callable[[int], Any], Any]:
    cfg = ResNetConfig(widths=(8, 16) if quick else (16, 32, 64))
    size = 16 if quick else 32

    def batch(index: int) -> Any:
        generator = torch.Generator().manual_seed(index)
        images = torch.randn(32, 3, size, size, generator=generator)
        return images, torch.randint(0, cfg.num_classes, (32,), generator=generator)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return ResNet(cfg)

    return build, batch, classification_loss


MODELS = {"gpt": _gpt, "cnn": _cnn}


class TorchVariant:
    """The nn.Module (in DDP on several ranks) with torch.optim.AdamW(fused=True)."""

    def __init__(self, build, batch, loss, *, compiled: bool) -> None:
        module = build()
        if dist.is_initialized() and dist.get_world_size() > 1:
            module = torch.nn.parallel.DistributedDataParallel(module)
        self.module = module
        self.forward = torch.compile(module) if compiled else module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE, fused=True)
        self.batch, self.loss, self.calls = batch, loss, 0

    def __call__(self) -> None:
        inputs, targets = self.batch(self.calls)
        self.calls += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.forward(inputs), targets).backward()
        self.optimizer.step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.module.parameters()]


PLANS = {"data_parallel": fs.data_parallel, "shard_optimizer": fs.shard_optimizer}
LABELS = {"data_parallel": "fscale", "shard_optimizer": "fscale ZeRO-2"}
FSCALE_COMPILED = {None: "eager", "step": "compiled", "loss_fn": "compiled loss_fn"}
"""What each fscale variant compiles, and the label's suffix."""


def _eager_of(label: str) -> str:
    """The eager variant a compiled one is compared with (itself for an eager one)."""
    return label.replace(" compiled loss_fn", " eager").replace(" compiled", " eager")


class FscaleVariant:
    """fscale.train_step over the functionalized module (`plan` on several ranks)."""

    def __init__(
        self, build, batch, loss, *, compiled: str | None, plan: str = "data_parallel"
    ) -> None:
        apply, params, buffers = fs.functionalize(build())

        def loss_fn(params, buffers, batch, key):
            out, new_buffers = apply(params, buffers, batch[0], key=key)
            return loss(out, batch[1]), new_buffers

        compiled_loss = torch.compile(loss_fn) if compiled == "loss_fn" else loss_fn
        step = fs.train_step(compiled_loss, fs.optim.adamw(LEARNING_RATE), donate=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            step = PLANS[plan](step, fs.Mesh(dp=dist.get_world_size()))
        self.state = step.init(params, buffers)
        self.step = torch.compile(step) if compiled == "step" else step
        self.batch, self.calls = batch, 0

    def __call__(self) -> None:
        self.state, _ = self.step(self.state, self.batch(self.calls))
        self.calls += 1

    def params(self) -> list[torch.Tensor]:
        return fs.tree.leaves(self.state.params)


def _local_batch(batch: Callable[[int], Any]) -> Callable[[int], Any]:
    """Each rank's slice of the global batch."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return batch
    rank, world = dist.get_rank(), dist.get_world_size()
    return lambda index: tuple(t.chunk(world)[rank] for t in batch(index))


def run_model(name: str, quick: bool, steps: int, warmup: int, plans: list[str]) -> dict[str, Any]:
    """Time the variants on model `name` in this process (one rank of the group)."""
    build, batch, loss = MODELS[name](quick)
    batch = _local_batch(batch)
    barrier = dist.barrier if dist.is_initialized() else None
    variants: dict[str, Any] = {}
    first_call: dict[str, float] = {}
    several = dist.is_initialized() and dist.get_world_size() > 1
    variant_kinds: list[tuple[str, Any, dict[str, Any]]] = [
        ("torch eager", TorchVariant, {"compiled": False}),
        ("torch compiled", TorchVariant, {"compiled": True}),
    ]
    for plan in plans if several else ["data_parallel"]:
        for compiled, suffix in FSCALE_COMPILED.items():
            label = f"{LABELS[plan]} {suffix}"
            variant_kinds.append((label, FscaleVariant, {"compiled": compiled, "plan": plan}))
    for label, kind, options in variant_kinds:
        # Dynamo caches compiled code per code object: without a reset, a variant could run
        # code another one compiled (the loss function's frames) and report no compile time.
        # The variants compiled before recompile in the untimed warm-up rounds.
        torch._dynamo.reset()
        start = time.perf_counter()
        variant = kind(build, batch, loss, **options)  # `init` calls a compiled loss_fn once
        variant()  # compiles the compiled variants
        first_call[label] = time.perf_counter() - start
        variants[label] = variant
    load = _util.MachineLoad()
    with load:
        times = _util.interleave(variants, rounds=steps, warmup=warmup, before_each=barrier)
    stats = {label: _util.summarize(samples) for label, samples in times.items()}
    reference = stats["torch eager"].median
    rows = []
    for label, summary in stats.items():
        eager = variants[_eager_of(label)]
        diffs = [
            (a.double() - b.double()).abs().max().item()
            for a, b in zip(variants[label].params(), eager.params())
        ]
        rows.append(
            {
                "model": name,
                "variant": label,
                "step_ms": summary.scaled(1e3).as_dict(),
                "ratio_to_torch_eager": summary.median / reference,
                "compile_s": max(0.0, first_call[label] - summary.median)
                if "compiled" in label
                else None,
                "equal_to_eager": max(diffs, default=0.0) == 0.0,
                "max_abs_diff_to_eager": max(diffs, default=0.0),
            }
        )
    return {"rows": rows, "load": load.as_dict()}


def _rank_main(
    models: list[str], quick: bool, steps: int, warmup: int, plans: list[str]
) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore")
    return [run_model(name, quick, steps, warmup, plans) for name in models]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds after compiling")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--plans",
        nargs="+",
        default=["data_parallel"],
        choices=list(PLANS),
        help="fscale plans timed on several ranks",
    )
    args = parser.parse_args()
    results = []
    for world in args.ranks:
        if world == 1:
            per_model = _rank_main(args.models, args.quick, args.steps, args.warmup, args.plans)
        else:
            # Each rank compiles three variants per plan and torch's: minutes on a small machine.
            per_model = fs.launch(
                _rank_main,
                world,
                args.models,
                args.quick,
                args.steps,
                args.warmup,
                args.plans,
                timeout=1800.0 * len(args.plans),
            )[0]
        results.extend(
            {"ranks": world, **row, "load": outcome["load"]}
            for outcome in per_model
            for row in outcome["rows"]
        )
    header = ["ranks", "model", "variant", "median ms", "IQR ms", "x torch eager", "compile s"]
    table = [
        [
            r["ranks"],
            r["model"],
            r["variant"],
            r["step_ms"]["median"],
            r["step_ms"]["iqr"],
            r["ratio_to_torch_eager"],
            r["compile_s"],
        ]
        for r in results
    ]
    print(_util.format_table(header, table))
    for r in results:
        if "compiled" in r["variant"]:
            verdict = "bit for bit" if r["equal_to_eager"] else f"{r['max_abs_diff_to_eager']:.2e}"
            print(f"{r['ranks']} rank(s) {r['model']} {r['variant']}: params vs eager {verdict}")
    path = _util.write_results("compile", {"args": vars(args), "rows": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
