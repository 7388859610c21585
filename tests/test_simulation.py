"""The verdicts' error rates and power, proven by simulating 10,000 sweeps per scenario through the sweep's own
decision code (``python -m kvviz sweep --simulate`` prints the same figures)."""

import json
import subprocess
import sys

import pytest

from kvviz.studies.sequential import ONE_SIDED
from kvviz.studies.simulation import error_rates

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def rates():
    return error_rates(runs=10_000)


def test_every_claim_holds_its_level_where_its_null_is_at_the_edge(rates):
    for name in ("within_at_margin", "within_at_margin_half", "beyond_at_margin", "beyond_at_zero", "worse_at_zero",
                 "family_within", "family_beyond"):
        found = rates.rates[name]
        assert found.runs == 10_000
        assert found.share <= ONE_SIDED, f"{name}: {found.text()}"
    assert rates.rates["within_at_margin"].count > 0, "at the edge the test does pass sometimes: it is not blind"


def test_the_fixed_n_rule_looked_at_every_round_fails_its_level(rates):
    peeking, once = rates.rates["fixed_rule_peeking"], rates.rates["fixed_rule_at_cap"]
    assert peeking.interval[0] > 4 * ONE_SIDED, peeking.text()
    assert once.interval[0] > ONE_SIDED, f"Newcombe is approximate even at one look: {once.text()}"


def test_power_and_items_to_a_decision_at_0_1_and_2_5_points(rates):
    by_loss = {row.loss_points: row for row in rates.power}
    assert by_loss[0.0].within.share >= 0.99 and by_loss[0.0].median_items <= 112, (
        "identical to full: proven at the round of 112 items (the stake on the largest bet; 128 without it)")
    assert 0.7 <= by_loss[1.0].within.share < by_loss[0.0].within.share
    assert by_loss[1.0].median_items <= 208
    assert by_loss[2.5].within.share < 0.3, "2.5 of 5 points lost: rarely proven within 256 items"
    assert by_loss[2.5].loss_proven.share > 0.1, "...and often stopped as worse than full instead"


def test_the_command_prints_the_figures_without_a_model(tmp_path):
    out = tmp_path / "rates.json"
    done = subprocess.run([sys.executable, "-m", "kvviz", "sweep", "--simulate", "--runs", "200", "--max-items", "64",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "200 simulated sweeps per scenario, rounds of 16 items up to 64" in done.stdout
    assert "the fixed-n rule (Newcombe) looked at after every round" in done.stdout
    data = json.loads(out.read_text())
    assert data["runs"] == 200 and set(data["rates"]) >= {"within_at_margin", "family_within", "fixed_rule_peeking"}
    refused = subprocess.run([sys.executable, "-m", "kvviz", "sweep", "--simulate", "--runs", "5"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "simulate at least 100 sweeps" in refused.stderr
