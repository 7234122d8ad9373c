"""fscale: large-scale training in PyTorch as pure, composable transformations of a train step."""

from fscale import random as random
from fscale import tree as tree

__version__ = "0.1.0"
