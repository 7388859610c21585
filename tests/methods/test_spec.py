"""The SPEC grammar and the parameter declarations every method shares."""

import pytest

from kvviz.cache.spec import Param
from kvviz.methods import REGISTRY, Budget, SpecError, parse_spec


def test_full_parses_and_prints_back():
    stack = parse_spec("full")
    assert stack.eviction.name == "full" and stack.quantization is None
    assert stack.label == "full"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty method SPEC"),
        ("nope", "unknown method 'nope'; valid:"),
        ("full:window=3", "unknown parameter 'window' for full"),
        ("full:window", "write key=value"),
        ("full+full", "stacks two eviction methods"),
    ],
)
def test_bad_specs_give_one_line_naming_the_choices(spec, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse_spec(spec)
    assert "\n" not in str(caught.value)


def test_param_parsing_checks_types_ranges_and_choices():
    bits = Param("bits", int, 2, "bits", choices=(2, 4, 8))
    assert bits.parse("m", "4") == 4
    with pytest.raises(SpecError, match="choose 2|4|8"):
        bits.parse("m", "3")
    window = Param("window", int, 8, "w", min=1)
    for bad in ("-1", "abc", "2.5", "0"):
        with pytest.raises(SpecError, match=r"bad value in 'm:window="):
            window.parse("m", bad)
    budget = Param("budget", Budget, 256, "b")
    assert budget.parse("m", "0.25").tokens(1000) == 250
    assert budget.parse("m", "128").tokens(1000) == 128
    for bad in ("0", "-3", "nan", "1.5"):
        with pytest.raises(SpecError):
            budget.parse("m", bad)


def test_every_registered_method_declares_valid_defaults():
    for name, cls in REGISTRY.items():
        method = cls()
        assert method.spec() == name, "defaults print as the bare name"
        for param in cls.params:
            assert param.help, f"{name}.{param.name} needs help text"


def test_a_budget_with_a_decimal_point_is_a_ratio_and_without_one_a_token_count():
    budget = Param("budget", Budget, 256, "b")
    assert budget.parse("m", "1.0").tokens(124) == 124, "1.0 is the whole prompt"
    assert budget.parse("m", "1").tokens(124) == 1, "1 is one token"
    assert budget.parse("m", "0.5").tokens(124) == 62
    assert str(budget.parse("m", "1.0")) == "1.0" and str(budget.parse("m", "64")) == "64"
    assert "decimal point" in budget.describe_range()


def test_snapkv_budget_1_0_keeps_the_whole_prompt_and_prints_back_as_written():
    stack = parse_spec("snapkv:budget=1.0")
    assert stack.label == "snapkv:budget=1.0"
    assert stack.eviction.budget_for(124) == 124
    assert parse_spec(stack.label).label == stack.label, "the canonical SPEC reads back the same"
    with pytest.raises(SpecError, match="decimal point"):
        parse_spec("snapkv:budget=1")
