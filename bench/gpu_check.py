"""One prepared run of the CUDA paths, for a machine with a GPU: `python bench/gpu_check.py`.

What it exercises (each prints one line; the script exits non-zero if a check fails):

1. `fscale.checkpoint` on a GPT-style model on the device: gradients equal without and with
   checkpointing, with and without `offload=True` (pinned host memory, side-stream copies), and
   the peak device memory of each (`torch.cuda.max_memory_allocated`): checkpointing must lower
   it, offload must lower it again.
2. `fscale.offload_optimizer` with device parameters: equal to the same optimizer run on host
   copies of the parameters, state on the host.
3. A bf16 `train_step` on the device: finite, decreasing loss.
4. `fscale.mixed_precision` on the device (explicit casts, no autocast): a bf16 step on fp32
   master weights equals a reference written in the check (bf16 casts of the params before the
   forward, fp32 gradients, the same optimizer on the masters) bit for bit; the state stays
   fp32 (4 + 8 bytes per parameter with AdamW); the peak device memory of the bf16 step is
   below the fp32 step's; and the same policy under `fully_shard` with NCCL on one GPU gives
   the local step's parameters (skipped with `--device cpu`).
5. `torch.compile` (inductor) of the local step, donate False and True: with SGD the
   parameters after 3 steps equal the eager step's within 1e-5 (the update is linear in the
   gradient, so only the kernels' rounding differs); with AdamW the losses agree within 1e-4
   relative (its division by sqrt(v) + eps lifts a rounding difference in a near-zero gradient
   to the size of the learning rate). ``--skip-compile`` leaves it out.
6. `data_parallel` under `fscale.launch` with NCCL on one GPU, and `data_parallel`,
   `shard_optimizer` and `fully_shard` compiled against eager there (skipped with
   `--device cpu`).
7. `data_parallel`'s ``overlap`` on 2 gloo ranks sharing the device: the default starts the
   all-reduces during backward on CUDA (its gradient hooks run) and after it on the CPU (none
   run), and ``overlap=None``, ``True`` and ``False`` train to the same parameters bit for bit.
8. `fscale.pipeline` on 2 gloo ranks sharing the device, 1F1B and zero-bubble (its split
   backward): the stages on the device, each message copied through host memory; the
   parameters after 3 SGD steps equal one-process training within 1e-5.
9. The test-suite cases that skip without CUDA (`pytest -k cuda tests/test_offload.py
   tests/test_random.py`).

Equality checks run under ``torch.use_deterministic_algorithms(True)``, in this process and in
each rank `fscale.launch` starts (a new process does not inherit it): with CUDA's default
kernels, one forward+backward of the remat model run twice already differs in its last bits
(the check prints whether it does). A check that raises fails with its traceback and the others
still run.

On a GPU machine without network or optree (an image with torch 2.11 had everything else):
carry an optree wheel (CPython 3.12, manylinux x86-64), install it with ``pip install
--no-index --no-deps --target /tmp/site WHEEL``, and run with
``PYTHONPATH=/tmp/site:$PWD python bench/gpu_check.py`` from the checkout (an editable install
needs setuptools >= 77 for the build, which an offline image may not have). The whole check
took under two minutes on an H200; ``python bench/gpu_step.py`` about one more.

`--device cpu` runs the same code on the CPU (a smoke test of the script itself; the memory
figures are then not measured). `--quick` shrinks the models of checks 1, 3 and 4 (sequences
of 32 or 64 positions, batches of 4): the smoke test's size, for a CPU without bf16 kernels of
its own (AVX2 only), where a bf16 product takes tens of times an fp32 one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from typing import Any

# cuBLAS needs a fixed workspace to be deterministic; set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

import fscale as fs
from fscale import models
from fscale.parallel.buckets import GradBuckets

FAILURES: list[str] = []
# `--quick`: the checks' models shrunk to a smoke test's size (set by `main`, and in a launched
# rank by its entry point, which imported this module afresh).
QUICK = False


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)


def _peak(device: torch.device, fn) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    result = fn()
    if device.type != "cuda":
        return result, float("nan")
    torch.cuda.synchronize(device)
    return result, (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _next_token_loss(model: torch.nn.Module, *, float_logits: bool = False):
    """``(loss_fn, params, buffers)`` of `model` on token batches (each row predicts its next
    token); `float_logits` upcasts the logits for the loss."""
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, batch, key):
        logits, _ = apply(p, b, batch[:, :-1], key=key)
        return models.lm_loss(logits.float() if float_logits else logits, batch[:, 1:])

    return loss_fn, params, buffers


def check_remat(device: torch.device) -> None:
    seq_len, rows = (64, 4) if QUICK else (512, 8)
    cfg = models.GPTConfig(
        vocab_size=512, seq_len=seq_len, d_model=256, n_heads=4, n_layers=4, dropout=0.1
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (rows, seq_len + 1), generator=generator).to(device)
    grads, runs = {}, {}
    for variant in ("none", "checkpoint", "checkpoint+offload"):
        model = models.GPT(cfg, seed=0).to(device)
        if variant != "none":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = fs.checkpoint(block, offload=variant.endswith("offload"))
        loss_fn, params, buffers = _next_token_loss(model)

        def forward_backward(loss_fn=loss_fn, params=params, buffers=buffers):
            return fs.value_and_grad(loss_fn, params, buffers, tokens, fs.random.key(1))

        (_, g), peak = _peak(device, forward_backward)
        grads[variant], runs[variant] = (g, peak), forward_backward
        print(f"      {variant:<20} peak memory of forward+backward: {peak:8.1f} MiB")
    reference = grads["none"][0]
    for variant in ("checkpoint", "checkpoint+offload"):
        same = all(torch.equal(grads[variant][0][k], reference[k]) for k in reference)
        worst = max((grads[variant][0][k] - reference[k]).abs().max().item() for k in reference)
        check(f"remat gradients equal ({variant})", same, "" if same else f"max |diff| {worst:.3g}")
    if device.type == "cuda":
        # Why the checks run deterministic: the same forward+backward twice with the defaults.
        torch.use_deterministic_algorithms(False)
        try:
            first, second = runs["none"]()[1], runs["none"]()[1]
        finally:
            torch.use_deterministic_algorithms(True)
        repeatable = all(torch.equal(first[k], second[k]) for k in first)
        print(
            "      torch's default kernels, one forward+backward run twice: "
            + ("the same bits" if repeatable else "different bits")
        )
        check(
            "checkpoint lowers peak memory, offload lowers it again",
            grads["none"][1] > grads["checkpoint"][1] > grads["checkpoint+offload"][1],
            ", ".join(f"{k} {v[1]:.1f} MiB" for k, v in grads.items()),
        )


def check_offload_optimizer(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    host = {"w": torch.randn(1000, 37, generator=g), "b": torch.randn(37, generator=g)}
    on_device = {k: v.to(device) for k, v in host.items()}
    plain, offloaded = fs.optim.adamw(1e-2), fs.offload_optimizer(fs.optim.adamw(1e-2), "cpu")
    plain_state, off_state = plain.init(host), offloaded.init(on_device)
    for _ in range(5):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in host.items()}
        host, plain_state = fs.optim.step(plain, grads, plain_state, host)
        on_device, off_state = fs.optim.step(
            offloaded, {k: v.to(device) for k, v in grads.items()}, off_state, on_device
        )
    same = all(torch.equal(on_device[k].cpu(), host[k]) for k in host)
    on_host = all(t.device.type == "cpu" for t in fs.tree.leaves(off_state))
    check("offload_optimizer equals the host run; state on the host", same and on_host)


def check_bf16_step(device: torch.device) -> None:
    seq_len, rows = (32, 4) if QUICK else (64, 16)
    cfg = models.GPTConfig(vocab_size=256, seq_len=seq_len, d_model=128, n_heads=4, n_layers=2)
    model = models.GPT(cfg, seed=0).to(device=device, dtype=torch.bfloat16)
    loss_fn, params, buffers = _next_token_loss(model, float_logits=True)
    step = fs.train_step(loss_fn, fs.optim.adamw(3e-3))
    state = step.init(params, buffers)
    tokens = fs.data.ByteTokenizer().encode(fs.data.bundled_corpus())
    batches = fs.data.LMBatches(fs.data.batchify(tokens, rows), seq_len, batch_major=True)
    losses = []
    for i in range(8 if QUICK else 30):  # bf16 matmuls are slow on a CPU smoke run
        state, metrics = step(state, batches[i % len(batches)].inputs.to(device))
        losses.append(float(metrics["loss"]))
    ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    check("bf16 train_step on the device", ok, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _mixed_precision_model(device: torch.device):
    seq_len, rows, width = (64, 4, 64) if QUICK else (256, 8, 256)
    cfg = models.GPTConfig(vocab_size=512, seq_len=seq_len, d_model=width, n_heads=4, n_layers=4)
    loss_fn, params, buffers = _next_token_loss(models.GPT(cfg, seed=0).to(device))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (rows, seq_len + 1), generator=generator)
    return loss_fn, params, buffers, tokens.to(device)


def check_mixed_precision(device: torch.device) -> None:
    loss_fn, params, buffers, tokens = _mixed_precision_model(device)
    step = fs.mixed_precision(fs.train_step(loss_fn, fs.optim.adamw(1e-3)))
    state = step.init(params, buffers)
    (state, metrics), bf16_peak = _peak(device, lambda: step(state, tokens))
    fp32_step = fs.train_step(loss_fn, fs.optim.adamw(1e-3))
    fp32_state = fp32_step.init(params, buffers)
    _, fp32_peak = _peak(device, lambda: fp32_step(fp32_state, tokens))

    # The reference: bf16 casts of the fp32 masters, fp32 gradients, AdamW on the masters.
    optimizer = fs.optim.adamw(1e-3)
    masters = {k: v.detach().clone() for k, v in params.items()}
    live = {k: v.requires_grad_(True) for k, v in masters.items()}
    low = {k: v.to(torch.bfloat16) for k, v in live.items()}
    loss = loss_fn(low, buffers, tokens, fs.random.key(0))
    grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
    expected, _ = fs.optim.step(
        optimizer, grads, optimizer.init(masters), {k: v.detach() for k, v in live.items()}
    )
    same = all(torch.equal(state.params[k], expected[k]) for k in expected)
    check("mixed_precision bf16 step equals the explicit-cast reference", same)
    psi = sum(p.numel() for p in params.values())
    state_bytes = fs.memory.tree_bytes(state.params) + fs.memory.tree_bytes(
        (state.opt_state.exp_avg, state.opt_state.exp_avg_sq)
    )
    check(
        "mixed_precision keeps fp32 masters and fp32 AdamW state (12 bytes per parameter)",
        state_bytes == 12 * psi and metrics["loss"].dtype == torch.bfloat16,
        f"{state_bytes} bytes for {psi} parameters",
    )
    if device.type == "cuda":
        check(
            "the bf16 step peaks below the fp32 step",
            bf16_peak < fp32_peak,
            f"bf16 {bf16_peak:.1f} MiB, fp32 {fp32_peak:.1f} MiB",
        )
        sharded = fs.launch(_mixed_precision_fsdp_rank, 1, QUICK, backend="nccl")[0]
        same = all(torch.equal(sharded[k], state.params[k].cpu()) for k in sharded)
        worst = max((sharded[k] - state.params[k].cpu()).abs().max().item() for k in sharded)
        check(
            "mixed_precision under fully_shard (NCCL) equals the local step",
            same,
            "" if same else f"max |diff| {worst:.3g}",
        )


def _mixed_precision_fsdp_rank(quick: bool) -> dict[str, torch.Tensor]:
    global QUICK
    QUICK = quick  # the launched process imported this module afresh: the same model sizes
    torch.use_deterministic_algorithms(True)  # as the local step it is compared with
    device = torch.device("cuda", torch.cuda.current_device())
    loss_fn, params, buffers, tokens = _mixed_precision_model(device)
    step = fs.mixed_precision(
        fs.fully_shard(fs.train_step(loss_fn, fs.optim.adamw(1e-3)), fs.Mesh(dp=1))
    )
    state, _ = step(step.init(params, buffers), tokens)
    return {k: v.cpu() for k, v in fs.consolidate(step, state).params.items()}


def _dp_rank() -> float:
    device = torch.device("cuda", torch.cuda.current_device())
    step, state, tokens = _small_lm_step(device, False, fs.optim.adamw(1e-3))
    step = fs.data_parallel(step, fs.Mesh(dp=1))
    state = step.init(state.params, state.buffers)
    for _ in range(3):
        state, metrics = step(state, tokens)
    return float(metrics["loss"])


def _small_lm_step(device: torch.device, donate: bool, optimizer):
    cfg = models.GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=2)
    loss_fn, params, buffers = _next_token_loss(models.GPT(cfg, seed=0).to(device))
    step = fs.train_step(loss_fn, optimizer, donate=donate)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    return step, step.init(params, buffers), tokens.to(device)


def _compiled_difference(device, donate, optimizer, wrap=None) -> tuple[float, float]:
    """Eager against torch.compile (inductor) over 3 steps: the largest |difference| of the
    parameters at the end, and the largest relative difference of the losses."""
    torch._dynamo.reset()
    finals, losses = [], []
    for compile_it in (False, True):
        step, state, tokens = _small_lm_step(device, donate, optimizer)
        if wrap is not None:
            step = wrap(step)
            state = step.init(state.params, state.buffers)
        run = torch.compile(step) if compile_it else step
        run_losses = []
        for _ in range(3):
            state, metrics = run(state, tokens)
            run_losses.append(float(metrics["loss"]))
        finals.append(fs.consolidate(step, state).params if wrap is not None else state.params)
        losses.append(run_losses)
    param_difference = max((finals[0][k] - finals[1][k]).abs().max().item() for k in finals[0])
    loss_difference = max(abs(a - b) / abs(a) for a, b in zip(*losses))
    return param_difference, loss_difference


def check_compile(device: torch.device) -> None:
    # Inductor's kernels round differently from eager's (other fusions). With SGD the update is
    # linear in the gradient, so the parameters differ by that rounding alone; AdamW divides by
    # sqrt(v) + eps and lifts a rounding difference in a near-zero gradient to the size of lr,
    # so it is read by the losses.
    for donate in (False, True):
        params, losses = _compiled_difference(device, donate, fs.optim.sgd(0.1))
        check(
            f"torch.compile(train_step(sgd, donate={donate})) equals the eager step",
            params <= 1e-5 and losses <= 1e-5,
            f"params max |diff| {params:.3g}, losses max rel diff {losses:.3g}",
        )
    params, losses = _compiled_difference(device, True, fs.optim.adamw(1e-3))
    check(
        "torch.compile(train_step(adamw, donate=True)) follows the eager step",
        losses <= 1e-4,
        f"losses max rel diff {losses:.3g}, params max |diff| {params:.3g}",
    )


_COMPILED_PLANS = {
    "data_parallel": fs.data_parallel,
    "shard_optimizer": fs.shard_optimizer,
    "fully_shard": fs.fully_shard,
}


def _compiled_plans_rank() -> dict[str, tuple[float, float] | str]:
    """Per plan over one NCCL rank: eager against compiled, or the error compiling raised."""
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", torch.cuda.current_device())
    return {name: _compiled_or_error(device, plan) for name, plan in _COMPILED_PLANS.items()}


def _compiled_or_error(device: torch.device, plan) -> tuple[float, float] | str:
    try:
        return _compiled_difference(
            device, True, fs.optim.sgd(0.1), lambda step: plan(step, fs.Mesh(dp=1))
        )
    except Exception as error:
        traceback.print_exc()
        return f"{type(error).__name__}: {error}"


def _overlap_rank(device_type: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Per `overlap` (None, True, False): how many gradient hooks ran, and the params after 3
    data_parallel steps on this rank's share of the device."""
    torch.use_deterministic_algorithms(True)
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    delivered = []
    deliver = GradBuckets._deliver

    def counted(self, *args):
        delivered.append(1)
        return deliver(self, *args)

    GradBuckets._deliver = counted
    results = []
    try:
        for overlap in (None, True, False):
            before = len(delivered)
            step, state, tokens = _small_lm_step(device, True, fs.optim.adamw(1e-3))
            mesh = fs.Mesh(dp=torch.distributed.get_world_size())
            step = fs.data_parallel(step, mesh, bucket_mb=0.25, overlap=overlap)
            state = step.init(state.params, state.buffers)
            rank = torch.distributed.get_rank()
            local = tokens[rank * 2 : rank * 2 + 2]
            for _ in range(3):
                state, _ = step(state, local)
            results.append((len(delivered) - before, {k: v.cpu() for k, v in state.params.items()}))
    finally:
        GradBuckets._deliver = deliver
    return results


def _two_rank_checks(device_type: str) -> tuple[list[Any], dict[str, float]]:
    """Both two-rank checks in one launch: starting the ranks costs more than either check."""
    return _overlap_rank(device_type), _pipeline_rank(device_type)


def check_two_ranks(device: torch.device) -> None:
    overlap, pipeline = fs.launch(_two_rank_checks, 2, device.type, backend="gloo")[0]
    report_data_parallel_overlap(device, overlap)
    report_pipeline(device, pipeline)


def report_data_parallel_overlap(device: torch.device, results: list[Any]) -> None:
    (default, on, off) = results
    hooks_by_default = default[0] > 0
    check(
        f"data_parallel's default overlap on {device.type}",
        hooks_by_default == (device.type != "cpu") and on[0] > 0 and off[0] == 0,
        f"hooks run: default {default[0]}, overlap=True {on[0]}, overlap=False {off[0]}",
    )
    same = all(
        torch.equal(default[1][k], on[1][k]) and torch.equal(on[1][k], off[1][k]) for k in on[1]
    )
    check("data_parallel with overlap None / True / False: params equal bit for bit", same)


def _pipeline_rank(device_type: str) -> dict[str, float]:
    """Per schedule, max |diff| between the parameters after 3 steps of a two-stage pipeline of
    a small MLP on this rank's device (the ranks share it; the messages go through host
    memory) and the same model trained in one process on the whole batch."""
    torch.use_deterministic_algorithms(True)
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    batch = (inputs.to(device), targets.to(device))

    def model() -> torch.nn.Sequential:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)]
        return torch.nn.Sequential(*layers, torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)

    apply, params, buffers = fs.functionalize(model())
    mse = torch.nn.functional.mse_loss

    def loss_fn(p, b, pair, key):
        out, _ = apply(p, b, pair[0], key=key)
        return mse(out, pair[1])

    reference = fs.train_step(loss_fn, fs.optim.sgd(0.1))
    state = reference.init(params, buffers)
    for _ in range(3):
        state, _ = reference(state, batch)
    expected = state.params
    differences = {}
    for schedule in ("1f1b", "zero_bubble"):
        mesh = fs.Mesh(pp=torch.distributed.get_world_size())
        step = fs.pipeline(
            model(),
            mse,
            fs.optim.sgd(0.1),
            mesh,
            micro_batches=4,
            balance=[3, 2],
            schedule=schedule,
        )
        _, params, buffers = fs.functionalize(model())
        state = step.init(params, buffers)
        for _ in range(3):
            state, _ = step(state, batch)
        found = fs.consolidate(step, state).params
        differences[schedule] = max((found[k] - expected[k]).abs().max().item() for k in expected)
    return differences


def report_pipeline(device: torch.device, differences: dict[str, float]) -> None:
    for schedule, difference in differences.items():
        check(
            f"pipeline ({schedule}, 2 ranks, messages through host memory) on {device.type} "
            "equals one-process training",
            difference <= 1e-5,
            f"params max |diff| {difference:.3g}",
        )


def _check_nccl(device: torch.device) -> None:
    losses = fs.launch(_dp_rank, 1, backend="nccl")
    check("data_parallel under NCCL", all(x == x for x in losses), f"loss {losses[0]:.3f}")
    for name, result in fs.launch(_compiled_plans_rank, 1, backend="nccl")[0].items():
        label = f"torch.compile({name}(sgd) step) under NCCL equals the eager step"
        if isinstance(result, str):
            check(label, False, f"raised {result}")
            continue
        params, losses = result
        check(
            label,
            params <= 1e-5 and losses <= 1e-5,
            f"params max |diff| {params:.3g}, losses max rel diff {losses:.3g}",
        )


def _guarded(run_check, device: torch.device) -> None:
    """Run one check; an exception fails it (with its traceback) and the others still run."""
    try:
        run_check(device)
    except Exception as error:
        traceback.print_exc()
        check(run_check.__name__, False, f"raised {type(error).__name__}: {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test")
    parser.add_argument("--skip-tests", action="store_true", help="do not run pytest -k cuda")
    parser.add_argument("--skip-compile", action="store_true", help="no torch.compile checks")
    parser.add_argument("--quick", action="store_true", help="smaller models (a smoke test)")
    args = parser.parse_args()
    global QUICK
    QUICK = args.quick
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke test of this script")
        return 2
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    # The equality checks compare bits: CUDA's default kernels for some backwards (attention
    # over several key blocks, for one) accumulate with atomics, so two runs of one computation
    # differ in their last bits unless torch picks its deterministic kernels.
    torch.use_deterministic_algorithms(True)
    for run_check in (
        check_remat,
        check_offload_optimizer,
        check_bf16_step,
        check_mixed_precision,
        check_two_ranks,
    ):
        _guarded(run_check, device)
    if not args.skip_compile:
        _guarded(check_compile, device)
    if device.type == "cuda":
        _guarded(_check_nccl, device)
        if not args.skip_tests:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-k",
                    "cuda",
                    "tests/test_offload.py",
                    "tests/test_random.py",
                ],
                check=False,
            )
            check("pytest -k cuda", done.returncode == 0)
    print("all checks passed" if not FAILURES else f"FAILED: {FAILURES}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
