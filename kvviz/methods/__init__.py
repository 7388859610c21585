"""The methods: every module in this package (and in :mod:`kvviz.methods.kvpress`) holds method implementations;
importing the package loads them all into the registry, so ``parse_spec`` knows every name.

Adding a method means adding one file here with a class decorated by :func:`register`. The protocol the methods
implement and the SPEC grammar live below, in :mod:`kvviz.cache.protocol` and :mod:`kvviz.cache.spec`.
"""

import importlib
import pkgutil

from kvviz.cache.protocol import ArchitectureMethod, EvictionMethod, LayerView, QuantizationMethod, ScoringEviction
from kvviz.cache.spec import (
    KINDS,
    REGISTRY,
    Budget,
    Method,
    MethodStack,
    Param,
    Sizing,
    SpecError,
    budget_spec,
    parse_spec,
    register,
)

for _module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_module.name)

__all__ = [
    "KINDS",
    "REGISTRY",
    "ArchitectureMethod",
    "Budget",
    "EvictionMethod",
    "LayerView",
    "Method",
    "MethodStack",
    "Param",
    "QuantizationMethod",
    "ScoringEviction",
    "Sizing",
    "SpecError",
    "parse_spec",
    "budget_spec",
    "register",
]
