"""Small reference models for tests, benchmarks and the demo: an MLP, a GPT and a ResNet.

They are plain ``nn.Module``s with nothing fscale-specific inside, so the same module trains
eagerly and through `fscale.functionalize`, and every strategy can be checked against eager
PyTorch on it. Each is built on the CPU in float32 from an explicit ``seed`` without touching
the caller's RNG, so two processes that build the same model hold the same weights; move it
with ``.to(device)``. Inputs may live on any device: every tensor a forward creates follows
its input's device.

The layout is chosen for the transformations:

- `GPT` keeps its transformer blocks in an ``nn.ModuleList`` called ``blocks``, with the
  embeddings (``embed``) and the final norm and output layer (``final_norm``, ``lm_head``) as
  separate children, so "one sharding unit per block plus the root" and "remat each block"
  (``model.blocks[i] = fscale.checkpoint(model.blocks[i])``) are one line each. The output
  layer shares its weight with the token embedding (one parameter under two names).
- `ResNet` has BatchNorm, i.e. buffers that change in training mode.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import einops
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "ResNet",
    "ResNetConfig",
    "classification_loss",
    "lm_loss",
    "mlp",
    "resnet",
]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
}


@contextlib.contextmanager
def _seeded_float32_init(seed: int) -> Iterator[None]:
    """Build modules on the CPU in float32 from `seed`; the caller's RNG and dtype are restored."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"`seed` must be an int, got {type(seed).__name__}")
    previous_dtype = torch.get_default_dtype()
    # Only the CPU generator is forked and seeded: modules are built on the CPU, and seeding
    # accelerator generators here would change the caller's RNG on those devices.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def _check_positive_ints(owner: str, **values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


# --------------------------------------------------------------------------------------------
# MLP


def mlp(
    sizes: Sequence[int], *, activation: str = "relu", bias: bool = True, seed: int = 0
) -> nn.Sequential:
    """A multi-layer perceptron: ``Linear`` layers with an activation between them.

    Args:
        sizes: layer widths, input first: ``[4, 8, 2]`` is ``Linear(4, 8), act, Linear(8, 2)``.
        activation: one of ``"relu"``, ``"gelu"``, ``"tanh"``, ``"silu"``, ``"sigmoid"``.
        bias: whether the ``Linear`` layers have a bias.
        seed: the initialisation seed (PyTorch's default ``Linear`` initialisation).

    Returns:
        An ``nn.Sequential``; its parameters are named ``"0.weight"``, ``"0.bias"``,
        ``"2.weight"``, ...

    Raises:
        ValueError: fewer than two sizes, a size that is not a positive int, or an unknown
            activation.
        TypeError: `seed` is not an int.
    """
    sizes = list(sizes)
    if len(sizes) < 2:
        raise ValueError(f"mlp: `sizes` needs at least an input and an output width, got {sizes!r}")
    _check_positive_ints("mlp", **{f"sizes[{i}]": size for i, size in enumerate(sizes)})
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"mlp: unknown `activation` {activation!r}; choose one of {sorted(_ACTIVATIONS)}"
        )
    layers: list[nn.Module] = []
    with _seeded_float32_init(seed):
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            if i > 0:
                layers.append(_ACTIVATIONS[activation]())
            layers.append(nn.Linear(fan_in, fan_out, bias=bias))
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------------------------
# GPT


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`.

    Attributes:
        vocab_size: number of token ids.
        seq_len: longest sequence (number of learned positions).
        d_model: width of the residual stream.
        n_heads: attention heads; must divide `d_model`.
        n_layers: transformer blocks.
        d_ff: hidden width of the MLPs; None means ``4 * d_model``.
        dropout: probability of the dropouts on the embeddings and on each block's attention
            and MLP outputs.
        tie_embeddings: whether the output layer reuses the token embedding's weight.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        _check_positive_ints(
            "GPTConfig",
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            d_ff=self.d_ff,
        )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: `n_heads`={self.n_heads} must divide `d_model`={self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: `dropout` must be in [0, 1), got {self.dropout!r}")


class Embeddings(nn.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.token(tokens) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # No bias: the key bias would have an exactly-zero gradient (softmax ignores a constant
        # shift per query), which adaptive optimizers turn from rounding noise into updates.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = einops.rearrange(
            self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads
        )
        # The fused kernel never materialises the [T, T] scores or a mask. On the CPU each
        # output row (and, in backward, each head's gradient) is computed by one thread in a
        # fixed order, so results are bit-identical across runs, thread counts and splits of
        # the batch; it also works under torch.func.grad and vjp.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.proj(einops.rearrange(attended, "b h t d -> b t (h d)")))


class FeedForward(nn.Module):
    """Position-wise MLP: Linear, GELU, Linear, dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.d_ff if cfg.d_ff is not None else 4 * cfg.d_model
        self.fc_in = nn.Linear(cfg.d_model, hidden)
        self.fc_out = nn.Linear(hidden, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2 layout, pre-LayerNorm).

    Maps token ids ``[B, T]`` (int64, batch-major, ``T <= cfg.seq_len``) to next-token logits
    ``[B, T, vocab_size]``. Weights are initialised as in GPT-2: normal(0, 0.02), with the
    projections that write into the residual stream scaled by ``1 / sqrt(2 * n_layers)`` so the
    stream's variance does not grow with depth; biases zero, LayerNorms the identity.

    Args:
        cfg: the shape.
        seed: the initialisation seed.
    """

    def __init__(self, cfg: GPTConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        cfg = GPTConfig() if cfg is None else cfg
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT: `cfg` must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        with _seeded_float32_init(seed):
            self.embed = Embeddings(cfg)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.final_norm = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.token.weight

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_output = name.endswith(("attn.proj", "mlp.fc_out"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual_output else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``[B, T]``."""
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dtype not in (torch.int64, torch.int32)
            or tokens.dim() != 2
        ):
            raise ValueError(
                "GPT: `tokens` must be an int64 tensor of shape [batch, time], got "
                + (
                    f"dtype {tokens.dtype} and shape {tuple(tokens.shape)}"
                    if isinstance(tokens, torch.Tensor)
                    else type(tokens).__name__
                )
            )
        if not 1 <= tokens.shape[1] <= self.cfg.seq_len:
            raise ValueError(
                f"GPT: sequences of length {tokens.shape[1]} do not fit; the model has "
                f"seq_len={self.cfg.seq_len} positions"
            )
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


# --------------------------------------------------------------------------------------------
# ResNet


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a `ResNet`.

    Attributes:
        in_channels: channels of the input images.
        num_classes: number of output logits.
        widths: channels of each stage; every stage after the first halves the resolution.
        blocks_per_stage: residual blocks in each stage.
    """

    in_channels: int = 3
    num_classes: int = 10
    widths: tuple[int, ...] = (16, 32, 64)
    blocks_per_stage: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        if not self.widths:
            raise ValueError("ResNetConfig: `widths` needs at least one stage")
        _check_positive_ints(
            "ResNetConfig",
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            blocks_per_stage=self.blocks_per_stage,
            **{f"widths[{i}]": width for i, width in enumerate(self.widths)},
        )


def _conv_bn(in_channels: int, out_channels: int, kernel_size: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=kernel_size // 2,
            bias=False,  # the BatchNorm's shift makes a conv bias redundant
        ),
        nn.BatchNorm2d(out_channels),
    )


class ResidualBlock(nn.Module):
    """Two 3x3 conv-BN layers plus a shortcut (a 1x1 conv-BN where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(in_channels, out_channels, 3, stride)
        self.conv2 = _conv_bn(out_channels, out_channels, 3, 1)
        self.shortcut = (
            _conv_bn(in_channels, out_channels, 1, stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.conv2(F.relu(self.conv1(x)))
        return F.relu(residual + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet for images ``[N, C, H, W]`` (3x32x32 by default) -> logits ``[N, classes]``.

    A 3x3 conv-BN-ReLU stem, one stage of residual blocks per entry of ``cfg.widths`` (each
    stage after the first starts with a stride-2 block), global average pooling and a linear
    classifier. The default configuration has 78,042 parameters. PyTorch's default
    initialisation, from `seed`.

    Args:
        cfg: the shape.
        seed: the initialisation seed.
    """

    def __init__(self, cfg: ResNetConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        cfg = ResNetConfig() if cfg is None else cfg
        if not isinstance(cfg, ResNetConfig):
            raise TypeError(f"ResNet: `cfg` must be a ResNetConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        with _seeded_float32_init(seed):
            self.stem = nn.Sequential(_conv_bn(cfg.in_channels, cfg.widths[0], 3, 1), nn.ReLU())
            stages = []
            in_channels = cfg.widths[0]
            for stage, width in enumerate(cfg.widths):
                blocks = []
                for index in range(cfg.blocks_per_stage):
                    stride = 2 if stage > 0 and index == 0 else 1
                    blocks.append(ResidualBlock(in_channels, width, stride))
                    in_channels = width
                stages.append(nn.Sequential(*blocks))
            self.stages = nn.Sequential(*stages)
            self.head = nn.Linear(in_channels, cfg.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_classes]`` for images ``[N, in_channels, H, W]``."""
        if (
            not isinstance(images, torch.Tensor)
            or images.dim() != 4
            or images.shape[1] != self.cfg.in_channels
        ):
            raise ValueError(
                f"ResNet: `images` must be a tensor of shape [N, {self.cfg.in_channels}, H, W], "
                "got "
                + (
                    f"shape {tuple(images.shape)}"
                    if isinstance(images, torch.Tensor)
                    else type(images).__name__
                )
            )
        features = self.stages(self.stem(images))
        return self.head(features.mean(dim=(2, 3)))


def resnet(cfg: ResNetConfig | None = None, *, seed: int = 0) -> ResNet:
    """A `ResNet` of shape `cfg` (default ``ResNetConfig()``: 3x32x32 images, 10 classes)."""
    return ResNet(cfg, seed=seed)


# --------------------------------------------------------------------------------------------
# Losses


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    Args:
        logits: ``[B, T, vocab]``, as returned by `GPT`.
        targets: token ids ``[B, T]``. Positions whose target is -100 are skipped (PyTorch's
            ``ignore_index`` convention), and the mean is over the remaining positions.

    Returns:
        A scalar: the mean over the ``B * T`` positions of ``-log softmax(logits)[target]``.

    Raises:
        ValueError: the shapes do not match.
    """
    if logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            "lm_loss: expected `logits` [B, T, vocab] and `targets` [B, T], got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits ``[N, classes]`` against labels ``[N]``.

    Raises:
        ValueError: the shapes do not match.
    """
    if logits.dim() != 2 or tuple(labels.shape) != (logits.shape[0],):
        raise ValueError(
            "classification_loss: expected `logits` [N, classes] and `labels` [N], got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    return F.cross_entropy(logits, labels)
