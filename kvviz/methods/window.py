"""Recent tokens only: the failure StreamingLLM explains (dropping the first tokens removes the attention sinks)."""

from __future__ import annotations

from kvviz.cache.protocol import EvictionMethod, LayerView, OnLocal
from kvviz.cache.spec import Budget, Param, register
from kvviz.cache.storage import KeptRanges


def sinks_and_recent(view: LayerView, sinks: int, recent: int) -> KeptRanges | None:
    """The first ``sinks`` and the last ``recent`` cache entries, or None to keep all.

    Entries sit in cache order (ascending position) and positional policies never evict a sink, so cache index i <
    sinks is token i.
    """
    batch, heads, length = view.positions.shape
    if sinks + recent >= length:
        return None
    spans = ((0, sinks), (length - recent, length)) if sinks else ((length - recent, length),)
    return KeptRanges(spans, batch, heads, view.positions.device)


@register
class Window(EvictionMethod):
    name = "window"
    summary = "Keep only the most recent tokens (no sinks): the failure case StreamingLLM explains."
    params = (Param("window", Budget, 512, "recent tokens kept"),)
    on_local_layers = OnLocal.WITHIN_WINDOW  # a narrower window narrows a local layer's too

    def select(self, view: LayerView) -> KeptRanges | None:
        return sinks_and_recent(view, 0, self.window.tokens(view.prompt_length))

    def budget_for(self, prompt_length: int) -> int:
        return self.window.tokens(prompt_length)
