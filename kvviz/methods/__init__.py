"""Every module in this package registers one method; importing the package loads them all.

Adding a method means adding one file here with a class decorated by :func:`register`.
"""

import importlib
import pkgutil

from kvviz.methods.base import (
    KINDS,
    REGISTRY,
    ArchitectureMethod,
    Budget,
    EvictionMethod,
    LayerView,
    Method,
    MethodStack,
    Param,
    QuantizationMethod,
    ScoringEviction,
    SpecError,
    budget_spec,
    parse_spec,
    register,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

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
    "SpecError",
    "parse_spec",
    "budget_spec",
    "register",
]
