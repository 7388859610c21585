"""random: a seeded control that respects its budget and always keeps the newest token."""

from __future__ import annotations

from kvviz.comparison.session import PromptSession
from tests.methods.test_window import prompt, step_through


def test_budget_respected_newest_kept_and_seeded(tiny_model):
    ids = prompt(tiny_model, 30)
    kept_runs = []
    for seed in (1, 1, 2):
        trail = []

        def check(cache, step, trail=trail):
            seen = len(ids) + step
            kept = cache.kept_positions(0)
            assert kept.shape == (2, 10)
            if step:
                assert bool((kept[:, -1] == seen - 1).all())
            trail.append(kept.tolist())

        step_through(tiny_model, ids, f"random:budget=10,seed={seed}", 6, check)
        kept_runs.append(trail)
    assert kept_runs[0] == kept_runs[1]
    assert kept_runs[0] != kept_runs[2]
    assert kept_runs[0][0][0] != kept_runs[0][0][1]  # heads draw independently


def test_ledger_matches_the_cache(tiny_model):
    ids = prompt(tiny_model, 30)
    result, _ = PromptSession(tiny_model, ids).run("random:budget=0.5", 6)
    ledger = result.ledger
    assert ledger.kept_mask(5, ledger.length).sum(-1).tolist() == [[15, 15], [15, 15]]
    data = result.to_json()["ledger"]
    assert data["kept_per_layer"] == [[15, 15], [15, 15]]
    assert data["total_length"] == ledger.length == 35
    assert all(len(pairs) == ledger.length - 15 for per_layer in data["evicted_at"] for pairs in per_layer)
