"""The losses the reference models are trained with: next-token and classification cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["classification_loss", "lm_loss"]


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
