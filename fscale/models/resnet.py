"""A small ResNet for image classification, with BatchNorm: buffers that change in training mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fscale.models import building

__all__ = ["ResNet", "ResNetConfig", "ResidualBlock", "resnet"]


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
        building.check_positive_ints(
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
        with building.seeded_float32_init(seed):
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
