"""fscale: large-scale training in PyTorch as pure, composable transformations of a train step."""

from fscale import data as data
from fscale import models as models
from fscale import random as random
from fscale import tree as tree
from fscale.model import FunctionalModule as FunctionalModule
from fscale.model import functionalize as functionalize

__version__ = "0.1.0"
