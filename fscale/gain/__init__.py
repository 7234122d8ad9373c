"""AdaScale: the learning rate scaled by the gain ratio of a larger batch, under any data plan."""

from fscale.gain.estimate import GainStats as GainStats
from fscale.gain.estimate import gain as gain
from fscale.gain.plan import AdaScalePlan as AdaScalePlan
from fscale.gain.plan import AdaScaleState as AdaScaleState
from fscale.gain.transform import adascale as adascale
