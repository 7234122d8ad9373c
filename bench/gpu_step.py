"""Benchmark on a GPU: one fscale training step against the eager PyTorch step, in one process.

Usage: ``python bench/gpu_step.py [--quick] [--rounds N] [--warmup N] [--device cuda|cpu]``
(``--device cpu``: a smoke run of the script itself, on `_util.gpt_config(quick=True)`; device
memory is then not measured)

Two `fscale.models.GPT` shapes, dropout 0, every variant built from seed 0 and fed the same
batches (on the device): ``small`` (`_util.gpt_config`, about 5.3M parameters, batch 8: the
per-step fixed cost dominates, as in `bench/step.py` on the CPU) and ``large`` (vocabulary 8192,
d_model 1024, 16 heads, 8 layers, 1024 positions, batch 8: about 110M parameters, the kernels
dominate). Variants (`bench/step.py`'s, on the device):

* ``eager``: the ``nn.Module`` with ``torch.optim.AdamW(fused=True)``: ``zero_grad(set_to_none=
  True)``, ``loss.backward()``, ``opt.step()`` (the reference of every ratio);
* ``fscale``: ``fscale.train_step(loss_fn, fscale.optim.adamw(lr), donate=True)`` over
  ``fscale.functionalize`` of the same model (bit for bit the eager step: checked);
* ``fscale exact=False``: the same with ``adamw(lr, exact=False)`` (one fused call per flat
  buffer; within rounding of torch, not bit for bit);
* ``eager bf16 autocast``: the eager step under ``torch.autocast("cuda", torch.bfloat16)``;
* ``fscale bf16``: ``fscale.mixed_precision`` of the ``fscale`` step (bf16 compute on fp32
  masters, explicit casts, no autocast).

Variants run interleaved round by round (`_util.interleave`, the clock synchronising the device
before each reading); warm-up rounds are dropped. Each row gives the median step time, the ratio
of medians to ``eager`` with the 95% interval of the round-by-round ratio, the transient device
memory of one step (``torch.cuda.max_memory_allocated`` above what was allocated before it:
eager keeps its gradients in ``.grad`` from one step to the next, so its figure leaves out the
4 bytes per parameter that fscale's, which frees them at the end of its step, includes) and,
for the fp32 variants, whether their losses and parameters after 3 steps equal eager's bit for
bit (a separate pass under ``torch.use_deterministic_algorithms(True)``, `bitwise_pass`).
Writes ``bench/results/gpu_step.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import _util

# cuBLAS needs a fixed workspace to be deterministic (the bitwise pass); set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from step import Batches, EagerVariant, FscaleVariant

from fscale.models import GPTConfig

BATCH_SIZE = 8
BATCHES = 8


def large_config() -> GPTConfig:
    return GPTConfig(vocab_size=8192, seq_len=1024, d_model=1024, n_heads=16, n_layers=8)


def transient_bytes(variant: Callable[[], None], device: torch.device) -> int | None:
    """Bytes by which one step's peak device allocation exceeds what was allocated before it
    (None on the CPU, where the smoke run does not measure it)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    variant()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def bitwise_pass(
    cfg: GPTConfig, batches: Batches, device: torch.device, steps: int = 3
) -> dict[str, bool]:
    """Whether fresh fscale fp32 steps give eager's losses and parameters bit for bit.

    Run apart from the timing, under ``torch.use_deterministic_algorithms(True)``: CUDA's
    default attention backward accumulates with atomics, so even two eager runs differ in the
    last bits without it, while the timed rounds use the defaults both sides would use.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        reference = EagerVariant(cfg, batches, device)
        candidates = {
            "fscale": FscaleVariant(cfg, batches, donate=True, device=device),
            "fscale exact=False": FscaleVariant(
                cfg, batches, donate=True, device=device, exact=False
            ),
        }
        for variant in [reference, *candidates.values()]:
            for _ in range(steps):
                variant()
        expected = reference.params()
        return {
            key: all(torch.equal(a, b) for a, b in zip(v.losses, reference.losses))
            and all(torch.equal(p, expected[k]) for k, p in v.params().items())
            for key, v in candidates.items()
        }
    finally:
        torch.use_deterministic_algorithms(previous)


def run_model(
    name: str, cfg: GPTConfig, device: torch.device, rounds: int, warmup: int
) -> list[dict[str, Any]]:
    batches = Batches(cfg, BATCH_SIZE, BATCHES, device)
    variants: dict[str, Any] = {
        "eager": EagerVariant(cfg, batches, device),
        "fscale": FscaleVariant(cfg, batches, donate=True, device=device),
        "fscale exact=False": FscaleVariant(cfg, batches, donate=True, device=device, exact=False),
        "eager bf16 autocast": EagerVariant(cfg, batches, device, bf16=True),
        "fscale bf16": FscaleVariant(cfg, batches, donate=True, device=device, bf16=True),
    }

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    times = _util.interleave(variants, rounds, warmup, clock=clock)
    equal = bitwise_pass(cfg, batches, device)
    memory = {key: transient_bytes(v, device) for key, v in variants.items()}
    rows = []
    for key in variants:
        ratio = _util.median_interval(_util.paired_ratios(times[key], times["eager"]))
        rows.append(
            {
                "model": name,
                "variant": key,
                "median_ms": 1e3 * _util.quantile(times[key], 0.5),
                "ratio_to_eager": _util.quantile(times[key], 0.5)
                / _util.quantile(times["eager"], 0.5),
                "ratio_interval": [ratio.low, ratio.high],
                "transient_mib": None if memory[key] is None else memory[key] / 2**20,
                "bitwise_equal_to_eager": equal.get(key),
                "times_s": times[key],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model only, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--results-dir", default=_util.RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_step.py: no CUDA device here; --device cpu for a smoke run")
    rounds = args.rounds or (5 if args.quick else 30)
    # On the CPU the run is a smoke test of the script: the quick GPT, as bf16 products there
    # can take tens of times fp32's (a CPU with AVX2 only has no bf16 kernels).
    models = {"small": _util.gpt_config(quick=device.type == "cpu")}
    if not args.quick:
        models["large"] = large_config()
    rows = []
    for name, cfg in models.items():
        rows.extend(run_model(name, cfg, device, rounds, args.warmup))
        print(f"{name}: done", flush=True)
    table = _util.format_table(
        ["model", "variant", "median ms", "x eager", "95% interval", "transient MiB", "bitwise"],
        [
            [
                r["model"],
                r["variant"],
                r["median_ms"],
                r["ratio_to_eager"],
                "{:.3f}-{:.3f}".format(*r["ratio_interval"]),
                r["transient_mib"],
                r["bitwise_equal_to_eager"],
            ]
            for r in rows
        ],
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, {rounds} rounds")
    print(table)
    payload = {"device": name, "rounds": rounds, "rows": rows}
    result_name = "gpu_step" if device.type == "cuda" else "gpu_step_cpu_smoke"
    path = _util.write_results(result_name, payload, directory=args.results_dir)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
