"""Nothing process-wide behind a loader's name: loading a model changes no process setting (malloc, the garbage
collector, the environment, the press catalog); the app's one start-up applies the settings, once."""

import ctypes
import gc
import os
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from kvviz.comparison import startup
from kvviz.methods.kvpress import catalog
from kvviz.runtime.models import DEFAULT_MODEL, load_model, ready

ROOT = Path(__file__).resolve().parents[1]


def _process_state() -> tuple:
    return (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count(), dict(os.environ), catalog.own_presses())


@pytest.fixture
def c_calls(monkeypatch) -> list[str]:
    """The C library functions looked up through ctypes meanwhile (mallopt, malloc_trim: malloc's settings)."""
    looked_up: list[str] = []
    real = ctypes.CDLL

    class Watched(real):
        def __getattr__(self, name):
            looked_up.append(name)
            return super().__getattr__(name)

    monkeypatch.setattr(ctypes, "CDLL", Watched)
    return looked_up


def test_loading_a_model_changes_nothing_process_wide(c_calls, real_model):
    before = _process_state()
    loaded = load_model(DEFAULT_MODEL, device="cpu")
    tiny = ready("tiny", LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      num_key_value_heads=1)), None, "cpu", loaded.dtype)
    assert _process_state() == before
    assert not {"mallopt", "malloc_trim"} & set(c_calls)
    assert tiny.engine is not loaded.engine, "each model its own engine"


def test_the_server_starts_once_with_its_settings(monkeypatch):
    monkeypatch.setattr(startup, "_SERVER", startup._Server())
    monkeypatch.setenv("KVVIZ_PRESSES", "tests.own_presses.KeyScalingPress")
    try:
        settings = startup.start_server()
        assert catalog.own_presses().paths == ("tests.own_presses.KeyScalingPress",)
        monkeypatch.setenv("KVVIZ_PRESSES", "")
        assert startup.start_server() is settings, "once per process: a rerun of app.py changes nothing"
        assert catalog.own_presses().paths == ("tests.own_presses.KeyScalingPress",)
    finally:
        catalog.configure_presses((), True)


def test_the_app_entry_starts_the_server_and_the_pages_only_read_settings():
    assert "start_server()" in (ROOT / "app.py").read_text()
    from kvviz_app import chrome

    before = catalog.own_presses()
    chrome.settings()
    assert catalog.own_presses() is before, "a page's getter does not replace the catalog"


def test_streamlits_full_collection_after_every_rerun_is_off_in_the_served_config(monkeypatch):
    """It walked 0.55 M objects (0.4 s) after each rerun once torch and a model were loaded
    (kvviz/comparison/startup.py);
    a plain `streamlit run app.py` reads .streamlit/config.toml from the folder it starts in."""
    from streamlit import config

    monkeypatch.chdir(ROOT)
    try:
        config.get_config_options(force_reparse=True)
        assert config.get_option("runner.postScriptGC") is False
    finally:
        config.get_config_options(force_reparse=True)


def test_only_a_local_ray_start_writes_the_environment():
    """architecture.md: the process-wide settings are the start-up's, and a local Ray instance's loopback switch,
    which Ray reads once when it is imported; no other module writes the environment."""
    import re

    writes = re.compile(r"os\.environ\[[^]]+\]\s*=[^=]|os\.environ\.(setdefault|update|pop|clear)\(|os\.putenv\(")
    writers = sorted(str(path.relative_to(ROOT)) for folder in ("kvviz", "kvviz_app", "views")
                     for path in (ROOT / folder).rglob("*.py") if writes.search(path.read_text()))
    assert writers == ["kvviz/runtime/cluster.py"]
    assert 'os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"' in (ROOT / "kvviz/runtime/cluster.py").read_text()
