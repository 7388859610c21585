"""EVICTION+QUANT: every registered eviction method stacks with the quantization methods and savings multiply."""

import pytest
import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import REGISTRY, Budget, SpecError, parse_spec

EVICTIONS = sorted(name for name, cls in REGISTRY.items() if cls.kind == "eviction")
QUANTIZATIONS = ["kivi:bits=2,group=8,residual=8", "per_token:bits=4,group=8,residual=8", "bnb:type=nf4"]


def _eviction_spec(name: str) -> str:
    """The eviction with every budget at a quarter of the prompt and re-rotation off (refused with quantized keys)."""
    cls = REGISTRY[name]
    parts = [f"{p.name}=0.25" for p in cls.params if p.type is Budget]
    parts += [f"{p.name}=0" for p in cls.params if p.name == "rerotate"]
    return name + (":" + ",".join(parts) if parts else "")


@pytest.fixture(scope="module")
def session(tiny_model, story_ids):
    return PromptSession(tiny_model, story_ids[:160])


# every eviction with KIVI; the other storages with the one eviction that thins groups differently per head
CASES = [(eviction, QUANTIZATIONS[0]) for eviction in EVICTIONS] + [("random", quant) for quant in QUANTIZATIONS[1:]]


@pytest.mark.parametrize("eviction, quant", CASES)
def test_eviction_then_quantization_multiplies_savings(session, eviction, quant):
    evicted_spec = _eviction_spec(eviction)
    stacked, _ = session.run(f"{evicted_spec}+{quant}", max_new_tokens=4)
    assert stacked.error is None and len(stacked.token_ids) == 4 and stacked.kv_breakdown.codes > 0
    # the quantizer's own effect at the token count eviction left: the same storage holding as many fresh tokens
    cache = session.fork(parse_spec(f"{evicted_spec}+{quant}"))
    quantization = parse_spec(quant).quantization
    for layer in cache.layers:
        storage = layer.storage
        keys, values = storage.materialize()
        alone = quantization.new_storage(layer.layer_idx)
        alone.append(torch.randn_like(keys), torch.randn_like(values))
        held, expected = storage.nbytes().total, alone.nbytes().total
        dense = 2 * keys.numel() * keys.element_size()
        if quant.startswith("bnb"):
            assert held == expected  # token by token: nothing to round
            continue
        # every kept token is stored exactly once, as a code row or as a full-precision row
        assert storage.quantized_length + storage.residual_length == len(storage) == keys.shape[2]
        # rounding: where the quantized/full-precision boundary sits (up to residual + group tokens) and the
        # metadata of key groups eviction left partly empty
        token = dense // keys.shape[2]
        groups = storage.keys.scale.shape[2] if quantization.keys_per_channel else 0
        slack = (quantization.residual + quantization.group) * token + groups * keys.shape[-1] * 2 * 2 * keys.shape[1]
        assert abs(held - expected) <= slack
        assert held < 0.75 * dense  # savings multiply: the kept tokens are stored in fewer bits


def test_default_rerotating_streaming_llm_is_refused_with_quantized_keys():
    if "streaming_llm" not in REGISTRY or not REGISTRY["streaming_llm"]().rerotate:
        pytest.skip("no re-rotating eviction registered")
    with pytest.raises(SpecError, match="re-rotates"):
        parse_spec("streaming_llm+kivi:bits=2")
