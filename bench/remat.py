"""Benchmark: activation checkpointing of a GPT-style LM, fscale against torch's own tools.

Variants, each a full training forward+backward (``functionalize`` + ``torch.autograd.grad``):

* ``none``: no checkpointing;
* ``fscale``: ``fscale.checkpoint`` per block;
* ``fscale+offload``: the same with ``offload=True``;
* ``fscale+matmuls``: the same with ``policy=save_matmuls()``;
* ``torch.checkpoint``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
  per block;
* ``torch.save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` around the forward.

Variants are interleaved round by round (so a slow spell on a shared machine hits all of them)
and the median step time is reported with its ratio to ``torch.checkpoint``.

Saved-activation bytes are the storages kept for backward, parameters excluded, each counted
once: the tensors autograd saves (seen through a saved-tensor hook) plus, for the checkpoint
variants, the block inputs they hold for the recompute. ``host`` is the part parked in host
memory (on a CPU run host and device are the same memory, so it records what would move).

Usage: ``python bench/remat.py [--quick] [--rounds N] [--threads N] [--device cpu|cuda]``.
Writes ``bench/results/remat.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from fscale.functional import functionalize
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.remat import checkpoint, save_matmuls, track

RESULTS = Path(__file__).parent / "results" / "remat.json"


class _Ledger:
    """Storages kept for backward during one forward, split into device and host bytes."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}

    def keep(self, t: torch.Tensor, *, host: bool = False) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            (self.host if host else self.device)[storage.data_ptr()] = storage.nbytes()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.keep(t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class _SaveOnCpuCounted(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu, recording what it moves."""

    def __init__(self, ledger: _Ledger, pin_memory: bool) -> None:
        super().__init__(pin_memory=pin_memory)
        pack = self.pack_hook

        def counted_pack(t: torch.Tensor):  # type: ignore[no-untyped-def]
            ledger.keep(t, host=True)
            return pack(t)

        self.pack_hook = counted_pack


class _TorchCheckpointed(nn.Module):
    """A block run through torch.utils.checkpoint (non-reentrant), recording its kept input."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.ledger: _Ledger | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ledger is not None and torch.is_grad_enabled():
            self.ledger.keep(x)  # held by the checkpoint's recompute closure
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _model(cfg: GPTConfig, variant: str, device: torch.device) -> nn.Module:
    model = GPT(cfg, seed=0).to(device)
    for i, block in enumerate(model.blocks):
        if variant == "fscale":
            model.blocks[i] = checkpoint(block)
        elif variant == "fscale+offload":
            model.blocks[i] = checkpoint(block, offload=True)
        elif variant == "fscale+matmuls":
            model.blocks[i] = checkpoint(block, policy=save_matmuls())
        elif variant == "torch.checkpoint":
            model.blocks[i] = _TorchCheckpointed(block)
    return model


class _Variant:
    """One variant's train step and its measurements."""

    def __init__(self, name: str, cfg: GPTConfig, device: torch.device, tokens: torch.Tensor):
        self.name = name
        self.model = _model(cfg, name, device)
        apply, params, self.buffers = functionalize(self.model)
        self.apply = apply
        self.params = {k: v.requires_grad_() for k, v in params.items()}
        self.tokens = tokens
        self.device = device
        self.times: list[float] = []

    def _forward(self) -> torch.Tensor:
        logits, _ = self.apply(self.params, self.buffers, self.tokens[:, :-1])
        return lm_loss(logits, self.tokens[:, 1:])

    def step(self) -> float:
        start = time.perf_counter()
        if self.name == "torch.save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda"):
                loss = self._forward()
        else:
            loss = self._forward()
        torch.autograd.grad(loss, list(self.params.values()))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def saved_bytes(self) -> tuple[int, int]:
        """(bytes kept for backward in all, of which in host memory) for one forward."""
        state = [*self.params.values(), *self.buffers.values(), *self.model.parameters()]
        ledger = _Ledger({t.untyped_storage().data_ptr() for t in state})
        handles = []
        for block in self.model.blocks:
            if isinstance(block, _TorchCheckpointed):
                block.ledger = ledger
            elif self.name.startswith("fscale"):
                # fscale's checkpoints report what they keep (inputs, policy values, parked
                # copies) through `track`; their inputs are left out of the hook's count so
                # nothing is counted twice.
                handles.append(
                    block.register_forward_pre_hook(
                        lambda _, args: ledger.excluded.add(args[0].untyped_storage().data_ptr())
                    )
                )
        if self.name == "torch.save_on_cpu":
            context = _SaveOnCpuCounted(ledger, pin_memory=self.device.type == "cuda")
        else:
            context = ledger.hooks()
        with context, track() as stats:
            self._forward()
        for handle in handles:
            handle.remove()
        kept = sum(ledger.device.values()) + sum(ledger.host.values()) + stats.saved_bytes
        host = sum(ledger.host.values()) + stats.offloaded_bytes
        return kept, host


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    if args.quick:
        cfg = GPTConfig(vocab_size=256, seq_len=512, d_model=64, n_heads=4, n_layers=2)
        batch, rounds = 2, args.rounds or 3
    else:
        cfg = GPTConfig(vocab_size=256, seq_len=512, d_model=128, n_heads=4, n_layers=4)
        batch, rounds = 4, args.rounds or 11
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=generator)
    tokens = tokens.to(device)

    names = [
        "none",
        "fscale",
        "fscale+offload",
        "fscale+matmuls",
        "torch.checkpoint",
        "torch.save_on_cpu",
    ]
    variants = [_Variant(name, cfg, device, tokens) for name in names]
    for variant in variants:  # warm-up, not timed
        variant.step()
    for _ in range(rounds):
        for variant in variants:
            variant.times.append(variant.step())

    reference = next(v for v in variants if v.name == "torch.checkpoint")
    reference_time = statistics.median(reference.times)
    rows = []
    for variant in variants:
        kept_bytes, host_bytes = variant.saved_bytes()
        median = statistics.median(variant.times)
        rows.append(
            {
                "variant": variant.name,
                "median_s": median,
                "min_s": min(variant.times),
                "time_vs_torch_checkpoint": median / reference_time,
                "saved_bytes": kept_bytes,
                "saved_host_bytes": host_bytes,
            }
        )

    header = (
        f"{'variant':<18} {'median ms':>10} {'min ms':>8} {'x torch.ckpt':>12} "
        f"{'saved MiB':>10} {'host MiB':>9}"
    )
    print(
        f"GPT d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} seq={cfg.seq_len} "
        f"batch={batch} on {device} ({args.threads} threads), {rounds} interleaved rounds"
    )
    print(header)
    for row in rows:
        print(
            f"{row['variant']:<18} {row['median_s'] * 1e3:>10.1f} {row['min_s'] * 1e3:>8.1f} "
            f"{row['time_vs_torch_checkpoint']:>12.3f} {row['saved_bytes'] / 2**20:>10.2f} "
            f"{row['saved_host_bytes'] / 2**20:>9.2f}"
        )
    result = {
        "config": {**cfg.__dict__, "batch": batch, "device": str(device), "threads": args.threads},
        "rounds": rounds,
        "torch": torch.__version__,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
