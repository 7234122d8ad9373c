"""Former home of `functionalize` and the unit protocol, now ``fscale.functional``: re-exports."""

from fscale.functional.functionalize import FunctionalModule as FunctionalModule
from fscale.functional.functionalize import functionalize as functionalize
from fscale.functional.units import ParamUnit as ParamUnit
from fscale.functional.units import UnitCall as UnitCall
from fscale.functional.units import UnitParams as UnitParams
