"""AdaScale at S times the batch: the steps to a target loss, against naive linear lr scaling.

Workload: least-squares regression, 32 features of log-spaced variance (0.05 to 1), label noise
0.5, 8192 training samples; the model is one linear layer trained by SGD. The base run uses
batch b = 8 and learning rate 0.05 and needs T steps to bring the full training loss to the
target. At S times the batch (one process: ``fs.accumulate(step, S)`` gives S micro-batches of
b, so AdaScale sees S samples per step, as S replicas would give it):

- AdaScale (``fs.adascale``) scales the learning rate by the gain r_t each step. Its claim: the
  target is reached when the scale-invariant progress Σr reaches T, i.e. in about T / mean(r)
  steps (the table shows Σr at the step the target is reached, against T).
- Linear scaling runs learning rate 0.05 · S. Below the critical batch it reaches the target in
  about T / S steps; beyond it (here 0.05 · S past the stability limit of the curvature) it
  diverges, or needs more than T / S steps.

Output: a table, ``bench/results/adascale.json`` and ``bench/results/adascale.png`` (steps to
target against S, and the loss curves at the largest S). ``--quick`` runs fewer scales.
"""

from __future__ import annotations

import argparse
import math
import time

import _util  # bench/ is sys.path[0] when a script in it runs
import torch

import fscale as fs

FEATURES, SAMPLES, NOISE = 32, 8192, 0.5
BASE_BATCH, BASE_LR = 8, 0.05
TARGET = 0.30  # the loss floor is NOISE² = 0.25
MAX_BASE_STEPS = 4000


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(math.log10(0.05), 0.0, FEATURES)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator) * scales.sqrt()
    true_w = torch.randn(FEATURES, generator=generator)
    targets = inputs @ true_w + NOISE * torch.randn(SAMPLES, generator=generator)
    return inputs, targets


def loss_fn(params, buffers, batch, key):
    inputs, targets = batch
    return ((inputs @ params["w"] + params["b"] - targets) ** 2).mean()


def run(method: str, scale: int, data, max_steps: int) -> dict:
    """Train until the full loss reaches TARGET; the loss curve, gains and steps taken."""
    inputs, targets = data
    lr = BASE_LR * (scale if method == "linear" else 1)
    step = fs.train_step(loss_fn, fs.optim.sgd(lr))
    if scale > 1:
        step = fs.accumulate(step, scale)
    if method == "adascale":
        step = fs.adascale(step, fs.Mesh(dp=1))
    state = step.init({"w": torch.zeros(FEATURES), "b": torch.zeros(())})
    order = torch.Generator().manual_seed(scale)
    batch = BASE_BATCH * scale
    curve, gains, progress = [], [], []
    reached = None
    for t in range(1, max_steps + 1):
        rows = torch.randint(0, SAMPLES, (batch,), generator=order)
        state, metrics = step(state, (inputs[rows], targets[rows]))
        with torch.no_grad():
            full = float(loss_fn(state.params, None, data, None))
        curve.append(full)
        if method == "adascale":
            gains.append(float(metrics["gain"]))
            progress.append(float(metrics["progress"]))
        if not math.isfinite(full) or full > 1e6:
            break
        if full <= TARGET:
            reached = t
            break
    return {"steps": reached, "curve": curve, "gains": gains, "progress": progress}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="scales 4 and 16 only")
    args = parser.parse_args()
    scales = [4, 16] if args.quick else [2, 4, 8, 16, 32, 64]
    data = dataset()
    started = time.perf_counter()
    base = run("base", 1, data, MAX_BASE_STEPS)
    if base["steps"] is None:
        raise SystemExit(f"the base run did not reach {TARGET} in {MAX_BASE_STEPS} steps")
    base_steps = base["steps"]
    rows, runs = [], {}
    for scale in scales:
        budget = 3 * math.ceil(base_steps / min(scale, 4)) + 50
        ada = run("adascale", scale, data, budget)
        lin = run("linear", scale, data, budget)
        runs[scale] = {"adascale": ada, "linear": lin}
        gains = ada["gains"]
        last = lin["curve"][-1]
        rows.append(
            {
                "scale": scale,
                "batch": BASE_BATCH * scale,
                "adascale_steps": ada["steps"],
                "adascale_mean_gain": sum(gains) / len(gains),
                # AdaScale's claim: the progress Σr at the target is the base run's T.
                "adascale_progress_at_target": ada["progress"][-1] if ada["steps"] else None,
                "base_steps_over_mean_gain": base_steps / (sum(gains) / len(gains)),
                "linear_steps": lin["steps"],
                "linear_diverged": not math.isfinite(last) or last > 1e6,
                "ideal_steps": base_steps / scale,
            }
        )
    elapsed = time.perf_counter() - started
    table = _util.format_table(
        ["S", "batch", "AdaScale steps", "T / mean r", "Σr at target", "mean r", "linear", "T/S"],
        [
            [
                r["scale"],
                r["batch"],
                r["adascale_steps"] or "—",
                r["base_steps_over_mean_gain"],
                r["adascale_progress_at_target"] or "—",
                r["adascale_mean_gain"],
                "diverged" if r["linear_diverged"] else (r["linear_steps"] or "not reached"),
                r["ideal_steps"],
            ]
            for r in rows
        ],
    )
    print(f"base: batch {BASE_BATCH}, lr {BASE_LR}: T = {base_steps} steps to loss {TARGET}")
    print(table)
    print(f"({elapsed:.0f} s)")
    _util.write_results(
        "adascale",
        {
            "workload": {
                "features": FEATURES,
                "samples": SAMPLES,
                "noise": NOISE,
                "base_batch": BASE_BATCH,
                "base_lr": BASE_LR,
                "target": TARGET,
            },
            "base_steps": base_steps,
            "rows": rows,
            "seconds": elapsed,
        },
    )
    plot(base, runs, base_steps, rows)


def plot(base: dict, runs: dict, base_steps: int, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    scales = [r["scale"] for r in rows]
    left.plot(scales, [base_steps / s for s in scales], "k:", label="T / S (perfect scaling)")
    left.plot(scales, [r["base_steps_over_mean_gain"] for r in rows], "C0--", label="T / mean r")
    left.plot(scales, [r["adascale_steps"] for r in rows], "C0o-", label="AdaScale (measured)")
    reached = [(r["scale"], r["linear_steps"]) for r in rows if r["linear_steps"]]
    if reached:
        left.plot(*zip(*reached), "C3s-", label="linear lr scaling (measured)")
    for r in rows:
        if r["linear_steps"] is None:
            left.plot([r["scale"]], [base_steps / r["scale"]], "C3x", markersize=10)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("S (batch = S × 8)")
    left.set_ylabel(f"steps to loss {TARGET}")
    left.set_title(f"steps to target (base: T = {base_steps}); x: linear scaling failed")
    left.legend(fontsize=8)
    largest = max(runs)

    def steps(curve: list[float]) -> range:
        return range(1, len(curve) + 1)

    right.plot(steps(base["curve"]), base["curve"], "k", label="base, batch 8")
    ada_curve = runs[largest]["adascale"]["curve"]
    right.plot(steps(ada_curve), ada_curve, "C0", label=f"AdaScale, S = {largest}")
    linear_curve = [min(v, 1e3) for v in runs[largest]["linear"]["curve"]]
    right.plot(
        steps(linear_curve), linear_curve, "C3", label=f"linear lr × {largest} (shown up to 1e3)"
    )
    right.axhline(TARGET, color="grey", linewidth=0.8)
    right.set_yscale("log")
    right.set_xscale("log")
    right.set_xlabel("step")
    right.set_ylabel("full training loss")
    right.set_title(f"loss curves at S = {largest}")
    right.legend(fontsize=8)
    figure.tight_layout()
    path = _util.RESULTS_DIR / "adascale.png"
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
