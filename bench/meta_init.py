"""A model too large for one rank's memory budget, built on the meta device and trained sharded.

Each of 4 gloo ranks limits its own data segment (``RLIMIT_DATA``, which counts heap and
anonymous mappings: every tensor) to what it uses after start-up plus a budget of
8·Ψ bytes, half of what the full fp32 model and its Adam state take (16·Ψ: params 4, grads 4,
moments 8), plus a fixed allowance of 96 MiB for the runtime (thread stacks, gloo's buffers, the
allocator's arenas: about 73 MiB on a 1.1M-parameter model). Allocating past the limit fails,
as it would on a machine that small. The ranks fix glibc's mmap threshold (``mallopt``), so
that the freed buffers of gathered units go back to the system instead of staying in the heap
(glibc's default raises the threshold after the first large free, and the heap then keeps them:
the peak RSS of this run is about twice as high without it).

- ``fully_shard (meta init)``: the GPT is built under ``with torch.device("meta")`` and
  functionalized with its GPT-2 initialisation as ``init``; ``fully_shard``'s ``step.init``
  makes only this rank's shards, one submodule at a time, and the step trains. The budget holds.
- ``data_parallel (full model)``, the control: the same GPT built normally and trained under
  ``data_parallel`` with the same limit. It needs the whole model on every rank and fails.

Reported per rank: the peak of anonymous resident memory above the rank's own after start-up
(``RssAnon``, sampled every 5 ms: tensors and heap, not the pages of torch's libraries that the
first step touches), after init and after training, against Ψ·16/N; the peak RSS
(``VmHWM``) above start-up, which includes those library pages; the state's own bytes
(`fscale.memory`) and the losses. JSON in ``bench/results/meta_init.json``.

Run: ``python bench/meta_init.py`` (``--quick``: a smaller GPT, for a smoke test).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import resource
import threading
import time

import _util
import torch
from torch import nn

import fscale as fs
from fscale.distributed import RankError
from fscale.memory import tree_bytes

WORLD = 4
STEPS = 3
BATCH = 2  # sequences per rank
ALLOWANCE = 96 * 2**20  # the runtime's own data: thread stacks, gloo, allocator arenas
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _config(quick: bool) -> fs.models.GPTConfig:
    if quick:
        return fs.models.GPTConfig(vocab_size=2048, seq_len=32, d_model=128, n_heads=4, n_layers=4)
    return fs.models.GPTConfig(vocab_size=8192, seq_len=64, d_model=512, n_heads=8, n_layers=6)


def _psi(cfg: fs.models.GPTConfig) -> int:
    with torch.device("meta"):
        model = fs.models.GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def gpt2_init(n_layers: int):
    """GPT-2's initialisation one submodule at a time (what `fs.models.GPT` does at build)."""
    residual_std = 0.02 / math.sqrt(2 * n_layers)

    def init(path: str, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if path.endswith(("attn.proj", "mlp.fc_out")) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    return init


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class AnonPeak:
    """The peak of ``RssAnon``, sampled by a thread every `interval` seconds."""

    def __init__(self, interval: float = 0.005) -> None:
        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, _status("RssAnon"))

    def read(self) -> int:
        self.peak = max(self.peak, _status("RssAnon"))
        return self.peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _limit(budget: int) -> int:
    limit = _status("VmData") + budget
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def _train(variant: str, cfg: fs.models.GPTConfig, rank: int, world: int, anon, phase: list):
    """Build, init and train; `phase[0]` says which part runs (for an error at the limit)."""
    mesh = fs.Mesh(dp=world)
    if variant == "meta":
        with torch.device("meta"):
            model = fs.models.GPT(cfg)
        apply, params, buffers = fs.functionalize(model, init=gpt2_init(cfg.n_layers))
    else:
        model = fs.models.GPT(cfg)
        apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, batch, key):
        logits, b = apply(p, b, batch.inputs, key=key)
        return fs.models.lm_loss(logits, batch.targets), b

    step = fs.train_step(loss_fn, fs.optim.adam(1e-3), donate=True)
    step = fs.fully_shard(step, mesh) if variant == "meta" else fs.data_parallel(step, mesh)
    phase[0] = "step.init"
    started = time.perf_counter()
    state = step.init(params, buffers, key=0)
    del params, buffers
    init_seconds = time.perf_counter() - started
    init_peak = anon.read()
    losses = []
    started = time.perf_counter()
    for i in range(STEPS):
        phase[0] = f"step {i + 1}"
        batch = fs.data.split_batch(_util.lm_batch(cfg, BATCH * world, i), rank, world)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    step_seconds = (time.perf_counter() - started) / STEPS
    return state, losses, init_seconds, step_seconds, init_peak


def _rank(variant: str, quick: bool) -> dict:
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)
    rank, world = fs.distributed.rank(), fs.distributed.world_size()
    cfg = _config(quick)
    psi = _psi(cfg)
    start_rss, start_data = _util.rss_bytes(), _status("VmData")
    anon = AnonPeak()
    start_anon = anon.read()
    _limit(8 * psi + ALLOWANCE)
    phase = ["building the model"]
    try:
        state, losses, init_seconds, step_seconds, init_peak = _train(
            variant, cfg, rank, world, anon, phase
        )
    except (RuntimeError, MemoryError) as error:  # the limit: say where it was reached
        raise RuntimeError(f"during {phase[0]}: {error}") from error
    result = {
        "rank": rank,
        "psi": psi,
        "start_rss": start_rss,
        "init_anon_peak_above_start": init_peak - start_anon,
        "anon_peak_above_start": anon.read() - start_anon,
        "rss_peak_above_start": _util.peak_rss_bytes() - start_rss,
        "data_growth": _status("VmData") - start_data,
        "state_bytes": tree_bytes(state),
        "init_s": init_seconds,
        "step_s": step_seconds,
        "losses": losses,
    }
    anon.stop()
    return result


def _row(label: str, r: dict, share: int) -> list:
    mib = 2**20
    return [
        label,
        "yes",
        r["init_anon_peak_above_start"] / mib,
        r["anon_peak_above_start"] / mib,
        r["anon_peak_above_start"] / share,
        r["rss_peak_above_start"] / mib,
        r["state_bytes"] / mib,
        f"{r['step_s']:.1f} s/step, losses {', '.join(f'{x:.4f}' for x in r['losses'])}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller GPT")
    args = parser.parse_args()
    psi = _psi(_config(args.quick))
    share = 16 * psi // WORLD
    results = {
        "psi": psi,
        "world_size": WORLD,
        "limit_above_start_bytes": 8 * psi + ALLOWANCE,
        "share_bytes": share,
    }
    rows = []
    for variant, label in (("meta", "fully_shard (meta init)"), ("full", "data_parallel (full)")):
        try:
            per_rank = fs.launch(_rank, WORLD, variant, args.quick, timeout=1200)
        except RankError as error:
            failure = next(
                (line for line in str(error).splitlines() if "Error" in line), str(error)
            )
            results[variant] = {"fit": False, "error": failure.strip()[:300]}
            rows.append([label, "no", None, None, None, None, None, failure.strip()[:60]])
            continue
        results[variant] = {"fit": True, "ranks": per_rank}
        rows.extend(_row(f"{label} rank {r['rank']}", r, share) for r in per_rank)
    print(
        f"GPT of {psi / 1e6:.1f}M parameters, {WORLD} ranks; full fp32 params + grads + Adam: "
        f"{16 * psi / 2**20:.0f} MiB, per-rank share Ψ·16/N = {share / 2**20:.0f} MiB, "
        f"limit 8·Ψ + {ALLOWANCE // 2**20} MiB = {(8 * psi + ALLOWANCE) / 2**20:.0f} MiB of data "
        "above start-up"
    )
    header = [
        "variant",
        "fits",
        "init anon peak MiB",
        "anon peak MiB",
        "anon peak / (Ψ·16/N)",
        "VmHWM MiB",
        "state MiB",
    ]
    print(_util.format_table([*header, "notes"], rows, float_format="{:.1f}"))
    path = _util.write_results("meta_init", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
