"""An ``nn.Module`` as a pure function of explicit parameters and buffers, and the unit protocol."""

from fscale.functional.functionalize import FunctionalModule as FunctionalModule
from fscale.functional.functionalize import functionalize as functionalize
from fscale.functional.units import ParamUnit as ParamUnit
from fscale.functional.units import UnitCall as UnitCall
from fscale.functional.units import UnitParams as UnitParams

__all__ = ["FunctionalModule", "ParamUnit", "UnitCall", "UnitParams", "functionalize"]
