"""Presses a user might write, importable by dotted path (``KVVIZ_PRESSES=tests.own_presses.KeyScalingPress``) from
any test without importing a test module (whose collection reads the press catalog)."""

from __future__ import annotations

from dataclasses import dataclass

import kvpress


@dataclass
class KeyScalingPress(kvpress.BasePress):
    """Keeps every other token and scales its keys: rows that no prompt token has, so kvviz must refuse them."""

    scale: float = 1.5

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return (keys[:, :, ::2] * self.scale).contiguous(), values[:, :, ::2].contiguous()
