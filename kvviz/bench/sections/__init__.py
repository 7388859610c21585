"""One module per bench section, each registering its function with ``bench_section``; importing this package
registers them all, in the order below (cheapest first, so a run cut short still has the core figures: its JSON is
rewritten after every section), except that the served app comes before the class: its engine runs are the baseline
of a server process that has done nothing else, so they run before the class's many runs grow this process's heap
(5.2 GB resident after the class against 2.7 GB before it, measured on the 2-core CPU). The module's name is the
section's name."""

import importlib

ORDER = ("shared_prefill", "batched_compare", "kv_bytes", "layouts", "replay_vs_generate", "bookkeeping",
         "decode_large_cache", "kivi", "peer_kvpress", "kvpress_native", "capture", "perplexity", "needle", "prefix",
         "sweep", "adaptive_sweep", "sweep_ray", "app", "classroom", "engine_process")

for _name in ORDER:
    importlib.import_module(f"{__name__}.{_name}")
