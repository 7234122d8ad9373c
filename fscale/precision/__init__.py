"""Mixed precision: one dtype policy for every gather, reduction and update of a step."""

from fscale.precision.casts import cast_floating as cast_floating
from fscale.precision.plan import MixedPrecisionPlan as MixedPrecisionPlan
from fscale.precision.policy import Policy as Policy
from fscale.precision.policy import make_policy as make_policy
from fscale.precision.transform import mixed_precision as mixed_precision
