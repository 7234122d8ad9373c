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
5. `data_parallel` under `fscale.launch` with NCCL on one GPU (skipped with `--device cpu`).
6. The test-suite cases that skip without CUDA (`pytest -k cuda tests/test_offload.py
   tests/test_random.py`).

On the GPU machine (torch 2.11, no optree there): carry an optree wheel and install it with
`pip install --no-deps`, then `pip install --no-deps -e .` and run this script.

`--device cpu` runs the same code on the CPU (a smoke test of the script itself; the memory
figures are then not measured).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

import fscale as fs
from fscale import models

FAILURES: list[str] = []


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


def check_remat(device: torch.device) -> None:
    cfg = models.GPTConfig(
        vocab_size=512, seq_len=512, d_model=256, n_heads=4, n_layers=4, dropout=0.1
    )
    tokens = torch.randint(0, 512, (8, 513), generator=torch.Generator().manual_seed(0)).to(device)
    grads = {}
    for variant in ("none", "checkpoint", "checkpoint+offload"):
        model = models.GPT(cfg, seed=0).to(device)
        if variant != "none":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = fs.checkpoint(block, offload=variant.endswith("offload"))
        apply, params, buffers = fs.functionalize(model)

        def loss_fn(p, b, batch, key, apply=apply):
            logits, _ = apply(p, b, batch[:, :-1], key=key)
            return models.lm_loss(logits, batch[:, 1:])

        def forward_backward(loss_fn=loss_fn, params=params, buffers=buffers):
            return fs.value_and_grad(loss_fn, params, buffers, tokens, fs.random.key(1))

        (_, g), peak = _peak(device, forward_backward)
        grads[variant] = (g, peak)
        print(f"      {variant:<20} peak memory of forward+backward: {peak:8.1f} MiB")
    reference = grads["none"][0]
    for variant in ("checkpoint", "checkpoint+offload"):
        same = all(torch.equal(grads[variant][0][k], reference[k]) for k in reference)
        check(f"remat gradients equal ({variant})", same)
    if device.type == "cuda":
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
    cfg = models.GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=2)
    model = models.GPT(cfg, seed=0).to(device=device, dtype=torch.bfloat16)
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, batch, key):
        logits, _ = apply(p, b, batch[:, :-1], key=key)
        return models.lm_loss(logits.float(), batch[:, 1:])

    step = fs.train_step(loss_fn, fs.optim.adamw(3e-3))
    state = step.init(params, buffers)
    tokens = fs.data.ByteTokenizer().encode(fs.data.bundled_corpus())
    batches = fs.data.LMBatches(fs.data.batchify(tokens, 16), 64, batch_major=True)
    losses = []
    for i in range(30):
        state, metrics = step(state, batches[i % len(batches)].inputs.to(device))
        losses.append(float(metrics["loss"]))
    ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    check("bf16 train_step on the device", ok, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _mixed_precision_model(device: torch.device):
    cfg = models.GPTConfig(vocab_size=512, seq_len=256, d_model=256, n_heads=4, n_layers=4)
    apply, params, buffers = fs.functionalize(models.GPT(cfg, seed=0).to(device))

    def loss_fn(p, b, batch, key):
        logits, _ = apply(p, b, batch[:, :-1], key=key)
        return models.lm_loss(logits, batch[:, 1:])

    tokens = torch.randint(0, 512, (8, 257), generator=torch.Generator().manual_seed(0))
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
        sharded = fs.launch(_mixed_precision_fsdp_rank, 1, backend="nccl")[0]
        same = all(torch.equal(sharded[k], state.params[k].cpu()) for k in sharded)
        check("mixed_precision under fully_shard (NCCL) equals the local step", same)


def _mixed_precision_fsdp_rank() -> dict[str, torch.Tensor]:
    device = torch.device("cuda", torch.cuda.current_device())
    loss_fn, params, buffers, tokens = _mixed_precision_model(device)
    step = fs.mixed_precision(
        fs.fully_shard(fs.train_step(loss_fn, fs.optim.adamw(1e-3)), fs.Mesh(dp=1))
    )
    state, _ = step(step.init(params, buffers), tokens)
    return {k: v.cpu() for k, v in fs.consolidate(step, state).params.items()}


def _dp_rank() -> float:
    cfg = models.GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=2, n_layers=2)
    device = torch.device("cuda", torch.cuda.current_device())
    apply, params, buffers = fs.functionalize(models.GPT(cfg, seed=0).to(device))

    def loss_fn(p, b, batch, key):
        logits, _ = apply(p, b, batch[:, :-1], key=key)
        return models.lm_loss(logits, batch[:, 1:])

    step = fs.data_parallel(fs.train_step(loss_fn, fs.optim.adamw(1e-3)), fs.Mesh(dp=1))
    state = step.init(params, buffers)
    batch = torch.randint(0, 256, (4, 33), device=device)
    for _ in range(3):
        state, metrics = step(state, batch)
    return float(metrics["loss"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test")
    parser.add_argument("--skip-tests", action="store_true", help="do not run pytest -k cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke test of this script")
        return 2
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    check_remat(device)
    check_offload_optimizer(device)
    check_bf16_step(device)
    check_mixed_precision(device)
    if device.type == "cuda":
        losses = fs.launch(_dp_rank, 1, backend="nccl")
        check("data_parallel under NCCL", all(x == x for x in losses), f"loss {losses[0]:.3f}")
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
