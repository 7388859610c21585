"""StreamingLLM (Xiao et al. 2023): a few attention-sink tokens plus a window of recent tokens."""

from __future__ import annotations

from kvviz.cache.protocol import EvictionMethod, LayerView
from kvviz.cache.spec import Budget, MethodStack, Param, SpecError, register
from kvviz.cache.storage import KeptRanges
from kvviz.methods.window import sinks_and_recent


@register
class StreamingLLM(EvictionMethod):
    name = "streaming_llm"
    summary = ("Attention sinks (the first tokens) plus a recent window, enforced at prefill and every decode step; "
               "rerotate=1 gives cached keys their positions inside the cache, as the paper does.")
    params = (
        Param("sinks", int, 4, "first tokens always kept (reference start_size 4)", min=0, max=1024),
        Param("window", Budget, 512, "recent tokens kept (512: the reference)"),
        Param("rerotate", bool, True, "1: re-apply RoPE so keys take in-cache positions; 0: keep absolute positions"),
    )

    rerotate: bool = True  # a plain attribute set from the parameter, shadowing the base class's property

    def check_stack(self, stack: MethodStack) -> None:
        if self.rerotate and stack.quantization is not None:
            raise SpecError(f"{self.spec()} re-rotates stored keys, which a quantized cache cannot do exactly; "
                            "use rerotate=0 with quantization")

    def select(self, view: LayerView) -> KeptRanges | None:
        return sinks_and_recent(view, self.sinks, self.window.tokens(view.prompt_length))

    def budget_for(self, prompt_length: int) -> int:
        return self.sinks + self.window.tokens(prompt_length)

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> StreamingLLM:
        """Four sinks and the rest a recent window."""
        return cls(sinks=4, window=max(1, tokens - 4))
