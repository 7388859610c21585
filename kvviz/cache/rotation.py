"""Moving cached keys along the rotary axis: the model's RoPE frequencies (:class:`KeyRotator`) and the shared plan
by which every layer of a cache re-rotates its keys to in-cache positions (:class:`KeyRerotation`, StreamingLLM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvviz.cache.spec import SpecError


@dataclass
class KeyRotator:
    """Rotates cached keys by per-entry position deltas with the model's rotary frequencies (rotate-half RoPE).

    It reads ``inv_freq`` (which RoPE variants that rescale with length keep up to date) instead of calling the
    rotary module: the module's autocast guard costs more than rotating a few sink keys, once per layer and step.
    """

    inv_freq: torch.Tensor

    def angles(self, delta: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., D] of the rotation by ``delta`` positions."""
        angles = delta.to(self.inv_freq.device).unsqueeze(-1).float() * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = keys.shape[-1] // 2
        return keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * sin


def rope_rotator(model: torch.nn.Module) -> KeyRotator | None:
    """The rotator for ``model``'s keys, or None when it has no rotary embedding to read."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    return None if inv_freq is None else KeyRotator(inv_freq)


@dataclass
class Rerotation:
    """The rotary positions keys end at (``target`` [T]), the entries whose keys move (``changed``) and the cos/sin
    of their rotation."""

    target: torch.Tensor
    changed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class KeyRerotation:
    """Moves cached keys to consecutive rotary positions, for every layer of one cache (StreamingLLM's position
    shift). Layers that hold the same positions in a step (every layer, for a positional policy) share one plan
    instead of each computing the angles again."""

    def __init__(self, rotator: KeyRotator | None):
        self.rotator = rotator
        self._last: tuple[tuple, torch.Tensor, Rerotation | None] | None = None  # the last layer's question and plan

    def plan(self, rotary: torch.Tensor, end: int, dtype: torch.dtype) -> Rerotation | None:
        """How to move keys at rotary positions ``rotary`` [T] to consecutive positions ending at ``end - 1``, or
        None when none move."""
        last = self._last
        if last is not None and last[0] == (end, dtype) and torch.equal(last[1], rotary):
            return last[2]
        target = torch.arange(end - rotary.numel(), end, device=rotary.device)
        changed = (target != rotary).nonzero().flatten()
        plan = None
        if changed.numel():
            if self.rotator is None:
                raise SpecError("re-rotating cached keys needs the model's rotary embedding (rotary_emb.inv_freq)")
            plan = Rerotation(target, changed, *self.rotator.angles(target[changed] - rotary[changed], dtype))
        self._last = ((end, dtype), rotary, plan)
        return plan

    def moved_keys(self, keys: torch.Tensor, plan: Rerotation) -> torch.Tensor:
        """The keys [B, H, T, D] of the entries ``plan`` moves, rotated to their new positions."""
        return self.rotator.apply(keys[:, :, plan.changed], plan.cos, plan.sin)
