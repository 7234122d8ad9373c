"""The training steps the strategy benchmarks compare: each fscale strategy and its peers.

A `Workload` is a model family (the GPT language model of `_util.gpt_config`, or the ResNet of
`bench/oss.py`), its loss, the submodules that form its sharding units and its checkpointed
blocks, and this rank's slices of one stream of global batches. `build` turns a variant name
into a callable running one training step on the current process group; every variant trains
the same model (seed 0) on the same batches with AdamW at the same learning rate:

* ``torch DDP``: ``DistributedDataParallel`` + ``torch.optim.AdamW(fused=True)``;
* ``torch DDP + checkpoint``: the same with ``torch.utils.checkpoint`` (non-reentrant) around
  every block;
* ``torch DDP + ZeRO-1``: DDP + ``ZeroRedundancyOptimizer`` over fused AdamW with
  ``parameters_as_bucket_view=True`` (one broadcast per rank's bucket, not one per parameter);
* ``FairScale OSS + ShardedDDP``: ``fairscale.optim.OSS`` over fused AdamW under
  ``fairscale.nn.ShardedDataParallel``, reset with ``model.zero_grad()`` as FairScale documents;
* ``DeepSpeed ZeRO-2``: ``deepspeed.initialize`` with ZeRO stage 2 over fused AdamW as the client
  optimizer, fp32, gradient clipping off (DeepSpeed's default clips at 1.0, which the others do
  not), its other ZeRO settings at their defaults, on DeepSpeed's CPU accelerator (which uses
  the gloo group the ranks already have);
* ``torch FSDP2``: ``torch.distributed.fsdp.fully_shard`` on every unit, then on the root, with
  ``torch.optim.AdamW(fused=True)`` over its DTensor shards;
* ``torch FSDP2 last kept``: the same with ``reshard_after_forward=False`` on the last
  unit (torchtitan's default policy, as fscale's ``"except_last"``);
* ``fscale DDP`` / ``fscale DDP donate=False``: ``fscale.data_parallel``, donated and pure;
* ``fscale ZeRO-1`` / ``fscale ZeRO-2``: ``fscale.shard_optimizer(shard_grads=False / True)``;
* ``fscale DDP over gloo`` / ``fscale ZeRO-2 over gloo``: the same with their bucket collectives
  on gloo instead of shared memory (``fscale.distributed.set_shared_memory(False)``,
  decided per process group at its first collective: only in processes of their own, as
  ``bench/strategies.py --isolated`` runs them);
* ``fscale ZeRO-3``: ``fscale.fully_shard`` over the same units as FSDP2;
* ``fscale DDP + checkpoint``: ``fscale.checkpoint`` around every block, under data_parallel
  (the step keeps the last block's saved tensors instead of recomputing it,
  ``fscale.remat.keep_last``).

A step returns nothing; `Variant.global_loss` reduces the losses after the timing, so the
torch peers pay no extra all-reduce inside a timed step (fscale's step returns the global mean
loss itself: that collective is part of its cost).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import _util
import torch
import torch.distributed as dist
from torch import nn

import fscale as fs

__all__ = [
    "DEEPSPEED",
    "FAIRSCALE",
    "FSCALE",
    "OVER_GLOO",
    "PEERS",
    "Variant",
    "Workload",
    "build",
    "deepspeed_status",
    "fairscale_status",
]

LEARNING_RATE = 1e-3
SEQUENCES_PER_RANK = 8
IMAGES_PER_RANK = 32

FSCALE = (
    "fscale DDP",
    "fscale DDP donate=False",
    "fscale ZeRO-1",
    "fscale ZeRO-2",
    "fscale ZeRO-3",
    "fscale DDP + checkpoint",
    "fscale DDP over gloo",
    "fscale ZeRO-2 over gloo",
    "fscale ZeRO-3 over gloo",
)
OVER_GLOO = ("fscale DDP over gloo", "fscale ZeRO-2 over gloo", "fscale ZeRO-3 over gloo")
"""The variants that need a process group of their own (its transport is decided once)."""
PEERS = (
    "torch DDP",
    "torch DDP + checkpoint",
    "torch DDP + ZeRO-1",
    "FairScale OSS + ShardedDDP",
    "DeepSpeed ZeRO-2",
    "torch FSDP2",
    "torch FSDP2 last kept",
)
FAIRSCALE = ("FairScale OSS + ShardedDDP",)
"""The variants that need ``import fairscale``."""
DEEPSPEED = ("DeepSpeed ZeRO-2",)
"""The variants that need ``import deepspeed``."""


def fairscale_status() -> str | None:
    """None when FairScale's OSS and ShardedDataParallel import, else why they do not."""
    try:
        from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: F401
        from fairscale.optim.oss import OSS  # noqa: F401
    except Exception as error:
        return f"FairScale skipped: `import fairscale` failed ({type(error).__name__}: {error})"
    return None


def deepspeed_status() -> str | None:
    """None when ``import deepspeed`` works, else why not (the DeepSpeed variants are skipped).

    DeepSpeed is an optional peer: ``DS_BUILD_OPS=0 pip install --no-build-isolation
    deepspeed==0.19.8`` with the torch constraint (the README's Dependencies section).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed  # noqa: F401  # pyright: ignore[reportMissingImports]
    except Exception as error:
        return (
            f"DeepSpeed ZeRO-2 skipped: `import deepspeed` failed ({type(error).__name__}: {error})"
        )
    return None


class Workload:
    """A model family with its loss, units, blocks and this rank's batches.

    Args:
        model: ``"gpt"`` (the LM of `_util.gpt_config`) or ``"cnn"`` (`fscale.models.resnet`,
            widths 16-32-64, quick 8-16-32, on 3x32x32 images of 10 classes).
        quick: the small configuration.
        count: batches in the stream; step ``i`` trains on batch ``i % count``.
        rank: this rank.
        world: the number of ranks; each global batch is split evenly over them.
    """

    def __init__(self, model: str, quick: bool, count: int, rank: int, world: int) -> None:
        if model not in ("gpt", "cnn"):
            raise ValueError(f"Workload: `model` must be 'gpt' or 'cnn', got {model!r}")
        self.model = model
        self.quick = quick
        if model == "gpt":
            cfg = _util.gpt_config(quick)
            self.config: Any = cfg
            self.per_rank = SEQUENCES_PER_RANK
            global_batches = [_util.lm_batch(cfg, self.per_rank * world, i) for i in range(count)]
        else:
            widths = (8, 16, 32) if quick else (16, 32, 64)
            self.config = fs.models.ResNetConfig(num_classes=10, widths=widths)
            self.per_rank = IMAGES_PER_RANK
            global_batches = [self._images(self.per_rank * world, i) for i in range(count)]
        self.batches = [fs.data.split_batch(b, rank, world) for b in global_batches]

    @staticmethod
    def _images(size: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        images = torch.randn(size, 3, 32, 32, generator=generator)
        return images, torch.randint(0, 10, (size,), generator=generator)

    def build_model(self) -> nn.Module:
        """A new model, initialised from seed 0."""
        if self.model == "gpt":
            return fs.models.GPT(self.config, seed=0)
        return fs.models.resnet(self.config, seed=0)

    def units(self, model: nn.Module) -> list[str]:
        """Paths of the submodules sharded as units (GPT blocks, ResNet stages); rest: root."""
        container = "blocks" if self.model == "gpt" else "stages"
        return [f"{container}.{i}" for i in range(len(model.get_submodule(container)))]

    def block_paths(self, model: nn.Module) -> list[str]:
        """Paths of the blocks the checkpoint variants recompute (GPT only: see the module doc)."""
        if self.model != "gpt":
            raise ValueError("Workload.block_paths: the checkpoint variants train the GPT only")
        return self.units(model)

    def inputs(self, batch: Any) -> torch.Tensor:
        return batch.inputs if self.model == "gpt" else batch[0]

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        if self.model == "gpt":
            return fs.models.lm_loss(output, batch.targets)
        return fs.models.classification_loss(output, batch[1])

    def batch(self, index: int) -> Any:
        return self.batches[index % len(self.batches)]


class Variant:
    """One training step of a variant; calling it runs the next step of its batch stream.

    Attributes:
        name: the variant's name.
        model: the nn.Module it trains (for fscale: the module its functional call runs).
        steps: steps run so far.
        fscale_step: an fscale variant's Step (None for the peers).
        holder: an fscale variant's ``{"state": TrainState}``, replaced by every step.
    """

    def __init__(self, name: str, workload: Workload, model: nn.Module) -> None:
        self.name = name
        self.workload = workload
        self.model = model
        self.steps = 0
        self._losses: list[torch.Tensor] = []
        self._run: Callable[[Any], torch.Tensor] = lambda batch: torch.zeros(())
        self._global = False  # whether the recorded losses are already means over the ranks
        self.fscale_step: fs.Step | None = None
        self.holder: dict[str, Any] = {}  # an fscale variant's {"state": TrainState}

    def __call__(self) -> None:
        self._losses.append(self._run(self.workload.batch(self.steps)))
        self.steps += 1

    def global_loss(self) -> float:
        """The mean over the ranks of the last step's loss (a collective: call on every rank)."""
        if not self._losses:
            raise RuntimeError(f"Variant {self.name!r}: no step has run yet")
        loss = self._losses[-1].detach().clone()
        if not self._global:
            loss /= dist.get_world_size()
            dist.all_reduce(loss)
        return float(loss)


def build(name: str, workload: Workload) -> Variant:
    """The variant `name` (one of `FSCALE` or `PEERS`) over `workload`, on the current group.

    Raises:
        ValueError: `name` is unknown, or a checkpoint variant on a workload without blocks.
        ImportError: a FairScale or DeepSpeed variant while that library does not import.
    """
    if name not in FSCALE and name not in PEERS:
        raise ValueError(f"build: unknown variant {name!r}; have {FSCALE + PEERS}")
    model = workload.build_model()
    if name.endswith("checkpoint"):
        for path in workload.block_paths(model):
            parent, _, child = path.rpartition(".")
            block = model.get_submodule(path)
            wrapped = (
                fs.checkpoint(block) if name.startswith("fscale") else _TorchCheckpointed(block)
            )
            model.get_submodule(parent).register_module(child, wrapped)
    variant = Variant(name, workload, model)
    if name.startswith("fscale"):
        _fscale(variant, workload, model)
    elif name.startswith("torch FSDP2"):
        _fsdp2(variant, workload, model)
    elif name in DEEPSPEED:
        _deepspeed(variant, workload, model)
    else:
        _torch_ddp_family(variant, workload, model)
    return variant


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _fscale(variant: Variant, workload: Workload, model: nn.Module) -> None:
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):  # type: ignore[no-untyped-def]
        output, new_buffers = apply(params, buffers, workload.inputs(batch), key=key)
        return workload.loss(output, batch), new_buffers

    name = variant.name
    if name in OVER_GLOO:
        fs.distributed.set_shared_memory(False)
    step = fs.train_step(
        loss_fn, fs.optim.adamw(LEARNING_RATE), donate=not name.endswith("donate=False")
    )
    mesh = fs.Mesh(dp=dist.get_world_size())
    if name.startswith("fscale ZeRO-3"):
        step = fs.fully_shard(step, mesh, units=workload.units(model))
    elif "ZeRO" in name:
        step = fs.shard_optimizer(step, mesh, shard_grads="ZeRO-2" in name)
    else:
        step = fs.data_parallel(step, mesh)
    holder = {"state": step.init(params, buffers)}
    del params, buffers

    def run(batch: Any) -> torch.Tensor:
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    variant._run = run
    variant._global = True
    variant.fscale_step = step
    variant.holder = holder


def _torch_ddp_family(variant: Variant, workload: Workload, model: nn.Module) -> None:
    from torch.nn.parallel import DistributedDataParallel

    name = variant.name
    adamw: dict[str, Any] = {"lr": LEARNING_RATE, "fused": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's and FairScale's notes about gloo and versions
        if name == "torch DDP + ZeRO-1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer: Any = ZeroRedundancyOptimizer(
                model.parameters(),
                optimizer_class=torch.optim.AdamW,
                parameters_as_bucket_view=True,
                **adamw,
            )
        elif name in FAIRSCALE:
            from fairscale.optim.oss import OSS

            optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        if name in FAIRSCALE:
            from fairscale.nn.data_parallel import ShardedDataParallel

            wrapped: nn.Module = ShardedDataParallel(model, optimizer)
        else:
            wrapped = DistributedDataParallel(model)

    # ShardedDDP's documented reset is the model's: its gradients live in buckets.
    reset = model.zero_grad if name in FAIRSCALE else lambda: optimizer.zero_grad(set_to_none=True)
    variant._run = _eager_step(workload, wrapped, optimizer, reset)


def _fsdp2(variant: Variant, workload: Workload, model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    paths = workload.units(model)
    keep_last = variant.name == "torch FSDP2 last kept"
    for i, path in enumerate(paths):
        reshard = not (keep_last and i == len(paths) - 1)
        fully_shard(model.get_submodule(path), mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)

    reset = lambda: optimizer.zero_grad(set_to_none=True)  # noqa: E731
    variant._run = _eager_step(workload, model, optimizer, reset)


def _deepspeed(variant: Variant, workload: Workload, model: nn.Module) -> None:
    import logging

    import deepspeed  # pyright: ignore[reportMissingImports]

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its per-step INFO lines
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": workload.per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31,
        "zero_optimization": {"stage": 2},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )

    def run(batch: Any) -> torch.Tensor:
        loss = workload.loss(engine(workload.inputs(batch)), batch)
        engine.backward(loss)
        engine.step()  # the update, then the gradients are zeroed for the next step
        return loss.detach()

    variant._run = run


def _eager_step(workload: Workload, model: nn.Module, optimizer: Any, reset: Any) -> Any:
    """A torch peer's training step: reset the gradients, forward, backward, update."""

    def run(batch: Any) -> torch.Tensor:
        reset()
        loss = workload.loss(model(workload.inputs(batch)), batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return run
