"""hypothesis strategies for property-testing strategies: random models, batches, optimizers.

A drawn case is a small frozen description (plain data), not a tensor: draw it in the test
process and pass it to `run_spmd`, so every rank builds the identical model, batch and
optimizer from it. Each case knows how to build the same thing for fscale and for the torch
reference it is compared with.

Example:
    >>> from hypothesis import given
    >>> from fscale.testing import strategies as fst
    >>> @given(model=fst.model_cases(), opt=fst.optimizer_cases())
    ... def test_my_strategy(model, opt):
    ...     results = run_spmd(train_with_my_strategy, 2, model, opt)
    ...     reference = train_single_process(model, opt)
    ...     assert_trees_close(results[0], reference, rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fscale import models
from fscale import optim as fsoptim

__all__ = [
    "POINTWISE_OPTIMIZERS",
    "ModelCase",
    "OptimizerCase",
    "model_cases",
    "optimizer_cases",
]

# Optimizers torch.optim also has, with the torch implementation each one matches bit for bit.
_TORCH_IMPL: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"fused": True}),
    "adam": ("Adam", {"fused": True}),
    "adamw": ("AdamW", {"fused": True}),
    "adagrad": ("Adagrad", {"fused": True}),
    "rmsprop": ("RMSprop", {"foreach": False}),
    "adadelta": ("Adadelta", {"foreach": False}),
    "adamax": ("Adamax", {"foreach": False}),
}
POINTWISE_OPTIMIZERS = tuple(_TORCH_IMPL)
_KINDS = ("mlp", "gpt", "cnn")


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A small model of one of three kinds, with its loss and a batch maker.

    Attributes:
        kind: "mlp" (regression), "gpt" (language model, tied embeddings) or "cnn" (ResNet-style
            with BatchNorm).
        width: hidden width (MLP layers, GPT d_model, CNN first stage channels).
        depth: layers (MLP hidden layers, GPT blocks, CNN stages).
        seed: initialisation seed.
        freeze: names of parameters to freeze (``requires_grad=False``); they move to buffers.
        dtype: the floating-point dtype of the module and of the batch's floating-point
            tensors (float64 where summation orders must not show: ranks that add in another
            order differ by float32's rounding, which adaptive optimizers enlarge).
    """

    kind: str
    width: int = 8
    depth: int = 2
    seed: int = 0
    freeze: tuple[str, ...] = ()
    dtype: torch.dtype = torch.float32

    def module(self) -> torch.nn.Module:
        if self.kind == "mlp":
            sizes = [5] + [self.width] * self.depth + [3]
            module = models.mlp(sizes, seed=self.seed)
        elif self.kind == "gpt":
            cfg = models.GPTConfig(
                vocab_size=32, seq_len=8, d_model=self.width, n_heads=2, n_layers=self.depth
            )
            module = models.GPT(cfg, seed=self.seed)
        elif self.kind == "cnn":
            cfg = models.ResNetConfig(
                num_classes=4, widths=tuple(self.width * 2**i for i in range(self.depth))
            )
            module = models.resnet(cfg, seed=self.seed)
        else:
            raise ValueError(f"ModelCase: unknown kind {self.kind!r}; use 'mlp', 'gpt' or 'cnn'")
        named = dict(module.named_parameters())
        for name in self.freeze:
            if name not in named:
                raise ValueError(f"ModelCase: cannot freeze {name!r}; parameters: {sorted(named)}")
            named[name].requires_grad_(False)
        return module.to(self.dtype)

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """The mean loss of `output` (the module's output on `inputs(batch)`) over the batch."""
        if self.kind == "mlp":
            return torch.nn.functional.mse_loss(output, batch[1])
        if self.kind == "gpt":
            return models.lm_loss(output, batch[:, 1:])
        return models.classification_loss(output, batch[1])

    def inputs(self, batch: Any) -> torch.Tensor:
        """The module's input for `batch`."""
        return batch[:, :-1] if self.kind == "gpt" else batch[0]

    def loss_fn(self, apply: Any):
        """``loss_fn(params, buffers, batch, key)`` for `fscale.train_step` over `apply`."""

        def loss_fn(params, buffers, batch, key):
            output, new_buffers = apply(params, buffers, self.inputs(batch), key=key)
            return self.loss(output, batch), new_buffers

        return loss_fn

    def batch(self, size: int, seed: int) -> Any:
        """A global batch of `size` examples (batch dimension 0 everywhere)."""
        g = torch.Generator().manual_seed(seed)
        if self.kind == "mlp":
            x, y = torch.randn(size, 5, generator=g), torch.randn(size, 3, generator=g)
            return x.to(self.dtype), y.to(self.dtype)
        if self.kind == "gpt":
            return torch.randint(0, 32, (size, 9), generator=g)
        images = torch.randn(size, 3, 8, 8, generator=g).to(self.dtype)
        return images, torch.randint(0, 4, (size,), generator=g)


@dataclasses.dataclass(frozen=True)
class OptimizerCase:
    """An optimizer name and hyper-parameters (torch.optim's names and meanings)."""

    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def fscale(self) -> fsoptim.Optimizer:
        """The fscale optimizer."""
        return getattr(fsoptim, self.name)(**self.options)

    def torch(self, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The torch.optim optimizer with the implementation fscale's matches bit for bit."""
        if self.name not in _TORCH_IMPL:
            raise ValueError(f"OptimizerCase: torch.optim has no counterpart of {self.name!r}")
        cls_name, impl = _TORCH_IMPL[self.name]
        return getattr(torch.optim, cls_name)(params, **self.options, **impl)


_lr = st.sampled_from([1e-3, 1e-2, 0.05])
_wd = st.sampled_from([0.0, 0.0, 1e-2])
_betas = st.tuples(st.sampled_from([0.8, 0.9]), st.sampled_from([0.99, 0.999]))


def _options(name: str) -> st.SearchStrategy[dict[str, Any]]:
    if name == "sgd":
        return st.fixed_dictionaries(
            {"lr": _lr, "momentum": st.sampled_from([0.0, 0.9]), "weight_decay": _wd}
        ).flatmap(
            lambda d: st.fixed_dictionaries(
                {
                    **{k: st.just(v) for k, v in d.items()},
                    "nesterov": st.just(False) if d["momentum"] == 0 else st.booleans(),
                }
            )
        )
    if name in ("adam", "adamw"):
        return st.fixed_dictionaries(
            {"lr": _lr, "betas": _betas, "weight_decay": _wd, "amsgrad": st.booleans()}
        )
    if name == "rmsprop":
        return st.fixed_dictionaries(
            {
                "lr": _lr,
                "momentum": st.sampled_from([0.0, 0.9]),
                "centered": st.booleans(),
                "weight_decay": _wd,
            }
        )
    if name == "adagrad":
        return st.fixed_dictionaries(
            {"lr": _lr, "lr_decay": st.sampled_from([0.0, 1e-3]), "weight_decay": _wd}
        )
    if name == "adadelta":
        return st.fixed_dictionaries(
            {
                "lr": st.sampled_from([0.5, 1.0]),
                "rho": st.sampled_from([0.9, 0.95]),
                "weight_decay": _wd,
            }
        )
    if name == "adamax":
        return st.fixed_dictionaries({"lr": _lr, "betas": _betas, "weight_decay": _wd})
    raise ValueError(f"optimizer_cases: no hyper-parameter strategy for {name!r}")


def optimizer_cases(
    names: Sequence[str] = POINTWISE_OPTIMIZERS,
) -> st.SearchStrategy[OptimizerCase]:
    """Optimizers among `names` with random hyper-parameters."""
    unknown = sorted(set(names) - set(POINTWISE_OPTIMIZERS))
    if unknown or not names:
        raise ValueError(
            f"optimizer_cases: `names` must be a non-empty subset of {POINTWISE_OPTIMIZERS}, "
            f"got unknown {unknown}"
            if unknown
            else "optimizer_cases: `names` is empty"
        )
    return st.sampled_from(list(names)).flatmap(
        lambda name: _options(name).map(
            lambda opts: OptimizerCase(name, tuple(sorted(opts.items())))
        )
    )


def model_cases(kinds: Sequence[str] = _KINDS) -> st.SearchStrategy[ModelCase]:
    """Small models of the given kinds with random width, depth and seed."""
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown or not kinds:
        raise ValueError(
            f"model_cases: `kinds` must be a non-empty subset of {_KINDS}, got unknown {unknown}"
            if unknown
            else "model_cases: `kinds` is empty"
        )
    return st.builds(
        ModelCase,
        kind=st.sampled_from(list(kinds)),
        width=st.sampled_from([4, 8, 12]),
        depth=st.integers(1, 2),
        seed=st.integers(0, 2**16),
    )
