"""Run a kvpress press in its own hooks during a prefill and map the cache it leaves back to token positions.

Kept apart from the method file because it touches the model: hooks are added for the one forward and removed after,
and the attributes kvpress sets on the attention modules (``rotary_emb``, ``masked_key_indices``) are taken off
again, so the shared model is left as it was found.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from kvviz.cache.kvcache import KVCache, KVLayer
from kvviz.cache.rotation import KeyRotator
from kvviz.methods.kvpress.report import MAX_KEY_DISTANCE, NativePrefill, NativeReport, NotMappable
from kvviz.methods.kvpress.rowmatch import RowMatch, match_rows, match_rows_in_order
from kvviz.methods.merge import nearest_survivor
from kvviz.runtime.models import LoadedModel

_KVPRESS_ATTRIBUTES = ("rotary_emb", "masked_key_indices")


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


def _rerotates(press) -> bool:
    """KeyRerotationPress, or a press with ``rerotate_keys`` set (Finch), possibly inside a wrapper."""
    import kvpress

    if isinstance(press, kvpress.KeyRerotationPress) or getattr(press, "rerotate_keys", False):
        return True
    inner = [getattr(press, name, None) for name in ("press", "prefilling_press")] + list(getattr(press, "presses", []))
    return any(p is not None and _rerotates(p) for p in inner)


def _needs_weights(press) -> bool:
    """ObservedAttentionPress (alone or inside a wrapper) scores with the attention weights eager attention returns."""
    import kvpress

    if isinstance(press, kvpress.ObservedAttentionPress):
        return True
    inner = [getattr(press, name, None) for name in ("press", "prefilling_press")] + list(getattr(press, "presses", []))
    return any(p is not None and _needs_weights(p) for p in inner)


def run_press_prefill(loaded: LoadedModel, prompt_ids: list[int], press, label: str,
                      rotator: KeyRotator | None) -> NativePrefill:
    """Prefill ``prompt_ids`` with ``press`` active; return kvviz's view of what it kept."""
    model = loaded.model
    modules = attention_modules(model)
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def snapshot(module, args, kwargs, output):  # runs before the press's hook: it was registered first
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        if module.layer_idx not in full:
            full[module.layer_idx] = (layer.keys.clone(), layer.values.clone())

    before = {id(m): {a for a in _KVPRESS_ATTRIBUTES if a in m.__dict__ or a in m._modules} for m in modules}
    for module in modules:
        module.masked_key_indices = None
    hooks = [m.register_forward_hook(snapshot, with_kwargs=True) for m in modules]
    cache = DynamicCache(config=model.config)
    implementation = model.config._attn_implementation
    if _needs_weights(press):  # kvpress reads the attention weights from the layer's output: eager attention only
        model.config._attn_implementation = "eager"
    started = time.perf_counter()
    try:
        with torch.inference_mode(), press(model):
            output = model(input_ids=torch.tensor([prompt_ids], device=loaded.device), past_key_values=cache,
                           use_cache=True, logits_to_keep=1)
        masked = [getattr(m, "masked_key_indices", None) for m in modules]
    except OSError as error:  # a file the press loads (a tokenizer, weights) is not on this machine
        raise NotMappable(f"kvpress {label} needs files this machine does not have: {error}") from None
    except (AssertionError, ValueError, KeyError, NotImplementedError, RuntimeError) as error:
        raise NotMappable(f"kvpress {label} failed on this model: {type(error).__name__}: {error}") from None
    finally:
        model.config._attn_implementation = implementation
        for hook in hooks:
            hook.remove()
        for module in modules:
            for attribute in _KVPRESS_ATTRIBUTES:
                if attribute not in before[id(module)]:
                    if attribute in module._modules:
                        del module._modules[attribute]
                    module.__dict__.pop(attribute, None)
    press_seconds = time.perf_counter() - started
    report = NativeReport(label, len(prompt_ids), press_seconds, rerotated=_rerotates(press))
    with torch.inference_mode():  # the snapshots are inference tensors, written in place
        prefill, kept, blocked = _map_cache(cache, full, masked, len(prompt_ids), report, rotator)
    return NativePrefill(prefill, kept, blocked, output.logits[0, -1].float(), report,
                         time.perf_counter() - started)


def _map_cache(cache: DynamicCache, full: dict, masked: list, length: int, report: NativeReport,
               rotator: KeyRotator | None) -> tuple[KVCache, list, list]:
    """Per layer: match the press's rows to the full rows; build kvviz's prefill cache and the kept indices."""
    prefill = KVCache(len(cache.layers))
    prefill.prompt_length = length
    kept_per_layer: list[torch.Tensor | None] = []
    blocked_per_layer: list[torch.Tensor | None] = []
    channels: list[list[int]] = []
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        full_keys, full_values = full.get(layer_idx, (keys, values))
        if full_keys.shape[2] != length:
            raise NotMappable(f"kvpress {report.press} changed the cache before layer {layer_idx} was seen whole")
        pruned = _pruned_channels(keys, full_keys)
        channels.append((keys.shape[-1] - pruned[0].sum(-1)).tolist())
        found = _matched_rows(full_keys, keys, pruned, layer_idx, report, rotator)
        kept, blocked = _kept_rows(found.positions, masked[layer_idx], keys.shape, report)
        kept_per_layer.append(None if kept.shape[-1] == length and blocked is None else kept)
        blocked_per_layer.append(blocked)
        index = found.positions.unsqueeze(-1).expand_as(keys)
        changed = (values != full_values.gather(2, index)).any(-1)  # [B, H, n] survivors whose values moved
        if bool(changed.any()):
            report.merged_into[layer_idx] = _merge_targets(full_keys, found.positions, changed, length)
        # the snapshot is this function's own copy: the press's rows are written into it where they came from
        stored = (full_keys, full_values) if layer_idx in full else (keys.clone(), values.clone())
        keys_moved = not found.all_exact or bool(pruned.any())
        _hold_press_rows(prefill.layers[layer_idx], *stored, index, keys if keys_moved else None,
                         values if bool(changed.any()) else None)
    if any(c != keys.shape[-1] for layer in channels for c in layer):
        report.channels_kept = channels
    return prefill, kept_per_layer, blocked_per_layer


def _pruned_channels(keys: torch.Tensor, full_keys: torch.Tensor) -> torch.Tensor:
    """[B, H, D] True on the key channels the press zeroed (ThinK prunes channels, not tokens)."""
    return (keys == 0).all(2) & ~(full_keys == 0).all(2)


def _matched_rows(full_keys: torch.Tensor, keys: torch.Tensor, pruned: torch.Tensor, layer_idx: int,
                  report: NativeReport, rotator: KeyRotator | None) -> RowMatch:
    """Which full row each of the press's rows came from, compared as the press left them (pruned channels zeroed,
    re-rotation undone); refused when a row matches no prompt token or two rows one token."""
    match_full, match_compressed = full_keys, keys
    if bool(pruned.any()):
        match_full = full_keys.masked_fill(pruned.unsqueeze(2), 0)
    if report.rerotated:
        if rotator is None:
            raise NotMappable(f"kvpress {report.press} re-rotates keys; this model has no RoPE to undo")
        match_full = _derotate(rotator, match_full, torch.arange(full_keys.shape[2]))
        match_compressed = _derotate(rotator, match_compressed, torch.arange(keys.shape[2]))
        # undone rotations leave rounding; repeated tokens' position-free keys can coincide: match in order
        found = match_rows_in_order(match_full, match_compressed, MAX_KEY_DISTANCE)
    else:
        found = match_rows(match_full, match_compressed)
    if float(found.distance.max()) > MAX_KEY_DISTANCE:
        raise NotMappable(f"kvpress {report.press} changed keys in layer {layer_idx}: the nearest full row is "
                          f"{float(found.distance.max()):.1%} away, so its entries are not the prompt's tokens")
    if not found.unique():
        raise NotMappable(f"kvpress {report.press} left two entries matching one token in layer {layer_idx}")
    report.exact_rows += int(found.exact.sum())
    report.nearest_rows += int((~found.exact).sum())
    report.max_distance = max(report.max_distance, float(found.distance.max()))
    return found


def _kept_rows(positions: torch.Tensor, masked, shape: torch.Size,
               report: NativeReport) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token positions each head holds [B, H, n], ascending, and which of them are held blocked (a head-wise
    press's masked rows, :func:`_unmasked_rows`), or None when nothing is masked."""
    held = _unmasked_rows(masked, shape, report)
    if held is not None:
        positions = positions.gather(-1, held[0])
    kept, order = positions.sort(dim=-1)
    return kept, None if held is None else held[1].gather(-1, order.cpu())


def _hold_press_rows(target: KVLayer, full_keys: torch.Tensor, full_values: torch.Tensor, index: torch.Tensor,
                     keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
    """``target`` holds the prompt's rows at positions 0.., the press's own ``keys`` and ``values`` (re-rotated,
    pruned or merged as it left them; None where they equal the full rows) written over them at ``index``."""
    if keys is not None:
        full_keys.scatter_(2, index, keys)
    if values is not None:
        full_values.scatter_(2, index, values)
    target.lazy_initialization(full_keys, full_values)
    target.storage.append(full_keys, full_values)
    batch, heads, length = full_keys.shape[:3]
    target.positions = torch.arange(length).view(1, 1, length).expand(batch, heads, length).clone()
    target.rotary = target.positions.clone()


def _derotate(rotator: KeyRotator, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys [B, H, T, D] rotated back from ``positions`` [T] to position 0 (what RoPE adds, taken off)."""
    cos, sin = rotator.angles(-positions, torch.float32)
    return rotator.apply(keys.float(), cos.to(keys.device), sin.to(keys.device))


def _unmasked_rows(masked, shape: torch.Size, report: NativeReport) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a head-wise press (kvpress masks entries in place): rows [B, H, n] of the compressed cache to hold and
    which of them are blocked [B, H, n]. Heads keeping fewer tokens than the most-keeping head hold some of their
    masked rows blocked, so every head has the same length. None when nothing is masked."""
    if masked is None or len(masked[0]) == 0:
        return None
    report.masked = True
    batch, heads, length = shape[:3]
    keep = torch.ones(batch, heads, length, dtype=torch.bool)
    keep[masked[0].cpu(), masked[1].cpu(), masked[2].cpu()] = False
    counts = keep.sum(-1)
    held = int(counts.max())
    order = torch.arange(length).expand(batch, heads, length)
    rows = torch.where(keep, order, order + length).sort(-1).values[..., :held] % length  # kept rows, then masked
    blocked = torch.arange(held).expand(batch, heads, held) >= counts.unsqueeze(-1)
    report.blocked_entries += int(blocked.sum())
    return rows.to(masked[2].device), blocked


def _merge_targets(full_keys: torch.Tensor, positions: torch.Tensor, changed: torch.Tensor,
                   length: int) -> torch.Tensor:
    """[H, N] for batch 0: the survivor each evicted token was folded into (-1 for survivors and untouched tokens).

    Attribution: an evicted token goes to the survivor whose values changed and whose key is most cosine-similar
    to its own (:func:`kvviz.methods.merge.nearest_survivor`, the rule merging presses use; the values alone do not
    say which tokens were summed).
    """
    heads = full_keys.shape[1]
    target = torch.full((heads, length), -1, dtype=torch.long)
    for head in range(heads):
        survivors = positions[0, head][changed[0, head]]
        evicted = torch.ones(length, dtype=torch.bool, device=full_keys.device)
        evicted[positions[0, head]] = False
        if survivors.numel() == 0 or not bool(evicted.any()):
            continue
        keys = full_keys[0, head]
        target[head, evicted.cpu()] = survivors[nearest_survivor(keys[evicted], keys[survivors])].cpu()
    return target
