"""Benchmark: fscale.optim Adam / AdamW / SGD-momentum against torch.optim on CPU.

Usage: ``python bench/optim.py [--quick] [--threads N]``

Three parameter sets: (a) 200 tensors of 100 x 250 (5.0M params); (b) a GPT-style model (d=256,
8 blocks of attention and MLP linears with layer norms, an 8192 x 256 embedding); (c) 2000
tensors of 1000 (2.0M params), where a kernel's per-tensor cost shows. Variants:
torch.optim with ``foreach=True`` and with ``fused=True`` (grads attached to ``.grad``), and
fscale's `step` with ``donate=True`` (params and state are the flat-buffer views its previous
step returned, updated in place) and with ``donate=False`` (pure: fresh params and state); for
Adam and AdamW also with ``exact=False`` (one fused call per flat buffer instead of the list of
per-tensor views: not bit-identical to torch, see `fscale.optim.flat_group`), given the gradients
as separate tensors (that path then keeps the per-tensor call) and as views of one flat buffer:
the same view tensors every step ("flat-g", a refilled gradient buffer: the layout is known from
the first step) or new views of the buffer every step ("new flat-g": their addresses are read
every step), and as new views of four buffers filled in reverse leaf order every step
("buckets-g", as `fscale.data_parallel`'s reducer hands them over: one span per bucket).
Variants are interleaved round by round; medians are reported with the ratio to torch's fused
optimizer, printed as a table and written to ``bench/results/optim.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import fscale.optim as optim


def tensors_200() -> dict[str, torch.Tensor]:
    return {f"w{i:03d}": torch.randn(100, 250) for i in range(200)}


def tensors_2000() -> dict[str, torch.Tensor]:
    return {f"v{i:04d}": torch.randn(1000) for i in range(2000)}


def gpt_like(d: int = 256, blocks: int = 8, vocab: int = 8192) -> dict[str, torch.Tensor]:
    params = {"embed": torch.randn(vocab, d) * 0.02}
    for b in range(blocks):
        for name, shape in [
            ("ln1.w", (d,)),
            ("ln1.b", (d,)),
            ("attn.qkv.w", (3 * d, d)),
            ("attn.qkv.b", (3 * d,)),
            ("attn.proj.w", (d, d)),
            ("attn.proj.b", (d,)),
            ("ln2.w", (d,)),
            ("ln2.b", (d,)),
            ("mlp.fc.w", (4 * d, d)),
            ("mlp.fc.b", (4 * d,)),
            ("mlp.proj.w", (d, 4 * d)),
            ("mlp.proj.b", (d,)),
        ]:
            params[f"blocks.{b}.{name}"] = torch.randn(shape) * 0.02
    params["ln_f.w"], params["ln_f.b"] = torch.ones(d), torch.zeros(d)
    return params


OPTIMIZERS = {
    "adam": (
        lambda **kw: optim.adam(1e-3, **kw),
        lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    ),
    "adamw": (
        lambda **kw: optim.adamw(1e-3, **kw),
        lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw),
    ),
    "sgd-momentum": (
        lambda **kw: optim.sgd(1e-2, momentum=0.9, **kw),
        lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
    ),
}
# Optimizers with an opt-in non-exact path (``exact=False``), benchmarked beside the exact one.
NON_EXACT = ("adam", "adamw")


def flat_views(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as views of one buffer, in order (a flat gradient buffer)."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    views = flat.split([t.numel() for t in tensors.values()])
    return {k: v.view(t.shape) for (k, t), v in zip(tensors.items(), views)}


def bucket_views(tensors: dict[str, torch.Tensor], buckets: int = 4) -> dict[str, torch.Tensor]:
    """The same values as views of `buckets` buffers, filled in reverse order (as a reducer's)."""
    names = list(reversed(tensors))
    views: dict[str, torch.Tensor] = {}
    for b in range(buckets):
        chunk = names[b * len(names) // buckets : (b + 1) * len(names) // buckets]
        views.update(flat_views({k: tensors[k] for k in chunk}))
    return {k: views[k] for k in tensors}


def fresh_views(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New view tensors of the same buffer, at the same places (what a new step hands over)."""
    return {k: v.view(v.shape) for k, v in views.items()}


def make_variants(name: str, params: dict[str, torch.Tensor]) -> dict:
    """Each variant is ``(prepare, run)``: ``run(prepare())`` is one optimizer step."""
    make_fscale, make_torch = OPTIMIZERS[name]
    grads = {k: torch.randn_like(v) * 1e-3 for k, v in params.items()}
    flat_grads = flat_views(grads)
    bucket_grads = bucket_views(grads)
    variants = {}
    for kind in ("foreach", "fused"):
        torch_params = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(torch_params, grads.values()):
            p.grad = g.clone()
        torch_step = make_torch(torch_params, **{kind: True}).step
        variants[f"torch {kind}"] = (lambda: None, lambda _, torch_step=torch_step: torch_step())
    paths = [("", {}, lambda: grads)]
    if name in NON_EXACT:
        paths += [
            (" exact=False", {"exact": False}, lambda: grads),
            (" exact=False flat-g", {"exact": False}, lambda: flat_grads),
            (" exact=False new flat-g", {"exact": False}, lambda: fresh_views(flat_grads)),
            (" exact=False buckets-g", {"exact": False}, lambda: fresh_views(bucket_grads)),
        ]
    for suffix, options, gradients in paths:
        for donate in (True, False):
            opt = make_fscale(**options)
            box = {"state": opt.init(params)}
            # one warm-up step: params and state are then the flat-buffer views fscale produces
            box["params"], box["state"] = optim.step(opt, gradients(), box["state"], params)

            def run(given, opt=opt, box=box, donate=donate) -> None:
                box["params"], box["state"] = optim.step(
                    opt, given, box["state"], box["params"], donate=donate
                )

            variants[f"fscale donate={donate}{suffix}"] = (gradients, run)
    return variants


def measure(variants: dict, rounds: int) -> dict[str, float]:
    """Median milliseconds of each variant; a variant is ``(prepare, run)``, and only
    ``run(prepare())`` is timed (``prepare`` makes what a new step would be handed)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for prepare, run in variants.values():  # warm-up
        run(prepare())
    for _ in range(rounds):
        for label, (prepare, run) in variants.items():
            given = prepare()
            start = time.perf_counter()
            run(given)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(ts) * 1e3 for label, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds = 5 if args.quick else 30
    param_sets = {
        "200 tensors (5.0M)": tensors_200(),
        "GPT-like d=256": gpt_like(),
        "2000 tensors (2.0M)": tensors_2000(),
    }
    results = []
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {rounds} rounds, medians in ms; "
        "fscale donate=True: params/state are its own previous outputs, updated in place"
    )
    header = f"{'params':<20} {'optimizer':<13} {'variant':<42} {'ms':>8} {'vs fused':>9}"
    print(header)
    print("-" * len(header))
    for set_name, params in param_sets.items():
        numel = sum(p.numel() for p in params.values())
        for opt_name in OPTIMIZERS:
            medians = measure(make_variants(opt_name, params), rounds)
            fused = medians["torch fused"]
            for label, ms in medians.items():
                print(f"{set_name:<20} {opt_name:<13} {label:<42} {ms:8.2f} {ms / fused:8.2f}x")
                results.append(
                    {
                        "params": set_name,
                        "numel": numel,
                        "tensors": len(params),
                        "optimizer": opt_name,
                        "variant": label,
                        "median_ms": ms,
                        "ratio_vs_torch_fused": ms / fused,
                    }
                )
    out = Path(__file__).parent / "results" / "optim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "rounds": rounds,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
