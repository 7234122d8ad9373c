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

from fscale.models.gpt import GPT as GPT
from fscale.models.gpt import Block as Block
from fscale.models.gpt import CausalSelfAttention as CausalSelfAttention
from fscale.models.gpt import Embeddings as Embeddings
from fscale.models.gpt import FeedForward as FeedForward
from fscale.models.gpt import GPTConfig as GPTConfig
from fscale.models.losses import classification_loss as classification_loss
from fscale.models.losses import lm_loss as lm_loss
from fscale.models.mlp import mlp as mlp
from fscale.models.moe_gpt import MoEGPT as MoEGPT
from fscale.models.moe_gpt import MoEGPTConfig as MoEGPTConfig
from fscale.models.resnet import ResidualBlock as ResidualBlock
from fscale.models.resnet import ResNet as ResNet
from fscale.models.resnet import ResNetConfig as ResNetConfig
from fscale.models.resnet import resnet as resnet

__all__ = [
    "GPT",
    "GPTConfig",
    "MoEGPT",
    "MoEGPTConfig",
    "ResNet",
    "ResNetConfig",
    "classification_loss",
    "lm_loss",
    "mlp",
    "resnet",
]
