"""The deployed methods (fp8, adakv, pyramidkv, per_layer, decoding, merge) reach every view through the registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvviz.methods import REGISTRY, parse_spec
from kvviz_app import widgets

DEPLOYED = {"fp8": "quantization", "adakv": "eviction", "pyramidkv": "eviction", "per_layer": "eviction",
            "decoding": "eviction", "merge": "eviction"}


def test_listed_by_the_cli_with_their_parameters():
    listing = subprocess.run([sys.executable, "-m", "kvviz", "methods"], capture_output=True, text=True,
                             check=True).stdout
    for name, kind in DEPLOYED.items():
        assert f"{name} ({kind})" in listing
        for param in REGISTRY[name].params:
            assert f"    {param.name}=" in listing


@pytest.mark.parametrize("name, kind", sorted(DEPLOYED.items()))
def test_offered_by_the_compare_widgets(name, kind):
    assert name in widgets.methods_of(kind)
    assert widgets._initial_values(parse_spec(name))[kind] == name
