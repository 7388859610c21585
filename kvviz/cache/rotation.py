"""Moving cached keys along the rotary axis: the model's RoPE frequencies (:class:`KeyRotator`) and the shared plan
by which every layer of a cache re-rotates its keys to in-cache positions (:class:`KeyRerotation`, StreamingLLM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvviz.cache.layer_types import text_config
from kvviz.cache.spec import SpecError


@dataclass
class KeyRotator:
    """Rotates cached keys by per-entry position deltas with the model's rotary frequencies (rotate-half RoPE).

    It reads ``inv_freq`` (which RoPE variants that rescale with length keep up to date) instead of calling the
    rotary module: the module's autocast guard costs more than rotating a few sink keys, once per layer and step.
    ``layers``: one rotator per decoder layer where layers rotate with different frequencies (Gemma 3: local layers
    at base 10K, global ones at 1M); empty when every layer shares ``inv_freq``. ``refusal``: why moving this model's
    keys along the rotary axis would not be exact (RoPE on part of each key, interleaved pairs), or empty.
    """

    inv_freq: torch.Tensor
    layers: tuple[KeyRotator, ...] = ()
    refusal: str = ""

    def for_layer(self, layer_idx: int) -> KeyRotator:
        """The rotator of decoder layer ``layer_idx``."""
        return self.layers[layer_idx] if self.layers else self

    def check(self) -> None:
        """SpecError when keys cannot be moved exactly on this model (the feature named)."""
        if self.refusal:
            raise SpecError(f"re-rotating cached keys is not exact on this model: {self.refusal}")

    def angles(self, delta: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., D] of the rotation by ``delta`` positions."""
        angles = delta.to(self.inv_freq.device).unsqueeze(-1).float() * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = keys.shape[-1] // 2
        return keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * sin


def _rotary_refusal(config) -> str:
    """Why rotate-half over the whole key is not how this model applies RoPE, or empty."""
    partial = getattr(config, "partial_rotary_factor", None) or 1.0
    no_rope = getattr(config, "no_rope_layers", None)
    if getattr(config, "qk_nope_head_dim", None):
        return "RoPE covers only part of each key (MLA's qk_rope_head_dim)"
    if getattr(config, "rope_interleave", None):
        return "RoPE rotates interleaved channel pairs"
    if partial < 1.0:
        return f"RoPE covers only part of each key (partial_rotary_factor {partial})"
    if no_rope and not all(no_rope):
        return "some layers use no RoPE"
    return ""


def rope_rotator(model: torch.nn.Module) -> KeyRotator | None:
    """The rotator for ``model``'s keys (one per layer type when types rotate differently, as Gemma 3's do), or None
    when it has no rotary embedding to read."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    config = text_config(model.config)
    refusal = _rotary_refusal(config)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is not None:
        return KeyRotator(inv_freq, refusal=refusal)
    types = getattr(config, "layer_types", None) or []
    by_type = {kind: getattr(rotary, f"{kind}_inv_freq", None) for kind in set(types)}
    if not types or any(freq is None for freq in by_type.values()):
        return None
    rotators = {kind: KeyRotator(freq, refusal=refusal) for kind, freq in by_type.items()}
    return KeyRotator(by_type[types[0]], tuple(rotators[kind] for kind in types), refusal)


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
    shift). Layers that hold the same positions in a step and rotate alike (every layer of a type, for a positional
    policy) share one plan instead of each computing the angles again."""

    def __init__(self, rotator: KeyRotator | None):
        self.rotator = rotator
        self._last: dict[int, tuple[tuple, torch.Tensor, Rerotation | None]] = {}  # per rotator: question and plan

    def plan(self, rotary: torch.Tensor, end: int, dtype: torch.dtype, layer_idx: int = 0) -> Rerotation | None:
        """How to move layer ``layer_idx``'s keys at rotary positions ``rotary`` [T] to consecutive positions ending
        at ``end - 1``, or None when none move."""
        rotator = None if self.rotator is None else self.rotator.for_layer(layer_idx)
        last = self._last.get(id(rotator))
        if last is not None and last[0] == (end, dtype) and torch.equal(last[1], rotary):
            return last[2]
        target = torch.arange(end - rotary.numel(), end, device=rotary.device)
        changed = (target != rotary).nonzero().flatten()
        plan = None
        if changed.numel():
            if rotator is None:
                raise SpecError("re-rotating cached keys needs the model's rotary embedding (rotary_emb.inv_freq)")
            rotator.check()
            plan = Rerotation(target, changed, *rotator.angles(target[changed] - rotary[changed], dtype))
        self._last[id(rotator)] = ((end, dtype), rotary, plan)
        return plan

    def moved_keys(self, keys: torch.Tensor, plan: Rerotation) -> torch.Tensor:
        """The keys [B, H, T, D] of the entries ``plan`` moves, rotated to their new positions."""
        return KeyRotator.apply(keys[:, :, plan.changed], plan.cos, plan.sin)
