"""AdaScale: the learning rate scaled by the gain ratio of a larger batch, under any data plan."""

from fscale.adascale.estimate import GainStats as GainStats
from fscale.adascale.estimate import gain as gain
from fscale.adascale.plan import AdaScalePlan as AdaScalePlan
from fscale.adascale.plan import AdaScaleState as AdaScaleState
from fscale.adascale.transform import adascale as adascale
